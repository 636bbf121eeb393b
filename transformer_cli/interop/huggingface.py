"""`tfm export --format huggingface`: a tfm model as a `transformers` model directory, loadable by
`AutoModelForSeq2SeqLM`/`AutoTokenizer` (and transformers 4's `pipeline("translation")`) with no custom code.

The directory is what `save_pretrained` writes (the model and its tokenizer, written by transformers
itself), a generation_config.json with the run's decoding settings and a model card (README.md).

Which shipped architecture computes what tfm's model computes:

- post-norm (the paper's): **Marian** (`MarianMTModel`) — √d-scaled embeddings, sinusoids laid out
  all sines then all cosines, LayerNorm after each residual sum, biases everywhere, an optional
  output bias (final_logits_bias), one shared or two separate vocabularies.
- pre-norm: **Pegasus** (`PegasusForConditionalGeneration`) — Marian's embeddings and sinusoids, a
  LayerNorm before each sublayer and one after each stack (tfm's encoder_norm/decoder_norm), no
  LayerNorm on the embeddings. Pegasus has one embedding matrix for the encoder's input, the
  decoder's input and (tied) the output, so a pre-norm model is exported only with a joint
  vocabulary and shared embeddings.

tfm's default sinusoids interleave sin and cos (`positional: sinusoidal`); both architectures put
the sines first. A permutation of the model dimension applied to every weight that reads or writes
the residual stream gives an equal network with their layout (`split_order`): LayerNorm does not
depend on the order of its inputs, and nothing else mixes them but the weights.

Ids are tfm's (<pad>=0, <unk>=1, <s>=2, </s>=3): the tokenizer (Marian's: sentencepiece, then an
id map, then </s>) maps each piece to the id tfm's sentencepiece model gives it, and generation
starts from <s> (decoder_start_token_id 2) as tfm's does. The export loads what it wrote back
through transformers and compares its output with tfm's on a batch before it is moved into place.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..experiment.config import ExperimentConfig
from ..model.lengths import output_token_cap, source_token_limit
from ..model.special_tokens import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from ..model.transformer import Transformer, TransformerConfig
from ..runtime.errors import TfmError
from ..runtime.files import check_export_directory, replace_with_staged, staging_directory
from .model_card import model_card, test_scores

ARCHITECTURES = {"post": ("marian", "MarianMTModel"), "pre": ("pegasus", "PegasusForConditionalGeneration")}
# What save_pretrained writes for the model and the tokenizer, and the card: an earlier export holds
# only these (--force replaces it; a directory with anything else is the user's).
EXPORT_FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer_config.json",
                "special_tokens_map.json", "source.spm", "target.spm", "vocab.json", "target_vocab.json",
                "added_tokens.json", "chat_template.jinja", "README.md"}
TAG_PIECE = re.compile(r"\u2581>>[^\s<>]+<<")  # a target-language tag as tfm's sentencepiece holds it
CHECK_TOLERANCE = 1e-3  # |logit difference| allowed between tfm and transformers on the check batch (fp32)


class NotExportable(TfmError):
    """The model is one no shipped transformers architecture computes (the reasons, joined)."""


def architecture_problems(cfg: TransformerConfig) -> list[str]:
    """Why `cfg`'s model has no equal among the architectures transformers ships (none: it has one)."""
    problems = []
    if cfg.positional == "learned":
        problems.append("model.positional: learned (Marian and Pegasus have fixed sinusoids)")
    if cfg.norm_position == "pre" and not cfg.share_embeddings:
        problems.append("model.norm_position: pre with separate source and target embeddings (Pegasus, the "
                        "pre-norm architecture, has one embedding matrix for both sides and the output; a "
                        "post-norm model or a joint vocabulary with model.share_embeddings: true exports)")
    if cfg.d_model % cfg.n_heads:
        problems.append(f"model.d_model {cfg.d_model} is not divisible by model.n_heads {cfg.n_heads}")
    return problems


