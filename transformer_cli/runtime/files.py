"""Files: gzip-aware UTF-8 reading of corpora and inputs, and atomic writes of everything tfm writes."""

from __future__ import annotations

import fnmatch
import gzip
import hashlib
import json
import os
import re
import shutil
import socket
import stat
import tempfile
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from .errors import TfmError


def _open_binary(path: Path) -> IO[bytes]:
    if not path.is_file():
        raise TfmError(f"file not found: {path}")
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def text_file_problem(path: str | Path, head: int = 1 << 16) -> str | None:
    """What makes a file not line-by-line UTF-8 text, told from its first `head` bytes, in words
    (with the fix); None where nothing is seen. For errors that would otherwise only say that every
    line was dropped, or that two files' line counts differ."""
    try:
        with _open_binary(Path(path)) as f:
            data = f.read(head)
    except (OSError, EOFError, zlib.error, gzip.BadGzipFile, TfmError):
        return None
    if data.startswith((b"\xff\xfe", b"\xfe\xff")) or data.count(b"\0") > len(data) // 4:
        return "it is UTF-16 (convert it: iconv -f UTF-16 -t UTF-8)"
    if b"\r" in data and b"\n" not in data:
        return "its lines end in CR alone (old Mac line ends): it reads as one line (convert them: tr '\\r' '\\n')"
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.start < len(data) - 4:  # (not a character the head cut in two)
            return (f"it is not UTF-8 (byte {exc.start}: {exc.reason}); Latin-1 or Windows-1252? convert it: "
                    "iconv -f WINDOWS-1252 -t UTF-8")
    return None


def content_hash(path: Path) -> str:
    """A file's SHA-256 (hex), read a megabyte at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


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


# --------------------------------------------------------------------------- who may write where

MANIFEST_NAME, CONFIG_NAME = "prepare.json", "config.yaml"  # a directory holding prepare.json is a run directory
# A run's own files: what `tfm prepare` and `tfm train` write there, and nothing else does
# (filter_models/: the model filter's own models and the halves of the corpus they learn from).
_RUN_OWN_DIRECTORIES = ("checkpoints", "data", "tensorboard", "filter_models")
_RUN_OWN_FILES = (MANIFEST_NAME, CONFIG_NAME, "metrics.jsonl", ".tfm.lock")

# Directories this process is the writer of: the runs whose lock it holds (`RunLock`) and the
# staging directories it made. Their own files may be written; everyone else's are refused.
_WRITER_OF: set[Path] = set()


def claim_directory(directory: Path) -> None:
    _WRITER_OF.add(Path(directory).resolve())


def release_directory(directory: Path) -> None:
    _WRITER_OF.discard(Path(directory).resolve())


def run_owning(target: str | Path) -> Path | None:
    """The run directory of which `target` is one of the own files (its checkpoints/, data/,
    tensorboard/, prepare.json, config.yaml, metrics.jsonl, sentencepiece models), else None."""
    resolved = Path(target).resolve()
    for folder in resolved.parents:
        if (folder / MANIFEST_NAME).is_file():
            inside = resolved.relative_to(folder).parts
            own = inside[0] in _RUN_OWN_DIRECTORIES or (
                len(inside) == 1 and (inside[0] in _RUN_OWN_FILES or fnmatch.fnmatch(inside[0], "spm*.model")))
            return folder if own else None  # the innermost run directory decides
    return None


def refuse_run_files(target: str | Path, hint: str = "choose another output path") -> None:
    """Raise a TfmError where `target` is a run's own file and this process is not that run's
    writer: its checkpoints, data, vocabulary and settings are written only by `tfm prepare` and
    `tfm train` on it (which hold its lock), so that no other command's output replaces them."""
    run = run_owning(target)
    # ...or the writer of a run nested in that run's own folders (the model filter's runs in
    # filter_models/, made before their own prepare.json says they are runs)
    nested_writer = run is not None and any(run in folder.parents for folder in Path(target).resolve().parents
                                            if folder in _WRITER_OF)
    if run is not None and run not in _WRITER_OF and not nested_writer:
        raise TfmError(f"{target} is one of the run directory {run}'s own files (only tfm prepare and tfm train on "
                       f"that run write its checkpoints, data, vocabulary and settings); {hint}")


