"""CTranslate2's format: `tfm export --format ctranslate2` (a tfm checkpoint → a CTranslate2 model
directory), and reading such a directory back, checked, for the engine that translates with it
(decoding/ct2_engine.py) and the conversion cache (interop/ct2_cache.py).

The conversion fills ctranslate2's own specification objects (`ctranslate2.specs.TransformerSpec`
and its layer specs) with our weights, as its OpenNMT-py and fairseq converters do; CTranslate2
then validates and saves them. ctranslate2 is an optional extra (`pip install -e '.[ct2]'`).

How tfm's conventions map onto CTranslate2's:
- token ids: the vocabulary is the sentencepiece pieces in id order, so <pad>=0, <unk>=1, <s>=2,
  </s>=3 keep their ids; CTranslate2 finds unk/bos/eos by their strings. The decoder starts from
  <s> (tfm's BOS) and stops at </s>; `add_source_eos` appends </s> to the source as tfm does.
- embeddings are multiplied by sqrt(d_model) (`TokenEmbedding.scale`) before positions are added.
- positions: tfm's sinusoidal table interleaves sin/cos (PE[:, 0::2] = sin, PE[:, 1::2] = cos),
  while CTranslate2's built-in table concatenates them, so the table itself is written into the
  model (as for learned positions). Inputs longer than max_positions are truncated, as in tfm.
- attention: tfm's fused projections are CTranslate2's layout: Q, K, V in one matrix for
  self-attention (`qkv_proj`), K and V in one for cross-attention (`kv_proj`).
- LayerNorm epsilon is torch's default, 1e-5 (CTranslate2's default differs).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import os
import re
import shutil
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import sentencepiece as spm

from ..experiment.config import DecodeConfig, apply_override, check_inference_overrides, config_from_dict
from ..model.special_tokens import BOS_ID, EOS_ID, UNK_ID
from ..runtime.errors import TfmError
from ..runtime.files import check_digest, check_export_directory, digest_file, replace_with_staged, staging_directory

if TYPE_CHECKING:  # this module imports neither torch nor numpy: CTranslate2 translates without them
    import numpy as np
    import torch

    from ..model.transformer import Transformer, TransformerConfig

INSTALL_HINT = "ctranslate2 is not installed: pip install ctranslate2 (a dependency of tfm where its wheels exist)"
SRC_SPM, TGT_SPM, TFM_JSON = "source.spm.model", "target.spm.model", "tfm_decode.json"
SPECIAL_PIECES = {UNK_ID: "<unk>", BOS_ID: "<s>", EOS_ID: "</s>"}

VMAP_FILE = "vmap.txt"  # the vocabulary map (a lexical shortlist) CTranslate2 reads from a model directory


def import_ctranslate2() -> Any:
    try:
        import ctranslate2
    except ImportError:
        raise TfmError(INSTALL_HINT) from None
    return ctranslate2


def resolve_compute_type(compute_type: str, device: str, supported: set[str]) -> str:
    """decode.compute_type → what CTranslate2 loads the weights as. auto: int8 on CPU (the fastest
    there at tfm's BLEU: docs/translation.md), float16 on CUDA (bfloat16, then float32, where the
    device has not got it); default: as converted (float32)."""
    if compute_type != "auto":
        return compute_type
    preferred = ("int8", "float32") if device == "cpu" else ("float16", "bfloat16", "float32")
    return next((c for c in preferred if c in supported), "default")


def first_line(exc: BaseException) -> str:
    """An exception's message for a one-line error: its first line, or its type's name."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def load_translator(model_dir: Path, device: str, compute_type: str, inter_threads: int, intra_threads: int,
                    files: dict[str, bytes] | None = None) -> Any:
    """A `ctranslate2.Translator` of `model_dir` (`files`: the directory's files from memory
    instead). CTranslate2 sets the calling thread's OpenMP thread count to intra_threads, which is
    torch's too: torch's own work in this process (training, tfm's engine) keeps its count. A
    TfmError where CTranslate2 cannot load the model."""
    ctranslate2 = import_ctranslate2()
    loaded_torch = sys.modules.get("torch")
    torch_threads = loaded_torch.get_num_threads() if loaded_torch is not None else None
    try:
        return ctranslate2.Translator(str(model_dir), device=device, compute_type=compute_type,
                                      inter_threads=inter_threads, intra_threads=intra_threads, files=files)
    except (RuntimeError, ValueError, OSError) as exc:  # what read_export could not see
        raise TfmError(f"{model_dir}: CTranslate2 cannot load this model ({first_line(exc)})") from None
    finally:
        if loaded_torch is not None:
            loaded_torch.set_num_threads(torch_threads)


