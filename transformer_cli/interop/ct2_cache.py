"""The CTranslate2 conversion of a checkpoint, made on first use and kept beside it.

`decode.engine: auto` translates a checkpoint through CTranslate2. The first translation converts
it as `tfm export` does (float32 weights: the compute type is applied when CTranslate2 loads the
model, so one conversion serves int8 on a CPU and float16 on a GPU alike) into

    <the checkpoint's directory>/ctranslate2/<checkpoint name>-<16 hex digits>/

and later translations load that directly, without loading torch at all.

- Which conversion: the one named by the checkpoint's content (its SHA-256, with the versions of
  the conversion and of CTranslate2: `converter`). Hashing a large checkpoint takes a
  while, so a conversion records the identity of the file it was made from (device, inode, size,
  modification time); a checkpoint with that identity is not hashed again. Training replaces a
  checkpoint by renaming a new file onto it (a new inode): that one is hashed, and new content gets
  a new conversion, after which the conversions of the name's earlier contents are removed.
- Staged: the conversion is built in a directory named after the converting process
  (files.staging_directory) and renamed into place only when whole. A kill -9 mid-conversion
  leaves only that directory, which the next conversion there removes (its writer is dead). Two
  processes converting at once each build their own; the first rename wins and the other process
  uses the winner's and drops its own.
- Where the checkpoint's directory cannot be written (read-only, another user's), the conversion
  goes to a temporary directory, removed at exit, and a warning says so.
- tfm's own, so it heals: the record lists every file of the conversion with its size, time and
  SHA-256 (`files`). A conversion whose file is missing, of another size, or of another content
  (checked by digest where its time changed) is removed and made again, with one line on stderr;
  its decode settings (tfm_decode.json) are therefore always the checkpoint's. A conversion that
  CTranslate2 then cannot load is made again once (decoding/engine.py). A record written before
  `files` existed is checked for the files every conversion has.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..runtime.errors import TfmError
from ..runtime.files import content_hash, read_json_object, staging_directory, writer_tag

CACHE_NAME = "ctranslate2"
SOURCE_JSON = "tfm_source.json"  # inside a conversion: the checkpoint's hash and the identities it was read as
HASH_DIGITS = 16
# What a conversion is made with besides the checkpoint: tfm's conversion (its format: raise it when
# write_conversion writes something else) and the CTranslate2 that wrote model.bin (an older one
# cannot read a newer one's). Part of the key: either changing gives a new conversion.
CONVERSION_FORMAT = 1


def converter() -> str:
    import ctranslate2

    return f"tfm-{CONVERSION_FORMAT}/ctranslate2-{ctranslate2.__version__}"


@dataclass(frozen=True)
class Conversion:
    directory: Path
    note: str | None = None  # a warning to print (converted into a temporary directory)
    converted: bool = False  # made by this call (not found in the cache)


def file_identity(path: Path) -> list[int]:
    status = path.stat()
    return [status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns]


def _source_record(directory: Path) -> dict:
    return read_json_object(directory / SOURCE_JSON)


CONVERSION_FILES = ("model.bin", "config.json", "tfm_decode.json", "source.spm.model", "target.spm.model")


def _is_whole(directory: Path) -> bool:
    return (directory / "model.bin").is_file() and (directory / SOURCE_JSON).is_file()


def file_manifest(directory: Path) -> dict[str, list]:
    """Every file of a conversion (its record aside) → [size, modification time, SHA-256]."""
    manifest = {}
    for path in sorted(directory.iterdir()):
        if path.is_file() and path.name != SOURCE_JSON and not path.name.startswith("."):
            status = path.stat()
            manifest[path.name] = [status.st_size, status.st_mtime_ns, content_hash(path)]
    return manifest


def damage(directory: Path, record: dict) -> str | None:
    """What is wrong with a conversion in the cache (None: nothing): a file missing, of another size,
    or, where its time changed, of another content than its record says."""
    files = record.get("files")
    if not isinstance(files, dict):  # recorded before manifests: the files every conversion has
        missing = [name for name in CONVERSION_FILES if not (directory / name).is_file()]
        return f"{missing[0]}: missing" if missing else None
    for name, recorded in files.items():
        path = directory / name
        if not isinstance(recorded, list) or len(recorded) != 3:
            return f"{SOURCE_JSON}: not a conversion's record"
        try:
            status = path.stat()
        except OSError:
            return f"{name}: missing"
        if status.st_size != recorded[0]:
            return f"{name}: {status.st_size} bytes, {recorded[0]} when converted"
        if status.st_mtime_ns != recorded[1] and content_hash(path) != recorded[2]:
            return f"{name}: changed since it was converted"
    return None


def discard(directory: Path) -> None:
    """A conversion out of the cache: moved aside (out of the lookup at once), then deleted."""
    aside = directory.parent / f".{directory.name}.{writer_tag()}.removing.staging"
    try:
        directory.rename(aside)
    except OSError:
        shutil.rmtree(directory, ignore_errors=True)
        return
    shutil.rmtree(aside, ignore_errors=True)


def _conversions_of(cache: Path, checkpoint_name: str) -> list[Path]:
    """The conversions in `cache` of a checkpoint named `checkpoint_name` (of any content)."""
    try:
        names = os.listdir(cache)
    except OSError:
        return []
    prefix = f"{checkpoint_name}-"
    return [cache / n for n in names
            if n.startswith(prefix) and len(n) == len(prefix) + HASH_DIGITS and not n.startswith(".")]


def _umask() -> int:
    mask = os.umask(0)  # the only way to read it is to set it
    os.umask(mask)
    return mask


def _write_record(directory: Path, record: dict) -> None:
    """tfm_source.json replaced whole (a reader sees the old record or the new one)."""
    handle, temporary = tempfile.mkstemp(prefix=f".{SOURCE_JSON}.{writer_tag()}.", suffix=".tmp", dir=directory)
    with os.fdopen(handle, "w", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
    os.replace(temporary, directory / SOURCE_JSON)


def cached_conversion(checkpoint: str | Path) -> Conversion:
    """The CTranslate2 directory converted from `checkpoint`: found in its cache, or made now
    (ct2.write_conversion; NotConvertible where CTranslate2 cannot express the model)."""
    checkpoint = Path(checkpoint)
    if not checkpoint.is_file():
        raise TfmError(f"checkpoint not found: {checkpoint}")
    cache = checkpoint.parent / CACHE_NAME
    identity, made_by = file_identity(checkpoint), converter()
    healed = None  # what was wrong with the conversion found, where it is made again
    for directory in _conversions_of(cache, checkpoint.name):
        record = _source_record(directory)
        if identity in record.get("identities", []) and record.get("converter") == made_by and _is_whole(directory):
            healed = damage(directory, record)
            if healed is None:
                return Conversion(directory)
            discard(directory)
            break
    digest = content_hash(checkpoint)
    key = hashlib.sha256(f"{digest} {made_by}".encode()).hexdigest()
    target = cache / f"{checkpoint.name}-{key[:HASH_DIGITS]}"
    record = _source_record(target)
    if target.is_dir() and healed is None and (not _is_whole(target) or damage(target, record) is not None):
        healed = damage(target, record) or f"{SOURCE_JSON} or model.bin: missing"
        discard(target)
    if _is_whole(target) and record.get("sha256") == digest and record.get("converter") == made_by:
        # The same content under another identity (copied, touched): remembered, so it is not hashed again.
        try:
            _write_record(target, {**record, "identities": [*record.get("identities", [])[-7:], identity]})
        except OSError:
            pass  # a read-only cache still serves
        return Conversion(target)
    try:
        cache.mkdir(exist_ok=True)
        staging = staging_directory(target, run_cache=True)
        os.chmod(staging, 0o777 & ~_umask())  # readable as the run's other files are (mkdtemp makes it private)
    except OSError as exc:
        return _temporary_conversion(checkpoint, cache, exc)
    try:
        from .ct2 import write_conversion  # imports torch, to read the checkpoint

        write_conversion(checkpoint, staging)
        (staging / SOURCE_JSON).write_text(json.dumps({"checkpoint": checkpoint.name, "sha256": digest,
                                                       "converter": made_by, "identities": [identity],
                                                       "files": file_manifest(staging)}) + "\n",
                                           encoding="utf-8")
        try:
            staging.rename(target)
        except OSError:
            if not _is_whole(target):  # not another process's conversion that got there first
                raise
    except OSError as exc:  # a full disk mid-conversion: convert where there is room
        return _temporary_conversion(checkpoint, cache, exc)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    _remove_earlier_conversions(cache, checkpoint.name, keep=target)
    note = (f"warning: the cached CTranslate2 conversion of {checkpoint.name} was damaged ({healed}): made it again "
            f"in {target}") if healed else None
    return Conversion(target, note, converted=True)


def _remove_earlier_conversions(cache: Path, checkpoint_name: str, keep: Path) -> None:
    """Conversions of the checkpoint's earlier contents: moved aside (out of the lookup at once),
    then deleted. Best effort."""
    for directory in _conversions_of(cache, checkpoint_name):
        if directory != keep:
            discard(directory)


def _temporary_conversion(checkpoint: Path, cache: Path, why: OSError) -> Conversion:
    from .ct2 import write_conversion

    temporary = Path(tempfile.mkdtemp(prefix="tfm-ctranslate2-"))
    atexit.register(shutil.rmtree, temporary, ignore_errors=True)
    write_conversion(checkpoint, temporary)
    reason = why.strerror or type(why).__name__
    return Conversion(temporary, f"warning: {cache} cannot be written ({reason}): the CTranslate2 conversion of "
                                 f"{checkpoint.name} went to the temporary directory {temporary}, removed at exit "
                                 "(made again by every command)", converted=True)
