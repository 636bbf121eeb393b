"""`tfm import --format marian`: a Hugging Face Marian model directory (OPUS-MT) as a tfm run directory.

The input is what `MarianMTModel.save_pretrained` and `MarianTokenizer.save_pretrained` write:
config.json, model.safetensors or pytorch_model.bin, source.spm, target.spm and vocab.json, one
id map over both sentencepiece models. The files are read directly (transformers is not needed);
weights load with safetensors or `torch.load(weights_only=True)`, never unsafely.

Marian is the paper's post-norm Transformer with √d-scaled shared embeddings, as tfm's model; what
differs is configuration of that one model: the swish activation, sinusoids laid out as all sines
then all cosines (`positional: sinusoidal_split`), a bias on the output projection
(final_logits_bias), and the ids. Marian's are </s>=0, <unk>=1, …, <pad>=N-1, and its decoder
starts from <pad>; tfm's are fixed (<pad>=0, <unk>=1, <s>=2, </s>=3). The import permutes the
embedding rows into tfm's order, gives tfm's <s> a copy of the decoder-start row, and writes
sentencepiece models whose piece ids are tfm's: each side's own pieces with their own scores, and
the other side's pieces as unused ones (never produced by segmentation, decoded as their text),
except single characters, which Marian's tokenizer finds in the id map where sentencepiece says <unk>.
<pad> and the added <s> get an output bias of −10⁴: Marian's generate never produces <pad>
(bad_words_ids), and neither does tfm then.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ..experiment.checkpoint import model_payload, save_checkpoint
from ..experiment.config import config_from_dict, config_to_yaml
from ..experiment.rundir import BEST, RunDirectory
from ..experiment.scoring import MARIAN_LENGTH_PENALTY
from ..model.special_tokens import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from ..model.transformer import Transformer, TransformerConfig, sinusoidal_table
from ..runtime.errors import TfmError
from ..runtime.files import atomic_write_text, check_output, staging_directory

NEVER = -1.0e4  # output bias of tokens an imported model never produces (<pad>, tfm's added <s>)
ACTIVATIONS = {"swish": "swish", "silu": "swish", "relu": "relu", "gelu": "gelu"}


@dataclass
class ImportResult:
    run: RunDirectory
    parameters: int
    vocab_size: int
    warnings: list[str]


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TfmError(f"{path}: not readable JSON ({exc})") from None


def _required(directory: Path, name: str, what: str) -> Path:
    path = directory / name
    if not path.is_file():
        raise TfmError(f"{path} not found: a Marian model directory has {name} ({what})")
    return path


_REQUIRED = object()  # a key without a default: config.json must give it
MAX_POSITIONS = 1 << 16  # tfm builds the whole position table: a bound before allocating it

# config.json's integers that tfm reads: (lowest, highest or None, default). The sizes and the
# <pad> id have no default: save_pretrained writes them all, and a guessed one would describe
# another model than the weights'. A None default is filled in from another key below.
INTEGER_KEYS: dict[str, tuple[int, int | None, Any]] = {
    "vocab_size": (4, None, _REQUIRED), "decoder_vocab_size": (4, None, None),
    "d_model": (1, None, _REQUIRED), "encoder_layers": (1, None, _REQUIRED), "decoder_layers": (1, None, _REQUIRED),
    "encoder_attention_heads": (1, None, _REQUIRED), "decoder_attention_heads": (1, None, _REQUIRED),
    "encoder_ffn_dim": (1, None, _REQUIRED), "decoder_ffn_dim": (1, None, _REQUIRED),
    "max_position_embeddings": (4, MAX_POSITIONS, _REQUIRED),
    "pad_token_id": (0, None, _REQUIRED), "eos_token_id": (0, None, 0), "decoder_start_token_id": (0, None, None),
    "num_beams": (1, None, 4),
}
PROBABILITY_KEYS = {"dropout": 0.1, "attention_dropout": 0.0}  # Hugging Face's defaults; in [0, 1)
BOOLEAN_KEYS = {"scale_embedding": False, "normalize_before": False, "share_encoder_decoder_embeddings": True,
                "tie_word_embeddings": True}


def _typed_settings(hf: dict[str, Any], config_file: Path) -> dict[str, Any]:
    """The keys tfm reads, each of its type and in its range (a JSON null counts as absent), with
    Hugging Face's defaults where it has one that tfm can rely on."""
    def value(key: str, default: Any) -> Any:
        if hf.get(key) is None:
            if default is _REQUIRED:
                raise TfmError(f"{config_file}: no {key} (a Marian config.json written by save_pretrained has it)")
            return default
        return hf[key]

    settings: dict[str, Any] = {}
    for key, (low, high, default) in INTEGER_KEYS.items():
        number = settings[key] = value(key, default)
        if number is None:
            continue
        if type(number) is not int or number < low or (high is not None and number > high):
            bounds = f"from {low} to {high:,}" if high is not None else f"at least {low}"
            raise TfmError(f"{config_file}: {key}={number!r}: give an integer {bounds}")
    for key, default in PROBABILITY_KEYS.items():
        number = settings[key] = value(key, default)
        if type(number) not in (int, float) or not 0.0 <= number < 1.0:
            raise TfmError(f"{config_file}: {key}={number!r}: give a probability from 0 up to 1")
    for key, default in BOOLEAN_KEYS.items():
        flag = settings[key] = value(key, default)
        if type(flag) is not bool:
            raise TfmError(f"{config_file}: {key}={flag!r}: give true or false")
    activation = settings["activation_function"] = value("activation_function", _REQUIRED)
    if not isinstance(activation, str) or activation not in ACTIVATIONS:
        raise TfmError(f"{config_file}: activation_function={activation!r}: tfm's model has "
                       f"{', '.join(sorted(set(ACTIVATIONS.values())))}")
    return settings


