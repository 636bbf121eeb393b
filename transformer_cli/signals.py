"""SIGINT (Ctrl-C) and SIGTERM (schedulers, preemption): stop at the next step boundary.

The handler only records the signal; the training loop checks it between optimizer steps, saves
`checkpoint_last.pt` and raises `Interrupted`. Stopping at a boundary makes the saved weights,
optimizer, RNG and data position belong to the same step, so `--resume` is exact. A second
signal while stopping aborts at once (checkpoint writes are atomic: nothing is corrupted).
Once a stop has begun, a repeat must never meet the default handler, which would kill the process
by the signal (-15) instead of letting it exit with its code: after the training block a repeat
exits at once with the code, and from interpreter shutdown on (where Python resets its handlers to
the default, but leaves ignored signals alone) repeats are ignored. A signal that the process
started with ignored stays ignored, as Python itself does with SIGINT.
"""

from __future__ import annotations

import atexit
import os
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
        print(f"\n{signal.Signals(signum).name}: stopping after the current step and saving "
              "(send it again to abort)", file=sys.stderr, flush=True)


def _exit_at_once(signum: int, frame: FrameType | None) -> None:
    """A repeat after the training block: everything is saved, so leave now with the signal's code."""
    os.write(sys.stderr.fileno(), f"{signal.Signals(signum).name} again: exiting\n".encode())
    os._exit(EXIT_CODES[signum])


def _ignore_repeats() -> None:
    for signum in EXIT_CODES:
        signal.signal(signum, signal.SIG_IGN)