def convertible_problems(cfg: TransformerConfig, src_sp: spm.SentencePieceProcessor,
                         tgt_sp: spm.SentencePieceProcessor) -> list[str]:
    """What a CTranslate2 TransformerSpec cannot express of this model (empty: it converts)."""
    problems = []
    if cfg.activation not in ("relu", "gelu", "swish"):
        problems.append(f"activation {cfg.activation!r} (CTranslate2 export supports relu, gelu and swish)")
    if cfg.norm_position not in ("pre", "post"):
        problems.append(f"norm_position {cfg.norm_position!r} (pre or post)")
    if cfg.positional not in ("sinusoidal", "sinusoidal_split", "learned"):
        problems.append(f"positional {cfg.positional!r} (sinusoidal, sinusoidal_split or learned)")
    if cfg.enc_layers < 1 or cfg.dec_layers < 1:
        problems.append("a stack without layers")
    if cfg.pad_id != 0:
        problems.append(f"pad_id {cfg.pad_id} (CTranslate2 pads with id 0)")
    for side, sp in (("source", src_sp), ("target", tgt_sp)):
        problems += _special_piece_problems(side, sp)
    return problems


def check_convertible(cfg: TransformerConfig, src_sp: spm.SentencePieceProcessor,
                      tgt_sp: spm.SentencePieceProcessor) -> None:
    """Refuse, with the reason, what a CTranslate2 TransformerSpec cannot express."""
    problems = convertible_problems(cfg, src_sp, tgt_sp)
    if problems:
        raise TfmError("cannot export to CTranslate2: " + "; ".join(problems))


def _special_piece_problems(side: str, sp: spm.SentencePieceProcessor) -> list[str]:
    problems = []
    for token_id, piece in SPECIAL_PIECES.items():
        if token_id >= sp.vocab_size() or sp.id_to_piece(token_id) != piece:
            found = sp.id_to_piece(token_id) if token_id < sp.vocab_size() else "nothing"
            problems.append(f"{side} vocabulary id {token_id} is {found!r}, not {piece!r} "
                            "(CTranslate2 finds special tokens by their text)")
    return problems


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().cpu().numpy().copy()


def _concatenate(arrays: list[np.ndarray]) -> np.ndarray:
    import numpy as np  # converting only

    return np.concatenate(arrays)


def _linear(spec: Any, *layers: torch.nn.Linear) -> None:
    """One LinearSpec from one Linear, or from several stacked along the output dimension."""
    spec.weight = _concatenate([_np(layer.weight) for layer in layers])  # (out, in)
    if all(layer.bias is not None for layer in layers):
        spec.bias = _concatenate([_np(layer.bias) for layer in layers])


def _feed_forward(ffn_spec: Any, layer: torch.nn.Module) -> None:
    """PositionwiseFeedForward + its Add & Norm, the same in encoder and decoder layers."""
    _linear(ffn_spec.linear_0, layer.ffn.w1)
    _linear(ffn_spec.linear_1, layer.ffn.w2)
    _layer_norm(ffn_spec.layer_norm, layer.ffn_add_norm.norm)


def _layer_norm(spec: Any, norm: torch.nn.LayerNorm) -> None:
    spec.gamma, spec.beta = _np(norm.weight), _np(norm.bias)


def _inputs(spec: Any, embedding_spec: Any, embed: Any, positions: Any) -> None:
    embedding_spec.weight = _np(embed.embedding.weight)  # (V, D)
    spec.scale_embeddings = float(embed.scale)  # sqrt(d_model)
    spec.position_encodings.encodings = _np(positions.table)  # (max_positions, D)


