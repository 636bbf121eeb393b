"""Files: gzip-aware UTF-8 reading of corpora and inputs, and atomic writes of everything tfm writes."""

from __future__ import annotations

import gzip
import os
import tempfile
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from .errors import TfmError


def _open_binary(path: Path) -> IO[bytes]:
    if not path.is_file():
        raise TfmError(f"file not found: {path}")
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def iter_raw_lines(path: str | Path) -> Iterator[bytes]:
    """Lines of a plain or gzipped file as bytes (line ending included); a broken gzip is a TfmError."""
    path = Path(path)
    try:
        with _open_binary(path) as f:
            yield from f
    except (EOFError, zlib.error, gzip.BadGzipFile) as exc:
        raise TfmError(f"{path}: cannot read it to the end: truncated or corrupt file ({exc})") from None


def decode_line(raw: bytes, path: str | Path, number: int) -> str:
    """UTF-8 text of one line without its ending; invalid UTF-8 names the file and line.

    (Invalid bytes are an error rather than replaced: they would otherwise corrupt the vocab.
    So is a NUL byte, which text never contains: the file is binary or mis-encoded, e.g. UTF-16.)
    CRLF endings are handled; a UTF-8 byte-order mark at the start of the file is dropped.
    """
    if b"\0" in raw:
        raise TfmError(f"{path}: line {number} contains a NUL byte: not a UTF-8 text file (binary? UTF-16?)")
    try:
        text = raw.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError as exc:
        raise TfmError(f"{path}: line {number} is not valid UTF-8 ({exc.reason})") from None
    return text[1:] if number == 1 and text.startswith("\ufeff") else text


def read_lines(path: str | Path) -> list[str]:
    """All lines of a plain or gzipped UTF-8 file, without line endings."""
    return [decode_line(raw, path, number) for number, raw in enumerate(iter_raw_lines(path), start=1)]


TEMP_SUFFIX = ".tmp"


def refuse_output_among_inputs(output: Path | None, inputs: dict[str, list[Path | None]]) -> None:
    """Raise a TfmError where `output` is the same file as one the command reads (`inputs`: option →
    the paths given to it): the atomic write would replace it, e.g. a source text by its
    translation, or a checkpoint by an average."""
    if output is None or not output.is_file():
        return
    for option, paths in inputs.items():
        for path in paths:
            if path is not None and path.is_file() and os.path.samefile(output, path):
                raise TfmError(f"-o {output} is also this command's input ({option}): writing it would "
                               f"replace it; choose another output path")


def _fsync_directory(directory: Path) -> None:
    """Make a rename durable: the directory entry itself must reach the disk (POSIX)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # not possible on some platforms/filesystems: the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextmanager
def atomic_path(target: str | Path) -> Iterator[Path]:
    """Yield a temporary path next to `target`; on success fsync it and rename it over `target`.

    A crash (even kill -9 or power loss) leaves either the old file or the new one, never a
    mixture; the temporary file (`.<name>.<random>.tmp`) of an interrupted write is removed by
    `remove_stale_temps` at the next start. The new file gets the usual umask permissions.
    """
    target = Path(target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=TEMP_SUFFIX, dir=target.parent)
    except OSError as exc:
        raise named_after(exc, target) from None
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        os.chmod(tmp_path, 0o666 & ~_UMASK)  # mkstemp makes 0600; a normal file is expected
        with open(tmp_path, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp_path, target)
        _fsync_directory(target.parent)
    except OSError as exc:
        raise named_after(exc, target) from None
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def named_after(exc: OSError, target: Path) -> OSError:
    """The same error, naming the file the user knows rather than its temporary stand-in."""
    if exc.filename is None or TEMP_SUFFIX in str(exc.filename) or Path(exc.filename) == target.parent:
        return type(exc)(exc.errno, exc.strerror, str(target))
    return exc


def _read_umask() -> int:
    mask = os.umask(0)  # the only way to read it is to set it
    os.umask(mask)
    return mask


_UMASK = _read_umask()


def remove_stale_temps(directory: Path) -> list[Path]:
    """Delete temporary files left by writes that were killed (`atomic_path`); returns them.

    Only call this while holding the directory's lock: a live writer's temp file looks the same.
    """
    removed = []
    if directory.is_dir():
        for path in directory.glob(f".*{TEMP_SUFFIX}"):
            try:
                path.unlink()
                removed.append(path)
            except FileNotFoundError:
                pass
    return removed


def atomic_write_bytes(target: str | Path, data: bytes | memoryview) -> None:
    with atomic_path(target) as tmp, open(tmp, "wb") as f:
        f.write(data)


def atomic_write_text(target: str | Path, text: str) -> None:
    atomic_write_bytes(target, text.encode("utf-8"))
