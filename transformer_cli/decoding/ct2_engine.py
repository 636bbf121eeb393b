"""CTranslate2 as a TranslationEngine: a CTranslate2 model directory (`tfm export`, or the conversion
that `decode.engine: auto` caches beside a checkpoint: interop/ct2_cache.py) translated with the same
streaming, order, empty-line and long-line behaviour as tfm's own engine. The directory's format
(reading and checking it) is interop/ct2.py's."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..data.shortlist import check_shortlist
from ..experiment.config import DecodeConfig
from ..experiment.scoring import search_alpha, total_log_prob
from ..interop.ct2 import (
    VMAP_FILE,
    ExportedModel,
    exported_decode,
    first_line,
    import_ctranslate2,
    load_translator,
    read_export,
    resolve_compute_type,
)
from ..model.lengths import output_length_limit, source_token_limit
from ..runtime.errors import TfmError
from .hypothesis import Hypothesis
from .terms import TermIds
from .translation import TranslationEngine, balanced_batches, length_sorted_batches, trained_source_languages
from .workers import resolve_workers


class CT2Translator(TranslationEngine):
    """A CTranslate2 model directory (`tfm export`, or the conversion `decode.engine: auto` caches:
    interop/ct2_cache.py) as a TranslationEngine, so `translate_stream` gives the same streaming, order,
    empty-line and long-line behaviour as tfm's own engine.

    Differences from tfm's own search, by design of CTranslate2:
    - length penalty: CTranslate2 divides the score by len**alpha, tfm by ((5 + len) / 6)**alpha
      (GNMT); decode.length_penalty is passed through as alpha, so with alpha = 0 both rank
      hypotheses by the plain sum of log-probabilities. Reported scores follow CTranslate2's rule.
    - length limit: tfm allows max_len_a * src_len + max_len_b tokens per sentence; CTranslate2 takes
      one limit per call, so each batch gets the limit of its longest source.
    """

    name = "ctranslate2"
    decodes_in_background = True  # its threads: search_later submits and returns

    def __init__(self, model_dir: str | Path, device: str = "cpu", compute_type: str | None = None,
                 threads: int = 0, decode: DecodeConfig | None = None, overrides: list[str] | None = None,
                 model: ExportedModel | None = None, shortlist: Path | None = None):
        """`decode` replaces the exported decode settings; `overrides` (`decode.beam=4`…) edit them.
        `compute_type` (decode.compute_type's values; None: decode.compute_type): auto is int8 on
        CPU, float16 on CUDA. `model`: the directory as `read_export` read it already. `shortlist`:
        the vocabulary map (`tfm shortlist`) used where decode.shortlist is true; None: the
        directory's own vmap.txt (`tfm export` writes one), if it has one."""
        ctranslate2 = import_ctranslate2()
        model_dir = Path(model_dir)
        model = model if model is not None else read_export(model_dir)
        if decode is None:
            decode = exported_decode(model_dir, model.settings, overrides or [])
        if device not in ("auto", "cpu", "cuda"):
            raise TfmError(f"--device {device}: CTranslate2 runs on cpu or cuda")
        device = "cuda" if device == "auto" and ctranslate2.get_cuda_device_count() > 0 else (
            "cpu" if device == "auto" else device)
        try:
            supported = ctranslate2.get_supported_compute_types(device)
        except (RuntimeError, ValueError) as exc:  # no CUDA device, or no CUDA support in this build
            raise TfmError(f"CTranslate2 cannot run on {device} here ({str(exc).splitlines()[0]})") from None
        compute_type = resolve_compute_type(compute_type or decode.compute_type, device, supported)
        if compute_type != "default" and compute_type not in supported:
            raise TfmError(f"--compute-type {compute_type} is not supported on this {device} "
                           f"(supported: {', '.join(sorted(supported))})")
        self.decode = decode
        self.model_dir, self.device, self.compute_type = model_dir, device, compute_type
        self.threads = threads
        self._translator: Any = None  # opened by `open()` or the first translation, with decode.workers as set by then
        self._workers = 1
        self.src_sp, self.tgt_sp = model.src_sp, model.tgt_sp
        own_map = model_dir / VMAP_FILE
        self.shortlist = shortlist if shortlist is not None else (own_map if own_map.exists() else None)
        if self.shortlist is not None:
            check_shortlist(self.shortlist, self.tgt_sp)
        self.sizes = model.sizes
        trained = model.settings.get("config")
        self.own_language = trained.get("data", {}).get("tgt_lang") if isinstance(trained, dict) else None
        self.own_source_language = trained.get("data", {}).get("src_lang") if isinstance(trained, dict) else None
        self.source_languages = trained_source_languages(trained.get("data") if isinstance(trained, dict) else None)
        # tfm keeps at most source_token_limit() source tokens and </s> (model/lengths.py).
        self.max_source_tokens = source_token_limit(model.max_positions)
        self.max_input_length = self.max_source_tokens + 1
        # tfm's engine on the same checkpoint, for word alignments (a forced pass over CTranslate2's
        # output: decoding/alignment.py); None: alignments are refused (a bare model directory).
        self.aligner: TranslationEngine | None = None

    def describe(self) -> str:
        aligned = ", word alignments by tfm's engine" if self.aligner is not None and self.decode.alignment else ""
        return f"CTranslate2 {self.compute_type} on {self.device}{aligned}"

    def align(self, lines: list[str], sources: list[list], hyps: list[list[Hypothesis]],
              decode: DecodeConfig) -> list[list[str]]:
        """The aligner's alignments of CTranslate2's hypotheses (pieces, read as the ids they are)."""
        if self.aligner is None:
            return super().align(lines, sources, hyps, decode)
        source_ids = [[self.src_sp.piece_to_id(piece) for piece in pieces] for pieces in sources]
        output_ids = [[replace(h, tokens=[self.tgt_sp.piece_to_id(piece) for piece in h.tokens]) for h in sentence]
                      for sentence in hyps]
        return self.aligner.align(lines, source_ids, output_ids, decode)

    def close(self) -> None:
        if self.aligner is not None:
            self.aligner.close()

    @property
    def member_configs(self) -> list:
        return [self.sizes] if self.sizes is not None else []

    def first_chunk_lines(self) -> int:
        # A batch for each thread: one batch alone would leave the other threads idle until it is done.
        return self.decode.batch_size * self.budget_processes()

    def unsupported(self, decode: DecodeConfig) -> str | None:
        if decode.sample:
            return "sampling (--sample) is done by tfm's own engine: use --engine torch"
        if decode.alignment and self.aligner is None:
            return ("word alignments (--alignment, and a document's markup) come from tfm's own engine run on the "
                    "model's checkpoint beside CTranslate2: give the checkpoint (--checkpoint or --config), not --model "
                    "DIR (and serve it without --engine ctranslate2)")
        if decode.shortlist and self.shortlist is None:
            return (f"decode.shortlist: {self.model_dir} has no lexical shortlist: make one with "
                    "`tfm shortlist --config CONFIG` (or set decode.shortlist false)")
        return None

    def budget_processes(self) -> int:
        return resolve_workers(self.decode.workers, self.device)  # inter_threads: batches decoded at once

    @property
    def decoding_processes(self) -> int:  # type: ignore[override]
        return self._workers if self._translator is not None else 1

    def open(self) -> None:
        """Load the model (done by the first translation otherwise): decode.workers → CTranslate2's
        inter_threads (batches decoded at once), one thread each. A TfmError where CTranslate2
        cannot load it (a CUDA library it needs is missing)."""
        if self._translator is not None:
            return
        workers = resolve_workers(self.decode.workers, self.device)
        files = None
        if self.shortlist is not None and self.shortlist != self.model_dir / VMAP_FILE:
            # CTranslate2 reads the vocabulary map from the model's directory only: the conversion
            # tfm caches stays as it is, and the model is loaded from memory with the map beside it.
            files = {p.name: p.read_bytes() for p in self.model_dir.iterdir() if p.is_file()}
            files[VMAP_FILE] = self.shortlist.read_bytes()
        self._translator = load_translator(self.model_dir, self.device, self.compute_type, inter_threads=workers,
                                           intra_threads=1 if workers > 1 else self.threads, files=files)
        self._workers = workers
        if self.device == "cuda":
            self._check_it_runs()

    def _check_it_runs(self) -> None:
        """CTranslate2 loads some GPU libraries (cuBLAS) only when it first translates: a wheel built
        for another CUDA major version (PyPI's links CUDA 12's cuBLAS) loads the model, then fails
        mid-translation. One token translated now makes that a TfmError at open(), where auto falls
        back to tfm's engine (engine.open_engine)."""
        piece = self.src_sp.id_to_piece(self.src_sp.get_piece_size() - 1)
        try:
            self._translator.translate_batch([[piece]], beam_size=1, max_decoding_length=1)
        except RuntimeError as exc:
            self._translator = None
            raise TfmError(f"CTranslate2 cannot translate on {self.device} here ({first_line(exc)})") from None

    def _submit(self, pieces: list[list[str]], **options: Any) -> Any:
        try:
            return self._translator.translate_batch(pieces, **options)
        except RuntimeError as exc:  # e.g. out of GPU memory: a line, not a traceback
            raise self._failed(exc) from None

    def _failed(self, exc: RuntimeError) -> TfmError:
        return TfmError(f"CTranslate2 failed on {self.device}: {first_line(exc)}")

    def tokenize(self, lines: list[str]) -> list[list[str]]:
        return self.src_sp.encode(lines, out_type=str)

    def unknown_in_target(self, text: str) -> bool:
        return self.tgt_sp.unk_id() in self.tgt_sp.encode(text)

    def tokenize_target(self, texts: list[str]) -> list[list[str]]:
        return self.tgt_sp.encode(texts, out_type=str)

    def total_log_prob(self, score: float, length: int, decode: DecodeConfig) -> float:
        return total_log_prob(score, length, decode.length_penalty, decode.beam, "length")  # CTranslate2: len ** alpha

    def detokenize(self, tokens: list[str]) -> str:
        return self.tgt_sp.decode_pieces(tokens)

    def search(self, pieces: list[list[str]], decode: DecodeConfig | None = None,
               terms: list[TermIds] | None = None, max_len: int | None = None,
               deadline: float | None = None) -> list[list[Hypothesis]]:
        """Sentencepiece pieces (no </s>) → per sentence its n-best hypotheses (pieces, score), in input order."""
        return self.search_later(pieces, decode or self.decode, terms, max_len)()

    def search_later(self, pieces: list[list[str]], decode: DecodeConfig, terms: list[TermIds] | None = None, max_len: int | None = None,
                     deadline: float | None = None) -> Callable[[], list[list[Hypothesis]]]:
        """The batches submitted to CTranslate2's threads now; what it returns waits for them.
        The prefixes of `terms` become CTranslate2's `target_prefix` (hypotheses include them);
        constraints and avoided terms are tfm's engine's (`check_terms` refuses them). CTranslate2
        cannot stop a batch it has started: `deadline` is kept by its caller (tfm serve answers 504
        at the deadline) and by the work budget, which bounds what a batch may cost."""
        unsupported = self.unsupported(decode)
        if unsupported:
            raise TfmError(unsupported)
        if terms and any(t.constraints or t.avoid for t in terms):
            raise TfmError("constraints and avoided terms are applied by tfm's own engine: use --engine torch")
        self.check_search_budget(pieces, decode, terms)
        prefixes = [t.prefix for t in terms] if terms and any(t.prefix for t in terms) else None
        self.open()
        # Batches of similar lengths (decode.batch_size, decode.batch_tokens), as tfm's engine makes them.
        lengths = [min(len(p), self.max_source_tokens) + 1 for p in pieces]  # + the </s> CTranslate2 appends
        batches = length_sorted_batches(lengths, decode.batch_size, decode.batch_tokens)
        if decode.batching == "balanced" and len(batches) > 1:  # tfm serve: a batch per thread, finishing together
            batches = balanced_batches(batches, decode.batch_tokens, lengths)
        submitted = []
        for batch in batches:
            limit = max_len if max_len is not None else output_length_limit(
                max(lengths[i] for i in batch), decode.max_len_a, decode.max_len_b,
                self.max_input_length + 1)  # capped: no overflow
            forced = [prefixes[i] for i in batch] if prefixes else None  # each sentence's own
            if forced:
                limit = min(max(limit, max(map(len, forced)) + 1), self.max_input_length)
            # Asynchronous: with several workers (inter_threads) CTranslate2 decodes batches in parallel.
            submitted.append((batch, self._submit(
                [pieces[i] for i in batch], beam_size=decode.beam, num_hypotheses=decode.nbest,
                length_penalty=search_alpha(decode.length_penalty, decode.beam),
                max_decoding_length=max(limit, 1), max_input_length=self.max_input_length,
                target_prefix=forced, return_scores=decode.nbest > 1 or decode.scores,  # scores cost ~4% of greedy's time
                use_vmap=decode.shortlist, asynchronous=True)))

        def collect() -> list[list[Hypothesis]]:  # (the failures of CTranslate2's threads come out here)
            results: list[list[Hypothesis]] = [[] for _ in pieces]
            for batch, futures in submitted:
                for i, future in zip(batch, futures):
                    try:
                        result = future.result()
                    except RuntimeError as exc:  # e.g. out of GPU memory: a line, not a traceback
                        raise self._failed(exc) from None
                    scores = result.scores or [math.nan] * len(result.hypotheses)  # one hypothesis: not asked for
                    results[i] = [Hypothesis(tokens, score) for tokens, score in zip(result.hypotheses, scores)]
            return results

        return collect
