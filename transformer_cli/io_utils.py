"""Small file helpers: gzip-aware UTF-8 reading and atomic writes."""

from __future__ import annotations

import gzip
import io
import os
import tempfile
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


def read_lines(path: str | Path) -> list[str]:
    """All lines of a plain or gzipped UTF-8 file, without line endings.

    Invalid UTF-8 is an error naming the file and line (it would otherwise corrupt the vocab).
    """
    lines: list[str] = []
    with open(path, "rb") as raw_file:
        raw = gzip.GzipFile(fileobj=raw_file) if str(path).endswith(".gz") else raw_file
        for number, raw_line in enumerate(raw, start=1):
            try:
                lines.append(raw_line.decode("utf-8").rstrip("\r\n"))
            except UnicodeDecodeError as exc:
                raise TfmError(f"{path}: line {number} is not valid UTF-8 ({exc.reason})") from None
    return lines


def count_lines(path: str | Path) -> int:
    with open(path, "rb") as raw_file:
        raw = gzip.GzipFile(fileobj=raw_file) if str(path).endswith(".gz") else raw_file
        return sum(1 for _ in raw)


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
