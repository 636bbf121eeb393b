"""Checkpoints: plain tensors and Python primitives only, loaded with `weights_only=True`
so a checkpoint can never run code. Each carries the resolved config and the sentencepiece
model bytes, so `tfm translate --checkpoint X.pt` needs nothing else."""

from __future__ import annotations

import pickle
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import sentencepiece as spm
import torch

from ..model.shape import SHAPE_KEYS, Shape
from ..model.transformer import Transformer, TransformerConfig
from ..runtime.errors import TfmError
from .config import ExperimentConfig, config_from_dict
from .rundir import CHECKPOINT_FORMAT as FORMAT
from .rundir import save_checkpoint as save_checkpoint  # (where every checkpoint is written)

# What only checkpoint_last.pt holds (resuming needs it; translating does not).
TRAINING_STATE = ("optimizer", "torch_rng", "torch_rng_ranks", "cuda_rng", "ema")


def bytes_to_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()


def tensor_to_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.numpy().tobytes()


def model_payload(model: Transformer, config: ExperimentConfig | dict[str, Any], spm_files: dict[str, bytes],
                  progress: dict, **extra: Any) -> dict[str, Any]:
    """What every checkpoint holds — the one place it is written: weights, the model's and the
    run's configs (`config`, or its `model_dump(mode="json")` made already), progress, both
    sentencepiece models (`spm_files`: side → the model file's bytes), and `extra` keys
    (`data_digest`: the prepared data it learnt from; `imported_from`, `averaged`…)."""
    written = config if isinstance(config, dict) else config.model_dump(mode="json")
    return {"model": model.state_dict(), "model_config": asdict(model.cfg), "config": written,
            "progress": progress, "spm_src": bytes_to_tensor(spm_files["src"]),
            "spm_tgt": bytes_to_tensor(spm_files["tgt"]), **extra}


def training_payload(weights: dict[str, Any], optimizer: torch.optim.Optimizer, rank_rng_states: list[torch.Tensor],
                     ema: dict | None) -> dict[str, Any]:
    """checkpoint_last.pt: a `model_payload` plus everything resuming exactly needs — the optimizer,
    the RNG states (`rank_rng_states`: one per torchrun process, where there are several) and the
    weight average."""
    payload = {**weights, "optimizer": optimizer.state_dict(), "torch_rng": torch.get_rng_state()}
    if len(rank_rng_states) > 1:
        payload["torch_rng_ranks"] = rank_rng_states
    if torch.cuda.is_available():
        payload["cuda_rng"] = torch.cuda.get_rng_state_all()
    if ema is not None:
        payload["ema"] = ema
    return payload


@dataclass
class TrainingState:
    """checkpoint_last.pt as resuming reads it — the one place it is read."""

    path: Path
    model: dict[str, torch.Tensor]
    model_config: TransformerConfig
    optimizer: dict
    progress: dict
    spm_files: dict[str, bytes]
    data_digest: str | None
    torch_rng: torch.Tensor
    rank_rng_states: list[torch.Tensor] | None
    cuda_rng: list[torch.Tensor] | None
    ema: dict | None

    @classmethod
    def read(cls, path: Path, map_location: str | torch.device = "cpu") -> TrainingState:
        payload = load_checkpoint(path, map_location=map_location)
        if "optimizer" not in payload or "progress" not in payload:
            raise TfmError(f"--resume: {path} holds no training state (weights only: another command's output "
                           "written over it); nothing to continue from")
        return cls(path, payload["model"], TransformerConfig(**payload["model_config"]), payload["optimizer"],
                   payload["progress"], {side: tensor_to_bytes(payload[f"spm_{side}"]) for side in ("src", "tgt")},
                   payload.get("data_digest"), payload["torch_rng"].cpu(),
                   payload.get("torch_rng_ranks"), payload.get("cuda_rng"), payload.get("ema"))

    def check_made_for(self, spm_files: dict[str, bytes], data_digest: str | None, run: Path) -> None:
        """The state must have been trained on this run's vocabulary (`spm_files`) and encoded data:
        a run prepared again since (other ids) would go on training on what its ids now mean."""
        for side, name in (("src", "source"), ("tgt", "target")):
            if self.spm_files[side] != spm_files[side]:
                raise TfmError(f"--resume: {self.path} was trained with another {name} vocabulary than {run} holds "
                               "now (prepared again since?): prepare a new run_dir, or fine-tune from the "
                               "checkpoint there (train.init_from, vocab.from_run)")
        if self.data_digest and data_digest and self.data_digest != data_digest:
            raise TfmError(f"--resume: {self.path} was trained on other encoded data than {run} holds now "
                           "(prepared again since, with other data settings?): prepare it as it was, or train a "
                           "new run (train.init_from to start from this checkpoint)")

    def restore_random_states(self, rank: int, world_size: int, reseed: int) -> None:
        """This process's RNG states as they were; a different number of torchrun processes than
        saved them: rank 0 the saved state, the others fresh distinct streams (`reseed` + rank)."""
        torch.set_rng_state(self.torch_rng)
        if world_size > 1:
            if self.rank_rng_states is not None and len(self.rank_rng_states) == world_size:
                torch.set_rng_state(self.rank_rng_states[rank].cpu())
            elif rank > 0:
                torch.manual_seed(reseed + 7919 * rank)
        if self.cuda_rng is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([s.cpu() for s in self.cuda_rng])


