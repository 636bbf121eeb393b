"""`tfm` processes for the tests, forked from a warm process instead of started cold.

A test that runs `python -m transformer_cli[.cli] ...` or a script of scripts/ (most import torch
and tfm) as a real process (signals, kill -9, pipes, resource limits, servers) pays for importing
torch in it: 1.3 s of CPU on a Zen 4, 2.7 s on a Zen 3, and for `tfm train` torch's compiler too
(torch.optim imports it: 1 s / 2.5 s), ~190 times a run. So each test process keeps a warm process
that has imported torch and every tfm module once, and forks it for each such command. The child is
a real process: its own PID, the test's pipes, working directory, environment and session, the
signal dispositions of a new Python, `python -m`'s module (or the script, its folder first on
sys.path) run as `__main__`, Python's own exit (threads joined, atexit, streams flushed, an uncaught
KeyboardInterrupt dying of SIGINT), and the exit status the test reads through `subprocess.Popen`.
`tfm train` on mimalloc (the default allocator, runtime/allocator.py) forks from a second warm
process started on mimalloc, as `tfm train` starts itself again. A script's own `python -m
transformer_cli` commands (bench_distill.py's exports and translations) and torchrun's agent
(`python -m torch.distributed.run`) fork warm too, and so do the commands they start: the agent's
ranks (`python -u -m transformer_cli train`, each on mimalloc) fork from the test process's warm
processes, with torch's thread count set from the OMP_NUM_THREADS torchrun gives them. A shell
script's `tfm` (`tfm_in_scripts`: scripts/quickstart.sh, `tfm translate ... | head`) is a small
program first on PATH that forks `python -m transformer_cli` the same way.

Signal dispositions are those an exec would leave (what the test process ignores stays ignored,
Popen's restore_signals) and Python's start-up would set; a `preexec_fn` made by `preexec()`
(signals to their default, resource limits, capabilities dropped) is applied in the child. Started
cold as before: any other program; any other `preexec_fn`, `pass_fds`, another user, group, umask or
process group; a terminal on a standard stream (unless `preexec(own_terminal=True)` makes it the
controlling one); an environment that differs from the warm
process's in anything but what is read when used, not at import (`TFM_*`, inductor's cache folder,
a distributed run's RANK, WORLD_SIZE, MASTER_ADDR..., what torchrun tells its ranks) or remade in
the child (PYTHONUNBUFFERED, a positive OMP_NUM_THREADS); and every command while coverage.py
measures the run, where `TFM_TEST_WARM=0`, and in a run of fast tests only (a warm process's
start costs more than their few commands save). What still differs: /proc/<pid>/cmdline and environ
show the warm process's, so does sys.flags (`-u` and PYTHONUNBUFFERED make the standard streams, as
at start-up, but not sys.flags.unbuffered), OMP_NUM_THREADS sets torch's thread count but not
OpenBLAS's (numpy's), which starts its thread pool at first use, not at import; a rank of torchrun
is the child of the test process's warm process, not of the agent (which signals and waits for it
by its PID, as it does a child).
tests/test_warm_processes.py compares a warm and a cold `tfm translate`, and a script's run.
"""

from __future__ import annotations

import atexit
import gc
import io
import json
import os
import resource
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = "torch.distributed.run"  # torchrun's agent; it starts its ranks as `python -u -m transformer_cli ...`
MODULES = ("transformer_cli", "transformer_cli.cli", TORCHRUN)
SCRIPTS = ROOT / "scripts"  # `python scripts/<name>.py ...` is forked warm too: most import torch and tfm
# Environment keys a command may set differently from its warm process: tfm reads them when used.
RUNTIME_KEYS = ("TFM_",)
RUNTIME_NAMES = {"PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR", "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR",
                 "PYTHONUNBUFFERED",  # the child makes its standard streams anew by it (sys.flags stay the warm one's)
                 # a distributed run's, read by tfm and torch.distributed when a process group starts, and
                 # what torchrun tells its ranks (read by torch elastic when used)
                 "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "LOCAL_WORLD_SIZE", "ROLE_NAME", "ROLE_RANK", "ROLE_WORLD_SIZE", "TORCHELASTIC_ERROR_FILE",
                 "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID",
                 "TORCHELASTIC_USE_AGENT_STORE", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCHELASTIC_ENABLE_FILE_TIMER",
                 "TORCHELASTIC_TIMER_FILE", "TORCHELASTIC_SIGNALS_TO_HANDLE",
                 # a shell's own (a script's `tfm`, tfm_in_scripts): the command search path and the
                 # shell's bookkeeping, read when a program is started; scripts/quickstart.sh's settings
                 "PATH", "PWD", "OLDPWD", "SHLVL", "_", "TIME", "RUN_DIR", "SIZE"}
