"""Decoding on several CPU cores at once: forked worker processes, one thread each, whole batches.

A decoding step multiplies a few rows by each weight matrix and attends with one query per row:
ops too small for torch's intra-op threads to split well, while two processes decoding different
batches, one thread each, run close to twice as fast as one (docs/performance.md has the figures).
CTranslate2 calls this `inter_threads`. The workers are forked once the model is loaded, so they share its weights (copy
on write), and each runs exactly one torch thread: GNU OpenMP cannot start a thread team in a
forked child of a process that used one (it hangs), and one thread per core is the measured best.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from ..runtime.cpu import usable_cores
from ..runtime.errors import TfmError
from ..runtime.signals import die_with_parent
from .budget import SearchesStopped

_TASK: Callable[..., Any] | None = None  # set in the parent just before forking; inherited by the workers
_PARENT: int | None = None  # the forking process's id, likewise


def resolve_workers(setting: int | str, device: Any) -> int:
    """decode.workers → processes (or CTranslate2's inter_threads): `auto` = one per usable core on
    CPU; 1 on a GPU, or where processes cannot be forked (Windows). `device`: a torch.device or its
    type's name (this module imports no torch: CTranslate2's engine runs without it)."""
    if getattr(device, "type", device) != "cpu" or "fork" not in multiprocessing.get_all_start_methods():
        return 1
    return usable_cores() if setting == "auto" else int(setting)


def _start_worker() -> None:
    die_with_parent(_PARENT)
    import torch  # loaded already: the workers fork from tfm's own engine

    torch.set_num_threads(1)
    # Ctrl-C reaches the whole process group: the parent stops the workers and reports it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The fork inherited the parent's SIGTERM/SIGHUP handlers, which raise (runtime/signals.py); the
    # parent stops its workers with SIGTERM, and a worker should then simply end.
    for name in ("SIGTERM", "SIGHUP"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_DFL)


def _run_task(args: tuple) -> Any:
    return _TASK(*args)


class DecodingProcessDied(TfmError):
    """A decoding process ended without answering (killed: the kernel's out-of-memory killer sends
    SIGKILL): the batches it held are lost. The pool is stopped; the next `map` starts a new one."""


class DecodingWorkers:
    """A pool of `processes` forked workers that run `task(*args)` for each args tuple, in order.

    The pool starts on the first `map` of two or more tasks (one batch gains nothing from it) and
    stops with `close()` or at exit. `task` must be fixed before that start: the workers run the
    function and the model it refers to as they were when they were forked.

    A worker that dies is noticed at once (ProcessPoolExecutor watches every process; the older
    multiprocessing.Pool replaced a dead worker silently and waited forever for its task):
    `map` raises `DecodingProcessDied`, the remaining workers are stopped, and the next `map`
    forks a fresh pool.
    """

    def __init__(self, task: Callable[..., Any], processes: int) -> None:
        self.task, self.processes = task, processes
        self._pool: ProcessPoolExecutor | None = None
        self._forked: list = []  # the pool's processes
        self._stopping = False  # stop_now() was called: a broken pool means stopped, not died
        self.forks = 0  # pools forked so far: more than one means a pool was forked anew after a death

    def map(self, args: Iterable[tuple]) -> Iterator[Any]:
        args = list(args)
        if self.processes <= 1 or len(args) <= 1:
            return (self.task(*a) for a in args)
        if any(process.exitcode is not None for process in self._forked):
            self.close()  # a worker died while idle (nothing was lost): fork a fresh pool
        self.start()
        assert self._pool is not None
        # Submitted in order; each idle worker takes the next: batches come longest first, so
        # handing them out one at a time balances the load.
        try:
            futures = [self._pool.submit(_run_task, a) for a in args]
        except BrokenProcessPool:  # it broke just now, before any of these started
            self.close()
            return self.map(args)
        return self._results(futures)

    def _results(self, futures: list[Future]) -> Iterator[Any]:
        try:
            for future in futures:
                yield future.result()
        except BrokenProcessPool:
            if self._stopping:
                self.close()
                raise SearchesStopped("the server is stopping: decoding was stopped") from None
            dead = self._dead_workers()
            self.close()
            raise DecodingProcessDied(f"a decoding process died{dead} while translating: out of memory? "
                                      "(lower decode.batch_size, or decode.workers=1)") from None
        finally:
            for future in futures:
                future.cancel()

    def _dead_workers(self) -> str:
        """' (SIGKILL)': how a worker died, where a signal ended it (the others were then sent SIGTERM)."""
        for process in self._processes():  # the pool's manager thread is stopping them: a moment
            process.join(timeout=2)
        names = {signal.Signals(-p.exitcode).name for p in self._processes()
                 if p.exitcode is not None and p.exitcode < 0 and -p.exitcode in signal.Signals._value2member_map_}
        names = names - {"SIGTERM"} or names
        return f" ({', '.join(sorted(names))})" if names else ""

    def _processes(self) -> list:
        return list(self._forked)

    def start(self) -> None:
        """Fork the workers now (a server forks them before it starts threads of its own)."""
        if self._pool is None and self.processes > 1:
            global _TASK, _PARENT
            _TASK, _PARENT = self.task, os.getpid()
            # Workers flush the standard streams when they end: unwritten output must not be copied into them.
            sys.stdout.flush()
            sys.stderr.flush()
            pool = ProcessPoolExecutor(self.processes, mp_context=multiprocessing.get_context("fork"),
                                       initializer=_start_worker)
            pool.submit(int).result()  # with fork, every worker is forked at the first task: now
            # ProcessPoolExecutor keeps its processes private and forgets them once broken (Python
            # 3.14 adds terminate_workers()): keep them, to stop them and to say how one died.
            self._forked = list(getattr(pool, "_processes", {}).values())
            self._pool = pool
            self.forks += 1

    def alive(self) -> int:
        """Worker processes running now (0 before the pool starts)."""
        return sum(process.exitcode is None for process in self._forked)

    @property
    def pids(self) -> list[int]:
        """The worker processes' ids (none before the pool starts)."""
        return [process.pid for process in self._forked]

    @property
    def started(self) -> bool:
        return self._pool is not None

    def stop_now(self) -> None:
        """Kill the workers (from any thread): the `map` waiting for them raises SearchesStopped."""
        self._stopping = True
        for process in self._processes():
            if process.exitcode is None:
                process.kill()

    def close(self) -> None:
        if self._pool is not None:
            pool, processes = self._pool, self._processes()
            self._pool, self._forked = None, []
            for process in processes:  # a worker may be busy with a long batch: do not wait for it
                if process.exitcode is None:
                    process.kill()
            pool.shutdown(wait=True, cancel_futures=True)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 (interpreter shutdown: multiprocessing may be half torn down)
            pass
