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
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from .checkpoint import bytes_to_tensor, save_checkpoint
from .config import config_from_dict, config_to_yaml
from .data import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from .errors import TfmError
from .files import atomic_write_text
from .model import Transformer, TransformerConfig, sinusoidal_table
from .rundir import BEST, RunDirectory

NEVER = -1.0e4  # output bias of tokens an imported model never produces (<pad>, tfm's added <s>)
ACTIVATIONS = {"swish": "swish", "silu": "swish", "relu": "relu", "gelu": "gelu"}


@dataclass
class ImportResult:
    run_dir: Path
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


def read_marian_config(hf_dir: Path) -> dict[str, Any]:
    """config.json, checked for what tfm's model can express; a refusal names the key and why."""
    if not hf_dir.is_dir():
        raise TfmError(f"{hf_dir}: not a directory (give the folder that save_pretrained wrote)")
    config_file = hf_dir / "config.json"
    if not config_file.is_file():
        raise TfmError(f"{config_file} not found: {hf_dir} is not a Hugging Face model directory")
    hf = _read_json(config_file)
    if not isinstance(hf, dict) or hf.get("model_type") != "marian":
        kind = hf.get("model_type") if isinstance(hf, dict) else None
        raise TfmError(f"{config_file}: model_type {kind!r} is not a Marian model (model_type 'marian')")

    def refuse(key: str, why: str) -> None:
        raise TfmError(f"{config_file}: {key}={hf.get(key)!r}: {why}")

    if not hf.get("share_encoder_decoder_embeddings", True):
        refuse("share_encoder_decoder_embeddings", "separate source and target vocabularies are not supported")
    if hf.get("encoder_attention_heads") != hf.get("decoder_attention_heads"):
        refuse("decoder_attention_heads", "tfm's encoder and decoder have the same number of heads")
    if hf.get("encoder_ffn_dim") != hf.get("decoder_ffn_dim"):
        refuse("decoder_ffn_dim", "tfm's encoder and decoder have the same feed-forward size")
    if hf.get("activation_function", "gelu") not in ACTIVATIONS:
        refuse("activation_function", f"tfm's model has {', '.join(sorted(set(ACTIVATIONS.values())))}")
    if not hf.get("scale_embedding", False):
        refuse("scale_embedding", "tfm scales embeddings by √d_model, as the paper and Marian do")
    if hf.get("normalize_before", False):
        refuse("normalize_before", "pre-norm Marian models are not supported")
    if hf.get("d_model", 0) % max(hf.get("encoder_attention_heads", 1), 1):
        refuse("d_model", "not divisible by the number of attention heads")
    return hf


def _needs_extra(exc: ImportError) -> TfmError:
    return TfmError(f"tfm import --format marian needs the marian extra ({exc.name} is missing): "
                    "pip install 'transformer-cli[marian]'")


def read_weights(hf_dir: Path) -> dict[str, torch.Tensor]:
    safetensors_file, torch_file = hf_dir / "model.safetensors", hf_dir / "pytorch_model.bin"
    if safetensors_file.is_file():
        try:
            from safetensors import SafetensorError
            from safetensors.torch import load_file
        except ImportError as exc:
            raise _needs_extra(exc) from None

        try:
            return load_file(str(safetensors_file))
        except (SafetensorError, OSError) as exc:
            raise TfmError(f"{safetensors_file}: not readable safetensors ({exc})") from None
    if torch_file.is_file():
        try:
            return torch.load(torch_file, map_location="cpu", weights_only=True)
        except Exception as exc:  # a pickle with code is refused by weights_only, as a corrupt file is
            raise TfmError(f"{torch_file}: not a weights-only torch file ({type(exc).__name__}); tfm never loads "
                           "model files unsafely") from None
    raise TfmError(f"{hf_dir}: no model.safetensors or pytorch_model.bin (the model's weights)")