def split_order(cfg: TransformerConfig) -> torch.Tensor:
    """The model dimension in transformers' order: index j of an exported weight is tfm's dimension
    order[j]. Interleaved sinusoids (sin at even, cos at odd dimensions) become all sines, then all
    cosines; a model trained with that layout already (`sinusoidal_split`, an imported Marian) keeps its order."""
    return interleaved_to_split(cfg.d_model) if cfg.positional == "sinusoidal" else torch.arange(cfg.d_model)


def interleaved_to_split(d_model: int) -> torch.Tensor:
    """Dimension j of the split layout (all sines, then all cosines) is dimension order[j] of the
    interleaved one (sin at even, cos at odd dimensions)."""
    return torch.cat([torch.arange(0, d_model, 2), torch.arange(1, d_model, 2)])


def permute_model_dimension(state: dict[str, torch.Tensor], order: torch.Tensor) -> dict[str, torch.Tensor]:
    """tfm's weights (by tfm's names) with the model dimension reordered: dimension j of the result
    is dimension order[j] of `state`. Weights that read the residual stream (embeddings, the output
    projection, every projection into attention or the feed-forward layer) are permuted along their
    input; those that write it (attention's output, the feed-forward's second layer) along their
    output; LayerNorms along their one axis. The network computes the same function, its hidden
    states permuted — with positions added in the permuted layout."""
    reads = (".embedding.weight", "output_proj.weight", ".qkv_proj.weight", ".q_proj.weight", ".kv_proj.weight",
             ".w1.weight")
    writes = (".out_proj.weight", ".out_proj.bias", ".w2.weight", ".w2.bias")
    permuted = {}
    for name, tensor in state.items():
        if name.endswith(reads):
            permuted[name] = tensor[:, order].contiguous()
        elif name.endswith(writes) or ".norm." in name or name.startswith(("encoder_norm.", "decoder_norm.")):
            permuted[name] = tensor[order].contiguous()
        else:
            permuted[name] = tensor.clone()
    return permuted


def transformers_state(model: Transformer) -> dict[str, torch.Tensor]:
    """tfm's weights under transformers' names (Marian's and Pegasus's are the same), the model
    dimension in transformers' sinusoid layout (`split_order`)."""
    cfg = model.cfg
    ours = permute_model_dimension({name: t.detach().float() for name, t in model.state_dict().items()},
                                   split_order(cfg))
    d = cfg.d_model
    state: dict[str, torch.Tensor] = {}

    def norm(theirs: str, tfm: str) -> None:
        state[f"{theirs}.weight"], state[f"{theirs}.bias"] = ours[f"{tfm}.weight"], ours[f"{tfm}.bias"]

    def linear(theirs: str, weight: torch.Tensor, bias: torch.Tensor) -> None:
        state[f"{theirs}.weight"], state[f"{theirs}.bias"] = weight, bias

    def attention(theirs: str, tfm: str, fused_self: bool) -> None:
        if fused_self:
            weights, biases = ours[f"{tfm}.qkv_proj.weight"].split(d), ours[f"{tfm}.qkv_proj.bias"].split(d)
        else:
            weights = (ours[f"{tfm}.q_proj.weight"], *ours[f"{tfm}.kv_proj.weight"].split(d))
            biases = (ours[f"{tfm}.q_proj.bias"], *ours[f"{tfm}.kv_proj.bias"].split(d))
        for part, weight, bias in zip("qkv", weights, biases):
            linear(f"{theirs}.{part}_proj", weight.contiguous(), bias.contiguous())
        linear(f"{theirs}.out_proj", ours[f"{tfm}.out_proj.weight"], ours[f"{tfm}.out_proj.bias"])

    def feed_forward(theirs: str, tfm: str) -> None:
        linear(f"{theirs}.fc1", ours[f"{tfm}.ffn.w1.weight"], ours[f"{tfm}.ffn.w1.bias"])
        linear(f"{theirs}.fc2", ours[f"{tfm}.ffn.w2.weight"], ours[f"{tfm}.ffn.w2.bias"])
        norm(f"{theirs}.final_layer_norm", f"{tfm}.ffn_add_norm.norm")

    if cfg.share_embeddings:
        state["model.shared.weight"] = ours["src_embed.embedding.weight"]
    state["model.encoder.embed_tokens.weight"] = ours["src_embed.embedding.weight"]
    state["model.decoder.embed_tokens.weight"] = ours["tgt_embed.embedding.weight"]
    state["lm_head.weight"] = ours["output_proj.weight"]
    state["final_logits_bias"] = ours.get("output_proj.bias", torch.zeros(cfg.tgt_vocab_size)).reshape(1, -1)
    for i in range(cfg.enc_layers):
        theirs, tfm = f"model.encoder.layers.{i}", f"encoder_layers.{i}"
        attention(f"{theirs}.self_attn", f"{tfm}.self_attn", fused_self=True)
        norm(f"{theirs}.self_attn_layer_norm", f"{tfm}.attn_add_norm.norm")
        feed_forward(theirs, tfm)
    for i in range(cfg.dec_layers):
        theirs, tfm = f"model.decoder.layers.{i}", f"decoder_layers.{i}"
        attention(f"{theirs}.self_attn", f"{tfm}.self_attn", fused_self=True)
        norm(f"{theirs}.self_attn_layer_norm", f"{tfm}.self_add_norm.norm")
        attention(f"{theirs}.encoder_attn", f"{tfm}.cross_attn", fused_self=False)
        norm(f"{theirs}.encoder_attn_layer_norm", f"{tfm}.cross_add_norm.norm")
        feed_forward(theirs, tfm)
    if cfg.norm_position == "pre":
        norm("model.encoder.layer_norm", "encoder_norm")
        norm("model.decoder.layer_norm", "decoder_norm")
    return state


