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
import signal
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from .cpu import usable_cores

_TASK: Callable[..., Any] | None = None  # set in the parent just before forking; inherited by the workers


def resolve_workers(setting: int | str, device: torch.device) -> int:
    """decode.workers → processes: `auto` = one per usable core on CPU; 1 on a GPU, or where
    processes cannot be forked (Windows)."""
    if device.type != "cpu" or "fork" not in multiprocessing.get_all_start_methods():
        return 1
    return usable_cores() if setting == "auto" else int(setting)


def _start_worker() -> None:
    torch.set_num_threads(1)
    # Ctrl-C reaches the whole process group: the parent stops the workers and reports it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The fork inherited the parent's SIGTERM/SIGHUP handlers, which raise (signals.py); the
    # parent stops its workers with SIGTERM, and a worker should then simply end.
    for name in ("SIGTERM", "SIGHUP"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_DFL)


def _run_task(args: tuple) -> Any:
    return _TASK(*args)


class DecodingWorkers:
    """A pool of `processes` forked workers that run `task(*args)` for each args tuple, in order.

    The pool starts on the first `map` of two or more tasks (one batch gains nothing from it) and
    stops with `close()` or at exit. `task` must be fixed before that start: the workers run the
    function and the model it refers to as they were when they were forked.
    """

    def __init__(self, task: Callable[..., Any], processes: int) -> None:
        self.task, self.processes = task, processes
        self._pool = None

    def map(self, args: Iterable[tuple]) -> Iterator[Any]:
        args = list(args)
        if self.processes <= 1 or len(args) <= 1:
            return (self.task(*a) for a in args)
        self.start()
        # chunksize 1: batches come longest first, so handing them out one at a time balances the load.
        return self._pool.imap(_run_task, args, chunksize=1)

    def start(self) -> None:
        """Fork the workers now (a server forks them before it starts threads of its own)."""
        if self._pool is None and self.processes > 1:
            global _TASK
            _TASK = self.task
            # Workers flush the standard streams when they end: unwritten output must not be copied into them.
            sys.stdout.flush()
            sys.stderr.flush()
            self._pool = multiprocessing.get_context("fork").Pool(self.processes, initializer=_start_worker)

    @property
    def started(self) -> bool:
        return self._pool is not None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 (interpreter shutdown: multiprocessing may be half torn down)
            pass