def read_marian_config(hf_dir: Path) -> dict[str, Any]:
    """config.json, checked for type and range and for what tfm's model can express; a refusal
    names the key and why. Returns it with the keys tfm reads filled in (defaults, typed)."""
    if not hf_dir.is_dir():
        raise TfmError(f"{hf_dir}: not a directory (give the folder that save_pretrained wrote)")
    config_file = hf_dir / "config.json"
    if not config_file.is_file():
        raise TfmError(f"{config_file} not found: {hf_dir} is not a Hugging Face model directory")
    hf = _read_json(config_file)
    if not isinstance(hf, dict) or hf.get("model_type") not in ("marian", "pegasus"):
        kind = hf.get("model_type") if isinstance(hf, dict) else None
        raise TfmError(f"{config_file}: model_type {kind!r} is not a Marian model (model_type 'marian'; "
                       "'pegasus': the pre-norm models tfm export writes)")
    hf = {**hf, **_typed_settings(hf, config_file)}
    hf["norm_position"] = "pre" if hf["model_type"] == "pegasus" else "post"

    def refuse(key: str, why: str) -> None:
        raise TfmError(f"{config_file}: {key}={hf.get(key)!r}: {why}")

    if hf["decoder_vocab_size"] is None:
        hf["decoder_vocab_size"] = hf["vocab_size"]
    if hf["decoder_start_token_id"] is None:
        hf["decoder_start_token_id"] = hf["pad_token_id"]
    if hf["share_encoder_decoder_embeddings"] and hf["decoder_vocab_size"] != hf["vocab_size"]:
        refuse("decoder_vocab_size", f"differs from vocab_size={hf['vocab_size']}, but "
                                     "share_encoder_decoder_embeddings says both sides have one vocabulary")
    if not hf["share_encoder_decoder_embeddings"] and hf["norm_position"] == "pre":
        refuse("share_encoder_decoder_embeddings", "a Pegasus model has one vocabulary")
    for encoder, decoder, what in (("encoder_attention_heads", "decoder_attention_heads", "number of heads"),
                                   ("encoder_ffn_dim", "decoder_ffn_dim", "feed-forward size")):
        if hf[encoder] != hf[decoder]:
            raise TfmError(f"{config_file}: {encoder}={hf[encoder]!r}, {decoder}={hf[decoder]!r}: tfm's encoder and "
                           f"decoder have the same {what}")
    if not hf["scale_embedding"]:
        refuse("scale_embedding", "tfm scales embeddings by √d_model, as the paper and Marian do")
    if hf["normalize_before"]:
        refuse("normalize_before", "pre-norm Marian models are not supported")
    if hf["d_model"] % hf["encoder_attention_heads"]:
        refuse("d_model", "not divisible by the number of attention heads")
    for key in ("pad_token_id", "eos_token_id", "decoder_start_token_id"):
        if hf[key] >= min(hf["vocab_size"], hf["decoder_vocab_size"]):
            refuse(key, f"not an id of the {min(hf['vocab_size'], hf['decoder_vocab_size'])}-token vocabulary")
    if hf["decoder_start_token_id"] != hf["pad_token_id"] and not from_tfm(hf):
        # tfm gives its <s> a copy of the decoder-start row; a Marian model starts from <pad>, and
        # another id here is a damaged file far more likely than such a model (tfm's own exports
        # start from their <s>, and say so).
        refuse("decoder_start_token_id", f"Marian's decoder starts from <pad> (pad_token_id={hf['pad_token_id']})")
    if from_tfm(hf) and hf["tfm"].get("positional") not in ("sinusoidal", "sinusoidal_split"):
        raise TfmError(f"{config_file}: tfm.positional={hf['tfm'].get('positional')!r}: a tfm export has "
                       "sinusoidal or sinusoidal_split")
    if hf["pad_token_id"] == hf["eos_token_id"]:
        refuse("eos_token_id", "the same id as pad_token_id")
    return hf


