"""Stage 4, prediction, with tfm's own engine: a trained model (or an ensemble) decoded by tfm's
search in torch, in length-sorted batches, on worker processes. What every engine shares (the
`TranslationEngine` interface, streaming) is in translation.py; CTranslate2's engine in ct2_engine.py."""

from __future__ import annotations

import re
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch

from ..data.batches import pad_batch
from ..experiment.checkpoint import load_trained_model
from ..experiment.config import DecodeConfig, apply_override, check_inference_overrides, config_from_dict
from ..model.cpu_inference import pack_linear_layers, quantize_int8
from ..model.lengths import source_token_limit
from ..model.special_tokens import BOS_ID, EOS_ID
from ..model.transformer import Transformer, TransformerConfig
from ..runtime.console import warn
from ..runtime.cpu import denormals_flushed_to_zero, keep_freed_memory
from ..runtime.devices import is_out_of_memory, resolve_device, split_on_out_of_memory
from ..runtime.errors import TfmError
from ..runtime.precision import choose_decoding_precision
from .alignment import word_alignments
from .budget import searches_end_by
from .ensemble import load_ensemble
from .hypothesis import Hypothesis
from .search import SearchSettings, beam_search, greedy_search, greedy_search_continuous, sample_search
from .terms import TermIds
from .translation import TranslationEngine, balanced_batches, length_sorted_batches, trained_source_languages
from .workers import DecodingWorkers, resolve_workers

WORD_CHARACTER = re.compile(r"[^\W_]")  # a piece that starts with one (not "▁") continues the word before it


class Translator(TranslationEngine):
    """A trained model plus its sentencepiece models, decoding with tfm's own search.

    The model is moved to `device` and prepared for inference in place (bf16 cast, packed or int8
    linear layers): pass a model of its own, not one still being trained.
    """

    name = "torch"
    lexical_constraints = True
    stops_at_deadline = True

    def __init__(self, model: Transformer, src_sp, tgt_sp, decode: DecodeConfig, device: torch.device):
        self.model, self.src_sp, self.tgt_sp, self.decode, self.device = model, src_sp, tgt_sp, decode, device
        self.max_source_tokens = source_token_limit(model.cfg.max_positions)
        model.to(device).eval()
        if decode.precision == "int8" and device.type != "cpu":
            raise TfmError("int8 decoding (--quantize int8 / decode.precision=int8) runs on CPU only: "
                           "add --device cpu")
        self.precision = choose_decoding_precision(decode.precision, device, (model.cfg.d_model, model.cfg.d_ff))
        if self.precision.int8:
            self.model = quantize_int8(model)
        else:
            if self.precision.bf16:
                model.to(torch.bfloat16)  # scores are still accumulated in fp32 (decoding/search.py)
            if device.type == "cpu":
                pack_linear_layers(model)
        if device.type == "cpu":
            keep_freed_memory()
        self.workers: DecodingWorkers | None = None  # started by the first search

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
        translator = cls(trained.model, trained.src_sp, trained.tgt_sp, decode, dev)
        translator.own_language = config.data.tgt_lang
        translator.own_source_language = config.data.src_lang
        translator.source_languages = trained_source_languages(config.data.model_dump())
        return translator

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

    def unknown_in_target(self, text: str) -> bool:
        return self.tgt_sp.unk_id() in self.tgt_sp.encode(text)

    def tokenize_target(self, texts: list[str]) -> list[list[int]]:
        return self.tgt_sp.encode(texts, out_type=int)

    def detokenize(self, tokens: list[int]) -> str:
        return self.tgt_sp.decode(tokens)

    def decoding_workers(self) -> DecodingWorkers:
        """The processes that decode batches (decode.workers); they start at the first search of two
        or more batches, or with `.start()`."""
        if self.workers is None:  # decode.workers is read here: the CLI edits decode after loading
            processes = resolve_workers(self.decode.workers, self.device)
            self.workers = DecodingWorkers(partial(decode_task, self.model, self.device), processes)
        return self.workers

    def search(self, sources: list[list[int]], decode: DecodeConfig | None = None,
               terms: list[TermIds] | None = None, deadline: float | None = None) -> list[list[Hypothesis]]:
        decode = decode or self.decode
        self.check_search_budget(sources, decode, terms)
        continuations = self.word_continuations() if terms and any(t.constraints for t in terms) else ()
        return decode_in_batches(self.model, sources, decode, self.device, workers=self.decoding_workers(), terms=terms, deadline=deadline,
                                 word_continuations=continuations)

    def word_continuations(self) -> tuple[int, ...]:
        """The target pieces that continue a word: no "▁" before a letter or digit (constraints are
        placed as whole words: none of these may follow a term)."""
        if "_continuations" not in self.__dict__:
            sp = self.tgt_sp
            self._continuations = tuple(
                i for i in range(sp.get_piece_size())
                if not (sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i))
                and WORD_CHARACTER.match(sp.id_to_piece(i)))
        return self._continuations

    def target_pieces(self) -> dict[str, int]:
        sp = self.tgt_sp
        return {sp.id_to_piece(i): i for i in range(sp.get_piece_size())
                if not (sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i))}

    def budget_processes(self) -> int:
        return self.decoding_workers().processes

    def describe(self) -> str:
        return f"tfm's engine (torch), {self.precision.describe()}"

    @property
    def member_configs(self) -> list[TransformerConfig]:
        """The model's config, or each of an ensemble's (each keeps its own caches)."""
        return [m.cfg for m in getattr(self.model, "members", [self.model])]

    def align(self, lines: list[str], sources: list[list[int]], hyps: list[list[Hypothesis]],
              decode: DecodeConfig) -> list[list[str]]:
        return word_alignments(self.model, lines, sources, hyps, self.src_sp, self.tgt_sp, decode, self.device)