def build_spec(model: Transformer, src_vocab: list[str], tgt_vocab: list[str]) -> Any:
    """A filled `ctranslate2.specs.TransformerSpec` for `model` (fp32 weights)."""
    import_ctranslate2()  # a one-line error naming the extra when it is missing
    from ctranslate2.specs import common_spec, transformer_spec

    cfg = model.cfg
    pre = cfg.norm_position == "pre"
    activation = {"relu": common_spec.Activation.RELU, "gelu": common_spec.Activation.GELU,
                  "swish": common_spec.Activation.SWISH}[cfg.activation]
    spec = transformer_spec.TransformerSpec.from_config(
        (cfg.enc_layers, cfg.dec_layers), cfg.n_heads, pre_norm=pre, activation=activation)

    enc = spec.encoder
    _inputs(enc, enc.embeddings[0], model.src_embed, model.src_pos)
    for layer_spec, layer in zip(enc.layer, model.encoder_layers):
        attn = layer_spec.self_attention
        _linear(attn.linear[0], layer.self_attn.qkv_proj)  # fused Q, K, V
        _linear(attn.linear[1], layer.self_attn.out_proj)
        _layer_norm(attn.layer_norm, layer.attn_add_norm.norm)
        _feed_forward(layer_spec.ffn, layer)
    if pre:
        _layer_norm(enc.layer_norm, model.encoder_norm)

    dec = spec.decoder
    _inputs(dec, dec.embeddings, model.tgt_embed, model.tgt_pos)
    for layer_spec, layer in zip(dec.layer, model.decoder_layers):
        self_attn = layer_spec.self_attention
        _linear(self_attn.linear[0], layer.self_attn.qkv_proj)
        _linear(self_attn.linear[1], layer.self_attn.out_proj)
        _layer_norm(self_attn.layer_norm, layer.self_add_norm.norm)
        cross = layer_spec.attention
        _linear(cross.linear[0], layer.cross_attn.q_proj)
        _linear(cross.linear[1], layer.cross_attn.kv_proj)  # (2D, D): K rows, then V rows
        _linear(cross.linear[2], layer.cross_attn.out_proj)
        _layer_norm(cross.layer_norm, layer.cross_add_norm.norm)
        _feed_forward(layer_spec.ffn, layer)
    if pre:
        _layer_norm(dec.layer_norm, model.decoder_norm)
    _linear(dec.projection, model.output_proj)  # tied: a copy of the target embedding (+ its bias, if any)

    spec.config.layer_norm_epsilon = 1e-5  # torch.nn.LayerNorm's default, which tfm uses
    spec.config.unk_token, spec.config.bos_token, spec.config.eos_token = "<unk>", "<s>", "</s>"
    spec.config.decoder_start_token = "<s>"
    spec.config.add_source_eos = True
    spec.register_source_vocabulary(src_vocab)
    spec.register_target_vocabulary(tgt_vocab)
    return spec


def _pieces(sp: spm.SentencePieceProcessor) -> list[str]:
    return [sp.id_to_piece(i) for i in range(sp.vocab_size())]


# What `tfm export` writes, and nothing else: a directory holding exactly these (model.bin and
# tfm_decode.json among them) is recognisably a previous export, the only kind --force replaces.
EXPORT_FILES = frozenset({"model.bin", "config.json", "shared_vocabulary.json", "source_vocabulary.json",
                          "target_vocabulary.json", SRC_SPM, TGT_SPM, TFM_JSON})


def is_previous_export(directory: Path) -> bool:
    names = {p.name for p in directory.iterdir()}
    return {"model.bin", TFM_JSON} <= names <= EXPORT_FILES and all((directory / n).is_file() for n in names)


class NotConvertible(TfmError):
    """The checkpoint's model is one CTranslate2 cannot express (the reasons, joined)."""


def write_conversion(checkpoint: Path, directory: Path, quantization: str | None = None) -> None:
    """Convert `checkpoint` into the existing, empty `directory`: model.bin (float32 weights: the
    compute type is chosen when it is loaded; `quantization` int8: stored as int8, a quarter of the
    size on disk, for shipping), the vocabularies, both sentencepiece models and
    tfm_decode.json (the checkpoint's decode settings, its positions). NotConvertible, naming what
    CTranslate2 cannot express, before anything is written."""
    import_ctranslate2()
    from ..experiment.checkpoint import load_trained_model  # torch: only to convert

    trained = load_trained_model(checkpoint)
    model, config, src_sp, tgt_sp = trained.model.float(), trained.config, trained.src_sp, trained.tgt_sp
    problems = convertible_problems(model.cfg, src_sp, tgt_sp)
    if problems:
        raise NotConvertible("; ".join(problems))
    spec = build_spec(model, _pieces(src_sp), _pieces(tgt_sp))
    try:
        spec.validate()
    except ValueError as exc:  # a spec variable we left unset or gave the wrong shape: a tfm bug
        raise RuntimeError(f"CTranslate2 spec validation failed: {exc}") from exc
    spec.optimize(quantization=quantization)  # None: fp32; the compute type picks int8 etc. at load time
    spec.save(str(directory))
    (directory / SRC_SPM).write_bytes(trained.spm_files["src"])
    (directory / TGT_SPM).write_bytes(trained.spm_files["tgt"])
    (directory / TFM_JSON).write_text(json.dumps({"decode": config.decode.model_dump(mode="json"),
                                                  "max_positions": model.cfg.max_positions,
                                                  "checkpoint": str(checkpoint),
                                                  "config": config.model_dump(mode="json")}, indent=2) + "\n")


