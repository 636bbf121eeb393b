"""Stage 4, prediction: checkpoint → Translator; batched, order-preserving, streaming translation."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import IO

import sentencepiece as spm
import torch
from tqdm import tqdm

from .checkpoint import load_checkpoint, model_from_checkpoint, tensor_to_bytes
from .config import DecodeConfig, ExperimentConfig, apply_override, config_from_dict
from .console import warn, write_fully
from .cpu import denormals_flushed_to_zero, keep_freed_memory
from .cpu_inference import pack_linear_layers, quantize_int8
from .data import BOS_ID, EOS_ID
from .decoding import Hypothesis, beam_search, greedy_search, greedy_search_continuous
from .devices import is_out_of_memory, resolve_device, split_on_out_of_memory
from .errors import TfmError
from .model import Transformer
from .precision import PrecisionChoice, choose_precision
from .workers import DecodingWorkers, resolve_workers


def length_sorted_batches(lengths: list[int], batch_size: int, batch_tokens: int | None) -> list[list[int]]:
    """Indices grouped into batches of similar length (longest first), capped by sentences and tokens."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        width = lengths[current[0]] if current else lengths[i]  # longest in batch comes first
        too_many_tokens = batch_tokens is not None and current and width * (len(current) + 1) > batch_tokens
        if current and (len(current) >= batch_size or too_many_tokens):
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def decode_token_ids(
    model: Transformer, sources: list[list[int]], decode: DecodeConfig, device: torch.device,
    beam: int | None = None, nbest: int = 1, min_len: int = 0, max_len: int | None = None,
    workers: DecodingWorkers | None = None,
) -> list[list[Hypothesis]]:
    """Translate id sequences (no <eos>) → per sentence its n-best hypotheses, in input order.

    `min_len`/`max_len` force the output length (benchmarks with untrained weights). `workers`
    (CPU) decodes the batches in parallel processes; they must have been made for this `model`.
    """
    beam = decode.beam if beam is None else beam
    limit_positions = model.cfg.max_positions - 1
    sources = [s[: limit_positions - 1] + [EOS_ID] for s in sources]  # source too long → truncated
    results: list[list[Hypothesis]] = [[] for _ in sources]
    max_len_a, max_len_b = (0.0, max_len) if max_len is not None else (decode.max_len_a, decode.max_len_b)
    search = (beam, decode.length_penalty, max_len_a, max_len_b, nbest, min_len)
    batches = length_sorted_batches([len(s) for s in sources], decode.batch_size, decode.batch_tokens)
    tasks = decoding_tasks(batches, continuous=beam <= 1)
    if workers is None:
        workers = DecodingWorkers(partial(decode_batches, model, device), processes=1)
    was_training = model.training
    model.eval()
    try:
        for task, task_hyps in zip(tasks, workers.map(([[sources[i] for i in b] for b in task], *search)
                                                      for task in tasks)):
            for batch, hyps in zip(task, task_hyps):
                for i, h in zip(batch, hyps):
                    results[i] = h
    finally:
        model.train(was_training)
    return results


CONTINUOUS_BATCHES = 8  # batches per continuous-batching task (greedy)