def from_tfm(hf: dict[str, Any]) -> bool:
    """config.json was written by `tfm export --format huggingface` (its `tfm` section)."""
    return isinstance(hf.get("tfm"), dict)


def _needs_extra(exc: ImportError) -> TfmError:
    return TfmError(f"tfm import --format marian needs the marian extra ({exc.name} is missing): "
                    "pip install 'transformer-cli[marian]'")


class Weights:
    """The tensors of a weights file, each to be taken exactly once, by Marian's name (with or
    without the `model.` prefix) and with the shape that config.json implies. What no part of the
    model takes is refused by `check_all_taken`: a config.json that describes a smaller model than
    the weights (fewer layers) would otherwise import part of them without a word."""

    def __init__(self, tensors: dict[str, torch.Tensor], file: Path):
        self.tensors, self.file, self.taken = tensors, file, set()

    def _key(self, name: str) -> str | None:
        return next((key for key in (f"model.{name}", name) if key in self.tensors), None)

    def has(self, name: str) -> bool:
        return self._key(name) is not None

    def take(self, name: str, shape: tuple[int, ...], keys: str) -> torch.Tensor:
        """The tensor `name`, of `shape` (from config.json's `keys`), as float32."""
        key = self._key(name)
        if key is None:
            raise TfmError(f"{self.file}: no tensor '{name}', which config.json's model needs ({keys}; "
                           "not a MarianMTModel's weights, or a config.json of another model?)")
        self.taken.add(key)
        tensor = self.tensors[key]
        if tuple(tensor.shape) != shape:
            raise TfmError(f"{self.file}: tensor '{key}' has shape {tuple(tensor.shape)}, but config.json "
                           f"({keys}) makes it {shape}")
        if not tensor.is_floating_point():
            raise TfmError(f"{self.file}: tensor '{key}' holds {tensor.dtype}, not floating-point weights")
        if not bool(torch.isfinite(tensor).all()):
            raise TfmError(f"{self.file}: tensor '{key}' holds NaN or infinite values")
        return tensor.float()

    def take_copy(self, name: str, original: torch.Tensor, what: str) -> None:
        """A tensor that config.json says is `original` itself (tied embeddings), where the file has
        one: it must be equal, or the weights are not the model config.json describes."""
        if self.has(name) and not torch.equal(self.take(name, tuple(original.shape), what), original):
            raise TfmError(f"{self.file}: tensor '{self._key(name)}' differs from the shared embedding, but "
                           f"config.json ({what}) says they are one matrix")

    def check_all_taken(self) -> None:
        left = sorted(set(self.tensors) - self.taken)
        if left:
            raise TfmError(f"{self.file}: {len(left)} of its {len(self.tensors)} tensors are not part of the model "
                           f"that config.json describes, e.g. '{left[0]}' (does config.json give too few layers?)")