@dataclass(frozen=True)
class TrainedSettings:
    """What a checkpoint says of how its model was trained, its weights left aside: its shape (None
    where an older or imported checkpoint does not say it whole), the target vocabulary, and of its
    config the size named, peak lr, batch tokens and dropout (each None where it does not say)."""

    path: Path
    shape: Shape | None
    tgt_vocab_size: int | None
    size: str | None
    lr: float | None
    max_tokens: int | None
    dropout: float | None

    @classmethod
    def read(cls, path: Path) -> TrainedSettings:
        payload = load_checkpoint(path, map_location="cpu", mapped=True)  # its weights are never read
        trained, config = payload.get("model_config") or {}, payload.get("config") or {}
        model, train = config.get("model") or {}, config.get("train") or {}

        def typed(value: Any, kind: type) -> Any:
            return value if isinstance(value, kind) and not isinstance(value, bool) else None

        keys = {key: typed(trained.get(key), int) for key in SHAPE_KEYS}
        shape = None if None in keys.values() else Shape(**keys)
        return cls(path, shape, typed(trained.get("tgt_vocab_size"), int), typed(model.get("size"), str),
                   typed(train.get("lr"), float), typed(train.get("max_tokens"), int),
                   typed(model.get("dropout"), (int, float)))


def upgrade_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Model weights of any tfm version → today's names, in place. Checkpoints written before
    self-attention's Q, K, V projections were fused hold `…self_attn.q_proj` + `…self_attn.kv_proj`
    (cross-attention keeps its separate Q and K|V projections)."""
    for key in [k for k in state if ".self_attn.q_proj." in k]:
        prefix, kind = key.split(".self_attn.q_proj.")
        q, kv = state.pop(key), state.pop(f"{prefix}.self_attn.kv_proj.{kind}")
        state[f"{prefix}.self_attn.qkv_proj.{kind}"] = torch.cat([q, kv])
    return state


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu", mapped: bool = False) -> dict[str, Any]:
    """A checkpoint's payload; `mapped`: its tensors memory-mapped from the file, read only where used
    (a few settings of a multi-GB checkpoint_last.pt then cost no read of its weights and optimizer)."""
    path = Path(path)
    if not path.is_file():
        raise TfmError(f"checkpoint not found: {path}")
    if path.stat().st_size == 0:
        raise TfmError(f"{path}: empty file (0 bytes), not a checkpoint")
    with open(path, "rb") as f:
        magic = f.read(4)
    if not (magic.startswith(b"PK\x03\x04") or magic.startswith(b"\x80")):  # torch's zip, or a legacy pickle
        raise TfmError(f"{path}: not a checkpoint file (it starts with {magic!r}, not a torch zip archive)")
    try:
        payload = torch.load(path, map_location=map_location, weights_only=True,
                             mmap=mapped and magic.startswith(b"PK"))  # (a legacy pickle cannot be mapped)
    except pickle.UnpicklingError as exc:
        if "Weights only load failed" in str(exc):
            # torch's message ends with advice to load with weights_only=False: never do that with
            # a file you did not write yourself — unpickling it can run arbitrary code.
            raise TfmError(f"{path}: refused: it contains Python objects or code, not just tensors, and tfm never "
                           "loads checkpoints unsafely (loading such a file can run arbitrary code)") from None
        raise TfmError(f"{path}: not a readable tfm checkpoint (corrupt pickle: {exc})") from None
    except Exception as exc:  # truncated file, text, another binary format
        first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ""
        raise TfmError(f"{path}: not a checkpoint file, or a truncated/corrupt one "
                       f"({type(exc).__name__}{': ' + first if first else ''})") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise TfmError(f"{path}: not a tfm checkpoint (missing format marker {FORMAT!r})")
    if isinstance(payload.get("model"), dict):
        upgrade_state_dict(payload["model"])
    return payload


def model_from_checkpoint(payload: dict[str, Any]) -> tuple[Transformer, ExperimentConfig]:
    config = config_from_dict(payload["config"], "checkpoint config")
    model = Transformer(TransformerConfig(**payload["model_config"]))
    try:
        model.load_state_dict(payload["model"])
    except RuntimeError as exc:
        raise TfmError(f"checkpoint weights do not fit its model config: {str(exc).splitlines()[0]}") from None
    return model, config


# Settings that change what the weights mean without changing their shapes.
_SAME_SHAPE_SETTINGS = ("n_heads", "activation", "norm_position", "positional", "share_embeddings", "tie_output")


def load_initial_weights(model: Transformer, path: Path, spm_files: dict[str, bytes]) -> dict[str, Any]:
    """Copy a trained model's weights into `model` (fine-tuning), after checking that they fit: the
    same sentencepiece models (`spm_files`: this run's, by side), tensor names and shapes, and the
    settings that shapes do not show. Returns the checkpoint's payload. Dropout may differ."""
    payload = load_checkpoint(path)
    key = "key 'train.init_from'"
    for side, name in (("src", "source"), ("tgt", "target")):
        if tensor_to_bytes(payload[f"spm_{side}"]) != spm_files[side]:
            raise TfmError(f"{key}: {path} was trained with another {name} vocabulary than this run's: prepare "
                           "this run with vocab.from_run set to the checkpoint's run directory")
    theirs, ours = asdict(TransformerConfig(**payload["model_config"])), asdict(model.cfg)
    settings = ", ".join(f"model.{k} is {theirs[k]} there but {ours[k]} here"
                         for k in ours if k not in ("dropout", "attention_dropout", "activation_dropout") and theirs[k] != ours[k])
    state, expected = payload["model"], model.state_dict()
    for name in sorted(expected.keys() | state.keys()):
        if name not in state or name not in expected:
            where = "this model" if name in expected else f"{path}"
            raise TfmError(f"{key}: tensor '{name}' is only in {where}, so the model does not fit ({settings})")
        if state[name].shape != expected[name].shape:
            raise TfmError(f"{key}: tensor '{name}' has shape {tuple(state[name].shape)} in {path} but "
                           f"{tuple(expected[name].shape)} in this model ({settings})")
    for setting in _SAME_SHAPE_SETTINGS:
        if theirs[setting] != ours[setting]:
            raise TfmError(f"{key}: {path} has model.{setting}={theirs[setting]}, this config "
                           f"{ours[setting]}: set model.{setting} to the checkpoint's")
    model.load_state_dict(state)
    return payload


@dataclass
class TrainedModel:
    """A checkpoint's model (fp32, CPU, eval mode), the config it was trained with and its two
    sentencepiece models: everything translating, exporting or inspecting a model needs."""

    path: Path
    model: Transformer
    config: ExperimentConfig
    src_sp: spm.SentencePieceProcessor
    tgt_sp: spm.SentencePieceProcessor
    spm_files: dict[str, bytes]  # "src"/"tgt" → the sentencepiece model file as prepare wrote it
    progress: dict[str, Any] = field(default_factory=dict)  # training's record (steps, time, machines); {} if none


def load_trained_model(path: str | Path) -> TrainedModel:
    """Load a checkpoint with its sentencepiece models; a vocabulary that does not fit the model
    is a one-line error."""
    payload = load_checkpoint(path)
    model, config = model_from_checkpoint(payload)
    files = {side: tensor_to_bytes(payload[f"spm_{side}"]) for side in ("src", "tgt")}
    src_sp, tgt_sp = (spm.SentencePieceProcessor(model_proto=files[side]) for side in ("src", "tgt"))
    for side, sp, size in (("source", src_sp, model.cfg.src_vocab_size), ("target", tgt_sp, model.cfg.tgt_vocab_size)):
        if sp.vocab_size() != size:
            raise TfmError(f"{path}: {side} vocabulary has {sp.vocab_size()} pieces but the model expects {size}")
    return TrainedModel(Path(path), model.eval(), config, src_sp, tgt_sp, files, payload.get("progress") or {})


def check_same_vocabulary(first: Path, first_files: dict[str, bytes | None], other: Path,
                          other_files: dict[str, bytes | None], why: str) -> None:
    """Two models' sentencepiece models (`*_files`: side → the file's bytes) must be the same:
    their ids mean the same pieces. `why` ends the message (what needs a shared vocabulary)."""
    for side, name in (("src", "source"), ("tgt", "target")):
        if other_files[side] != first_files[side]:
            raise TfmError(f"{other}: its {name} vocabulary differs from {first}'s ({why})")


def _vocabulary_of(payload: dict[str, Any]) -> dict[str, bytes | None]:
    return {side: tensor_to_bytes(payload[f"spm_{side}"]) if f"spm_{side}" in payload else None
            for side in ("src", "tgt")}


def _check_averageable(first: Path, first_payload: dict[str, Any], path: Path, payload: dict[str, Any]) -> None:
    """Weights that have the same shapes can still mean different things: other settings
    (heads, activation, …) or another vocabulary. The mean of such weights is no model."""
    theirs, ours = first_payload.get("model_config", {}), payload.get("model_config", {})
    for setting in _SAME_SHAPE_SETTINGS:
        if setting in theirs and setting in ours and theirs[setting] != ours[setting]:
            raise TfmError(f"cannot average {path} with {first}: model.{setting} is {ours[setting]} there but "
                           f"{theirs[setting]} in the first (different model configs)")
    check_same_vocabulary(first, _vocabulary_of(first_payload), path, _vocabulary_of(payload),
                          "averaged weights mean nothing across vocabularies: average checkpoints of one run, "
                          "or of runs that share one vocabulary through vocab.from_run")


def average_state_dicts(paths: list[Path]) -> dict[str, torch.Tensor]:
    """Element-wise mean of the model weights of several checkpoints (Vaswani et al. §6.1).

    Every checkpoint must hold the same tensors with the same shapes, settings (the same model
    config) and vocabulary.
    """
    if not paths:
        raise TfmError("no checkpoints to average")
    total: dict[str, torch.Tensor] = {}
    shared: dict[str, str] = {}  # name → the first name of the tensor it shares storage with (tied weights)
    first: dict[str, Any] | None = None  # what the others are checked against
    for path in paths:
        payload = load_checkpoint(path)
        weights = payload["model"]
        if not shared:
            first_of: dict[int, str] = {}
            shared = {name: first_of.setdefault(t.untyped_storage().data_ptr(), name) for name, t in weights.items()}
        if total and weights.keys() != total.keys():
            differ = sorted(weights.keys() ^ total.keys())[0]
            raise TfmError(f"cannot average {path} with {paths[0]}: different models ({differ!r} is only in one)")
        for name, tensor in weights.items():
            if name not in total:
                total[name] = tensor.double().clone()
            elif tensor.shape != total[name].shape:
                raise TfmError(f"cannot average {path} with {paths[0]}: {name} has shape {tuple(tensor.shape)} "
                               f"there but {tuple(total[name].shape)} in the first (different model configs)")
            else:
                total[name] += tensor.double()
        if first is not None:
            _check_averageable(paths[0], first, path, payload)
        else:
            first = {key: payload[key] for key in ("model_config", "spm_src", "spm_tgt") if key in payload}
    averaged = {name: (total[name] / len(paths)).to(torch.float32) for name in total if shared[name] == name}
    return {name: averaged[shared[name]] for name in total}  # tied weights stay one tensor (saved once)


def average_checkpoints(paths: list[Path]) -> dict[str, Any]:
    """A weights-only checkpoint whose weights are the mean of `paths`'; config and vocab of the last."""
    payload = load_checkpoint(paths[-1])
    for training_state in (*TRAINING_STATE, "format"):
        payload.pop(training_state, None)
    payload["model"] = average_state_dicts(list(paths))
    payload["averaged"] = [str(p) for p in paths]
    return payload