MESSAGE_LIMIT = 1 << 20


# --------------------------------------------------------------------------- the warm process

def serve() -> None:
    """The warm process: import everything once, then fork a child per request (see the module's
    docstring). Ends when the test process closes its standard input."""
    import importlib
    import pkgutil

    launch_path = list(sys.path)
    import numpy  # noqa: F401  (its OpenBLAS starts a thread pool; a forked child starts it at first use)

    blas_threads = len(os.listdir("/proc/self/task"))
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401  (torch.optim's methods import it)
    import torch.optim  # noqa: F401

    import transformer_cli

    for module in pkgutil.walk_packages(transformer_cli.__path__, "transformer_cli."):
        if not module.name.endswith("__main__"):
            importlib.import_module(module.name)
    threads = len(os.listdir("/proc/self/task"))
    if threads != blas_threads:  # a fork copies one thread: another pool started at import would be lost
        print(f"not ready: {threads} threads after the imports", flush=True)
        return
    own_fds = {int(fd) for fd in os.listdir("/proc/self/fd")} - {0, 1, 2}
    own_fds = {fd for fd in own_fds if _is_open(fd)}
    # What the imports made lives as long as the process: in the permanent generation, the children's
    # garbage collections skip it (and so leave its pages shared with this process instead of copying them).
    gc.freeze()
    address = os.path.join(tempfile.mkdtemp(prefix="tfm-warm-"), "socket")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(address)
    listener.listen(64)
    print(f"ready {address}", flush=True)
    os.dup2(2, 1)  # nobody reads that pipe any more
    context = {"launch_path": launch_path, "own_fds": own_fds, "address": address, "env": dict(os.environ)}
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(0, selectors.EVENT_READ, "parent")
    while True:
        for key, _ in selector.select():
            if key.data == "parent":
                if not os.read(0, 4096):  # the test process has gone: so does this one (children stay)
                    os.unlink(address)
                    os.rmdir(os.path.dirname(address))
                    os._exit(0)
            elif key.data == "accept":
                connection, _ = listener.accept()
                _start_child(connection, selector, context)
            else:
                pid, connection, command = key.data
                selector.unregister(key.fd)
                os.close(key.fd)
                _, status, usage = os.wait4(pid, 0)
                _record_cpu(command, usage)
                try:
                    connection.send(str(status).encode())
                except OSError:
                    pass  # the test no longer waits
                connection.close()


def _record_cpu(command: list[str], usage) -> None:
    """With TFM_TEST_CPU_DIR (tests/cpu_per_test.py): a JSON line per command forked here, its test,
    module or script, arguments and CPU seconds (its own and its waited-for children's)."""
    folder = os.environ.get("TFM_TEST_CPU_DIR")
    if folder:
        with open(os.path.join(folder, f"warm-{os.getpid()}.jsonl"), "a") as log:
            log.write(json.dumps([*command[:2], command[2:5], usage.ru_utime + usage.ru_stime]) + "\n")


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _start_child(connection: socket.socket, selector: selectors.BaseSelector, context: dict) -> None:
    try:
        message, fds, _, _ = socket.recv_fds(connection, MESSAGE_LIMIT, 3)
        request = json.loads(message)
    except (OSError, ValueError):
        connection.close()
        return
    pid = os.fork()
    if pid == 0:
        _run_child(request, fds, context)  # never returns
    for fd in fds:
        os.close(fd)
    pidfd = os.pidfd_open(pid)
    command = [request["env"].get("PYTEST_CURRENT_TEST", ""), request["module"] or request["script"], *request["argv"]]
    selector.register(pidfd, selectors.EVENT_READ, (pid, connection, command))
    connection.send(str(pid).encode())


def _run_child(request: dict, fds: list[int], context: dict) -> None:
    """In the forked child: become `python -m <module> <args>` as started by the test."""
    try:
        if request["new_session"]:
            os.setsid()
        _signals_as_after_exec(request)
        for resource_id, value in request["limits"]:
            resource.setrlimit(resource_id, (value, value))
        _drop_capabilities(request["capabilities"])
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        _own_terminal(request["own_terminal"])
        for fd in map(int, os.listdir("/proc/self/fd")):
            if fd > 2 and fd not in context["own_fds"]:
                try:
                    os.close(fd)
                except OSError:
                    pass
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        # sys.path[0]: the working directory for `python -m`, the script's folder for `python script.py`
        first = os.path.dirname(request["script"]) if request["script"] else os.getcwd()
        sys.path[:] = [first, *context["launch_path"][1:]]
        sys.orig_argv = request["orig_argv"]
        tempfile.tempdir = None
        _new_standard_streams(request["unbuffered"])
        if request["warm_processes"] is not None:  # a script's or torchrun's own `python -m transformer_cli`
            _adopt(request["warm_processes"], context["env"])  # commands fork from the test process's warm processes too
        if request["threads"]:  # OMP_NUM_THREADS, read when torch was imported in the warm process
            import torch

            torch.set_num_threads(request["threads"])
        if request["module"] == TORCHRUN:  # torch elastic starts its ranks with the Popen it imported by name
            from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

            subprocess_handler.Popen = WarmPopen  # type: ignore[misc]
        if "numpy" in sys.modules:  # a new process seeds numpy's global generator anew
            sys.modules["numpy"].random.seed()
        import importlib

        import transformer_cli

        importlib.reload(transformer_cli)  # the environment it was launched with (LAUNCH_ENVIRONMENT)
        if request["module"] == "transformer_cli.cli":  # `python -m` runs a module nothing imported yet
            del sys.modules["transformer_cli.cli"]
            delattr(transformer_cli, "cli")
        main = sys.modules["__main__"].__dict__  # as `python -m` finds it: only its dunder names
        for name in [name for name in main if not name.startswith("__")]:
            del main[name]
    except BaseException:
        import traceback

        traceback.print_exc()
        os._exit(70)
    _exit_as_python(request["module"], request["script"], request["argv"])


def _signals_as_after_exec(request: dict) -> None:
    """Each signal's disposition and the blocked mask as `python -m` started by Popen would have
    them: ignored where the test's thread ignored it (an exec keeps SIG_IGN) unless restore_signals
    or preexec() set it back; then Python's start-up: SIGPIPE and SIGXFSZ ignored, SIGINT raising
    KeyboardInterrupt where it is not ignored."""
    ignored = set(request["ignored"]) - set(request["default_signals"])
    if request["restore_signals"]:
        ignored -= {signal.SIGPIPE, signal.SIGXFSZ}
    for signum in signal.valid_signals():
        if signum in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            signal.signal(signum, signal.SIG_IGN if signum in ignored else signal.SIG_DFL)
        except (OSError, ValueError):
            pass  # the C library's own (real-time) signals
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    if signal.SIGINT not in ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_SETMASK, request["blocked"])


