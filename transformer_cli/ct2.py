"""CTranslate2: `tfm export --format ctranslate2` (a tfm checkpoint → a CTranslate2 model directory)
and `tfm translate --engine ctranslate2` (that directory as a TranslationEngine, like tfm's own).

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

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import sentencepiece as spm
import torch

from .checkpoint import load_trained_model
from .config import (
    DecodeConfig,
    apply_override,
    check_inference_overrides,
    config_from_dict,
)
from .data import BOS_ID, EOS_ID, UNK_ID
from .decoding import Hypothesis
from .errors import TfmError
from .model import Transformer, TransformerConfig
from .translate import TranslationEngine
from .workers import resolve_workers

INSTALL_HINT = "ctranslate2 is not installed: pip install -e '.[ct2]' (or pip install ctranslate2)"
SRC_SPM, TGT_SPM, TFM_JSON = "source.spm.model", "target.spm.model", "tfm_decode.json"
SPECIAL_PIECES = {UNK_ID: "<unk>", BOS_ID: "<s>", EOS_ID: "</s>"}


def import_ctranslate2() -> Any:
    try:
        import ctranslate2
    except ImportError:
        raise TfmError(INSTALL_HINT) from None
    return ctranslate2


def check_convertible(cfg: TransformerConfig, src_sp: spm.SentencePieceProcessor,
                      tgt_sp: spm.SentencePieceProcessor) -> None:
    """Refuse, with the reason, what a CTranslate2 TransformerSpec cannot express."""
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
        for token_id, piece in SPECIAL_PIECES.items():
            if token_id >= sp.vocab_size() or sp.id_to_piece(token_id) != piece:
                found = sp.id_to_piece(token_id) if token_id < sp.vocab_size() else "nothing"
                problems.append(f"{side} vocabulary id {token_id} is {found!r}, not {piece!r} "
                                "(CTranslate2 finds special tokens by their text)")
    if problems:
        raise TfmError("cannot export to CTranslate2: " + "; ".join(problems))


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().cpu().numpy().copy()


def _linear(spec: Any, *layers: torch.nn.Linear) -> None:
    """One LinearSpec from one Linear, or from several stacked along the output dimension."""
    spec.weight = np.concatenate([_np(layer.weight) for layer in layers])  # (out, in)
    if all(layer.bias is not None for layer in layers):
        spec.bias = np.concatenate([_np(layer.bias) for layer in layers])


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


def check_output_directory(output: Path, checkpoint: Path, force: bool) -> None:
    """The export may be written to `output`: a new or empty directory, or, with `force`, a previous
    export. Never a file, the working directory or one of its parents, a directory that holds the
    checkpoint (a run directory, its checkpoints/), or any other directory with files in it."""
    if not output.exists():
        return
    if not output.is_dir():
        raise TfmError(f"{output} exists and is not a directory: choose a new directory for the export")
    target, cwd = output.resolve(), Path.cwd().resolve()
    if target == cwd or target in cwd.parents:
        raise TfmError(f"{output} is the working directory or one of its parents: export into a new directory")
    if target in checkpoint.resolve().parents:
        raise TfmError(f"{output} holds the checkpoint {checkpoint}: export into a new directory")
    if not any(output.iterdir()):
        return
    if not is_previous_export(output):
        raise TfmError(f"{output} is not empty and is not a previous tfm export (--force replaces only an "
                       "export directory): choose a new directory")
    if not force:
        raise TfmError(f"{output} already holds an export (--force to replace it)")


def export_ctranslate2(checkpoint: str | Path, output: str | Path, force: bool = False) -> Path:
    """Write a CTranslate2 model directory: model.bin, the vocabularies, both sentencepiece
    models and tfm's decode settings (beam, length limits) for `tfm translate --engine ctranslate2`.

    The export is built in a staging directory beside `output` and moved into place only once it
    is complete; a previous export that `force` replaces is removed after that."""
    output, checkpoint = Path(output), Path(checkpoint)
    check_output_directory(output, checkpoint, force)
    import_ctranslate2()
    trained = load_trained_model(checkpoint)
    model, config, src_sp, tgt_sp = trained.model.float(), trained.config, trained.src_sp, trained.tgt_sp
    src_bytes, tgt_bytes = trained.spm_files["src"], trained.spm_files["tgt"]
    check_convertible(model.cfg, src_sp, tgt_sp)
    spec = build_spec(model, _pieces(src_sp), _pieces(tgt_sp))
    try:
        spec.validate()
    except ValueError as exc:  # a spec variable we left unset or gave the wrong shape: a tfm bug
        raise RuntimeError(f"CTranslate2 spec validation failed: {exc}") from exc
    spec.optimize(quantization=None)  # weights stay fp32; `--compute-type` picks int8 etc. at load time

    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
    replaced = staging.with_name(staging.name + ".old")
    try:
        spec.save(str(staging))
        (staging / SRC_SPM).write_bytes(src_bytes)
        (staging / TGT_SPM).write_bytes(tgt_bytes)
        (staging / TFM_JSON).write_text(json.dumps({"decode": config.decode.model_dump(mode="json"),
                                                    "max_positions": model.cfg.max_positions,
                                                    "checkpoint": str(checkpoint)}, indent=2) + "\n")
        if output.exists():  # an empty directory, or a previous export (checked above)
            output.rename(replaced)
        try:
            staging.rename(output)
        except OSError:
            if replaced.exists():
                replaced.rename(output)
            raise
    except OSError as exc:  # a full disk: name the directory the user asked for, not the staging one
        raise OSError(exc.errno, exc.strerror, str(output)) from None
    finally:
        for leftover in (staging, replaced):
            if leftover.exists():
                shutil.rmtree(leftover)
    return output


# --------------------------------------------------------------------------- translating


class CT2Translator(TranslationEngine):
    """An exported directory as a TranslationEngine, so `translate_stream` gives the same
    streaming, order, empty-line and long-line behaviour as tfm's own engine.

    Differences from tfm's own search, by design of CTranslate2:
    - length penalty: CTranslate2 divides the score by len**alpha, tfm by ((5 + len) / 6)**alpha
      (GNMT); decode.length_penalty is passed through as alpha, so with alpha = 0 both rank
      hypotheses by the plain sum of log-probabilities. Reported scores follow CTranslate2's rule.
    - length limit: tfm allows max_len_a * src_len + max_len_b tokens per sentence; CTranslate2 takes
      one limit per call, so each batch gets the limit of its longest source.
    """

    def __init__(self, model_dir: str | Path, device: str = "cpu", compute_type: str = "default",
                 threads: int = 0, decode: DecodeConfig | None = None, overrides: list[str] | None = None):
        """`decode` replaces the exported decode settings; `overrides` (`decode.beam=4`…) edit them."""
        ctranslate2 = import_ctranslate2()
        model_dir = Path(model_dir)
        if not (model_dir / "model.bin").is_file():
            raise TfmError(f"{model_dir}: not a CTranslate2 model directory (no model.bin; "
                           "create one with tfm export --format ctranslate2)")
        for name in (SRC_SPM, TGT_SPM):
            if not (model_dir / name).is_file():
                raise TfmError(f"{model_dir}: {name} is missing (export with tfm export)")
        device = "cuda" if device == "auto" and ctranslate2.get_cuda_device_count() > 0 else (
            "cpu" if device == "auto" else device)
        supported = ctranslate2.get_supported_compute_types(device)
        if compute_type != "default" and compute_type not in supported:
            raise TfmError(f"--compute-type {compute_type} is not supported on this {device} "
                           f"(supported: {', '.join(sorted(supported))})")
        exported = json.loads((model_dir / TFM_JSON).read_text()) if (model_dir / TFM_JSON).is_file() else {}
        if decode is None:
            raw = {"decode": exported.get("decode", {})}
            check_inference_overrides(overrides or [])
            for assignment in overrides or []:
                apply_override(raw, assignment)
            decode = config_from_dict(raw, f"{model_dir / TFM_JSON} (with --set)").decode
        self.decode = decode
        self._settings = {"model_path": str(model_dir), "device": device, "compute_type": compute_type}
        self.threads, self.decoding_processes = threads, 1
        self._translator = None  # opened by the first translation, with the decode.workers set by then
        self.src_sp = spm.SentencePieceProcessor(model_file=str(model_dir / SRC_SPM))
        self.tgt_sp = spm.SentencePieceProcessor(model_file=str(model_dir / TGT_SPM))
        # tfm keeps at most max_positions - 1 source tokens, </s> included (decode_in_batches).
        max_positions = int(exported.get("max_positions", 1025))
        self.max_input_length, self.max_source_tokens = max_positions - 1, max_positions - 2

    def tokenize(self, lines: list[str]) -> list[list[str]]:
        return self.src_sp.encode(lines, out_type=str)

    def detokenize(self, tokens: list[str]) -> str:
        return self.tgt_sp.decode_pieces(tokens)

    def search(self, pieces: list[list[str]], beam: int, nbest: int = 1, decode: DecodeConfig | None = None,
               max_len: int | None = None) -> list[list[Hypothesis]]:
        """Sentencepiece pieces (no </s>) → per sentence its n-best hypotheses (pieces, score), in input order."""
        decode = decode or self.decode
        if decode.sample:
            raise TfmError("sampling (--sample) is done by tfm's own engine: use --engine torch")
        if self._translator is None:
            # decode.workers → CTranslate2's inter_threads (batches decoded at once), one thread each.
            workers = resolve_workers(self.decode.workers, torch.device(self._settings["device"]))
            # CTranslate2 sets the calling thread's OpenMP thread count to intra_threads, which is
            # torch's too: torch's own work in this process (training, tfm's engine) keeps its count.
            torch_threads = torch.get_num_threads()
            self._translator = import_ctranslate2().Translator(
                **self._settings, inter_threads=workers, intra_threads=1 if workers > 1 else self.threads)
            torch.set_num_threads(torch_threads)
            self.decoding_processes = workers
        results: list[list[Hypothesis]] = [[] for _ in pieces]
        order = sorted(range(len(pieces)), key=lambda i: -len(pieces[i]))  # similar lengths together
        step = decode.batch_size
        submitted = []
        for start in range(0, len(order), step):
            batch = order[start : start + step]
            longest = max(len(pieces[i]) for i in batch) + 1  # + the </s> CTranslate2 appends
            limit = max_len if max_len is not None else int(decode.max_len_a * longest) + decode.max_len_b
            # Asynchronous: with several workers (inter_threads) CTranslate2 decodes batches in parallel.
            submitted.append((batch, self._translator.translate_batch(
                [pieces[i] for i in batch], beam_size=beam, num_hypotheses=nbest,
                length_penalty=decode.length_penalty if beam > 1 else 0.0,
                max_decoding_length=max(limit, 1), max_input_length=self.max_input_length,
                return_scores=True, asynchronous=True)))
        for batch, futures in submitted:
            for i, future in zip(batch, futures):
                result = future.result()
                results[i] = [Hypothesis(tokens, score) for tokens, score in zip(result.hypotheses, result.scores)]
        return results