def tfm_order(vocab: dict[str, int], hf: dict[str, Any]) -> list[int]:
    """tfm id → Marian id: tfm's specials first (<pad>, <unk>, <s> = Marian's decoder start, </s>),
    then every other Marian id in its order."""
    pad, eos = hf.get("pad_token_id"), hf.get("eos_token_id", 0)
    start = hf.get("decoder_start_token_id", pad)
    unk = vocab.get("<unk>")
    size = hf["vocab_size"]
    ids = {"pad_token_id": pad, "eos_token_id": eos, "decoder_start_token_id": start, "vocab.json <unk>": unk}
    for name, value in ids.items():
        if not isinstance(value, int) or not 0 <= value < size:
            raise TfmError(f"config.json: {name}={value!r} is not an id of the {size}-token vocabulary")
    if len({pad, eos, unk}) < 3:
        raise TfmError(f"config.json: <pad> ({pad}), </s> ({eos}) and <unk> ({unk}) must be distinct ids")
    return [pad, unk, start, eos] + [i for i in range(size) if i not in (pad, unk, eos)]


def convert_state_dict(weights: dict[str, torch.Tensor], hf: dict[str, Any], order: list[int]
                       ) -> dict[str, torch.Tensor]:
    """Marian's tensor names and layout → tfm's (fused Q|K|V and K|V projections, permuted ids)."""
    def get(name: str) -> torch.Tensor:
        for candidate in (name, f"model.{name}"):
            if candidate in weights:
                return weights[candidate].float()
        raise TfmError(f"the weights have no tensor '{name}' (not a MarianMTModel's weights?)")

    index = torch.tensor(order)
    shared = next((weights[n] for n in ("model.shared.weight", "shared.weight", "model.encoder.embed_tokens.weight")
                   if n in weights), None)
    if shared is None:
        raise TfmError("the weights have no tensor 'model.shared.weight' (not a MarianMTModel's weights?)")
    state = {"src_embed.embedding.weight": shared.float()[index]}
    state["tgt_embed.embedding.weight"] = state["src_embed.embedding.weight"]
    if not hf.get("tie_word_embeddings", True):
        state["output_proj.weight"] = get("lm_head.weight")[index]
    else:
        state["output_proj.weight"] = state["src_embed.embedding.weight"]
    bias = weights.get("final_logits_bias", torch.zeros(1, len(order) - 1)).float().reshape(-1)[index].clone()
    bias[PAD_ID] = bias[BOS_ID] = NEVER
    state["output_proj.bias"] = bias

    def attention(ours: str, theirs: str, fused_self: bool) -> None:
        parts = {p[0]: (get(f"{theirs}.{p}_proj.weight"), get(f"{theirs}.{p}_proj.bias")) for p in ("q", "k", "v", "out")}
        if fused_self:
            state[f"{ours}.qkv_proj.weight"] = torch.cat([parts[p][0] for p in "qkv"])
            state[f"{ours}.qkv_proj.bias"] = torch.cat([parts[p][1] for p in "qkv"])
        else:
            state[f"{ours}.q_proj.weight"], state[f"{ours}.q_proj.bias"] = parts["q"]
            state[f"{ours}.kv_proj.weight"] = torch.cat([parts["k"][0], parts["v"][0]])
            state[f"{ours}.kv_proj.bias"] = torch.cat([parts["k"][1], parts["v"][1]])
        state[f"{ours}.out_proj.weight"], state[f"{ours}.out_proj.bias"] = parts["o"]

    def norm(ours: str, theirs: str) -> None:
        state[f"{ours}.norm.weight"], state[f"{ours}.norm.bias"] = get(f"{theirs}.weight"), get(f"{theirs}.bias")

    def feed_forward(ours: str, theirs: str) -> None:
        for mine, hf_name in (("w1", "fc1"), ("w2", "fc2")):
            state[f"{ours}.ffn.{mine}.weight"] = get(f"{theirs}.{hf_name}.weight")
            state[f"{ours}.ffn.{mine}.bias"] = get(f"{theirs}.{hf_name}.bias")
        norm(f"{ours}.ffn_add_norm", f"{theirs}.final_layer_norm")

    for i in range(hf["encoder_layers"]):
        ours, theirs = f"encoder_layers.{i}", f"encoder.layers.{i}"
        attention(f"{ours}.self_attn", f"{theirs}.self_attn", fused_self=True)
        norm(f"{ours}.attn_add_norm", f"{theirs}.self_attn_layer_norm")
        feed_forward(ours, theirs)
    for i in range(hf["decoder_layers"]):
        ours, theirs = f"decoder_layers.{i}", f"decoder.layers.{i}"
        attention(f"{ours}.self_attn", f"{theirs}.self_attn", fused_self=True)
        norm(f"{ours}.self_add_norm", f"{theirs}.self_attn_layer_norm")
        attention(f"{ours}.cross_attn", f"{theirs}.encoder_attn", fused_self=False)
        norm(f"{ours}.cross_add_norm", f"{theirs}.encoder_attn_layer_norm")
        feed_forward(ours, theirs)
    return state