def _signal_set(field: str) -> list[int]:
    """The signals of a mask in this thread's /proc status (SigIgn, SigBlk)."""
    for line in Path("/proc/thread-self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            mask = int(line.split()[1], 16)
            return [bit + 1 for bit in range(64) if mask >> bit & 1]
    return []


def preexec(*, default_signals: tuple[int, ...] = (), limits: tuple[tuple[int, int], ...] = (),
            drop_capabilities: tuple[int, ...] = (), own_terminal: bool = False):
    """A preexec_fn that a warm start applies too: `default_signals` set to SIG_DFL, each
    (resource.RLIMIT_*, value) of `limits` set as both its soft and hard limit, the capabilities
    `drop_capabilities` (numbers from linux/capability.h, under 32) dropped for good, and with
    `own_terminal` a new session whose controlling terminal is the one on standard input (a login
    shell's job: the process the kernel sends SIGHUP when that terminal goes away)."""
    def apply() -> None:
        for signum in default_signals:
            signal.signal(signum, signal.SIG_DFL)
        for resource_id, value in limits:
            resource.setrlimit(resource_id, (value, value))
        _drop_capabilities(drop_capabilities)
        _own_terminal(own_terminal)

    apply.warm = {"default_signals": [int(s) for s in default_signals],  # type: ignore[attr-defined]
                  "limits": [[int(r), int(v)] for r, v in limits], "capabilities": [int(c) for c in drop_capabilities],
                  "own_terminal": own_terminal}
    return apply


def _own_terminal(own: bool) -> None:
    """With `own`: a new session (unless this process leads one) whose controlling terminal is fd 0."""
    if own:
        import fcntl
        import termios

        if os.getsid(0) != os.getpid():
            os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def _drop_capabilities(capabilities: tuple[int, ...] | list[int]) -> None:
    """Drop `capabilities` from this process's bounding set (what an exec keeps) and from its
    effective, permitted and inheritable sets (what it holds now, without an exec): both a command
    started cold and one forked warm run without them."""
    if not capabilities:
        return
    import ctypes

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Sets(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    libc = ctypes.CDLL(None, use_errno=True)
    for capability in capabilities:
        if libc.prctl(24, capability, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")
    header, sets = Header(0x20080522, 0), (Sets * 2)()  # _LINUX_CAPABILITY_VERSION_3: two 32-bit words
    if libc.capget(ctypes.byref(header), sets) != 0:
        raise OSError(ctypes.get_errno(), "capget")
    keep = ~sum(1 << c for c in capabilities) & 0xFFFFFFFF
    sets[0].effective &= keep
    sets[0].permitted &= keep
    sets[0].inheritable &= keep
    if libc.capset(ctypes.byref(header), sets) != 0:
        raise OSError(ctypes.get_errno(), "capset")


def _new_standard_streams(unbuffered: bool) -> None:
    """sys.stdin/stdout/stderr over the new file descriptors 0–2, made as Python's start-up makes
    them (its create_stdio: names, buffering, line buffering, errors); `unbuffered`: `python -u`."""
    encoding, errors = sys.stdout.encoding, sys.stdout.errors
    buffered = not (unbuffered or os.environ.get("PYTHONUNBUFFERED"))  # the command's (the warm process: no -u)

    def stream(fd: int, name: str, errors: str):
        if not _is_open(fd):
            return None
        raw = io.FileIO(fd, "r" if fd == 0 else "w", closefd=False)
        raw.name = name
        if fd == 0:  # stdin is buffered even where output is not
            buffer = io.BufferedReader(raw)
        else:
            buffer = io.BufferedWriter(raw) if buffered else raw
        line_buffering = buffered and (os.isatty(fd) or fd == 2)
        return io.TextIOWrapper(buffer, encoding=encoding, errors=errors, newline="\n",  # type: ignore[arg-type]
                                line_buffering=line_buffering, write_through=not buffered)

    sys.stdin = sys.__stdin__ = stream(0, "<stdin>", errors)
    sys.stdout = sys.__stdout__ = stream(1, "<stdout>", errors)
    sys.stderr = sys.__stderr__ = stream(2, "<stderr>", "backslashreplace")


def _exit_as_python(module: str | None, script: str | None, argv: list[str]) -> None:
    import runpy

    sys.argv = [script or module, *argv]
    code, interrupted = 0, False
    try:
        if script:
            runpy.run_path(script, run_name="__main__")  # what `python script.py` runs
        else:
            runpy._run_module_as_main(module, alter_argv=True)  # what `python -m module` runs
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        interrupted = True
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    # Python's own shutdown: wait for non-daemon threads, run atexit, flush the streams.
    try:
        threading._shutdown()  # type: ignore[attr-defined]
    except BaseException:
        pass
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except BaseException as exc:
            try:
                print(f"Exception ignored in: {stream!r}\n{type(exc).__name__}: {exc}", file=sys.__stderr__)
            except BaseException:
                pass
            code = code or 120
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        code = 130
    os._exit(code)


def _exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        print(code, file=sys.stderr)
    except BaseException:
        pass
    return 1


# --------------------------------------------------------------------------- the test process's side

class _Warm:
    """One warm process (started at first use) and its launch environment."""

    def __init__(self, env: dict[str, str], address: str | None = None, failed: bool = False):
        self.env = env
        self.process: subprocess.Popen | None = None
        self.address = address  # given: a warm process that is already serving (a script's commands)
        self.failed = failed

    def ready(self) -> bool:
        if self.address is not None or self.failed:
            return not self.failed
        code = ("import sys; sys.path.insert(0, sys.argv[1]); from tests.warm_processes import serve; "
                "sys.path.pop(0); serve()")
        self.process = _COLD_POPEN([sys.executable, "-c", code, str(ROOT)], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, env=self.env, cwd=ROOT, text=True)
        line = self.process.stdout.readline() if self.process.stdout else ""
        if not line.startswith("ready "):
            self.failed = True
            print(f"warm tfm process not started ({line.strip() or 'no answer'}): commands start cold",
                  file=sys.stderr)
            return False
        self.address = line.split(" ", 1)[1].strip()
        atexit.register(self.close)
        return True

    def close(self) -> None:
        if self.process is not None and self.process.stdin is not None:
            self.process.stdin.close()
            self.process.wait()


_COLD_POPEN = subprocess.Popen
_WARM: dict[str, _Warm] = {}
_WARM_LOCK = threading.Lock()
_FAST_RUN = False


def _on_mimalloc(env: dict[str, str]) -> dict[str, str] | None:
    """`env` as `tfm train` changes it to start itself again on mimalloc (runtime/allocator.py), or
    None where it would not (no mimalloc here, or started again already)."""
    from transformer_cli.runtime.allocator import RELAUNCHED, mimalloc_library, relaunch_environment

    library = mimalloc_library()
    if library is None or env.get(RELAUNCHED):
        return None
    return relaunch_environment(library, env)


def _train_allocator(arguments: list[str], cwd: str) -> str:
    """The allocator `tfm train <arguments>` run in `cwd` would choose (its own config loader), or
    "system" where that cannot be told here (the child then starts itself again if it must)."""
    import typer

    from transformer_cli import cli

    try:
        command = typer.main.get_command(cli.app).commands["train"]  # type: ignore[attr-defined]
        context = command.make_context("train", list(arguments[1:]), resilient_parsing=True)
        config, settings = context.params.get("config"), context.params.get("set_")
        if config is None:
            return "system"
        return cli._load(Path(cwd, config), settings).train.allocator
    except Exception:  # a bad command or config: the child says so, and never starts itself again
        return "system"


def _plan(args, executable, preexec_fn, pass_fds, cwd, env, shell, rest, child_fds) -> dict | None:
    """The request to fork this command warm, or None where it must start cold."""
    if _cold_only() or len(rest) != 7:
        return None
    import transformer_cli  # noqa: F401  (sets its oneDNN setting in this process's environment first)

    restore_signals, gid, gids, uid, umask, start_new_session, process_group = rest
    if isinstance(args, (str, bytes, os.PathLike)):
        return None
    args = [os.fsdecode(a) for a in args]
    unbuffered = args[1:2] == ["-u"]  # (as torch elastic starts a rank)
    if unbuffered:
        args = [args[0], *args[2:]]
    script = _script_of(args, cwd)
    if script is None and (len(args) < 3 or args[0] != sys.executable or args[1] != "-m" or args[2] not in MODULES):
        return None
    steps = (getattr(preexec_fn, "warm", None) if preexec_fn is not None
             else {"default_signals": [], "limits": [], "capabilities": [], "own_terminal": False})
    if (shell or executable is not None or steps is None or pass_fds or gid is not None
            or gids is not None or uid is not None or umask != -1 or process_group not in (None, -1)):
        _why("cold: a Popen argument", args)
        return None
    if not steps["own_terminal"] and any(fd != -1 and os.isatty(fd) for fd in child_fds):
        _why("cold: a terminal", args)
        return None
    env = {os.fsdecode(k): os.fsdecode(v) for k, v in (os.environ if env is None else env).items()}
    cwd = os.path.abspath(os.fsdecode(cwd)) if cwd is not None else os.getcwd()
    if not os.path.isdir(cwd):
        return None  # Popen's own error, raised here
    module, argv = (None, args[2:]) if script else (args[2], args[3:])
    kind = "system"
    if module and argv[:1] == ["train"] and _train_allocator(argv, cwd) in ("auto", "mimalloc"):
        relaunched = _on_mimalloc(env)
        if relaunched is not None:
            kind, module, env = "mimalloc", "transformer_cli", relaunched
    with _WARM_LOCK:  # tests start commands from several threads
        if kind not in _WARM:
            launch_env = dict(os.environ)
            _WARM[kind] = _Warm(launch_env if kind == "system" else _on_mimalloc(launch_env) or launch_env)
        warm = _WARM[kind]
    changed = {k for k in set(env) | set(warm.env) if env.get(k) != warm.env.get(k)}
    threads = env.get("OMP_NUM_THREADS", "")
    threads_set = "OMP_NUM_THREADS" in changed and threads.isdigit() and int(threads) > 0
    if threads_set:
        changed.discard("OMP_NUM_THREADS")  # torch's thread count, set in the child (as torchrun sets it for ranks)
    read_at_import = sorted(k for k in changed if not k.startswith(RUNTIME_KEYS) and k not in RUNTIME_NAMES)
    if read_at_import:
        _why("cold: environment " + ",".join(read_at_import), args)
        return None
    with _WARM_LOCK:
        ready = warm.ready()
    if not ready:
        _why("cold: no warm process", args)
        return None
    siblings = _warm_processes() if script or module == TORCHRUN else None
    return {"warm": warm, "kind": kind, "module": module, "argv": argv, "cwd": cwd, "env": env,
            "warm_processes": siblings, "threads": int(threads) if threads_set else None,
            "script": script, "new_session": bool(start_new_session),
            "orig_argv": [sys.executable, *(["-u"] if unbuffered else []), *([script] if script else ["-m", module]),
                          *argv], "unbuffered": unbuffered,
            "restore_signals": bool(restore_signals), "ignored": _signal_set("SigIgn"),
            "blocked": _signal_set("SigBlk"), **steps}


def _warm_processes() -> dict[str, list]:
    """kind → [address, launch environment] of this process's warm processes, each started if it is
    not yet: what a script, torchrun's agent or a shell script's `tfm` forks its own commands from."""
    with _WARM_LOCK:
        if "system" not in _WARM:
            _WARM["system"] = _Warm(dict(os.environ))
        mimalloc = _on_mimalloc(dict(os.environ))
        if "mimalloc" not in _WARM and mimalloc is not None:
            _WARM["mimalloc"] = _Warm(mimalloc)
        return {kind: [warm.address, warm.env] for kind, warm in _WARM.items() if warm.ready()}


def _adopt(siblings: dict[str, list], env: dict[str, str]) -> None:
    """Fork this process's `python -m transformer_cli` commands from the warm processes `siblings`
    (`_warm_processes()` of a test process); a kind it lacks starts cold."""
    for kind in ("system", "mimalloc"):
        given = siblings.get(kind)
        _WARM[kind] = _Warm(given[1], address=given[0]) if given else _Warm(env, failed=True)
    install()


# --------------------------------------------------------------------------- `tfm` in a shell script

SHELL_KEY = "TFM_TEST_WARM_PROCESSES"  # the shim's warm processes, as JSON; the command never sees it
SHIM = """#!{python}
# `tfm` for a test's shell script (tests/warm_processes.py, tfm_in_scripts): the command forked warm.
import sys
sys.path.insert(0, {root!r})
from tests.warm_processes import run_as_tfm
sys.exit(run_as_tfm(sys.argv[1:]))
"""


def tfm_in_scripts(bin_dir: Path, env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (this process's by default) for a shell script whose `tfm` commands fork from this test
    process's warm processes: a `tfm` in `bin_dir`, first on PATH, runs `python -m transformer_cli`
    through WarmPopen and ends as its command ends (exit status, or the signal that ended it). Where
    commands start cold (TFM_TEST_WARM=0, coverage, a fast run), PATH leads to this Python's own `tfm` script."""
    env = dict(os.environ if env is None else env)
    python_bin = str(Path(sys.executable).parent)
    if _cold_only():
        return {**env, "PATH": f"{python_bin}{os.pathsep}{env.get('PATH', '')}"}
    bin_dir.mkdir(parents=True, exist_ok=True)
    shim = bin_dir / "tfm"
    shim.write_text(SHIM.format(python=sys.executable, root=str(ROOT)))
    shim.chmod(0o755)
    return {**env, SHELL_KEY: json.dumps(_warm_processes()),
            "PATH": f"{bin_dir}{os.pathsep}{python_bin}{os.pathsep}{env.get('PATH', '')}"}


def run_as_tfm(argv: list[str]) -> int:
    """The shim's body: `tfm argv` forked warm (or started cold where it cannot be), the signals a
    shell sends the shim passed on to it; returns its exit status, or dies of the signal it died of."""
    _adopt(json.loads(os.environ.pop(SHELL_KEY, "{}")), dict(os.environ))
    child = subprocess.Popen([sys.executable, "-m", "transformer_cli", *argv])
    for number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(number, lambda number, _frame: child.send_signal(number))
    code = child.wait()
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


def _script_of(args: list[str], cwd) -> str | None:
    """The absolute path of a script of scripts/ that `args` runs as `python <script> ...`, or None."""
    if len(args) < 2 or args[0] != sys.executable or not args[1].endswith(".py"):
        return None
    path = Path(os.fsdecode(cwd) if cwd is not None else os.getcwd(), args[1]).resolve()
    return str(path) if path.parent == SCRIPTS and path.is_file() else None


def _why(how: str, args: list[str]) -> None:
    """With TFM_TEST_WARM_LOG=<file>: a JSON line per `tfm` command a test starts (warm from which
    process, or cold and why; the test; the command)."""
    log = os.environ.get("TFM_TEST_WARM_LOG")
    if log:
        with open(log, "a") as file:
            command = [os.fsdecode(a) for a in (args[3:] if args[1:2] == ["-m"] else args[1:])]
            file.write(json.dumps([how, os.environ.get("PYTEST_CURRENT_TEST", ""), command]) + "\n")


def _cold_only() -> bool:
    """Every command starts cold: TFM_TEST_WARM=0, coverage.py measuring, or a run of fast tests only."""
    return os.environ.get("TFM_TEST_WARM", "1") == "0" or _coverage_running() or _FAST_RUN


def cold_for_a_fast_run() -> None:
    """A run of fast tests only (`-m "not slow"`) starts a few cheap commands: a warm process's start
    (3–5 s of CPU: torch and every tfm module) costs more than they would cold (~0.1 s each)."""
    global _FAST_RUN
    _FAST_RUN = True


def _coverage_running() -> bool:
    coverage = sys.modules.get("coverage")
    return coverage is not None and coverage.Coverage.current() is not None


class WarmPopen(subprocess.Popen):
    """subprocess.Popen that forks `python -m transformer_cli...` from a warm process where it can
    (the module's docstring), and starts everything else as Popen does."""

    _warm_connection: socket.socket | None = None

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                       creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite, *rest):
        plan = _plan(args, executable, preexec_fn, pass_fds, cwd, env, shell, rest, (p2cread, c2pwrite, errwrite))
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            if plan is not None:
                connection.connect(plan["warm"].address)
        except OSError:  # the warm process has gone (killed): this and later commands start cold
            plan["warm"].failed = True
            plan = None
            _why("cold: the warm process has gone", args)
        if plan is None:
            connection.close()
            return super()._execute_child(args, executable, preexec_fn, close_fds, pass_fds, cwd, env,
                                          startupinfo, creationflags, shell, p2cread, p2cwrite, c2pread,
                                          c2pwrite, errread, errwrite, *rest)
        fds = [fd if fd != -1 else default for fd, default in zip((p2cread, c2pwrite, errwrite), (0, 1, 2))]
        try:
            _why("warm: " + plan["kind"], args)
            request = {k: v for k, v in plan.items() if k not in ("warm", "kind")}
            socket.send_fds(connection, [json.dumps(request).encode()], fds)
            answer = connection.recv(64)
            if not answer:
                raise OSError("the warm tfm process did not start the command")
            self.pid = int(answer)
        except BaseException:
            connection.close()
            raise
        finally:
            self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)
        self._child_created = True
        self._warm_connection = connection

    def _warm_status(self, block: bool) -> tuple[int, int]:
        connection = self._warm_connection
        assert connection is not None
        try:
            answer = connection.recv(64, 0 if block else socket.MSG_DONTWAIT)
        except BlockingIOError:
            return 0, 0
        connection.close()
        return self.pid, int(answer) if answer else 255 << 8

    def _try_wait(self, wait_flags):
        if self._warm_connection is None:
            return super()._try_wait(wait_flags)
        return self._warm_status(block=not wait_flags & os.WNOHANG)

    def _internal_poll(self, _deadstate=None, **kwargs):
        if self._warm_connection is None:
            return super()._internal_poll(_deadstate, **kwargs)
        if self.returncode is None and self._waitpid_lock.acquire(False):
            try:
                if self.returncode is None:
                    pid, status = self._warm_status(block=False)
                    if pid:
                        self._handle_exitstatus(status)
            except OSError:
                if _deadstate is not None:
                    self.returncode = _deadstate
            finally:
                self._waitpid_lock.release()
        return self.returncode


def install() -> None:
    """Make subprocess.Popen (and so subprocess.run) WarmPopen in this test process."""
    subprocess.Popen = WarmPopen  # type: ignore[misc]