def decode_in_batches(
    model: Transformer, sources: list[list[int]], decode: DecodeConfig, device: torch.device,
    min_len: int = 0, max_len: int | None = None,
    workers: DecodingWorkers | None = None, terms: list[TermIds] | None = None, deadline: float | None = None,
    word_continuations: tuple[int, ...] = (),
) -> list[list[Hypothesis]]:
    """Translate id sequences (no <eos>) → per sentence its n-best hypotheses, in input order:
    sources longer than the model's positions are cut, the rest grouped into length-sorted batches
    (`decode.batch_size`, `decode.batch_tokens`), the batches into tasks (`group_into_tasks`), and
    each task decoded by `decode_task` on `workers` (CPU processes made for this `model`; None: this
    process). `min_len`/`max_len` force the output length (benchmarks
    with untrained weights). `terms`: per source, the target ids its hypotheses start with, must
    contain and must not contain (`TermIds`); each travels with its source through batches and tasks.
    `deadline`: the time.monotonic() by which every search must end (DeadlinePassed otherwise).
    `word_continuations`: the target pieces that continue a word (none may follow a constraint).
    """
    settings = replace(SearchSettings.from_decode(decode, min_len, max_len, deadline),
                       word_continuations=word_continuations)
    keep = source_token_limit(model.cfg.max_positions)
    sources = [s[:keep] + [EOS_ID] for s in sources]  # source too long → truncated
    results: list[list[Hypothesis]] = [[] for _ in sources]
    batches = length_sorted_batches([len(s) for s in sources], decode.batch_size, decode.batch_tokens)
    if decode.batching == "balanced" and len(batches) > 1:
        batches = balanced_batches(batches, decode.batch_tokens, [len(s) for s in sources])
        tasks = [[b] for b in batches]  # one batch per task: they decode side by side
    else:
        tasks = group_into_tasks(batches, continuous=settings.continuous)
    if workers is None:
        workers = DecodingWorkers(partial(decode_task, model, device), processes=1)
    was_training = model.training
    model.eval()
    try:
        def terms_of(task: list[list[int]]) -> list[list[TermIds]] | None:
            return [[terms[i] for i in b] for b in task] if terms else None

        for task, task_hyps in zip(tasks, workers.map(([[sources[i] for i in b] for b in task], settings,
                                                       terms_of(task)) for task in tasks)):
            for batch, hyps in zip(task, task_hyps):
                for i, h in zip(batch, hyps):
                    results[i] = h
    finally:
        model.train(was_training)
    return results