def refuse_output_among_inputs(output: Path | None, inputs: Mapping[str, Iterable[Path | None]], flag: str = "-o") -> None:
    """Raise a TfmError where `output` (given as `flag`) is the same file as one the command reads
    (`inputs`: option → the paths given to it), by any path, links included: the atomic write would
    replace it, e.g. a source text by its translation, a checkpoint by an average, a config by a report."""
    if output is None or not output.is_file():
        return
    for option, paths in inputs.items():
        for path in paths:
            if path is not None and path.is_file() and os.path.samefile(output, path):
                raise TfmError(f"{flag} {output} is also this command's input ({option}): writing it would "
                               f"replace it; choose another output path")


def _twins(name: str) -> tuple[str, ...]:
    """A file name and the name that would shadow it, or be shadowed by it, as a corpus (`x` / `x.gz`)."""
    return (name[:-3], name) if name.endswith(".gz") else (name, f"{name}.gz")


def check_output(target: str | Path | None, reads: Mapping[str, Iterable[Path | str | None]] | None = None, *,
                 flag: str = "-o", directory: bool = False, names: Iterable[str] | None = None,
                 ours: Callable[[Path], bool] | None = None, run_files: bool = True) -> None:
    """The output rule, the one check every command and script makes before it writes `target`
    (given on its command line as `flag`); a TfmError naming `flag` where it does not hold:

    - `target` is none of the files the command reads (`reads`: option → the paths given to it), by
      any path, links included, and none of a run's own files (unless this process is that run's writer);
    - a file to write is not an existing directory;
    - a directory that receives files (`directory`) is not an existing file, the working directory or
      one of its parents, nor one of the directories read. Where `names` lists the files it receives,
      none of them (nor its plain/.gz twin, which a corpus reader would take instead) may exist unless
      `ours(target)` says tfm wrote them there; without `names` the directory is replaced whole, so it
      must be empty, or hold nothing but what `ours` recognises, and hold none of the inputs.

    `run_files=False` leaves a run's own files to the caller, which writes them under the run's lock
    (`tfm average --force` into checkpoints/: experiment.rundir.save_checkpoint_file)."""
    if target is None or str(target) == "-":
        return
    target = Path(target)
    inputs = {option: [Path(p) for p in paths if p is not None] for option, paths in (reads or {}).items()}
    if not directory:
        if target.is_dir():
            raise TfmError(f"{flag} {target} is a directory: give the file to write")
        refuse_output_among_inputs(target, inputs, flag)
        if run_files:
            refuse_run_files(target, hint=f"choose another path for {flag}")
        return
    if target.exists() and not target.is_dir():
        raise TfmError(f"{flag} {target} exists and is not a directory: name a directory to write into")
    resolved, cwd = target.resolve(), Path.cwd().resolve()
    if resolved == cwd or resolved in cwd.parents:
        raise TfmError(f"{flag} {target} is the working directory or one of its parents: name a directory of its own")
    received = {twin for name in names or () for twin in _twins(name)}
    for option, paths in inputs.items():
        for path in paths:
            read = path.resolve()
            if read == resolved or (resolved in read.parents and (names is None or (
                    read.parent == resolved and read.name in received))):
                raise TfmError(f"{flag} {target} holds {path}, this command's input ({option}): writing there would "
                               "replace it; name a directory of its own")
    if run_files:
        refuse_run_files(target, hint=f"choose another directory for {flag}")
    if not target.is_dir() or not any(target.iterdir()) or (ours is not None and ours(target)):
        return
    if names is None:
        raise TfmError(f"{flag} {target} is not empty and holds files tfm did not write there: name a new or "
                       "empty directory")
    for twin in sorted(received):
        if (target / twin).exists():
            raise TfmError(f"{flag} {target} holds {twin}, which tfm did not write there: the output would "
                           "replace or shadow it; name a directory of its own")


