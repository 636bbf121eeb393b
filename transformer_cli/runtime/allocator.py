"""The memory allocator `tfm train` runs on: mimalloc where it is installed, else the C library's.

A training step allocates and frees ~1 GB of tensors whose sizes change with every batch. glibc's
malloc serves them from one heap that it cannot shrink between live blocks, so the heap fills with
free fragments and the resident memory grows for the whole run. mimalloc keeps blocks of one size
class together and measured less memory and faster steps (docs/performance.md, "Training memory").

An allocator replaces malloc only if it is loaded before the program starts, so the CLI starts
itself again with LD_PRELOAD naming the library, once, before torch is imported.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path

from .errors import TfmError

# Set in the process started again, so that it never starts itself a third time.
RELAUNCHED = "TFM_ALLOCATOR_RELAUNCHED"
# mimalloc returns freed pages to the OS after this many ms by default (10); then every step faults
# its activations in anew. -1: keep them, as glibc's heap does for tfm (cpu.keep_freed_memory).
MIMALLOC_DEFAULTS = {"MIMALLOC_PURGE_DELAY": "-1"}


def mimalloc_library() -> Path | None:
    """The mimalloc shared library of the `cmeel-mimalloc` package, if it is installed here."""
    try:
        files = metadata.distribution("cmeel-mimalloc").files or []
    except metadata.PackageNotFoundError:
        return None
    for file in files:
        if file.name.startswith("libmimalloc.so"):
            path = Path(str(file.locate()))
            if path.is_file():
                return path
    return None


def loaded_allocator() -> str:
    """"mimalloc" when it serves this process's malloc, else "system"."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "system"
    return "mimalloc" if "libmimalloc" in maps else "system"


def relaunch_environment(library: Path, launched: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment the user started tfm with (`launched`, by default this process's: not what
    tfm set in it since, such as the oneDNN kernel cache), with `library` preloaded and mimalloc's
    settings where the user gave none."""
    from .. import LAUNCH_ENVIRONMENT
    from .console import SAID_ENV

    env = dict(LAUNCH_ENVIRONMENT if launched is None else launched)
    env["LD_PRELOAD"] = " ".join(filter(None, [str(library), env.get("LD_PRELOAD")]))
    for key, value in MIMALLOC_DEFAULTS.items():
        env.setdefault(key, value)
    env[RELAUNCHED] = "1"
    if os.environ.get(SAID_ENV):  # lines said already are not said twice
        env[SAID_ENV] = os.environ[SAID_ENV]
    return env


def use_allocator(choice: str, command: list[str]) -> None:
    """Make this process run on the allocator `choice` asks for ("auto", "mimalloc" or "system").

    With "mimalloc", or "auto" where mimalloc is installed, on Linux, and not loaded yet: replaces
    this process by `python *command` (e.g. ["-m", "transformer_cli", "train", ...]) with the
    library preloaded: the same PID, and the same environment otherwise. Returns where nothing
    needs to change.
    """
    if choice == "system" or loaded_allocator() == "mimalloc":
        return
    if os.environ.get(RELAUNCHED):  # started again, yet the loader did not preload it (it said why)
        if choice == "mimalloc":
            raise TfmError("train.allocator: mimalloc could not be preloaded (see the loader's message above); "
                           "use auto or system")
        return
    library = mimalloc_library() if sys.platform.startswith("linux") and sys.executable else None
    if library is None:
        if choice == "mimalloc":
            raise TfmError("train.allocator: mimalloc is not installed here (pip install cmeel-mimalloc, "
                           "Linux only); use auto or system")
        return
    env = relaunch_environment(library)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *command], env)