def export_ctranslate2(checkpoint: str | Path, output: str | Path, force: bool = False,
                       shortlist: Path | None = None, quantization: str | None = None) -> Path:
    """Write a CTranslate2 model directory (`write_conversion`) for `tfm translate --engine
    ctranslate2 --model DIR` or for shipping; `shortlist` (a run's lexical shortlist) goes in as
    its vocabulary map, vmap.txt (used where decode.shortlist is true).

    The export is built in a staging directory beside `output` and moved into place only once it
    is complete; a previous export that `force` replaces is removed after that."""
    output, checkpoint = Path(output), Path(checkpoint)
    check_export_directory(output, checkpoint, force, is_previous_export)
    import_ctranslate2()
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_directory(output)  # names this process: a killed export's is removed by the next
    try:
        try:
            write_conversion(checkpoint, staging, quantization)
        except NotConvertible as exc:
            raise TfmError(f"cannot export to CTranslate2: {exc}") from None
        if shortlist is not None:  # the run's lexical shortlist, and its digest where it has one
            if not shortlist.is_file() or shortlist.stat().st_size == 0:  # CTranslate2 crashes on an empty map
                raise TfmError(f"{shortlist}: {'empty' if shortlist.is_file() else 'not a file'} (a lexical "
                               "shortlist: make it again with `tfm shortlist`)")
            digest = check_digest(shortlist, "make it again with `tfm shortlist`")
            shutil.copyfile(shortlist, staging / VMAP_FILE)
            if digest is not None:
                (staging / digest_file(Path(VMAP_FILE)).name).write_text(f"{digest}  {VMAP_FILE}\n", encoding="utf-8")
        replace_with_staged(staging, output)  # an empty directory, or a previous export (checked above)
    except OSError as exc:  # a full disk while writing: name the directory the user asked for
        raise OSError(exc.errno, exc.strerror, str(output)) from None
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return output


# --------------------------------------------------------------------------- reading an export

# config.json's settings that tfm's models need (what tfm export writes: the vocabulary's special
# pieces, </s> after each source as in training). CTranslate2's loader has no default for these
# (an absent one fails, or decodes without a start token), except multi_query_attention (false).
NEEDED_CONFIG = {"unk_token": SPECIAL_PIECES[UNK_ID], "bos_token": SPECIAL_PIECES[BOS_ID],
                 "eos_token": SPECIAL_PIECES[EOS_ID], "decoder_start_token": SPECIAL_PIECES[BOS_ID],
                 "add_source_bos": False, "add_source_eos": True, "multi_query_attention": False}
OPTIONAL_CONFIG = {"multi_query_attention"}  # older CTranslate2 versions did not write it
MAX_LAYER_NORM_EPSILON = 1e-3  # tfm's models use torch's 1e-5; a much larger one computes another model
CT2_TYPE_SIZES = (4, 1, 2, 4, 2, 2)  # bytes of CTranslate2's type ids: float32, int8, int16, int32, float16, bfloat16
INTEGER_TYPES = (1, 2, 3)
KNOWN_BINARY_VERSION = 6  # CTranslate2 4.x's
# model.bin's variables whose rows are the vocabulary's tokens: (variable, source or target side)
VOCABULARY_ROWS = (("encoder/embeddings_0/weight", 0), ("decoder/embeddings/weight", 1),
                   ("decoder/projection/weight", 1))
POSITIONS = "encoder/position_encodings/encodings"