def check_export_directory(output: Path, checkpoint: Path, force: bool, is_previous: Callable[[Path], bool]) -> None:
    """An export directory (replaced whole) under the output rule: new, empty, or an earlier export
    of its kind (`is_previous`), which only `force` replaces."""
    check_output(output, {"--checkpoint": [checkpoint]}, directory=True, ours=is_previous)
    if output.is_dir() and any(output.iterdir()) and not force:
        raise TfmError(f"{output} already holds an export (--force to replace it)")


SCRATCH_MARK = ".tfm-scratch"  # in a script's --workdir: the script's own, its files replaced on each run


def scratch_directory(directory: Path, reads: Mapping[str, Iterable[Path | str | None]] | None = None,
                      flag: str = "--workdir") -> Path:
    """A benchmark's or check's working directory, made ready: new, empty, or one that such a script
    made before (it holds SCRATCH_MARK), whose files it may replace or delete; anything else is
    refused by the output rule (check_output) before a file is touched."""
    check_output(directory, reads, flag=flag, directory=True, ours=lambda folder: (folder / SCRATCH_MARK).is_file())
    directory.mkdir(parents=True, exist_ok=True)
    (directory / SCRATCH_MARK).write_text("the working directory of a tfm script: its files are replaced on each run\n")
    return directory


# --------------------------------------------------------------------------- temporaries that name their writer

TEMP_SUFFIX = ".tmp"
STAGING_SUFFIX = ".staging"
# `.<target name>.tfm-<host>-<pid>-<start>.<random>.tmp` (a file) or `….staging` (a directory; a
# directory it replaces is moved aside to `….staging.old`): the writing process, so that whoever
# writes there next can tell a dead writer's leftovers from a live writer's work.
_TAGGED = re.compile(r"^\.(?P<name>.+)\.tfm-(?P<host>[0-9a-f]{8})-(?P<pid>\d+)-(?P<start>\d+)\.[a-z0-9_]+"
                     r"(?:\.tmp|\.staging(?P<aside>\.old)?)$")
_HOST = f"{zlib.crc32(socket.gethostname().encode()):08x}"


def _process_start(pid: int) -> int | None:
    """When process `pid` started (Linux: clock ticks after boot), which tells a reused PID from
    the process that wrote a file; None where it cannot be known."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read()
        return int(fields[fields.rindex(b")") + 2:].split()[19])  # field 22; the name in (…) may hold spaces
    except (OSError, ValueError, IndexError):
        return None


def writer_tag() -> str:
    """`tfm-<host>-<pid>-<start>` of this process (computed per call: a forked child is another writer)."""
    pid = os.getpid()
    return f"tfm-{_HOST}-{pid}-{_process_start(pid) or 0}"


def _writer_alive(found: re.Match) -> bool:
    if found["host"] != _HOST:  # another machine's, on a shared filesystem: it may well be alive
        return True
    pid, start = int(found["pid"]), int(found["start"])
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
    now = _process_start(pid) if start else None
    return now is None or now == start  # another start time: the PID was reused, the writer is gone


def _remove(path: Path) -> bool:
    """Best effort: cleaning up must not fail the write that does it (another user's leftovers,
    another process cleaning the same ones)."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    except OSError:
        return False
    return True


