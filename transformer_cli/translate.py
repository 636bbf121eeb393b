"""Stage 4, prediction: a trained model → translations; batched, order-preserving, streaming.

Two engines translate: tfm's own (`Translator`, torch) and CTranslate2 (ct2.py). Both are a
`TranslationEngine`: they tokenize, search and detokenize in their own way, and share everything
around that here: empty lines, over-long lines, the n-best record, chunked streaming.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import IO

import torch
from tqdm import tqdm

from .alignment import word_alignments
from .budget import check_decoding_budget
from .checkpoint import load_trained_model
from .config import (
    DecodeConfig,
    apply_override,
    check_inference_overrides,
    config_from_dict,
)
from .console import warn, write_fully
from .cpu import denormals_flushed_to_zero, keep_freed_memory
from .cpu_inference import pack_linear_layers, quantize_int8
from .data import BOS_ID, EOS_ID, pad_batch
from .decoding import Hypothesis, Sampling, beam_search, greedy_search, greedy_search_continuous, sample_search
from .devices import is_out_of_memory, resolve_device, split_on_out_of_memory
from .ensemble import load_ensemble
from .errors import TfmError
from .model import Transformer, TransformerConfig
from .precision import choose_decoding_precision
from .workers import DecodingWorkers, resolve_workers


@dataclass
class Translation:
    text: str
    score: float  # the search's score: length-normalised log-probability (greedy: the plain sum)
    n_tokens: int
    alignment: str | None = None  # "i-j i-j …" source word i ~ target word j (0-based), when asked for


class TranslationEngine:
    """Raw text in, detokenized text out. An engine provides `tokenize`, `search` and `detokenize`,
    its `decode` settings and `max_source_tokens`; `translate` is the same for every engine."""

    decode: DecodeConfig
    max_source_tokens: int  # per line, </s> excluded: longer lines are cut, with a warning
    decoding_processes: int = 1  # processes that have decoded so far

    def tokenize(self, lines: list[str]) -> list[list]:
        raise NotImplementedError

    def search(self, sources: list[list], beam: int, nbest: int, decode: DecodeConfig) -> list[list[Hypothesis]]:
        """Tokenized sources → per sentence its n-best hypotheses (tokens as `tokenize` gives them),
        under `decode`'s settings (sampling, length limits)."""
        raise NotImplementedError

    def align(self, lines: list[str], sources: list[list], hyps: list[list[Hypothesis]],
              decode: DecodeConfig) -> list[list[str]]:
        """Per sentence, per hypothesis its word alignment in Pharaoh format ("i-j …")."""
        raise TfmError("word alignments (--alignment) come from tfm's own engine: use --engine torch")

    def detokenize(self, tokens: list) -> str:
        raise NotImplementedError

    def close(self) -> None:
        """Release what the engine started (worker processes, threads); it also ends at exit."""

    def translate(self, lines: list[str], beam: int | None = None, nbest: int = 1,
                  first_line: int = 1, decode: DecodeConfig | None = None,
                  warn_long: bool = True) -> list[list[Translation]]:
        """Per input line its n-best translations (n samples with decode.sample); empty (or blank)
        lines give empty output. `decode` replaces the engine's settings for this call.

        A line longer than the model's positions is cut with a warning naming it (`first_line` is
        the number of `lines[0]` in the user's input; `warn_long=False`: silently, as a server does,
        whose log one client must not flood).
        """
        decode = self.decode if decode is None else decode
        beam = decode.beam if beam is None else beam
        nonempty = [i for i, line in enumerate(lines) if line.strip()]
        sources = self.tokenize([lines[i] for i in nonempty]) if nonempty else []
        if warn_long:
            warn_long_lines(nonempty, sources, self.max_source_tokens, first_line)
        hyps = self.search(sources, max(beam, 1), nbest, decode) if sources else []
        alignments = (self.align([lines[i] for i in nonempty], sources, hyps, decode) if decode.alignment and sources
                      else [[None] * len(h) for h in hyps])
        empty = Translation("", 0.0, 0, "" if decode.alignment else None)
        out: list[list[Translation]] = [[empty] * max(nbest, 1) for _ in lines]
        for i, h, a in zip(nonempty, hyps, alignments):
            out[i] = [Translation(self.detokenize(x.tokens), x.score, len(x.tokens), pairs) for x, pairs in zip(h, a)]
        return out


