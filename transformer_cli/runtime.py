"""Process-level CPU settings that make a measurable difference to training and decoding speed."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

from .errors import TfmError

T, R = TypeVar("T"), TypeVar("R")
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
_configured = False


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory for reuse instead of returning it to the OS.

    By default every allocation above 32 MB (logits, FFN activations and their gradients) is a
    fresh mmap whose pages the kernel must fault in and zero on first touch, and is unmapped
    again when freed — every step. Serving all allocations from the heap and never trimming it
    makes a 4k-token CPU training step ~15% faster here. No-op where glibc is not the allocator.
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


@contextlib.contextmanager
def denormals_flushed_to_zero() -> Iterator[None]:
    """Treat denormal floats as zero on CPU inside the block (restored to IEEE behaviour after).

    A trained model's log-softmax over the vocabulary takes exp() of logits far below the
    maximum; results under 1e-38 are denormals, which x86 cores compute ~100x slower. On the
    de-en model (AMD EPYC) this made log_softmax 3x slower per beam step. Flushed, they become 0,
    a change far below bf16/fp32 rounding of any probability that can matter to the search.
    """
    changed = torch.set_flush_denormal(True)  # False where the CPU does not support it
    try:
        yield
    finally:
        if changed:
            torch.set_flush_denormal(False)


def cpu_has_fast_bf16() -> bool:
    """True on CPUs with AMX tiles, where a bf16 matmul runs ~12x faster than fp32 (no need to measure)."""
    is_amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(is_amx and is_amx())


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


CACHE_ENV = "TFM_CACHE"
BF16_MIN_SPEEDUP = 1.5  # below this, autocast's casts and the fp32 elementwise work eat the gain


def cache_dir() -> Path:
    """Where measurements are kept: `TFM_CACHE`, else `$XDG_CACHE_HOME/tfm`, else `~/.cache/tfm`."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tfm"


def _matmul_flops(a: torch.Tensor, b: torch.Tensor, seconds: float = 0.08) -> float:
    for _ in range(2):  # warm-up: oneDNN picks and JITs its kernel on first use
        a @ b
    calls, started = 0, time.perf_counter()
    while calls < 3 or time.perf_counter() - started < seconds:
        a @ b
        calls += 1
    return 2 * a.size(0) * a.size(1) * b.size(1) * calls / (time.perf_counter() - started)


def measure_bf16_speedup(d_model: int, d_ff: int, tokens: int = 2048) -> float:
    """bf16 / fp32 matmul throughput for the model's own FFN shape, (tokens × d_model) @ (d_model × d_ff).

    ~0.3 s; the answer is cached per CPU model, torch version, thread count and shape.
    """
    key = f"{cpu_model_name()} | torch {torch.__version__} | {torch.get_num_threads()} threads | " \
          f"{tokens}x{d_model}x{d_ff}"
    path = cache_dir() / "bf16_speedup.json"
    try:
        cached = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        cached = {}
    if not isinstance(cached, dict):
        cached = {}
    if isinstance(cached.get(key), (int, float)):
        return float(cached[key])
    # A generator of its own: drawing from the global one would make a run's initial weights depend
    # on whether this measurement was cached yet (training seeds before it chooses the precision).
    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(tokens, d_model, generator=generator), torch.randn(d_model, d_ff, generator=generator)
    fp32 = _matmul_flops(a, b)
    bf16 = _matmul_flops(a.bfloat16(), b.bfloat16())
    speedup = bf16 / fp32
    cached[key] = round(speedup, 3)
    try:
        from .io_utils import atomic_write_text  # noqa: PLC0415 (io_utils imports errors only)

        atomic_write_text(path, json.dumps(cached, indent=1))
    except OSError:
        pass  # a read-only home: measure again next time
    return speedup


@dataclass(frozen=True)
class PrecisionChoice:
    bf16: bool
    reason: str  # printed with the first line of train/translate

    def describe(self) -> str:
        return f"{'bf16 autocast' if self.bf16 else 'fp32'} ({self.reason})"


