"""SIGINT (Ctrl-C), SIGTERM (schedulers, preemption) and SIGHUP (the terminal or ssh session that
started training went away): stop at the next step boundary.

The handler only records the signal; the training loop checks it between optimizer steps, saves
`checkpoint_last.pt` and raises `Interrupted`. Stopping at a boundary makes the saved weights,
optimizer, RNG and data position belong to the same step, so `--resume` is exact. A second
signal while stopping aborts at once (checkpoint writes are atomic: nothing is corrupted).
Once a stop has begun, a repeat must never meet the default handler, which would kill the process
by the signal (-15) instead of letting it exit with its code: after the training block a repeat
exits at once with the code, and from interpreter shutdown on (where Python resets its handlers to
the default, but leaves ignored signals alone) repeats are ignored. A signal that the process
started with ignored stays ignored, as Python itself does with SIGINT.
After a hang-up the terminal is gone and every write to it fails (EIO), as do writes into a pipe
whose reader (`| tee log`, in the same terminal) got the hang-up too (EPIPE); either would turn the
save into a crash. So output that went to a terminal or a pipe goes to /dev/null from then on;
output into files keeps going there (metrics.jsonl in the run directory has the record anyway).

Every other command (and training before and after its loop) takes SIGTERM and SIGHUP the way
Python takes Ctrl-C: as an exception (`Terminated`), so that `finally` clauses still run: the
temporary file of an unfinished `--output` is removed, decoding workers are stopped.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import stat
import sys
import threading
from collections.abc import Iterator
from types import FrameType

from .console import discard_writes, warn

EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}
if hasattr(signal, "SIGHUP"):  # not on Windows
    EXIT_CODES[signal.SIGHUP] = 129


class StopRequest:
    def __init__(self, announce: bool = True) -> None:
        self.announce = announce  # False on torchrun ranks other than 0: one message, not one per rank
        self.signum: int | None = None
        self._previous: dict[int, object] = {}
        self._hangup_fds: list[int] = []

    def __enter__(self) -> StopRequest:
        self._hangup_fds = outputs_a_hangup_takes()
        if threading.current_thread() is threading.main_thread():
            for signum in EXIT_CODES:
                if signal.getsignal(signum) is signal.SIG_IGN:
                    # The parent asked for it to be ignored, as a non-interactive shell does for `tfm
                    # train &` (so that Ctrl-C on the script leaves it running) or nohup: keep it so.
                    continue
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, _exit_at_once if self.signum is not None else handler)
        if self._previous and self.signum is not None:
            atexit.register(_ignore_repeats)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt  # second signal: give up now
        self.signum = signum
        if signum == getattr(signal, "SIGHUP", None):
            discard_writes(self._hangup_fds)
        if self.announce:
            warn(f"\n{signal.Signals(signum).name}: stopping after the current step and saving "
                 "(send it again to abort)")  # (an OSError raised here would strike the loop mid-step)


def _is_terminal_or_pipe(fd: int) -> bool:
    try:
        return os.isatty(fd) or stat.S_ISFIFO(os.fstat(fd).st_mode)
    except OSError:  # closed
        return False


def outputs_a_hangup_takes() -> list[int]:
    """stdout/stderr where they are a terminal or a pipe; looked at before any hang-up, since a
    hung-up terminal no longer says it is one. Every later write to them fails (EIO, EPIPE)."""
    return [fd for fd in (1, 2) if _is_terminal_or_pipe(fd)]


def _exit_at_once(signum: int, frame: FrameType | None) -> None:
    """A repeat after the training block: everything is saved, so leave now with the signal's code."""
    with contextlib.suppress(OSError):
        os.write(sys.stderr.fileno(), f"{signal.Signals(signum).name} again: exiting\n".encode())
    os._exit(EXIT_CODES[signum])


class Terminated(BaseException):
    """SIGTERM or SIGHUP, raised like KeyboardInterrupt (a BaseException: `except Exception` in
    library code does not swallow it); the CLI exits with `exit_code`."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.exit_code = EXIT_CODES[signum]


@contextlib.contextmanager
def terminate_like_ctrl_c() -> Iterator[None]:
    """Within this block SIGTERM and SIGHUP raise `Terminated` (signals the process started with
    ignored stay ignored; outside the main thread nothing changes)."""
    signums = [s for s in EXIT_CODES if s != signal.SIGINT]
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    hangup_fds = outputs_a_hangup_takes()

    def terminate(signum: int, frame: FrameType | None) -> None:
        if signum == getattr(signal, "SIGHUP", None):
            discard_writes(hangup_fds)
        raise Terminated(signum)

    previous = {s: signal.getsignal(s) for s in signums}
    for s, handler in previous.items():
        if handler is not signal.SIG_IGN:
            signal.signal(s, terminate)
    try:
        yield
    finally:
        for s, handler in previous.items():
            # Only undo our own: after a training stop, StopRequest left `_exit_at_once` in place for
            # repeats, and the default handler must not come back before the process has exited.
            if signal.getsignal(s) is terminate:
                signal.signal(s, handler if handler is not None else signal.SIG_DFL)


def _ignore_repeats() -> None:
    for signum in EXIT_CODES:
        signal.signal(signum, signal.SIG_IGN)


PR_SET_PDEATHSIG = 1  # prctl(2): the signal a process gets when its parent ends


def die_with_parent(parent: int | None) -> None:
    """Called first in a child process tfm starts (decoding workers, prepare's encoders): on Linux
    the child gets SIGKILL when its parent ends, however it ends, so a kill -9 of `tfm translate`,
    `tfm serve` or `tfm prepare` leaves no process behind, blocked on a pipe nobody writes and
    holding its copy of the model. The kernel sends it when the *thread* that started the child
    ends: tfm starts its children on the main thread. `parent`: the parent's pid as it was before
    the child started; a parent that ended before this call is caught by the check after it.
    Elsewhere a child still ends at the EOF of its task pipe, as multiprocessing's workers do."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # no prctl: the pipe's EOF still ends the child
        return
    if parent is not None and os.getppid() != parent:  # the parent ended before the prctl
        os._exit(1)