def warn_long_lines(numbers: list[int], encoded: list[list], limit: int, first_line: int) -> None:
    """A warning for each input line with more than `limit` tokens (decoding keeps the first `limit`)."""
    for i, tokens in zip(numbers, encoded):
        if len(tokens) > limit:
            warn(f"warning: input line {first_line + i} has {len(tokens)} tokens, more than the model's "
                 f"{limit}: only the first {limit} are translated")


# --------------------------------------------------------------------------- tfm's own engine


class Translator(TranslationEngine):
    """A trained model plus its sentencepiece models, decoding with tfm's own search.

    The model is moved to `device` and prepared for inference in place (bf16 cast, packed or int8
    linear layers): pass a model of its own, not one still being trained.
    """

    def __init__(self, model: Transformer, src_sp, tgt_sp, decode: DecodeConfig, device: torch.device):
        self.model, self.src_sp, self.tgt_sp, self.decode, self.device = model, src_sp, tgt_sp, decode, device
        self.max_source_tokens = model.cfg.max_positions - 2  # room for </s>
        model.to(device).eval()
        if decode.precision == "int8" and device.type != "cpu":
            raise TfmError("int8 decoding (--quantize int8 / decode.precision=int8) runs on CPU only: "
                           "add --device cpu")
        self.precision = choose_decoding_precision(decode.precision, device, (model.cfg.d_model, model.cfg.d_ff))
        if self.precision.int8:
            self.model = quantize_int8(model)
        else:
            if self.precision.bf16:
                model.to(torch.bfloat16)  # scores are still accumulated in fp32 (decoding.py)
            if device.type == "cpu":
                pack_linear_layers(model)
        if device.type == "cpu":
            keep_freed_memory()
        self.workers: DecodingWorkers | None = None  # started by the first search
        # Bytes a search may take (budget.py); None: no check. `tfm translate` sets it.
        self.memory_limit: int | None = None

    @classmethod
    def from_checkpoint(cls, path: str | Path | list[str | Path], decode: DecodeConfig | None = None,
                        device: str = "auto", overrides: list[str] | None = None,
                        precision: str | None = None) -> Translator:
        """`path`: a checkpoint, or several (an ensemble: the first one's settings). `decode` replaces
        the checkpoint's decode settings; `overrides` (`decode.beam=4`…) edit them; `precision` (fp32,
        bf16, int8, auto), when given, replaces the resulting decode.precision."""
        dev = resolve_device(device)
        paths = path if isinstance(path, (list, tuple)) else [path]
        trained = load_trained_model(paths[0]) if len(paths) == 1 else load_ensemble(paths)
        config = trained.config
        if overrides:
            check_inference_overrides(overrides, config)
            raw = config.model_dump(mode="json")
            for assignment in overrides:
                apply_override(raw, assignment)
            config = config_from_dict(raw, f"{path} (with --set)")
        decode = decode or config.decode
        if precision is not None:
            decode = DecodeConfig.model_validate({**decode.model_dump(), "precision": precision})
        return cls(trained.model, trained.src_sp, trained.tgt_sp, decode, dev)

    @property
    def decoding_processes(self) -> int:
        """Processes that have decoded so far: 1 until the workers start (a chunk of ≥ 2 batches)."""
        return self.workers.processes if self.workers is not None and self.workers.started else 1

    def close(self) -> None:
        if self.workers is not None:
            self.workers.close()
            self.workers = None

    def tokenize(self, lines: list[str]) -> list[list[int]]:
        return self.src_sp.encode(lines, out_type=int)

    def detokenize(self, tokens: list[int]) -> str:
        return self.tgt_sp.decode(tokens)

    def decoding_workers(self) -> DecodingWorkers:
        """The processes that decode batches (decode.workers); they start at the first search of two
        or more batches, or with `.start()`."""
        if self.workers is None:  # decode.workers is read here: the CLI edits decode after loading
            processes = resolve_workers(self.decode.workers, self.device)
            self.workers = DecodingWorkers(partial(decode_batches, self.model, self.device), processes)
        return self.workers

    def search(self, sources: list[list[int]], beam: int, nbest: int,
               decode: DecodeConfig | None = None) -> list[list[Hypothesis]]:
        decode = decode or self.decode
        check_decoding_budget(self.member_configs, decode, len(sources), max(map(len, sources), default=0),
                              self.memory_limit, beam=beam, nbest=nbest, processes=self.decoding_workers().processes)
        return decode_in_batches(self.model, sources, decode, self.device, beam, nbest,
                                 workers=self.decoding_workers())

    def check_budget(self, lines: list[str], decode: DecodeConfig) -> None:
        """A TfmError, naming the setting, where `translate(lines, decode=decode)` could take more than
        `memory_limit` (budget.py); checked before the call joins a batch (`tfm serve`)."""
        if self.memory_limit is None:
            return
        sources = self.tokenize([line for line in lines if line.strip()])
        check_decoding_budget(self.member_configs, decode, len(sources), max(map(len, sources), default=0),
                              self.memory_limit, beam=decode.beam, nbest=decode.nbest,
                              processes=self.decoding_workers().processes)

    @property
    def member_configs(self) -> list[TransformerConfig]:
        """The model's config, or each of an ensemble's (each keeps its own caches)."""
        return [m.cfg for m in getattr(self.model, "members", [self.model])]

    def align(self, lines: list[str], sources: list[list[int]], hyps: list[list[Hypothesis]],
              decode: DecodeConfig) -> list[list[str]]:
        return word_alignments(self.model, lines, sources, hyps, self.src_sp, self.tgt_sp, decode, self.device)


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