def check_positions(weights: dict[str, torch.Tensor], hf: dict[str, Any]) -> None:
    """Marian's position table is fixed sinusoids; a model whose table is anything else (learned
    positions) cannot be expressed."""
    for name in ("model.encoder.embed_positions.weight", "model.decoder.embed_positions.weight"):
        table = weights.get(name)
        if table is not None:
            expected = sinusoidal_table(table.size(0), table.size(1), split=True)
            if not torch.allclose(table.float(), expected, atol=1e-4):
                raise TfmError(f"{name}: not Marian's sinusoidal table (learned positions?), which tfm's "
                               "positional: sinusoidal_split could not reproduce")


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
    pieces[BOS_ID] = "<s>" if "<s>" not in vocab else "<tfm_start>"  # a copy of the decoder-start row
    pieces[PAD_ID], pieces[EOS_ID] = "<pad>", "</s>"
    return pieces


def tfm_model_config(hf: dict[str, Any], vocab_size: int) -> TransformerConfig:
    return TransformerConfig(
        src_vocab_size=vocab_size, tgt_vocab_size=vocab_size, d_model=hf["d_model"],
        n_heads=hf["encoder_attention_heads"], enc_layers=hf["encoder_layers"], dec_layers=hf["decoder_layers"],
        d_ff=hf["encoder_ffn_dim"], dropout=float(hf.get("dropout", 0.1)),
        attention_dropout=float(hf.get("attention_dropout", 0.0)),
        activation=ACTIVATIONS[hf.get("activation_function", "gelu")], norm_position="post",
        positional="sinusoidal_split", max_positions=hf.get("max_position_embeddings", 512), share_embeddings=True,
        tie_output=hf.get("tie_word_embeddings", True), output_bias=True, pad_id=PAD_ID)