PRECISION_ENV = "TFM_PRECISION"


def precision_override() -> str | None:
    """`TFM_PRECISION=fp32|bf16` decides what `precision: auto` means, on any device.

    It lets anyone reproduce another CPU family's behaviour (the test suite run as on an AMX
    Xeon, or as on a CPU without fast bf16). Explicit `fp32`/`bf16` settings are not affected.
    """
    value = os.environ.get(PRECISION_ENV, "").strip().lower()
    if not value or value == "auto":
        return None
    if value not in ("fp32", "bf16"):
        raise TfmError(f"{PRECISION_ENV}={value!r}: expected fp32, bf16 or auto")
    return value


def choose_precision(precision: str, device: torch.device, shape: tuple[int, int] = (512, 2048)) -> PrecisionChoice:
    """Resolve a `precision` setting (auto, fp32, bf16) and say why.

    auto = `TFM_PRECISION` when set; else bf16 on CUDA; on a CPU, bf16 when its bf16 matmuls
    measure ≥ 1.5x faster than fp32 for the model's (d_model, d_ff) — AMX Xeons (~12x) and
    AVX512_BF16 CPUs such as AMD Zen 4/5 (~4x) do, AVX2-only CPUs do not — else fp32.
    """
    if precision != "auto":
        return PrecisionChoice(precision == "bf16", f"precision: {precision}")
    forced = precision_override()
    if forced is not None:
        return PrecisionChoice(forced == "bf16", f"{PRECISION_ENV}={forced}")
    if device.type == "cuda":
        return PrecisionChoice(True, "CUDA")
    if device.type != "cpu":
        return PrecisionChoice(False, f"no bf16 rule for {device.type}")
    if cpu_has_fast_bf16():
        return PrecisionChoice(True, "AMX on this CPU")
    speedup = measure_bf16_speedup(*shape)
    verdict = "faster" if speedup >= 1 else "slower"
    factor = speedup if speedup >= 1 else 1 / speedup
    return PrecisionChoice(speedup >= BF16_MIN_SPEEDUP,
                           f"bf16 matmuls {factor:.1f}x {verdict} than fp32 measured on this CPU")


def wants_bf16(precision: str, device: torch.device, shape: tuple[int, int] = (512, 2048)) -> bool:
    return choose_precision(precision, device, shape).bf16


def resolve_device(name: str) -> torch.device:
    """`auto` (CUDA when present), `cpu`, `cuda`, `cuda:N`; anything else is a one-line TfmError."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise TfmError(f"device {name!r} was asked for, but CUDA is not available on this machine")
    try:
        return torch.device(name)
    except RuntimeError:
        raise TfmError(f"{name!r} is not a device (use auto, cpu, cuda or cuda:N)") from None


def is_out_of_memory(exc: BaseException) -> bool:
    """A failed allocation: CUDA's OutOfMemoryError, or the CPU allocator's RuntimeError."""
    if isinstance(exc, (MemoryError, torch.cuda.OutOfMemoryError)):
        return True
    return isinstance(exc, RuntimeError) and ("can't allocate memory" in str(exc) or "out of memory" in str(exc))


def split_on_out_of_memory(decode: Callable[[list[T]], list[R]], items: list[T],
                           on_split: Callable[[int], None] | None = None) -> list[R]:
    """`decode(items)`, or, if that runs out of memory, the same on each half (recursively).

    A batch that fits no longer fails the whole translation; a single item that does not fit
    is a real error and is raised. `on_split(n)` is told the size of each batch that was split.
    """
    try:
        return decode(items)
    except Exception as exc:
        if not is_out_of_memory(exc) or len(items) <= 1:
            raise
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if on_split is not None:
        on_split(len(items))
    half = len(items) // 2
    return (split_on_out_of_memory(decode, items[:half], on_split)
            + split_on_out_of_memory(decode, items[half:], on_split))