def transformers_config(cfg: TransformerConfig, config: ExperimentConfig) -> dict[str, Any]:
    """config.json's settings: the shape, the ids, and `tfm` (what the export was made from, which
    `tfm import` reads to give back the model it came from)."""
    settings = {
        "vocab_size": cfg.src_vocab_size, "d_model": cfg.d_model, "max_position_embeddings": cfg.max_positions,
        "encoder_layers": cfg.enc_layers, "decoder_layers": cfg.dec_layers,
        "encoder_attention_heads": cfg.n_heads, "decoder_attention_heads": cfg.n_heads,
        "encoder_ffn_dim": cfg.d_ff, "decoder_ffn_dim": cfg.d_ff, "activation_function": cfg.activation,
        "dropout": cfg.dropout, "attention_dropout": cfg.attention_dropout,
        "activation_dropout": cfg.dropout if cfg.activation_dropout is None else cfg.activation_dropout,
        "scale_embedding": True, "pad_token_id": PAD_ID, "eos_token_id": EOS_ID, "bos_token_id": BOS_ID,
        "decoder_start_token_id": BOS_ID, "forced_eos_token_id": None, "tie_word_embeddings": cfg.tie_output,
        "tfm": {"positional": cfg.positional, "norm_position": cfg.norm_position, "output_bias": cfg.output_bias,
                "src_lang": config.data.src_lang, "tgt_lang": config.data.tgt_lang},
    }
    if cfg.norm_position == "post":
        settings["decoder_vocab_size"] = cfg.tgt_vocab_size
        settings["share_encoder_decoder_embeddings"] = cfg.share_embeddings
    return settings


def generation_settings(cfg: TransformerConfig, config: ExperimentConfig) -> dict[str, Any]:
    """generation_config.json: the run's beam and length penalty (generate divides a beam's total by
    length ** length_penalty, as CTranslate2, tfm's default engine, does), beam search ending once it
    has a beam's worth of finished hypotheses (early_stopping, CTranslate2's rule: the same BLEU as
    CTranslate2 in float32 where generate's own heuristic differed by 0.4), and the longest output
    tfm's search allows any sentence (generate has one cap for all; tfm's is a·length + b per sentence)."""
    return {"decoder_start_token_id": BOS_ID, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID,
            "pad_token_id": PAD_ID, "forced_eos_token_id": None, "num_beams": config.decode.beam,
            "length_penalty": config.decode.length_penalty, "early_stopping": True,
            "max_length": output_token_cap(cfg.max_positions) + 1}  # + the start token, which generate counts