@dataclass(frozen=True)
class ExportedSizes:
    """The model's sizes as model.bin shows them: what decoding/budget.py bounds a search's memory with
    (a `budget.ModelSizes`, like tfm's TransformerConfig)."""
    d_model: int
    n_heads: int
    d_ff: int
    dec_layers: int
    tgt_vocab_size: int
    max_positions: int


@dataclass
class ExportedModel:
    """A CTranslate2 model directory, read and checked: its sentencepiece models, tfm_decode.json,
    the number of positions its model has and its sizes (None: an older CTranslate2 binary)."""
    src_sp: spm.SentencePieceProcessor
    tgt_sp: spm.SentencePieceProcessor
    settings: dict[str, Any]
    max_positions: int
    sizes: ExportedSizes | None = None


def _json_file(path: Path, what: str) -> Any:
    if not path.is_file():
        raise TfmError(f"{path}: not a file ({what})")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TfmError(f"{path}: not readable JSON ({exc})") from None


@functools.lru_cache(maxsize=1)
def ct2_binary_version() -> int:
    """The model.bin version this CTranslate2 writes and reads at most, read from its source:
    importing `ctranslate2.specs` would import torch, which a translation through CTranslate2 never
    needs (and which takes longer to import than the translation of a test set takes)."""
    package = importlib.util.find_spec("ctranslate2")  # (finding ctranslate2.specs.model_spec would import specs)
    try:
        source = (Path(package.origin).parent / "specs" / "model_spec.py").read_text(encoding="utf-8") \
            if package and package.origin else ""
    except OSError:
        source = ""
    found = re.search(r"^CURRENT_BINARY_VERSION = (\d+)", source, re.MULTILINE)
    return int(found[1]) if found else KNOWN_BINARY_VERSION


def read_model_variables(model_bin: Path, scalars: dict[str, int] | None = None) -> dict[str, tuple[int, ...]] | None:
    """The shape of each variable of model.bin (aliases included), once the file is known to be
    whole: every record inside the file, each payload the size its shape and type make, nothing
    after the last. None for an older binary version, which CTranslate2's own loader checks.
    `scalars`, where given, receives the value of each integer scalar (e.g. 'decoder/num_heads')."""
    CURRENT_BINARY_VERSION = ct2_binary_version()

    def broken(why: str) -> TfmError:
        return TfmError(f"{model_bin}: not a whole CTranslate2 model ({why}): export it again with tfm export")

    with model_bin.open("rb") as f:
        size = os.fstat(f.fileno()).st_size

        def number(code: str) -> int:
            data = f.read(struct.calcsize(code))
            if len(data) < struct.calcsize(code):
                raise broken(f"it ends at byte {size:,} in the middle of a record")
            return struct.unpack("=" + code, data)[0]

        def string() -> str:
            length = number("H")  # the text and its closing NUL
            data = f.read(length)
            if length == 0 or len(data) < length or data[-1] != 0:
                raise broken(f"a name is cut off or unterminated near byte {f.tell():,}")
            try:
                return data[:-1].decode("utf-8")
            except UnicodeDecodeError:
                raise broken(f"a name near byte {f.tell():,} is not UTF-8") from None

        version = number("I")
        if not 1 <= version <= CURRENT_BINARY_VERSION:
            raise broken(f"binary version {version}; this CTranslate2 reads 1 to {CURRENT_BINARY_VERSION}")
        if version != CURRENT_BINARY_VERSION:
            return None
        spec, _revision = string(), number("I")
        if spec != "TransformerSpec":
            raise TfmError(f"{model_bin}: a {spec!r} model, not the TransformerSpec that tfm export writes")
        shapes: dict[str, tuple[int, ...]] = {}
        for _ in range(number("I")):
            name = string()
            shape = tuple(number("I") for _ in range(number("B")))
            type_id, payload = number("B"), number("I")
            if type_id >= len(CT2_TYPE_SIZES) or payload != math.prod(shape) * CT2_TYPE_SIZES[type_id]:
                raise broken(f"variable '{name}' of shape {shape} and type {type_id} says it has {payload:,} bytes")
            if f.tell() + payload > size:
                raise broken(f"variable '{name}' runs past the end of the file ({size:,} bytes)")
            if name in shapes:
                raise broken(f"variable '{name}' twice")
            if scalars is not None and shape == () and type_id in INTEGER_TYPES:
                scalars[name] = int.from_bytes(f.read(payload), sys.byteorder, signed=True)
            else:
                f.seek(payload, os.SEEK_CUR)
            shapes[name] = shape
        for _ in range(number("I")):
            alias, name = string(), string()
            if name not in shapes:
                raise broken(f"'{alias}' stands for '{name}', which it does not have")
            shapes[alias] = shapes[name]
        if f.tell() != size:
            raise broken(f"{size - f.tell():,} bytes after its last record")
    return shapes


