"""Checkpoints: plain tensors and Python primitives only, loaded with `weights_only=True`
so a checkpoint can never run code. Each carries the resolved config and the sentencepiece
model bytes, so `tfm translate --checkpoint X.pt` needs nothing else."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .config import ExperimentConfig, config_from_dict
from .errors import TfmError
from .io_utils import atomic_path
from .model import Transformer, TransformerConfig

FORMAT = "tfm-checkpoint-1"


def bytes_to_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()


def tensor_to_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.numpy().tobytes()


def save_checkpoint(path: Path, payload: dict[str, Any]) -> None:
    """Write atomically: a crash mid-write never leaves a truncated checkpoint behind."""
    payload = {"format": FORMAT, **payload}
    with atomic_path(path) as tmp:
        torch.save(payload, tmp)


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise TfmError(f"checkpoint not found: {path}")
    try:
        payload = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # truncated file, not a torch file, or a pickle with code in it
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TfmError(f"{path}: not a readable tfm checkpoint ({first_line[:200]})") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise TfmError(f"{path}: not a tfm checkpoint (missing format marker {FORMAT!r})")
    return payload


def model_from_checkpoint(payload: dict[str, Any]) -> tuple[Transformer, ExperimentConfig]:
    config = config_from_dict(payload["config"], "checkpoint config")
    model = Transformer(TransformerConfig(**payload["model_config"]))
    try:
        model.load_state_dict(payload["model"])
    except RuntimeError as exc:
        raise TfmError(f"checkpoint weights do not fit its model config: {str(exc).splitlines()[0]}") from None
    return model, config


def average_state_dicts(paths: list[Path]) -> dict[str, torch.Tensor]:
    """Element-wise mean of the model weights of several checkpoints (Vaswani et al. §6.1)."""
    if not paths:
        raise TfmError("no checkpoints to average")
    total: dict[str, torch.Tensor] = {}
    for path in paths:
        weights = load_checkpoint(path)["model"]
        for name, tensor in weights.items():
            if name in total:
                total[name] += tensor.double()
            else:
                total[name] = tensor.double().clone()
    return {name: (tensor / len(paths)).to(torch.float32) for name, tensor in total.items()}
