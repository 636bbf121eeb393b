"""The CPU this process runs on: how many cores it may use, its name, how much of it other work
takes (`CpuReading`), and two process settings that make training and decoding on it faster (freed
memory kept for reuse, denormals flushed). Measurements behind them: docs/performance.md."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
# Other work taking this share of the CPUs or more makes a speed measured meanwhile one of the
# moment: it is said, and not kept as the machine's (others_share).
BUSY_SHARE = 0.2
_configured = False


def usable_cores() -> int:
    """Cores this process may use (affinity-aware where the OS tells)."""
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except AttributeError:  # not on Linux
        return max(os.cpu_count() or 1, 1)


def cpu_model_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "unknown CPU"


def cpu_flags() -> set[str]:
    """The instruction-set flags /proc/cpuinfo lists for this CPU (empty where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "flags":
                    return set(value.split())
    except OSError:
        pass
    return set()


@dataclass(frozen=True)
class CpuReading:
    """What this process and the machine had run at one moment. Two readings tell how much of the
    CPUs other work took between them (`others_share`): a measurement of speed taken meanwhile is
    a measurement of the moment, not of the machine."""

    wall: float  # time.monotonic()
    own: float  # this process's CPU seconds, every thread
    waited: float | None  # seconds this process's threads were runnable but waiting for a CPU (schedstat)
    busy: float | None  # CPU seconds every process used (/proc/stat), where it counts just the CPUs we may use


def _seconds_waited() -> float | None:
    """The run-queue wait of every thread of this process (/proc/self/task/*/schedstat, 2nd field, ns)."""
    total, found = 0, False
    for stat in Path("/proc/self/task").glob("*/schedstat"):
        try:
            total += int(stat.read_text().split()[1])
            found = True
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended meanwhile
    return total / 1e9 if found else None


def _seconds_busy() -> float | None:
    """CPU seconds all processes used (user, nice, system, irq, softirq, steal) where /proc/stat
    counts the CPUs this process may use; None elsewhere (a container shown the host's CPUs)."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
        cpus = sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit())
        fields = [int(x) for x in lines[0].split()[1:9]]
        if cpus != usable_cores():
            return None
        user, nice, system, _idle, _iowait, irq, softirq, steal = fields
        return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def cpu_reading() -> CpuReading:
    return CpuReading(time.monotonic(), time.process_time(), _seconds_waited(), _seconds_busy())


def others_share(start: CpuReading, end: CpuReading, threads: int) -> float:
    """The share of this process's CPUs that other work took between two readings (0 to 1): the
    larger of the time its `threads` waited for a CPU over the time they could have run, and other
    processes' CPU time over the CPUs' (steal of a virtual machine included); 0 where neither is
    readable (not Linux)."""
    wall = end.wall - start.wall
    if wall <= 0:
        return 0.0
    shares = [0.0]
    if start.waited is not None and end.waited is not None:
        shares.append((end.waited - start.waited) / (wall * max(threads, 1)))
    if start.busy is not None and end.busy is not None:
        shares.append((end.busy - start.busy - (end.own - start.own)) / (wall * usable_cores()))
    return min(max(shares), 1.0)


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory for reuse instead of returning it to the OS.

    By default every allocation above 32 MB (logits, FFN activations and their gradients) is a
    fresh mmap whose pages the kernel must fault in and zero on first touch, and is unmapped
    again when freed — every step. Serving all allocations from the heap and never trimming it
    makes CPU training steps faster. No-op where glibc is not the allocator (`tfm train` on
    mimalloc: runtime/allocator.py, which keeps freed pages by its own setting).
    """
    global _configured
    if _configured or not sys.platform.startswith("linux"):
        return _configured
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(_M_MMAP_MAX, 0) == 1 and mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1
    _configured = ok
    return ok


# oneDNN kernels kept built while training. Every kernel kept holds memory of its own, and
# token-bucketed batches bring ~6,000 matmul shapes: with room for 16,384 a 30-minute
# configs/de-en.yaml run peaked at 3.7 GB of RSS, with 16 at 2.6 GB, at the same tokens/s
# (AMD EPYC Zen 4; docs/performance.md). Decoding keeps the larger cache: its shapes recur.
TRAINING_KERNEL_CACHE = 16


def limit_training_kernel_cache() -> None:
    """Keep TRAINING_KERNEL_CACHE oneDNN kernels at most, unless the user set
    ONEDNN_PRIMITIVE_CACHE_CAPACITY. oneDNN reads it once, when torch runs its first kernel, so
    this must come before any torch work in the process (`tfm train` calls it first)."""
    from .. import USER_KERNEL_CACHE

    if USER_KERNEL_CACHE is None:
        os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = str(TRAINING_KERNEL_CACHE)


def release_freed_memory() -> bool:
    """Hand the freed memory that `keep_freed_memory` keeps back to the OS (glibc's malloc_trim),
    e.g. after a validation pass, whose allocations training does not reuse. No-op elsewhere."""
    if not _configured:
        return False
    try:
        return bool(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False


@contextlib.contextmanager
def denormals_flushed_to_zero() -> Iterator[None]:
    """Treat denormal floats as zero on CPU inside the block (restored to IEEE behaviour after).

    A trained model's log-softmax over the vocabulary takes exp() of logits far below the
    maximum; results under 1e-38 are denormals, which x86 cores compute far more slowly. Flushed,
    they become 0, a change far below bf16/fp32 rounding of any probability that can matter to the
    search.
    """
    import torch  # cpu.py's other helpers serve commands that never load torch

    changed = torch.set_flush_denormal(True)  # False where the CPU does not support it
    try:
        yield
    finally:
        if changed:
            torch.set_flush_denormal(False)
