"""SIGINT (Ctrl-C) and SIGTERM (schedulers, preemption): stop at the next step boundary.

The handler only records the signal; the training loop checks it between optimizer steps, saves
`checkpoint_last.pt` and raises `Interrupted`. Stopping at a boundary makes the saved weights,
optimizer, RNG and data position belong to the same step, so `--resume` is exact. A second
signal while stopping aborts at once (checkpoint writes are atomic: nothing is corrupted).
"""

from __future__ import annotations

import signal
import sys
import threading
from types import FrameType

EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}


class StopRequest:
    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for signum in EXIT_CODES:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt  # second signal: give up now
        self.signum = signum
        print(f"\n{signal.Signals(signum).name}: stopping after the current step and saving "
              "(send it again to abort)", file=sys.stderr, flush=True)