def import_marian(hf_dir: Path, run_dir: Path) -> ImportResult:
    """Write `run_dir` (which must not exist or be empty): config.yaml, prepare.json, the two
    sentencepiece models and checkpoints/checkpoint_best.pt."""
    hf = read_marian_config(hf_dir)
    vocab_file = _required(hf_dir, "vocab.json", "the id map over both sentencepiece models")
    spm_files = {"src": _required(hf_dir, "source.spm", "the source sentencepiece model"),
                 "tgt": _required(hf_dir, "target.spm", "the target sentencepiece model")}
    if run_dir.exists() and (not run_dir.is_dir() or any(run_dir.iterdir())):
        raise TfmError(f"{run_dir} exists and is not empty: import into a new run directory")
    vocab = _read_json(vocab_file)
    if not isinstance(vocab, dict) or sorted(vocab.values()) != list(range(len(vocab))):
        raise TfmError(f"{vocab_file}: not a Marian id map (pieces → the ids 0…N-1)")
    if len(vocab) != hf["vocab_size"]:
        raise TfmError(f"{vocab_file} has {len(vocab)} ids but config.json's vocab_size is {hf['vocab_size']}")
    weights = read_weights(hf_dir)
    check_positions(weights, hf)

    order = tfm_order(vocab, hf)
    pieces, codes = tfm_pieces(vocab, order), {p for p in vocab if p.startswith(">>") and p.endswith("<<")}
    warnings, models = [], {}
    for side, path in spm_files.items():
        models[side], missing = tfm_sentencepiece(path, pieces, codes if side == "src" else set())
        if missing:
            warnings.append(f"{path.name}: {missing} of its pieces are not in vocab.json (Marian maps them to "
                            "<unk>; tfm segments around them)")
    model = Transformer(tfm_model_config(hf, len(order)))
    try:
        model.load_state_dict(convert_state_dict(weights, hf, order))
    except RuntimeError as exc:
        raise TfmError(f"{hf_dir}: the weights do not fit config.json ({str(exc).splitlines()[0]})") from None
    write_run_directory(run_dir, hf_dir, hf, model, models)
    return ImportResult(run_dir, model.num_parameters(), len(order), warnings)


def write_run_directory(run_dir: Path, hf_dir: Path, hf: dict[str, Any], model: Transformer,
                        models: dict[str, bytes]) -> None:
    """The run directory, staged beside `run_dir` and renamed into place when complete, so that a
    failed import leaves nothing behind."""
    tokenizer = _read_json(hf_dir / "tokenizer_config.json") if (hf_dir / "tokenizer_config.json").is_file() else {}
    src_lang, tgt_lang = (tokenizer.get("source_lang") or "src"), (tokenizer.get("target_lang") or "tgt")
    size = model.cfg.src_vocab_size
    config = config_from_dict({
        "run_dir": str(run_dir),
        "data": {"src_lang": src_lang, "tgt_lang": tgt_lang},
        "vocab": {"joint": False, "size": size},
        "model": {k: v for k, v in asdict(model.cfg).items() if k not in ("src_vocab_size", "tgt_vocab_size", "pad_id")},
        # Marian's generate: length penalty 1 (score / length); its beam from config.json.
        "decode": {"beam": int(hf.get("num_beams") or 4), "length_penalty": 1.0},
    }, f"{hf_dir}/config.json")
    manifest = {
        "src_lang": src_lang, "tgt_lang": tgt_lang,
        "vocab": {"src": "spm.src.model", "tgt": "spm.tgt.model"},
        "vocab_size": {"src": size, "tgt": size},
        "special_ids": {"pad": PAD_ID, "unk": UNK_ID, "bos": BOS_ID, "eos": EOS_ID},
        "shared_ids": True,  # two sentencepiece models over one id map: embeddings are shared
        "imported_from": {"format": "marian", "path": str(hf_dir.resolve())},
    }
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{run_dir.name}.import-", dir=run_dir.parent))
    try:
        staged = RunDirectory(staging)
        for side, data in models.items():
            (staging / manifest["vocab"][side]).write_bytes(data)
        atomic_write_text(staged.manifest_file, json.dumps(manifest, indent=2))
        atomic_write_text(staged.config_file, config_to_yaml(config))
        staged.checkpoints.mkdir()
        save_checkpoint(staged.checkpoints / BEST, {
            "model": model.state_dict(), "model_config": asdict(model.cfg), "config": config.model_dump(mode="json"),
            "progress": {"step": 0}, "imported_from": manifest["imported_from"],
            "spm_src": bytes_to_tensor(models["src"]), "spm_tgt": bytes_to_tensor(models["tgt"]),
        })
        if run_dir.exists():
            run_dir.rmdir()  # empty (checked above)
        staging.rename(run_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