def remove_dead_writers_temps(directory: Path) -> list[Path]:
    """Delete, in `directory`, the temporary files and staging directories whose writer is dead
    (killed mid-write: kill -9, power loss); returns them. A live writer's are never touched. A
    directory a dead writer had moved aside to replace it goes back to its name if nothing took
    its place."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:  # not there (yet), not readable: nothing of ours to clean
        return removed
    for name in names:
        found = _TAGGED.match(name)
        if found is None or _writer_alive(found):
            continue
        path = Path(directory) / name
        if found["aside"] and not (Path(directory) / found["name"]).exists():
            try:
                path.rename(Path(directory) / found["name"])
                continue
            except OSError:
                pass
        if _remove(path):
            removed.append(path)
    return removed


def remove_stale_temps(directory: Path) -> list[Path]:
    """What `remove_dead_writers_temps` removes, plus temporary files named the way older tfm
    versions named them (`.<name>.<random>.tmp`, no writer). Call it only in a run directory whose
    lock this process holds: an old-style name cannot tell whether its writer is alive."""
    removed = remove_dead_writers_temps(directory)
    if directory.is_dir():
        for path in directory.glob(f".*{TEMP_SUFFIX}"):
            if _TAGGED.match(path.name) is None and path.is_file() and _remove(path):
                removed.append(path)
    return removed


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


def _written_into(target: Path) -> bool:
    """A FIFO, a character device (/dev/stdout, /dev/null), a socket: what is there is not a file to
    replace but a place to write into."""
    try:
        mode = target.stat().st_mode
    except OSError:
        return False
    return not stat.S_ISREG(mode) and not stat.S_ISDIR(mode)


@contextmanager
def atomic_path(target: str | Path) -> Iterator[Path]:
    """Yield a temporary path next to `target`; on success fsync it and rename it over `target`.

    A crash (even kill -9 or power loss) leaves either the old file or the new one, never a
    mixture. The temporary file names its writer (`.<name>.tfm-<host>-<pid>-<start>.<random>.tmp`):
    every write into a directory first removes the temporaries of dead writers there. A run's own
    files are refused unless this process is its writer (`refuse_run_files`). Where `target` is a
    FIFO or a device, the path yielded is `target` itself: it is written into, not replaced. The new
    file gets the usual umask permissions. A symbolic link is written through: its target is
    replaced, the link stays (a server's key file behind a link got the key).
    """
    target = through_link(Path(target))
    refuse_run_files(target)
    if _written_into(target):
        try:
            yield target
        except OSError as exc:
            raise named_after(exc, target) from None
        return
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        remove_dead_writers_temps(target.parent)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.{writer_tag()}.", suffix=TEMP_SUFFIX, dir=target.parent)
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


def through_link(target: Path) -> Path:
    """Where writing `target` lands: the file or directory a symbolic link points to, else `target`."""
    return Path(os.path.realpath(target)) if target.is_symlink() else target


def staging_directory(target: str | Path, run_cache: bool = False) -> Path:
    """A new, empty hidden directory beside `target` to build the directory `target` in (an
    export, an import), named after this process like `atomic_path`'s temporaries; dead writers'
    leftovers there are removed first. The caller renames it into place, or removes it.
    `run_cache`: `target` is a cache that any command may keep inside a run (interop/ct2_cache.py), not one
    of the files only the run's writer writes. A symbolic link's target is the directory built (the
    link stays); the new directory has the umask's permissions (mkdtemp makes it private)."""
    target = through_link(Path(target))
    if not run_cache:
        refuse_run_files(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_writers_temps(target.parent)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.{writer_tag()}.", suffix=STAGING_SUFFIX,
                                    dir=target.parent))
    os.chmod(staging, 0o777 & ~_UMASK)
    claim_directory(staging)  # a run built in it may write its own files there
    return staging


def replace_with_staged(staging: Path, target: Path) -> None:
    """Move the complete directory `staging` (from `staging_directory`) to `target`, an empty
    directory or an earlier output it replaces (checked by the caller), which goes only once the
    new one is in place; a failed move puts it back. An OSError names `target`, not the staging one.
    A symbolic link to a directory: its target is replaced, the link stays."""
    target = through_link(target)
    replaced = staging.with_name(staging.name + ".old")
    try:
        if target.exists():
            target.rename(replaced)
        try:
            staging.rename(target)
        except OSError:
            if replaced.exists():
                replaced.rename(target)
            raise
    except OSError as exc:  # a full disk: name the directory the user asked for
        raise OSError(exc.errno, exc.strerror, str(target)) from None
    finally:
        if replaced.exists():
            shutil.rmtree(replaced)


