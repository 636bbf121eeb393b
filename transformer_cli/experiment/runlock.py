"""One writer per run directory: `tfm train` and `tfm prepare` hold `<run_dir>/.tfm.lock`.

Two trainings on one run_dir would interleave their checkpoints and metrics. The lock is an
advisory `flock` on a file that also records the holder's PID (for the message): the kernel
drops it when the holder dies, even by kill -9, so a stale lock file is simply taken over.
Where the filesystem has no flock (some network mounts) the recorded PID is checked instead.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ..runtime.errors import TfmError
from ..runtime.files import claim_directory, release_directory

try:
    import fcntl
except ImportError:  # not POSIX
    fcntl = None  # type: ignore[assignment]

LOCK_NAME = ".tfm.lock"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


class RunLock:
    def __init__(self, run_dir: Path, what: str):
        self.path = Path(run_dir) / LOCK_NAME
        self.what = what  # e.g. "tfm train", shown to whoever finds the directory busy
        self._fd: int | None = None

    def _holder(self) -> str:
        try:
            return self.path.read_text(encoding="utf-8").strip() or "unknown process"
        except OSError:
            return "unknown process"

    def __enter__(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            if fcntl is not None:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise TfmError(f"{self.path.parent} is in use by {self._holder()} (lock {self.path}); "
                           "wait for it to finish or stop it") from None
        except OSError:  # no flock here: fall back to the PID written by the holder
            holder = self._holder()
            found = re.match(r"PID (\d+)", holder)
            if found and int(found[1]) != os.getpid() and _pid_alive(int(found[1])):
                os.close(fd)
                raise TfmError(f"{self.path.parent} is in use by {holder} (lock {self.path})") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"PID {os.getpid()} ({self.what})\n".encode())
        self._fd = fd
        claim_directory(self.path.parent)  # the run's own files are this process's to write now
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            # The file stays (removing it would race with a process about to lock it); closing
            # releases the flock, and the PID inside is no longer alive.
            os.close(self._fd)
            self._fd = None
            release_directory(self.path.parent)
