"""Which device a command runs on, and what to do when it runs out of memory."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from ..model.kernels import leave_out_cudnn_attention
from .errors import TfmError

T = TypeVar("T")
R = TypeVar("R")


def resolve_device(name: str) -> torch.device:
    """`auto` (CUDA when present), `cpu`, `cuda`, `cuda:N`; anything else is a one-line TfmError."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise TfmError(f"device {name!r} was asked for, but CUDA is not available on this machine")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise TfmError(f"{name!r} is not a device (use auto, cpu, cuda or cuda:N)") from None
    if device.type == "cuda":
        leave_out_cudnn_attention()  # model/kernels.py says why
    return device


def describe_machine(device: torch.device) -> str:
    """What a run trains on, as a model card names it: the GPU, or the CPU with the instruction set
    torch's kernels run at ("AMD EPYC" alone does not tell a Zen 3 from a Zen 5) and its cores."""
    from .cpu import cpu_model_name, usable_cores

    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (CUDA)"
    return f"{cpu_model_name()} ({torch.backends.cpu.get_cpu_capability()}, {usable_cores()} cores)"


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