def decoding_tasks(batches: list[list[int]], continuous: bool) -> list[list[list[int]]]:
    """Batches (longest first) → tasks of batches for the workers. Greedy decodes a task's batches
    with continuous batching, so tasks hold up to CONTINUOUS_BATCHES batches, dealt out in turn
    (task j gets batches j, j + T, …: every task has long and short sentences, still longest
    first); beam search decodes one batch per task. The tasks depend only on the batches, not on
    the number of processes, so every decode.workers setting computes the same rows together."""
    if not continuous:
        return [[b] for b in batches]
    count = -(-len(batches) // CONTINUOUS_BATCHES)
    return [batches[j::count] for j in range(count)]


def decode_batches(model: Transformer, device: torch.device, batches: list[list[list[int]]], beam: int,
                   alpha: float, max_len_a: float, max_len_b: int, nbest: int,
                   min_len: int) -> list[list[list[Hypothesis]]]:
    """A task: batches of id sequences (each ending in <eos>), longest first → per batch, per sentence its
    n-best hypotheses. Greedy decodes them with continuous batching (`greedy_search_continuous`),
    beam search one batch after the other; a batch that runs out of memory is retried in halves."""

    def padded(rows: list[list[int]]) -> torch.Tensor:
        width = max(len(s) for s in rows)
        src = torch.full((len(rows), width), model.cfg.pad_id, dtype=torch.long)
        for row, s in enumerate(rows):
            src[row, : len(s)] = torch.tensor(s)
        return src.to(device)

    def search(sources: list[list[int]], rows: list[int]) -> list[list[Hypothesis]]:
        src = padded([sources[i] for i in rows])
        if beam <= 1:
            return [[h] for h in greedy_search(model, src, BOS_ID, EOS_ID, max_len_a, max_len_b, min_len)]
        return beam_search(model, src, BOS_ID, EOS_ID, beam, alpha, max_len_a, max_len_b, nbest, min_len)

    def halved(size: int) -> None:
        warn(f"warning: out of memory translating a batch of {size} sentences: retrying it in halves "
             "(lower decode.batch_size to avoid this)")

    def one_by_one() -> list[list[list[Hypothesis]]]:
        return [split_on_out_of_memory(partial(search, b), list(range(len(b))), halved) for b in batches]

    with denormals_flushed_to_zero():
        if beam > 1 or len(batches) == 1:
            return one_by_one()
        srcs = [padded(b) for b in batches]
        try:
            found = greedy_search_continuous(model, srcs, BOS_ID, EOS_ID, max_len_a, max_len_b, min_len)
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            return one_by_one()  # the batches alone, halved where they still do not fit
        return [[[h] for h in hyps] for hyps in found]


@dataclass
class Translation:
    text: str
    score: float
    n_tokens: int


class Translator:
    """A trained model plus its sentencepiece models: raw text in, detokenized text out.

    The model is moved to `device` and, when `decode.precision` resolves to bf16, cast in place:
    pass a model of its own, not one still being trained.
    """

    def __init__(self, model: Transformer, src_sp: spm.SentencePieceProcessor, tgt_sp: spm.SentencePieceProcessor,
                 decode: DecodeConfig, device: torch.device):
        self.model, self.src_sp, self.tgt_sp, self.decode, self.device = model, src_sp, tgt_sp, decode, device
        self.precision = PrecisionChoice(False, "int8 dynamic quantization")
        model.to(device).eval()
        if decode.precision == "int8":
            if device.type != "cpu":
                raise TfmError("int8 decoding (--quantize int8 / decode.precision=int8) runs on CPU only: "
                               "add --device cpu")
            self.model = quantize_int8(model)
        else:
            self.precision = choose_precision(decode.precision, device, (model.cfg.d_model, model.cfg.d_ff))
            if self.precision.bf16:
                model.to(torch.bfloat16)  # scores are still accumulated in fp32 (decoding.py)
            if device.type == "cpu":
                pack_linear_layers(model)
        if device.type == "cpu":
            keep_freed_memory()
        self.workers: DecodingWorkers | None = None  # started by the first translate()

    @classmethod
    def from_checkpoint(cls, path: str | Path, decode: DecodeConfig | None = None,
                        device: str = "auto", overrides: list[str] | None = None,
                        precision: str | None = None) -> Translator:
        """`decode` replaces the checkpoint's decode settings; `overrides` (`decode.beam=4`…) edit them;
        `precision` (fp32, bf16, int8, auto), when given, replaces the resulting decode.precision."""
        dev = resolve_device(device)
        payload = load_checkpoint(path)
        model, config = model_from_checkpoint(payload)
        src_sp, tgt_sp = (spm.SentencePieceProcessor(model_proto=tensor_to_bytes(payload[key]))
                          for key in ("spm_src", "spm_tgt"))
        for side, sp, size in (("source", src_sp, model.cfg.src_vocab_size), ("target", tgt_sp, model.cfg.tgt_vocab_size)):
            if sp.vocab_size() != size:
                raise TfmError(f"{path}: {side} vocabulary has {sp.vocab_size()} pieces but the model expects {size}")
        if overrides:
            raw = config.model_dump(mode="json")
            for assignment in overrides:
                apply_override(raw, assignment)
            config = config_from_dict(raw, f"{path} (with --set)")
        decode = decode or config.decode
        if precision is not None:
            decode = DecodeConfig.model_validate({**decode.model_dump(), "precision": precision})
        return cls(model, src_sp, tgt_sp, decode, dev)

    @property
    def decoding_processes(self) -> int:
        """Processes that have decoded so far: 1 until the workers start (a chunk of ≥ 2 batches)."""
        return self.workers.processes if self.workers is not None and self.workers.started else 1

    def close(self) -> None:
        """Stop the decoding worker processes, if any were started (they also stop at exit)."""
        if self.workers is not None:
            self.workers.close()
            self.workers = None

    def translate(self, lines: list[str], beam: int | None = None, nbest: int = 1,
                  min_len: int = 0, max_len: int | None = None, first_line: int = 1) -> list[list[Translation]]:
        """Per input line its n-best translations; empty (or blank) lines give empty output.

        A line longer than the model's positions is truncated with a warning naming it
        (`first_line` is the number of `lines[0]` in the user's input).
        """
        nonempty = [i for i, line in enumerate(lines) if line.strip()]
        ids = self.src_sp.encode([lines[i] for i in nonempty], out_type=int) if nonempty else []
        warn_long_lines(nonempty, ids, self.model.cfg.max_positions - 2, first_line)  # room for </s>
        if self.workers is None:  # decode.workers is read here: the CLI edits decode after loading
            processes = resolve_workers(self.decode.workers, self.device)
            self.workers = DecodingWorkers(partial(decode_batches, self.model, self.device), processes)
        hyps = decode_token_ids(self.model, ids, self.decode, self.device, beam, nbest, min_len, max_len,
                                self.workers)
        out: list[list[Translation]] = [[Translation("", 0.0, 0)] * max(nbest, 1) for _ in lines]
        for i, h in zip(nonempty, hyps):
            out[i] = [Translation(self.tgt_sp.decode(x.tokens), x.score, len(x.tokens)) for x in h]
        return out


def warn_long_lines(numbers: list[int], encoded: list[list], limit: int, first_line: int) -> None:
    """A warning for each input line with more than `limit` tokens (decoding keeps the first `limit`)."""
    for i, tokens in zip(numbers, encoded):
        if len(tokens) > limit:
            warn(f"warning: input line {first_line + i} has {len(tokens)} tokens, more than the model's "
                 f"{limit}: only the first {limit} are translated")


# --------------------------------------------------------------------------- streaming


def read_decoded_lines(stream: IO[bytes], warnings: IO[str]) -> Iterator[str]:
    """Lines of a byte stream as text; invalid UTF-8 is replaced (U+FFFD) with a warning, never a crash."""
    for number, raw in enumerate(stream, start=1):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            text = raw.decode("utf-8", errors="replace")
            warn(f"warning: input line {number} is not valid UTF-8 ({exc.reason}); "
                 "invalid bytes replaced with U+FFFD", warnings)
        if number == 1 and text.startswith("\ufeff"):
            text = text[1:]  # a UTF-8 byte-order mark (Windows editors) is not part of the text
        yield text.rstrip("\r\n")


def chunks(lines: Iterable[str], first: int, rest: int) -> Iterator[list[str]]:
    """The first chunk small (output starts early), later ones larger (better length sorting)."""
    chunk: list[str] = []
    size = first
    for line in lines:
        chunk.append(line)
        if len(chunk) >= size:
            yield chunk
            chunk, size = [], rest
    if chunk:
        yield chunk


@dataclass
class StreamStats:
    sentences: int = 0
    tokens: int = 0
    seconds: float = 0.0


def format_nbest(index: int, translations: list[Translation]) -> list[str]:
    """n-best format: `<0-based input line>\\t<rank>\\t<score>\\t<translation>`, one hypothesis a line."""
    return [f"{index}\t{rank}\t{t.score:.4f}\t{t.text}" for rank, t in enumerate(translations, start=1)]


def translate_stream(
    translator: Translator, lines: Iterable[str], output: IO[str], beam: int | None = None, nbest: int = 1,
    chunk_lines: int = 1000, progress: bool = False,
) -> StreamStats:
    """Translate an (endless) stream of lines chunk by chunk, writing and flushing after each."""
    stats = StreamStats()
    started = time.perf_counter()
    bar = tqdm(desc="translate", unit="sent", file=sys.stderr, disable=not progress)
    first = min(chunk_lines, translator.decode.batch_size)
    for chunk in chunks(lines, first, chunk_lines):
        results = translator.translate(chunk, beam=beam, nbest=nbest, first_line=stats.sentences + 1)
        texts = []
        for offset, translations in enumerate(results):
            if nbest > 1:
                texts.extend(format_nbest(stats.sentences + offset, translations))
            else:
                texts.append(translations[0].text)
            stats.tokens += translations[0].n_tokens
        write_fully(output, "\n".join(texts) + "\n")  # a full disk: an OSError naming the file
        stats.sentences += len(chunk)
        bar.update(len(chunk))
    bar.close()
    stats.seconds = time.perf_counter() - started
    return stats


def default_checkpoint(config: ExperimentConfig) -> Path:
    """Of the run's checkpoint_avg.pt, checkpoint_ema.pt and checkpoint_best.pt, the one that validated
    best (scores.json, written at the end of training; ties in that order); without scores, the
    average, then the best, then checkpoint_last.pt."""
    ckpt_dir = config.run_path / "checkpoints"
    order = ["checkpoint_avg.pt", "checkpoint_ema.pt", "checkpoint_best.pt"]
    try:
        scores = json.loads((ckpt_dir / "scores.json").read_text(encoding="utf-8"))
        scored = [name for name in order if isinstance(scores.get(name), (int, float)) and (ckpt_dir / name).is_file()]
        if scored:
            return ckpt_dir / max(scored, key=lambda name: (scores[name], -order.index(name)))
    except (OSError, ValueError, AttributeError):
        pass
    for name in ["checkpoint_avg.pt", "checkpoint_best.pt", "checkpoint_last.pt"]:
        if (ckpt_dir / name).is_file():
            return ckpt_dir / name
    raise TfmError(f"no checkpoint in {ckpt_dir}: train first or pass --checkpoint")