def balanced_batches(batches: list[list[int]], batch_tokens: int | None, lengths: list[int]) -> list[list[int]]:
    """As many batches as `batches`, each dealt every len(batches)-th sentence of their length order
    (longest first), so that each holds long and short ones alike and batches decoded in parallel
    take about as long. `batches` as they are where that would break the token cap."""
    order = [i for batch in batches for i in batch]
    dealt = [order[j :: len(batches)] for j in range(len(batches))]
    if batch_tokens is not None and any(lengths[b[0]] * len(b) > batch_tokens for b in dealt):
        return batches
    return dealt


def decode_in_batches(
    model: Transformer, sources: list[list[int]], decode: DecodeConfig, device: torch.device,
    beam: int | None = None, nbest: int = 1, min_len: int = 0, max_len: int | None = None,
    workers: DecodingWorkers | None = None,
) -> list[list[Hypothesis]]:
    """Translate id sequences (no <eos>) → per sentence its n-best hypotheses, in input order:
    sources longer than the model's positions are cut, the rest grouped into length-sorted batches
    (`decode.batch_size`, `decode.batch_tokens`) and decoded by `workers` (CPU processes made for this
    `model`; None: this process). `min_len`/`max_len` force the output length (benchmarks with
    untrained weights).
    """
    beam = decode.beam if beam is None else beam
    limit_positions = model.cfg.max_positions - 1
    sources = [s[: limit_positions - 1] + [EOS_ID] for s in sources]  # source too long → truncated
    results: list[list[Hypothesis]] = [[] for _ in sources]
    max_len_a, max_len_b = (0.0, max_len) if max_len is not None else (decode.max_len_a, decode.max_len_b)
    sampling = Sampling(decode.temperature, decode.top_k, decode.top_p, decode.seed) if decode.sample else None
    search = (beam, decode.length_penalty, max_len_a, max_len_b, nbest, min_len, sampling)
    batches = length_sorted_batches([len(s) for s in sources], decode.batch_size, decode.batch_tokens)
    if decode.batching == "balanced" and len(batches) > 1:
        batches = balanced_batches(batches, decode.batch_tokens, [len(s) for s in sources])
        tasks = [[b] for b in batches]  # one batch per task: they decode side by side
    else:
        tasks = decoding_tasks(batches, continuous=beam <= 1 and sampling is None)
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
                   min_len: int, sampling: Sampling | None = None) -> list[list[list[Hypothesis]]]:
    """A task: batches of id sequences (each ending in <eos>), longest first → per batch, per sentence its
    n-best hypotheses (`nbest` samples with `sampling`). Greedy decodes them with continuous batching
    (`greedy_search_continuous`), beam search and sampling one batch after the other; a batch that runs
    out of memory is retried in halves."""

    def padded(rows: list[list[int]]) -> torch.Tensor:
        return pad_batch(rows).to(device)

    def search(sources: list[list[int]], rows: list[int]) -> list[list[Hypothesis]]:
        src = padded([sources[i] for i in rows])
        if sampling is not None:
            return sample_search(model, src, BOS_ID, EOS_ID, sampling, nbest, max_len_a, max_len_b, min_len)
        if beam <= 1:
            return [[h] for h in greedy_search(model, src, BOS_ID, EOS_ID, max_len_a, max_len_b, min_len)]
        return beam_search(model, src, BOS_ID, EOS_ID, beam, alpha, max_len_a, max_len_b, nbest, min_len)

    def halved(size: int) -> None:
        warn(f"warning: out of memory translating a batch of {size} sentences: retrying it in halves "
             "(lower decode.batch_size to avoid this)")

    def one_by_one() -> list[list[list[Hypothesis]]]:
        return [split_on_out_of_memory(partial(search, b), list(range(len(b))), halved) for b in batches]

    with denormals_flushed_to_zero():
        if beam > 1 or sampling is not None or len(batches) == 1:
            return one_by_one()
        srcs = [padded(b) for b in batches]
        try:
            found = greedy_search_continuous(model, srcs, BOS_ID, EOS_ID, max_len_a, max_len_b, min_len)
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            return one_by_one()  # the batches alone, halved where they still do not fit
        return [[[h] for h in hyps] for hyps in found]