def _needs_transformers(exc: ImportError) -> TfmError:
    return TfmError(f"tfm export --format huggingface needs transformers and safetensors ({exc.name} is missing): "
                    "pip install 'transformer-cli[huggingface]'")


def build_transformers_model(cfg: TransformerConfig, config: ExperimentConfig, state: dict[str, torch.Tensor]):
    """The transformers model of `cfg`'s architecture holding `state`; every weight it has is set
    (its fixed position tables aside), and every tensor of `state` is used."""
    try:
        import transformers
    except ImportError as exc:
        raise _needs_transformers(exc) from None
    model_type, class_name = ARCHITECTURES[cfg.norm_position]
    hf_config = transformers.AutoConfig.for_model(model_type, **transformers_config(cfg, config))
    model = getattr(transformers, class_name)(hf_config).eval()
    theirs = model.state_dict()
    unset = sorted(name for name in theirs if name not in state and "embed_positions" not in name)
    unknown = sorted(set(state) - set(theirs))
    if unset or unknown:  # a transformers version whose names differ: refuse rather than export half a model
        raise TfmError(f"transformers {transformers.__version__}'s {class_name} does not match tfm's mapping "
                       f"(unset: {unset[:3]}, unknown: {unknown[:3]})")
    model.load_state_dict({**theirs, **state})
    model.generation_config = transformers.GenerationConfig(**generation_settings(cfg, config))
    return model


def source_id_map(pieces: list[str]) -> dict[str, int]:
    """vocab.json: each piece → its tfm id. A target-language tag that tfm's sentencepiece model holds
    as `▁>>xx<<` is also there as `>>xx<<`: Marian's tokenizer splits a line's leading tag off before
    sentencepiece and looks it up bare. The bare names come first, so that an id reads back as tfm's piece."""
    aliases = {piece[1:]: i for i, piece in enumerate(pieces) if TAG_PIECE.fullmatch(piece)}
    return {**{bare: i for bare, i in aliases.items() if bare not in pieces}, **{p: i for i, p in enumerate(pieces)}}


def write_tokenizer(directory: Path, spm_files: dict[str, bytes], pieces: dict[str, list[str]],
                    config: ExperimentConfig, max_positions: int) -> None:
    """Marian's tokenizer over tfm's sentencepiece models: vocab.json (and target_vocab.json with
    two vocabularies) maps every piece to tfm's id for it; written by transformers' save_pretrained."""
    from transformers import MarianTokenizer

    separate = pieces["src"] != pieces["tgt"] or spm_files["src"] != spm_files["tgt"]
    work = directory / ".tokenizer"
    work.mkdir()
    files = {"source_spm": work / "source.spm", "target_spm": work / "target.spm", "vocab": work / "vocab.json"}
    files["source_spm"].write_bytes(spm_files["src"])
    files["target_spm"].write_bytes(spm_files["tgt"])
    files["vocab"].write_text(json.dumps(source_id_map(pieces["src"]), ensure_ascii=False))
    extra: dict[str, Any] = {}
    if separate:
        extra["target_vocab_file"] = str(work / "target_vocab.json")
        Path(extra["target_vocab_file"]).write_text(json.dumps({p: i for i, p in enumerate(pieces["tgt"])},
                                                               ensure_ascii=False))
    tokenizer = MarianTokenizer(
        **{key: str(path) for key, path in files.items()}, separate_vocabs=separate,
        source_lang=config.data.src_lang, target_lang=config.data.tgt_lang,
        unk_token=pieces["src"][UNK_ID], eos_token=pieces["src"][EOS_ID], pad_token=pieces["src"][PAD_ID],
        bos_token=pieces["tgt"][BOS_ID], model_max_length=source_token_limit(max_positions) + 1, **extra)
    tokenizer.save_pretrained(str(directory))
    shutil.rmtree(work)