def read_vocabularies(model_dir: Path) -> list[tuple[Path, list[str]]]:
    """The source and target vocabularies CTranslate2 will read: shared_vocabulary, or
    source_vocabulary and target_vocabulary, each .json (a list of tokens) or .txt (one a line)."""
    def read(stem: str) -> tuple[Path, list[str]] | None:
        for path in (model_dir / f"{stem}.json", model_dir / f"{stem}.txt"):
            if not path.exists():
                continue
            if path.suffix == ".json":
                tokens = _json_file(path, "a CTranslate2 vocabulary")
            else:
                try:
                    tokens = path.read_text(encoding="utf-8").splitlines()
                except (OSError, ValueError) as exc:
                    raise TfmError(f"{path}: not a readable vocabulary ({exc})") from None
            if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
                raise TfmError(f"{path}: not a CTranslate2 vocabulary (a non-empty list of tokens)")
            return path, tokens
        return None

    shared = read("shared_vocabulary")
    if shared:
        return [shared, shared]
    sides = [read("source_vocabulary"), read("target_vocabulary")]
    if None in sides:
        raise TfmError(f"{model_dir}: no shared_vocabulary.json, nor source_vocabulary.json and "
                       "target_vocabulary.json (export it again with tfm export)")
    return sides


def _sentencepiece(path: Path, vocabulary: tuple[Path, list[str]], side: str) -> spm.SentencePieceProcessor:
    """The sentencepiece model `path`, whose pieces must be the vocabulary's tokens, id for id."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise TfmError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    sp = spm.SentencePieceProcessor()
    try:
        sp.LoadFromSerializedProto(data)  # (the constructor's model_proto= takes b"" for no model at all)
    except RuntimeError:
        raise TfmError(f"{path}: not a sentencepiece model (damaged, empty or another kind of file)") from None
    vocabulary_file, tokens = vocabulary
    pieces = _pieces(sp)
    if pieces != tokens:
        first = next((i for i, (a, b) in enumerate(zip(pieces, tokens)) if a != b), min(len(pieces), len(tokens)))
        raise TfmError(f"{path}: its {len(pieces)} pieces are not the {len(tokens)} tokens of {vocabulary_file} "
                       f"(they differ from id {first}): the vocabulary and the sentencepiece model do not belong together")
    problems = _special_piece_problems(side, sp)
    if problems:
        raise TfmError(f"{path}: " + "; ".join(problems))
    return sp


def check_ct2_config(config_file: Path, config: Any) -> None:
    if not isinstance(config, dict):
        raise TfmError(f"{config_file}: not a JSON object (CTranslate2's model settings)")
    for key, needed in NEEDED_CONFIG.items():
        if key not in config and key in OPTIONAL_CONFIG:
            continue
        value = config.get(key)
        if type(value) is not type(needed) or value != needed:
            given = f"{key}={json.dumps(value)}" if key in config else f"no {key}"
            raise TfmError(f"{config_file}: {given}, but tfm's models need {json.dumps(needed)} (what tfm export writes)")
    epsilon = config.get("layer_norm_epsilon")
    if type(epsilon) not in (int, float) or not 0 < epsilon <= MAX_LAYER_NORM_EPSILON:
        raise TfmError(f"{config_file}: layer_norm_epsilon={json.dumps(epsilon)}: give a number above 0 and at most "
                       f"{MAX_LAYER_NORM_EPSILON} (tfm's models use 1e-05)")


def read_export(model_dir: Path) -> ExportedModel:
    """Everything `--engine ctranslate2` reads from `model_dir`, checked against everything else
    before CTranslate2 loads it: config.json's settings, the vocabularies against the
    sentencepiece models and against model.bin's embedding rows, model.bin whole,
    tfm_decode.json's positions against the model's. One line naming the file, never a traceback."""
    if not model_dir.is_dir():
        what = "it is not a directory" if model_dir.exists() else "it does not exist"
        raise TfmError(f"{model_dir}: not a CTranslate2 model directory ({what}; create one with tfm export "
                       "--format ctranslate2)")
    model_bin = model_dir / "model.bin"
    if not model_bin.is_file():
        raise TfmError(f"{model_dir}: not a CTranslate2 model directory (no model.bin; "
                       "create one with tfm export --format ctranslate2)")
    for name in (SRC_SPM, TGT_SPM):
        if not (model_dir / name).is_file():
            raise TfmError(f"{model_dir}: {name} is missing (export with tfm export)")
    check_ct2_config(model_dir / "config.json", _json_file(model_dir / "config.json", "CTranslate2's model settings"))
    vocabularies = read_vocabularies(model_dir)
    src_sp = _sentencepiece(model_dir / SRC_SPM, vocabularies[0], "source")
    tgt_sp = _sentencepiece(model_dir / TGT_SPM, vocabularies[1], "target")
    scalars: dict[str, int] = {}
    try:
        shapes = read_model_variables(model_bin, scalars)
    except OSError as exc:
        raise TfmError(f"{model_bin}: cannot be read ({exc.strerror or exc})") from None
    positions = None
    if shapes is not None:
        for name, side in VOCABULARY_ROWS:
            vocabulary_file, tokens = vocabularies[side]
            if name not in shapes:
                raise TfmError(f"{model_bin}: no variable '{name}' (not a Transformer that tfm export wrote)")
            if not shapes[name] or shapes[name][0] != len(tokens):
                raise TfmError(f"{model_bin}: '{name}' has shape {shapes[name]}, but {vocabulary_file} has "
                               f"{len(tokens)} tokens: the vocabulary is not this model's")
        positions = shapes[POSITIONS][0] if shapes.get(POSITIONS) else None
    settings = _json_file(model_dir / TFM_JSON, "tfm's decode settings") if (model_dir / TFM_JSON).exists() else {}
    if not isinstance(settings, dict) or not isinstance(settings.get("decode", {}), dict):
        raise TfmError(f"{model_dir / TFM_JSON}: not tfm's decode settings (a JSON object with a 'decode' object)")
    # tfm_decode.json names the model's positions; older exports did not (then the table's, or 1025).
    max_positions = settings.get("max_positions", positions or 1025)
    if type(max_positions) is not int or not 4 <= max_positions <= (positions or max_positions):
        bound = f"from 4 to the model's {positions}" if positions else "at least 4"
        raise TfmError(f"{model_dir / TFM_JSON}: max_positions={max_positions!r}: give an integer {bound}")
    return ExportedModel(src_sp, tgt_sp, settings, max_positions, _sizes(shapes, scalars, max_positions))


def _sizes(shapes: dict[str, tuple[int, ...]] | None, scalars: dict[str, int], max_positions: int) -> ExportedSizes | None:
    if shapes is None:
        return None
    layers = [name for name in shapes if name.startswith("decoder/layer_") and name.endswith("/ffn/linear_0/weight")]
    projection = shapes["decoder/projection/weight"]  # (V, D): checked above
    d_model = projection[1] if len(projection) == 2 else 1
    d_ff = max((shapes[name][0] for name in layers), default=4 * d_model)
    heads = scalars.get("decoder/num_heads") or max(d_model // 32, 1)  # the bound grows with heads
    return ExportedSizes(d_model, max(heads, 1), d_ff, len(layers), projection[0], max_positions)


# --------------------------------------------------------------------------- an export's decode settings


def exported_decode(model_dir: Path, settings: dict[str, Any], overrides: list[str]) -> DecodeConfig:
    """tfm_decode.json's decode settings edited by `overrides` (--set), checked as tfm's engine checks
    them against the checkpoint's whole config where the directory keeps it (newer exports)."""
    trained = None
    if isinstance(settings.get("config"), dict):
        try:
            trained = config_from_dict(settings["config"], str(model_dir / TFM_JSON))
        except TfmError:  # written by another tfm version: its decode settings alone are used
            trained = None
    check_inference_overrides(overrides, trained)
    raw = trained.model_dump(mode="json") if trained is not None else {"decode": settings.get("decode", {})}
    for assignment in overrides:
        apply_override(raw, assignment)
    return config_from_dict(raw, f"{model_dir / TFM_JSON} (with --set)").decode