def read_weights(hf_dir: Path) -> Weights:
    safetensors_file, torch_file = hf_dir / "model.safetensors", hf_dir / "pytorch_model.bin"
    if safetensors_file.is_file():
        try:
            from safetensors import SafetensorError
            from safetensors.torch import load_file
        except ImportError as exc:
            raise _needs_extra(exc) from None

        try:
            return Weights(load_file(str(safetensors_file)), safetensors_file)
        except (SafetensorError, OSError) as exc:
            raise TfmError(f"{safetensors_file}: not readable safetensors ({exc})") from None
    if torch_file.is_file():
        try:
            tensors = torch.load(torch_file, map_location="cpu", weights_only=True)
        except Exception as exc:  # a pickle with code is refused by weights_only, as a corrupt file is
            raise TfmError(f"{torch_file}: not a weights-only torch file ({type(exc).__name__}); tfm never loads "
                           "model files unsafely") from None
        if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
            raise TfmError(f"{torch_file}: not a state dict (names → tensors)")
        return Weights(tensors, torch_file)
    raise TfmError(f"{hf_dir}: no model.safetensors or pytorch_model.bin (the model's weights)")


def read_vocab(vocab_file: Path, hf: dict[str, Any], size_key: str = "vocab_size") -> dict[str, int]:
    """vocab.json (or target_vocab.json: `size_key` decoder_vocab_size): pieces → the ids
    0…size-1, with <pad> and </s> (where it names them) at config.json's ids."""
    vocab = _read_json(vocab_file)
    if from_tfm(hf) and isinstance(vocab, dict):  # its bare `>>xx<<` names of tags (huggingface.source_id_map)
        vocab = {p: i for p, i in vocab.items() if not (p.startswith(">>") and vocab.get("\u2581" + p) == i)}
    if (not isinstance(vocab, dict) or not all(type(i) is int for i in vocab.values())
            or sorted(vocab.values()) != list(range(len(vocab)))):
        raise TfmError(f"{vocab_file}: not a Marian id map (pieces → the ids 0…N-1)")
    if len(vocab) != hf[size_key]:
        raise TfmError(f"{vocab_file} has {len(vocab)} ids but config.json's {size_key} is {hf[size_key]}")
    for piece, key in (("<pad>", "pad_token_id"), ("</s>", "eos_token_id")):
        if piece in vocab and vocab[piece] != hf[key]:
            raise TfmError(f"{vocab_file}: {piece} is id {vocab[piece]}, but config.json's {key} is {hf[key]}")
    return vocab


def tfm_order(vocab: dict[str, int], hf: dict[str, Any], size_key: str = "vocab_size") -> list[int]:
    """tfm id → Marian id: tfm's specials first (<pad>, <unk>, <s> = Marian's decoder start, </s>),
    then every other Marian id in its order."""
    pad, eos = hf.get("pad_token_id"), hf.get("eos_token_id", 0)
    start = hf.get("decoder_start_token_id", pad)
    unk = vocab.get("<unk>")
    size = hf[size_key]
    ids = {"pad_token_id": pad, "eos_token_id": eos, "decoder_start_token_id": start, "vocab.json <unk>": unk}
    for name, value in ids.items():
        if not isinstance(value, int) or not 0 <= value < size:
            raise TfmError(f"config.json: {name}={value!r} is not an id of the {size}-token vocabulary")
    if len({pad, eos, unk}) < 3:
        raise TfmError(f"config.json: <pad> ({pad}), </s> ({eos}) and <unk> ({unk}) must be distinct ids")
    if start != pad and start in (unk, eos):
        raise TfmError(f"config.json: decoder_start_token_id={start} is <unk> or </s>")
    # Marian starts from <pad>: tfm's <s> is a copy of that row. A model with a start id of its own
    # (tfm's exports) keeps it as <s>.
    return [pad, unk, start, eos] + [i for i in range(size) if i not in (pad, unk, eos, start)]