def check_equal_computation(tfm_model: Transformer, directory: Path) -> float:
    """Load the export through transformers (no remote code) and compare its logits with tfm's on a
    batch of random ids with padding; the largest difference, or NotExportable past CHECK_TOLERANCE."""
    from transformers import AutoModelForSeq2SeqLM

    loaded = AutoModelForSeq2SeqLM.from_pretrained(str(directory), trust_remote_code=False).eval()
    cfg = tfm_model.cfg
    generator = torch.Generator().manual_seed(0)
    src = torch.randint(4, cfg.src_vocab_size, (3, 9), generator=generator)
    src[:, -1], src[1, 6:] = EOS_ID, PAD_ID
    src[1, 5] = EOS_ID
    tgt_in = torch.randint(4, cfg.tgt_vocab_size, (3, 7), generator=generator)
    tgt_in[:, 0] = BOS_ID
    with torch.no_grad():
        ours = tfm_model.float()(src, tgt_in)
        theirs = loaded(input_ids=src, attention_mask=(src != PAD_ID).long(), decoder_input_ids=tgt_in).logits
    difference = float((ours - theirs).abs().max())
    if not math.isfinite(difference) or difference > CHECK_TOLERANCE:
        raise NotExportable(f"transformers' {type(loaded).__name__} computes other logits than tfm's model "
                            f"(largest difference {difference:.3g})")
    return difference


def is_previous_export(directory: Path) -> bool:
    """What tfm export --format huggingface wrote: only its files, and a config.json with its `tfm`
    section (a model directory downloaded from the Hub has the same file names)."""
    names = {p.name for p in directory.iterdir()}
    if not {"config.json", "model.safetensors", "tokenizer_config.json"} <= names <= EXPORT_FILES:
        return False
    try:
        return isinstance(json.loads((directory / "config.json").read_text(encoding="utf-8")).get("tfm"), dict)
    except (OSError, ValueError, AttributeError):
        return False


@dataclass
class HuggingFaceExport:
    directory: Path
    architecture: str  # the transformers class
    parameters: int
    largest_difference: float  # tfm's logits against transformers' on the check batch


def transformers_logging():  # noqa: ANN201 (transformers' logging module, imported where it is used)
    from transformers.utils import logging

    return logging


def export_huggingface(checkpoint: str | Path, output: str | Path, force: bool = False) -> HuggingFaceExport:
    """Write `output`: the transformers model directory of `checkpoint` (see the module's text), with
    its model card. Built in a staging directory beside `output`, checked by loading it back, and
    moved into place only when complete; a previous export that `force` replaces goes after that."""
    from ..experiment.checkpoint import load_trained_model

    output, checkpoint = Path(output), Path(checkpoint)
    check_export_directory(output, checkpoint, force, is_previous_export)
    trained = load_trained_model(checkpoint)
    cfg = trained.model.cfg
    problems = architecture_problems(cfg)
    if problems:
        raise NotExportable(f"cannot export to Hugging Face: {'; '.join(problems)}")
    scores = test_scores(checkpoint)  # before any work: a model card without a test score is refused
    pieces = {side: [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
              for side, sp in (("src", trained.src_sp), ("tgt", trained.tgt_sp))}
    model = build_transformers_model(cfg, trained.config, transformers_state(trained.model))
    staging = staging_directory(output)
    try:
        try:
            transformers_logging().disable_progress_bar()  # "Writing model shards": a bar on tfm's console
            model.save_pretrained(str(staging), safe_serialization=True)
        except OSError:
            raise
        except Exception as exc:  # noqa: BLE001 (safetensors writes in Rust: a full disk is its SafetensorError)
            raise TfmError(f"{output}: could not be written ({str(exc).strip().splitlines()[0][:200]})") from None
        write_tokenizer(staging, trained.spm_files, pieces, trained.config, cfg.max_positions)
        difference = check_equal_computation(trained.model, staging)
        card = model_card(checkpoint, trained.config, cfg, ARCHITECTURES[cfg.norm_position][1],
                          trained.model.num_parameters(), trained.progress, scores, output)
        (staging / "README.md").write_text(card, encoding="utf-8")
        replace_with_staged(staging, output)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return HuggingFaceExport(output, ARCHITECTURES[cfg.norm_position][1], trained.model.num_parameters(), difference)
