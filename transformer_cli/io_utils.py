"""Small file helpers: gzip-aware UTF-8 reading and atomic writes."""

from __future__ import annotations

import gzip
import io
import os
import tempfile
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from .errors import TfmError


def open_text(path: str | Path) -> IO[str]:
    path = Path(path)
    if not path.is_file():
        raise TfmError(f"file not found: {path}")
    if path.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8", newline="\n")
    return open(path, encoding="utf-8", newline="\n")


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

    (Invalid bytes are an error rather than replaced: they would otherwise corrupt the vocab.)
    """
    try:
        return raw.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError as exc:
        raise TfmError(f"{path}: line {number} is not valid UTF-8 ({exc.reason})") from None


def read_lines(path: str | Path) -> list[str]:
    """All lines of a plain or gzipped UTF-8 file, without line endings."""
    return [decode_line(raw, path, number) for number, raw in enumerate(iter_raw_lines(path), start=1)]


@contextmanager
def atomic_path(target: str | Path) -> Iterator[Path]:
    """Yield a temporary path next to `target`; rename it over `target` only on success."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        os.replace(tmp_path, target)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def atomic_write_text(target: str | Path, text: str) -> None:
    with atomic_path(target) as tmp:
        tmp.write_text(text, encoding="utf-8")
