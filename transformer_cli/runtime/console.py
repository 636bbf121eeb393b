"""Everything tfm prints goes through here: a result line on stdout (`say`), a warning or error
line on stderr (`warn`), and writes that either complete or name the file (`write_fully`).

The console is a view, never the record: a line that cannot be written (a full disk under
`2> log`, a pipe whose reader quit, a hung-up terminal) never stops the work; that stream simply
takes nothing more. Results on stdout are different: failing to write them is an error.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import sys
from collections.abc import Callable
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:  # tqdm is imported where a bar is drawn: translating needs none
    from tqdm import tqdm

from .errors import describe_os_error


def discard_writes(fds: list[int]) -> None:
    """Point these file descriptors at /dev/null: what is still written to them (buffered output
    flushed at exit, a progress bar) goes nowhere instead of failing where nothing can take it."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for fd in fds:
        os.dup2(devnull, fd)
    os.close(devnull)


def discard_stream(stream: IO) -> None:
    """`discard_writes` for a stream whose file failed a write: from now on it takes everything and
    keeps nothing (a stream without a descriptor is left as it is)."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        discard_writes([stream.fileno()])


SAID_ENV = "TFM_SAID"  # digests of the lines `warn_once` said, carried over the allocator's relaunch


def warn_once(message: str) -> None:
    """`warn`, once a command: a line said before `tfm train` starts itself again on its allocator
    (runtime/allocator.py, the same PID) is not said again after it."""
    digest = hashlib.sha256(message.encode("utf-8")).hexdigest()[:16]
    said = os.environ.get(SAID_ENV, "").split()
    if digest in said:
        return
    os.environ[SAID_ENV] = " ".join([*said, digest])
    warn(message)


def warn(message: str, stream: IO[str] | None = None) -> None:
    """One line on stderr (or `stream`) that never stops the work: if it cannot be written (a full
    disk under `2> log`, a pipe whose reader quit, a hung-up terminal), the stream gets nothing more
    (it now points at /dev/null) and the caller carries on; its exit status says the rest."""
    stream = sys.stderr if stream is None else stream
    try:
        print(message, file=stream, flush=True)
    except OSError:
        discard_stream(stream)  # or Python's flush at exit fails again (status 120)


def write_fully(stream: IO[str], text: str) -> None:
    """Write `text` and flush it: all of it, or an OSError that names the file.

    An unbuffered text stream (`python -u`, PYTHONUNBUFFERED=1 as many container images set)
    ignores a short write, which a filling disk makes: the rest of the text was lost without an
    error. Its bytes go to the file here until all are written, so the next write says ENOSPC/EFBIG.
    After such an error the file takes nothing more; what is still buffered for it is dropped
    (the descriptor now points at /dev/null), or Python would retry it at exit and fail there with
    status 120. A closed pipe (BrokenPipeError) is left to the caller.
    """
    raw = getattr(stream, "buffer", None)
    try:
        if isinstance(raw, io.RawIOBase):
            stream.flush()
            data = memoryview(text.encode(getattr(stream, "encoding", None) or "utf-8",
                                          getattr(stream, "errors", None) or "strict"))
            while data:
                data = data[raw.write(data) or 0:]  # None: a non-blocking file that is full for now
        else:
            stream.write(text)
            stream.flush()
    except BrokenPipeError:
        raise
    except OSError as exc:
        name = getattr(stream, "name", None)
        discard_stream(stream)
        if exc.filename is not None or not isinstance(name, str):
            raise
        raise OSError(exc.errno, exc.strerror, "standard output" if name == "<stdout>" else name) from None


def say(text: str) -> None:
    """One result line on stdout, flushed now: a full disk under `tfm … > file` is then an OSError
    naming standard output (one line, exit 2), not an unnamed error or Python's failed flush at exit."""
    write_fully(sys.stdout, text + "\n")


class TrainingConsole:
    """What a training run shows while it runs: a progress bar (or, without a terminal, a line per
    log interval) and messages. Only one process shows it (torchrun's rank 0: `active`).

    When writing fails (`2> train.log` on a disk that filled up, a pipe whose reader quit),
    training goes on without a console: stderr points at /dev/null from then on, and `on_lost` is
    told why, once (the run's metrics.jsonl records it)."""

    def __init__(self, active: bool, progress_bar: bool, on_lost: Callable[[str], None]):
        self.active, self.progress_bar, self.on_lost = active, progress_bar, on_lost
        self.bar: tqdm | None = None

    def start_bar(self, total: int, initial: int) -> None:
        if self.active:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, desc="train", unit="step",
                            disable=not self.progress_bar, dynamic_ncols=True)

    def advance(self, postfix: dict | None = None) -> None:
        if self.bar is not None:
            self._write(_bar_update, self.bar, postfix)

    def close_bar(self) -> None:
        if self.bar is not None:
            self._write(self.bar.close)
            self.bar = None

    def print(self, message: str) -> None:
        if self.active:
            from tqdm import tqdm

            self._write(tqdm.write, message, file=sys.stderr)

    def _write(self, write: Callable[..., object], *args, **kwargs) -> None:
        try:
            write(*args, **kwargs)
            sys.stderr.flush()  # here, not at some later write or at exit
        except OSError as exc:  # the console is gone (BrokenPipeError included): carry on without it
            discard_stream(sys.stderr)
            self.on_lost(describe_os_error(exc, unnamed="stderr"))


def _bar_update(bar: tqdm, postfix: dict | None) -> None:
    bar.update(1)
    if postfix:
        bar.set_postfix(postfix, refresh=False)