def named_after(exc: OSError, target: Path) -> OSError:
    """The same error, naming the file the user knows rather than its temporary stand-in."""
    if exc.filename is None or TEMP_SUFFIX in str(exc.filename) or Path(exc.filename) == target.parent:
        return type(exc)(exc.errno, exc.strerror, str(target))
    return exc


class AtomicStream:
    """A file written piece by piece through `atomic_path`: it appears at `target` only on
    `close()`; `abort()` removes the temporary. A failed write (a full disk) names `target`, the
    file the user knows, not its temporary stand-in."""

    def __init__(self, target: Path, mode: str = "wb", encoding: str | None = None):
        self.target = Path(target)
        self._atomic = atomic_path(self.target)
        self._file = open(self._atomic.__enter__(), mode, encoding=encoding)

    def write(self, data) -> None:
        try:
            self._file.write(data)
        except OSError as exc:
            raise named_after(exc, self.target) from None

    def close(self) -> None:
        try:
            self._file.close()
        except OSError as exc:
            raise named_after(exc, self.target) from None
        self._atomic.__exit__(None, None, None)

    def abort(self) -> None:
        try:
            self._file.close()  # flushes what is buffered: fails again on a full disk
        except OSError:
            pass
        self._atomic.__exit__(TfmError, TfmError("aborted"), None)  # removes the temporary file


def _read_umask() -> int:
    mask = os.umask(0)  # the only way to read it is to set it
    os.umask(mask)
    return mask


_UMASK = _read_umask()


def atomic_write_bytes(target: str | Path, data: bytes | memoryview) -> None:
    with atomic_path(target) as tmp, open(tmp, "wb") as f:
        f.write(data)


def atomic_write_text(target: str | Path, text: str) -> None:
    atomic_write_bytes(target, text.encode("utf-8"))


def read_json_object(path: Path) -> dict:
    """A JSON object a command wrote and reads back: {} where the file is missing, torn or not an object."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def file_sha256(path: Path) -> str:
    """A file's SHA-256, read a megabyte at a time (a checkpoint: what a score names it by)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def digest_file(path: Path) -> Path:
    """A file's SHA-256 beside it, as `sha256sum` writes it (`sha256sum -c` checks it): for files tfm
    writes and a foreign library later reads unchecked (a lexical shortlist), so that a truncated or
    damaged copy is recognised before that library sees it."""
    return path.with_name(path.name + ".sha256")


def write_with_digest(path: Path, text: str, digest: str | None = None) -> None:
    """Write `text` to `path` and its digest file (each atomically); `digest`: a digest known already."""
    atomic_write_text(path, text)
    digest = digest or hashlib.sha256(text.encode("utf-8")).hexdigest()
    atomic_write_text(digest_file(path), f"{digest}  {path.name}\n")


def check_digest(path: Path, remedy: str) -> str | None:
    """Where a digest file is beside `path`, the file must match it: a TfmError naming both and
    `remedy` otherwise. Returns the digest (None: no digest file)."""
    digest = digest_file(path)
    if not digest.exists():
        return None
    try:
        recorded = digest.read_text(encoding="utf-8").split()[0]
        actual = hashlib.sha256(path.read_bytes()).hexdigest()
    except (OSError, UnicodeDecodeError, IndexError) as exc:
        raise TfmError(f"{digest}: cannot be read ({getattr(exc, 'strerror', None) or type(exc).__name__}): "
                       f"{remedy}") from None
    if recorded != actual:
        raise TfmError(f"{path}: truncated or changed since it was written (its SHA-256 differs from {digest.name}'s): "
                       f"{remedy} (or delete {digest.name} to use an edited file)")
    return recorded
