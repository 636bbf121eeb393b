"""Which precision training and decoding run in: fp32, or bf16 where it measures faster; decoding
also int8.

`auto` is decided per device: bf16 on CUDA and on CPUs whose bf16 matmuls are clearly faster than
fp32 for the model's shape (AMX Xeons, AVX512_BF16 CPUs), measured once per CPU and cached; on
other CPUs training runs in fp32 and decoding in int8 (`choose_decoding_precision`).
`TFM_PRECISION` overrides what `auto` means (to reproduce another CPU's behaviour).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..model import cpu_inference
from .cpu import BUSY_SHARE, cpu_model_name, cpu_reading, others_share
from .errors import TfmError
from .files import atomic_write_text


def cpu_has_fast_bf16() -> bool:
    """True on CPUs with AMX tiles, where bf16 matmuls run many times faster than fp32 (no need to measure)."""
    is_amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(is_amx and is_amx())


CACHE_ENV = "TFM_CACHE"
BF16_MIN_SPEEDUP = 1.5  # below this, autocast's casts and the fp32 elementwise work eat the gain
BF16_SCREEN = 0.25  # bf16 this much slower than fp32 on a few rows: emulated, no need to time the full shape


def cache_dir() -> Path:
    """Where measurements are kept: `TFM_CACHE`, else `$XDG_CACHE_HOME/tfm`, else `~/.cache/tfm`."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tfm"


def _matmul_flops(a: torch.Tensor, b: torch.Tensor, seconds: float = 0.08) -> float:
    """Mean FLOP/s of at least three calls, and of as many as fit in `seconds`, after two untimed."""
    for _ in range(2):  # warm-up: oneDNN picks and JITs its kernel on first use
        a @ b
    calls, started = 0, time.perf_counter()
    while calls < 3 or time.perf_counter() - started < seconds:
        a @ b
        calls += 1
    return 2 * a.size(0) * a.size(1) * b.size(1) * calls / (time.perf_counter() - started)


BF16_ROUNDS = 3  # fp32 and bf16 timed in turn, the fastest of each counts: a moment's load falls on both
_measured_busy: dict[str, float] = {}  # this process's measurements taken on a busy machine (not cached)


def measure_bf16_speedup(d_model: int, d_ff: int, tokens: int = 2048) -> float:
    """bf16 / fp32 matmul throughput for the model's own FFN shape, (tokens × d_model) @ (d_model × d_ff).

    ~0.3 s (0.2–1.8 s where bf16 is emulated); cached per CPU model and instruction-set cap, torch
    version, thread count and shape, where other work took under BUSY_SHARE of the CPUs meanwhile;
    a busy machine's answer holds for this process only, until `forget_busy_measurements`.
    """
    # The instruction sets the kernels may use are part of the machine: with oneDNN or ATen capped
    # (ONEDNN_MAX_CPU_ISA, ATEN_CPU_CAPABILITY) the same CPU emulates bf16, and an uncapped answer would be wrong.
    isa = f"{torch.backends.cpu.get_cpu_capability()}, oneDNN {os.environ.get('ONEDNN_MAX_CPU_ISA', 'any').lower()}"
    # ("timed in turn": answers of the one-after-the-other measurement, which a moment's load could
    # fool, 1.3x where 5.6x is true, are measured again)
    key = f"{cpu_model_name()} ({isa}) | torch {torch.__version__} | {torch.get_num_threads()} threads | " \
          f"{tokens}x{d_model}x{d_ff} | timed in turn"
    path = cache_dir() / "bf16_speedup.json"
    try:
        cached = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        cached = {}
    if not isinstance(cached, dict):
        cached = {}
    if isinstance(cached.get(key), (int, float)):
        return float(cached[key])
    if key in _measured_busy:
        return _measured_busy[key]
    # A generator of its own: drawing from the global one would make a run's initial weights depend
    # on whether this measurement was cached yet (training seeds before it chooses the precision).
    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(tokens, d_model, generator=generator), torch.randn(d_model, d_ff, generator=generator)
    before = cpu_reading()
    # Cores that were idle wake slowly (a virtual machine's halted vCPUs): timed at once, fp32 read
    # 16 GFLOP/s for 77 and the bf16 screen 1 for 200 (8 ms a call), which said "emulated" on a Zen 4.
    _matmul_flops(a, b, seconds=0.1)
    fp32 = _matmul_flops(a, b, seconds=0.03)
    # A CPU without bf16 instructions emulates them ~100x slower than fp32: timing the full shape
    # there took up to 46 s on a Zen 3 (d512, 1 thread), once per shape model.size auto times. A 32nd of
    # the rows first (1.8 s there); only a CPU that is not clearly slower on them is timed on the full shape.
    a16, b16 = a.bfloat16(), b.bfloat16()
    speedup = _matmul_flops(a16[: max(1, tokens // 32)], b16, seconds=0.0) / fp32
    if speedup >= BF16_SCREEN:
        bf16 = _matmul_flops(a16, b16, seconds=0.03)
        for _ in range(BF16_ROUNDS - 1):
            fp32, bf16 = max(fp32, _matmul_flops(a, b, seconds=0.03)), max(bf16, _matmul_flops(a16, b16, seconds=0.03))
        speedup = bf16 / fp32
    if others_share(before, cpu_reading(), torch.get_num_threads()) >= BUSY_SHARE:
        _measured_busy[key] = speedup
        return speedup
    cached[key] = round(speedup, 3)
    try:
        atomic_write_text(path, json.dumps(cached, indent=1))
    except OSError:
        pass  # a read-only home: measure again next time
    return speedup


def forget_busy_measurements() -> None:
    """Measure again what was measured on a busy machine (a probe that times the shapes anew)."""
    _measured_busy.clear()


@dataclass(frozen=True)
class PrecisionChoice:
    bf16: bool
    reason: str  # printed with the first line of train/translate
    int8: bool = False  # decoding only: dynamic int8 Linear layers (cpu_inference.quantize_int8)

    @property
    def name(self) -> str:
        return "int8" if self.int8 else "bf16" if self.bf16 else "fp32"

    def describe(self) -> str:
        what = "int8 dynamic quantization" if self.int8 else "bf16 autocast" if self.bf16 else "fp32"
        return f"{what} ({self.reason})"


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


def choose_decoding_precision(precision: str, device: torch.device,
                              shape: tuple[int, int] = (512, 2048)) -> PrecisionChoice:
    """Resolve `decode.precision` (auto, fp32, bf16, int8) and say why.

    auto = what training's auto picks (`choose_precision`), except on a CPU whose bf16 matmuls are
    not fast enough for it (AVX2-only CPUs): there int8 Linear layers, which decoded 1.5x faster than fp32
    at equal BLEU on every CPU measured (docs/translation.md), where this torch build still
    quantizes correctly. `TFM_PRECISION` still means exactly what it says.
    """
    if precision == "int8":
        return PrecisionChoice(False, "precision: int8", int8=True)
    choice = choose_precision(precision, device, shape)
    if precision != "auto" or choice.bf16 or device.type != "cpu" or precision_override() is not None:
        return choice
    if not cpu_inference.int8_quantization_works():
        return PrecisionChoice(False, f"{choice.reason}; int8 quantization unavailable in this torch")
    return PrecisionChoice(False, f"auto: {choice.reason}", int8=True)


def autocast_dtype(choice: PrecisionChoice) -> torch.dtype | None:
    """The dtype for torch.autocast, or None for plain fp32."""
    return torch.bfloat16 if choice.bf16 else None