def convert_embeddings(weights: Weights, hf: dict[str, Any], orders: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    """The embeddings and the output layer, their rows in tfm's id order (`orders`: side → tfm id →
    Marian id): one shared matrix, or (share_encoder_decoder_embeddings false) the encoder's and the
    decoder's, each of its own vocabulary."""
    d, size, tgt_size = hf["d_model"], hf["vocab_size"], hf["decoder_vocab_size"]
    src_index, tgt_index = torch.tensor(orders["src"]), torch.tensor(orders["tgt"])
    embedding = "vocab_size, d_model"
    if hf["share_encoder_decoder_embeddings"]:
        # The shared embedding: model.shared, or in files without it the encoder's (the decoder's is the same).
        only_encoders = weights.has("encoder.embed_tokens.weight") and not weights.has("shared.weight")
        shared = weights.take("encoder.embed_tokens.weight" if only_encoders else "shared.weight", (size, d),
                              embedding)
        for copy in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight"):  # pytorch_model.bin has them all
            weights.take_copy(copy, shared, f"share_encoder_decoder_embeddings, {embedding}")
        decoder = shared
        state = {"src_embed.embedding.weight": shared[src_index]}
        state["tgt_embed.embedding.weight"] = state["src_embed.embedding.weight"]
    else:
        decoder = weights.take("decoder.embed_tokens.weight", (tgt_size, d), "decoder_vocab_size, d_model")
        state = {"src_embed.embedding.weight": weights.take("encoder.embed_tokens.weight", (size, d), embedding)[
                     src_index], "tgt_embed.embedding.weight": decoder[tgt_index]}
    if not hf["tie_word_embeddings"]:
        state["output_proj.weight"] = weights.take("lm_head.weight", (tgt_size, d),
                                                   "decoder_vocab_size, d_model")[tgt_index]
    else:
        weights.take_copy("lm_head.weight", decoder, f"tie_word_embeddings, {embedding}")
        state["output_proj.weight"] = state["tgt_embed.embedding.weight"]
    bias = weights.take("final_logits_bias", (1, tgt_size), "decoder_vocab_size").reshape(-1)[tgt_index].clone()
    if hf["decoder_start_token_id"] == hf["pad_token_id"]:  # Marian's: <pad> and tfm's added <s> never produced
        bias[PAD_ID] = bias[BOS_ID] = NEVER
    if has_output_bias(hf, bias):
        state["output_proj.bias"] = bias
    return state


def convert_state_dict(weights: Weights, hf: dict[str, Any], orders: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    """Marian's tensor names and layout → tfm's (fused Q|K|V and K|V projections, permuted ids).
    Every tensor is taken with the shape config.json implies, and every tensor must be taken."""
    d, ffn = hf["d_model"], hf["encoder_ffn_dim"]
    state = convert_embeddings(weights, hf, orders)

    def linear(theirs: str, rows: int, columns: int, keys: str) -> tuple[torch.Tensor, torch.Tensor]:
        return weights.take(f"{theirs}.weight", (rows, columns), keys), weights.take(f"{theirs}.bias", (rows,), keys)

    def attention(ours: str, theirs: str, fused_self: bool) -> None:
        parts = {p[0]: linear(f"{theirs}.{p}_proj", d, d, "d_model") for p in ("q", "k", "v", "out")}
        if fused_self:
            state[f"{ours}.qkv_proj.weight"] = torch.cat([parts[p][0] for p in "qkv"])
            state[f"{ours}.qkv_proj.bias"] = torch.cat([parts[p][1] for p in "qkv"])
        else:
            state[f"{ours}.q_proj.weight"], state[f"{ours}.q_proj.bias"] = parts["q"]
            state[f"{ours}.kv_proj.weight"] = torch.cat([parts["k"][0], parts["v"][0]])
            state[f"{ours}.kv_proj.bias"] = torch.cat([parts["k"][1], parts["v"][1]])
        state[f"{ours}.out_proj.weight"], state[f"{ours}.out_proj.bias"] = parts["o"]

    def norm(ours: str, theirs: str) -> None:
        state[f"{ours}.norm.weight"] = weights.take(f"{theirs}.weight", (d,), "d_model")
        state[f"{ours}.norm.bias"] = weights.take(f"{theirs}.bias", (d,), "d_model")

    def feed_forward(ours: str, theirs: str, side: str) -> None:
        keys = f"d_model, {side}_ffn_dim"
        state[f"{ours}.ffn.w1.weight"], state[f"{ours}.ffn.w1.bias"] = linear(f"{theirs}.fc1", ffn, d, keys)
        state[f"{ours}.ffn.w2.weight"], state[f"{ours}.ffn.w2.bias"] = linear(f"{theirs}.fc2", d, ffn, keys)
        norm(f"{ours}.ffn_add_norm", f"{theirs}.final_layer_norm")

    for i in range(hf["encoder_layers"]):
        ours, theirs = f"encoder_layers.{i}", f"encoder.layers.{i}"
        attention(f"{ours}.self_attn", f"{theirs}.self_attn", fused_self=True)
        norm(f"{ours}.attn_add_norm", f"{theirs}.self_attn_layer_norm")
        feed_forward(ours, theirs, "encoder")
    for i in range(hf["decoder_layers"]):
        ours, theirs = f"decoder_layers.{i}", f"decoder.layers.{i}"
        attention(f"{ours}.self_attn", f"{theirs}.self_attn", fused_self=True)
        norm(f"{ours}.self_add_norm", f"{theirs}.self_attn_layer_norm")
        attention(f"{ours}.cross_attn", f"{theirs}.encoder_attn", fused_self=False)
        norm(f"{ours}.cross_add_norm", f"{theirs}.encoder_attn_layer_norm")
        feed_forward(ours, theirs, "decoder")
    if hf["norm_position"] == "pre":  # Pegasus: a LayerNorm after each stack
        for stack in ("encoder", "decoder"):
            state[f"{stack}_norm.weight"] = weights.take(f"{stack}.layer_norm.weight", (d,), "d_model")
            state[f"{stack}_norm.bias"] = weights.take(f"{stack}.layer_norm.bias", (d,), "d_model")
    if from_tfm(hf) and hf["tfm"]["positional"] == "sinusoidal":  # back to the interleaved layout it trained with
        from .huggingface import interleaved_to_split, permute_model_dimension

        state = permute_model_dimension(state, torch.argsort(interleaved_to_split(d)))
    return state


def has_output_bias(hf: dict[str, Any], bias: torch.Tensor) -> bool:
    """Whether the imported model needs an output bias: Marian's models have one; a tfm export
    without one (its final_logits_bias all zero) comes back without it."""
    return not (from_tfm(hf) and not hf["tfm"].get("output_bias") and not bool(bias.any()))


def check_positions(weights: Weights, hf: dict[str, Any]) -> None:
    """Marian's position table is fixed sinusoids (transformers 4 wrote it, 5 does not); a model
    whose table is anything else (learned positions) cannot be expressed."""
    shape = (hf["max_position_embeddings"], hf["d_model"])
    for name in ("encoder.embed_positions.weight", "decoder.embed_positions.weight"):
        if weights.has(name):
            table = weights.take(name, shape, "max_position_embeddings, d_model")
            if not torch.allclose(table, sinusoidal_table(*shape, split=True), atol=1e-4):
                raise TfmError(f"{weights.file}: tensor '{name}' is not Marian's sinusoidal table (learned positions?), "
                               "which tfm's positional: sinusoidal_split could not reproduce")


def tfm_sentencepiece(spm_file: Path, pieces: list[str], language_codes: set[str]) -> tuple[bytes, int]:
    """A sentencepiece model whose piece i is tfm id i's: the pieces of `spm_file` keep their scores
    and types, the others (the other side's pieces) are unused. Returns the model and how many of
    `spm_file`'s own pieces the id map lacks (Marian turns those into <unk>)."""
    try:
        from sentencepiece import sentencepiece_model_pb2 as pb  # needs protobuf
    except ImportError as exc:
        raise _needs_extra(exc) from None

    original = pb.ModelProto()
    try:
        original.ParseFromString(spm_file.read_bytes())
    except Exception as exc:  # protobuf's DecodeError and friends
        raise TfmError(f"{spm_file}: not a sentencepiece model ({type(exc).__name__})") from None
    if not original.pieces:
        raise TfmError(f"{spm_file}: not a sentencepiece model (no pieces)")
    own = {p.piece: p for p in original.pieces}
    Piece = pb.ModelProto.SentencePiece
    # A character this model does not know is <unk> to sentencepiece, but Marian's tokenizer looks
    # its text up in the id map: such characters become pieces of this model at the lowest score
    # (what sentencepiece gives an unknown character), chosen only where nothing else covers them.
    lowest = min((p.score for p in original.pieces if p.type == Piece.NORMAL), default=0.0) - 10.0
    model = pb.ModelProto()
    model.CopyFrom(original)
    del model.pieces[:]
    specials = {PAD_ID: Piece.CONTROL, UNK_ID: Piece.UNKNOWN, BOS_ID: Piece.CONTROL, EOS_ID: Piece.CONTROL}
    for tfm_id, text in enumerate(pieces):
        piece = model.pieces.add()
        piece.piece = text
        if tfm_id in specials:
            piece.type, piece.score = specials[tfm_id], 0.0
        elif text in language_codes:
            # >>fra<< etc. at the start of a line: one piece, as Marian's tokenizer splits it off before
            # sentencepiece. With the word-start mark, so that the line's leading mark is not a piece of its own.
            piece.piece, piece.type, piece.score = "\u2581" + text, Piece.USER_DEFINED, 0.0
        elif text in own and own[text].type in (Piece.NORMAL, Piece.USER_DEFINED):
            piece.type, piece.score = own[text].type, own[text].score
        elif len(text) == 1:
            piece.type, piece.score = Piece.NORMAL, lowest
        else:
            piece.type, piece.score = Piece.UNUSED, 0.0
    spec = model.trainer_spec
    spec.vocab_size = len(pieces)
    spec.pad_id, spec.unk_id, spec.bos_id, spec.eos_id = PAD_ID, UNK_ID, BOS_ID, EOS_ID
    spec.pad_piece, spec.unk_piece, spec.bos_piece, spec.eos_piece = (pieces[PAD_ID], pieces[UNK_ID],
                                                                       pieces[BOS_ID], pieces[EOS_ID])
    known = set(pieces)
    missing = sum(1 for p in original.pieces if p.type == Piece.NORMAL and p.piece not in known)
    return model.SerializeToString(), missing


def tfm_pieces(vocab: dict[str, int], order: list[int]) -> list[str]:
    """The piece of each tfm id: Marian's, with tfm's names for the special ids."""
    piece_of = {i: p for p, i in vocab.items()}
    pieces = [piece_of[m] for m in order]
    if order[BOS_ID] == order[PAD_ID]:  # Marian's start, <pad>: tfm's <s> is a copy of its row
        pieces[BOS_ID] = "<s>" if "<s>" not in vocab else "<tfm_start>"
    pieces[PAD_ID], pieces[EOS_ID] = "<pad>", "</s>"
    return pieces


def tfm_model_config(hf: dict[str, Any], sizes: dict[str, int], output_bias: bool = True) -> TransformerConfig:
    positional = hf["tfm"]["positional"] if from_tfm(hf) else "sinusoidal_split"
    return TransformerConfig(
        src_vocab_size=sizes["src"], tgt_vocab_size=sizes["tgt"], d_model=hf["d_model"],
        n_heads=hf["encoder_attention_heads"], enc_layers=hf["encoder_layers"], dec_layers=hf["decoder_layers"],
        d_ff=hf["encoder_ffn_dim"], dropout=float(hf["dropout"]),
        attention_dropout=float(hf["attention_dropout"]), activation=ACTIVATIONS[hf["activation_function"]],
        norm_position=hf["norm_position"], positional=positional, max_positions=hf["max_position_embeddings"],
        share_embeddings=hf["share_encoder_decoder_embeddings"], tie_output=hf["tie_word_embeddings"],
        output_bias=output_bias, pad_id=PAD_ID)


def read_languages(hf_dir: Path) -> tuple[str, str]:
    """source_lang and target_lang of tokenizer_config.json, where it has them ("src", "tgt" if not)."""
    tokenizer_file = hf_dir / "tokenizer_config.json"
    tokenizer = _read_json(tokenizer_file) if tokenizer_file.is_file() else {}
    if not isinstance(tokenizer, dict):
        raise TfmError(f"{tokenizer_file}: not a JSON object (a tokenizer's settings)")
    languages = []
    for key, default in (("source_lang", "src"), ("target_lang", "tgt")):
        language = tokenizer.get(key) or default
        if not isinstance(language, str):
            raise TfmError(f"{tokenizer_file}: {key}={language!r}: give a language name")
        languages.append(language)
    return languages[0], languages[1]


def import_marian(hf_dir: Path, run_dir: Path) -> ImportResult:
    """Write `run_dir` (which must not exist or be empty): config.yaml, prepare.json, the two
    sentencepiece models and checkpoints/checkpoint_best.pt. Everything is read and checked
    against everything else (config.json, the weights' names and shapes, the id map, the
    sentencepiece models) before anything is written."""
    check_output(run_dir, {"SOURCE": [hf_dir]}, directory=True)  # new or empty, before anything is read
    hf = read_marian_config(hf_dir)
    shared = hf["share_encoder_decoder_embeddings"]
    vocab_files = {"src": _required(hf_dir, "vocab.json", "the id map over both sentencepiece models" if shared
                                    else "the source id map")}
    if not shared and (hf_dir / "target_vocab.json").exists():  # without it: one id map for two embeddings
        vocab_files["tgt"] = _required(hf_dir, "target_vocab.json", "the target id map (separate vocabularies)")
    spm_files = {"src": _required(hf_dir, "source.spm", "the source sentencepiece model"),
                 "tgt": _required(hf_dir, "target.spm", "the target sentencepiece model")}
    vocabs = {side: read_vocab(path, hf, "vocab_size" if side == "src" else "decoder_vocab_size")
              for side, path in vocab_files.items()}
    vocabs.setdefault("tgt", vocabs["src"])
    languages = read_languages(hf_dir)
    weights = read_weights(hf_dir)
    check_positions(weights, hf)

    orders = {side: tfm_order(vocab, hf, "vocab_size" if side == "src" else "decoder_vocab_size")
              for side, vocab in vocabs.items()}
    codes = {p for p in vocabs["src"] if p.startswith(">>") and p.endswith("<<")}
    warnings, models = [], {}
    for side, path in spm_files.items():
        pieces = tfm_pieces(vocabs[side], orders[side])
        models[side], missing = tfm_sentencepiece(path, pieces, codes if side == "src" else set())
        if missing:
            warnings.append(f"{path.name}: {missing} of its pieces are not in {vocab_files.get(side, vocab_files['src']).name} "
                            "(Marian maps them to <unk>; tfm segments around them)")
    state = convert_state_dict(weights, hf, orders)
    weights.check_all_taken()
    model = Transformer(tfm_model_config(hf, {side: len(order) for side, order in orders.items()},
                                         output_bias="output_proj.bias" in state))
    try:
        model.load_state_dict(state)
    except RuntimeError as exc:
        raise TfmError(f"{hf_dir}: the weights do not fit config.json ({' '.join(str(exc).split())[:300]})") from None
    run = write_run_directory(run_dir, hf_dir, hf, languages, model, models)
    return ImportResult(run, model.num_parameters(), len(orders["src"]), warnings)


def write_run_directory(run_dir: Path, hf_dir: Path, hf: dict[str, Any], languages: tuple[str, str],
                        model: Transformer, models: dict[str, bytes]) -> RunDirectory:
    """The run directory, staged beside `run_dir` and renamed into place when complete, so that a
    failed import leaves nothing behind."""
    src_lang, tgt_lang = languages
    sizes = {"src": model.cfg.src_vocab_size, "tgt": model.cfg.tgt_vocab_size}
    config = config_from_dict({
        "run_dir": str(run_dir),
        "data": {"src_lang": src_lang, "tgt_lang": tgt_lang},
        "vocab": {"joint": False, "size": max(sizes.values())},
        "model": {k: v for k, v in asdict(model.cfg).items() if k not in ("src_vocab_size", "tgt_vocab_size", "pad_id")},
        # Marian's generate: its length penalty (score / length ** 1); its beam from config.json.
        "decode": {"beam": hf["num_beams"], "length_penalty": MARIAN_LENGTH_PENALTY},
    }, f"{hf_dir}/config.json")
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_directory(run_dir)  # names this process: a killed import's is removed by the next
    staged, imported_from = RunDirectory(staging), {"format": "marian", "path": str(hf_dir.resolve())}
    vocab_files = staged.vocab_files(joint=False)
    manifest = {
        "src_lang": src_lang, "tgt_lang": tgt_lang,
        "vocab": {side: path.name for side, path in vocab_files.items()},
        "vocab_size": sizes,
        "special_ids": {"pad": PAD_ID, "unk": UNK_ID, "bos": BOS_ID, "eos": EOS_ID},
        "shared_ids": model.cfg.share_embeddings,  # two sentencepiece models over one id map: shared embeddings
        "imported_from": imported_from,
    }
    try:
        for side, data in models.items():
            vocab_files[side].write_bytes(data)
        atomic_write_text(staged.manifest_file, json.dumps(manifest, indent=2))
        atomic_write_text(staged.config_file, config_to_yaml(config))
        staged.checkpoints.mkdir()
        save_checkpoint(staged.checkpoints / BEST, model_payload(model, config, models, {"step": 0},
                                                                 imported_from=imported_from))
        if run_dir.exists():
            run_dir.rmdir()  # empty (checked above)
        staging.rename(run_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return config.run