CONTINUOUS_BATCHES = 8  # batches per continuous-batching task (greedy)


def group_into_tasks(batches: list[list[int]], continuous: bool) -> list[list[list[int]]]:
    """Batches (longest first) → the tasks `decode_task` decodes, one at a time per worker. Greedy
    decodes a task's batches with continuous batching, so tasks hold up to CONTINUOUS_BATCHES
    batches, dealt out in turn (task j gets batches j, j + T, …: every task has long and short
    sentences, still longest first); beam search decodes one batch per task. The tasks depend only
    on the batches, not on the number of processes, so every decode.workers setting computes the
    same rows together."""
    if not continuous:
        return [[b] for b in batches]
    count = -(-len(batches) // CONTINUOUS_BATCHES)
    return [batches[j::count] for j in range(count)]


def decode_task(model: Transformer, device: torch.device, batches: list[list[list[int]]],
                settings: SearchSettings, terms: list[list[TermIds]] | None = None) -> list[list[list[Hypothesis]]]:
    """One task, in a worker: batches of id sequences (each ending in <eos>), longest first → per
    batch, per sentence its n-best hypotheses (`nbest` samples when sampling). Greedy decodes them
    with continuous batching (`greedy_search_continuous`), beam search and sampling one batch after
    the other; a batch that runs out of memory is retried in halves. `terms`: per batch, per
    sentence its terminology (None: none anywhere). A sentence whose constraints cannot all be
    placed within its length limit gets the best translation without them (its prefix and
    avoided terms kept); the engine warns, naming the line."""
    s = settings

    def padded(rows: list[list[int]]) -> torch.Tensor:
        return pad_batch(rows).to(device)

    continuations = None
    if s.word_continuations:
        continuations = torch.zeros(model.cfg.tgt_vocab_size, dtype=torch.bool, device=device)
        continuations[list(s.word_continuations)] = True

    def search(number: int, rows: list[int]) -> list[list[Hypothesis]]:
        src = padded([batches[number][i] for i in rows])
        own = [terms[number][i] for i in rows] if terms else None  # each row's own
        if s.sampling is not None:
            return sample_search(model, src, BOS_ID, EOS_ID, s.sampling, s.nbest, s.max_len_a, s.max_len_b, s.min_len,
                                 terms=own)
        if s.beam <= 1:
            return [[h] for h in greedy_search(model, src, BOS_ID, EOS_ID, s.max_len_a, s.max_len_b, s.min_len,
                                               terms=own)]
        found = beam_search(model, src, BOS_ID, EOS_ID, s.beam, s.length_penalty, s.max_len_a, s.max_len_b,
                            s.nbest, s.min_len, terms=own, word_continuations=continuations)
        unmet = [i for i, hyps in enumerate(found) if not hyps and own and own[i].constraints]
        if unmet:  # constraints that do not fit: the best translation without them
            loose = [TermIds(own[i].prefix, [], own[i].avoid) for i in unmet]  # type: ignore[index]
            again = beam_search(model, src[unmet], BOS_ID, EOS_ID, s.beam, s.length_penalty, s.max_len_a,
                                s.max_len_b, s.nbest, s.min_len, terms=loose)
            for i, hyps in zip(unmet, again):
                found[i] = hyps
        return found

    def halved(size: int) -> None:
        warn(f"warning: out of memory translating a batch of {size} sentences: retrying it in halves "
             "(lower decode.batch_size to avoid this)")

    def one_by_one() -> list[list[list[Hypothesis]]]:
        return [split_on_out_of_memory(partial(search, n), list(range(len(b))), halved) for n, b in enumerate(batches)]

    with denormals_flushed_to_zero(), searches_end_by(s.deadline):
        if not s.continuous or len(batches) == 1:
            return one_by_one()
        srcs = [padded(b) for b in batches]
        try:
            found = greedy_search_continuous(model, srcs, BOS_ID, EOS_ID, s.max_len_a, s.max_len_b, s.min_len,
                                             terms=[t for batch in terms for t in batch] if terms else None)
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            return one_by_one()  # the batches alone, halved where they still do not fit
        return [[[h] for h in hyps] for hyps in found]