# --------------------------------------------------------------------------- streaming


def read_decoded_lines(stream: IO[bytes], warnings: IO[str], name: str = "standard input") -> Iterator[str]:
    """Lines of a byte stream as text; invalid UTF-8 is replaced (U+FFFD) with a warning, never a
    crash. UTF-16 (a byte-order mark at the start) is refused: read as UTF-8 it would be garbage."""
    for number, raw in enumerate(stream, start=1):
        if number == 1 and raw.startswith((b"\xff\xfe", b"\xfe\xff")):
            raise TfmError(f"{name} is UTF-16 text (it starts with a UTF-16 byte-order mark): tfm reads UTF-8; "
                           f"convert it first, e.g. iconv -f UTF-16 -t UTF-8")
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


def with_alignment(translation: Translation) -> str:
    """The translation, and after a tab its word alignment when there is one."""
    return translation.text if translation.alignment is None else f"{translation.text}\t{translation.alignment}"


def format_nbest(index: int, translations: list[Translation]) -> list[str]:
    """n-best format: `<0-based input line>\\t<rank>\\t<score>\\t<translation>[\\t<alignment>]`, one
    hypothesis a line."""
    return [f"{index}\t{rank}\t{t.score:.4f}\t{with_alignment(t)}" for rank, t in enumerate(translations, start=1)]


CHUNK_LINES = 1000  # lines translated together (length-sorted into batches) after the first batch


def input_chunks(engine: TranslationEngine, lines: Iterable[str]) -> Iterator[list[str]]:
    """The chunks every command translates a text in: the first one batch (output starts early),
    then CHUNK_LINES lines. Batching depends on this, and bf16 results on batching: `translate` and
    `evaluate` take the same chunks, so they give the same translations."""
    return chunks(lines, min(CHUNK_LINES, engine.decode.batch_size), CHUNK_LINES)


def translate_stream(engine: TranslationEngine, lines: Iterable[str], output: IO[str], beam: int | None = None,
                     nbest: int = 1, progress: bool = False) -> StreamStats:
    """Translate an (endless) stream of lines chunk by chunk, writing and flushing after each."""
    stats = StreamStats()
    started = time.perf_counter()
    bar = tqdm(desc="translate", unit="sent", file=sys.stderr, disable=not progress)
    for chunk in input_chunks(engine, lines):
        results = engine.translate(chunk, beam=beam, nbest=nbest, first_line=stats.sentences + 1)
        texts = []
        for offset, translations in enumerate(results):
            if nbest > 1:
                texts.extend(format_nbest(stats.sentences + offset, translations))
            else:
                texts.append(with_alignment(translations[0]))
            stats.tokens += translations[0].n_tokens
        write_fully(output, "\n".join(texts) + "\n")  # a full disk: an OSError naming the file
        stats.sentences += len(chunk)
        bar.update(len(chunk))
    bar.close()
    stats.seconds = time.perf_counter() - started
    return stats


def translate_texts(engine: TranslationEngine, lines: list[str], beam: int | None = None) -> list[str]:
    """The best translation of each line, in the chunks `translate_stream` takes."""
    texts: list[str] = []
    for chunk in input_chunks(engine, lines):
        texts += [t[0].text for t in engine.translate(chunk, beam=beam, first_line=len(texts) + 1)]
    return texts
