"""Cleaning the training split in `tfm prepare`: the directions' filters (data/filters.py) built
from the config, duplicates dropped in corpus order, and the report of what was dropped: counts
per direction and reason, a few examples of each, the warnings, and the table `tfm prepare`
prints (written to `<run>/prepare_report.json`). `DroppedWriter` streams every dropped pair to the
file of `tfm prepare --dropped` (JSON lines).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..experiment.config import ExperimentConfig
from ..runtime.console import say, warn
from ..runtime.errors import TfmError
from ..runtime.files import AtomicStream, text_file_problem
from .corpus import (
    EXAMPLES,
    Corpus,
    DroppedPair,
    EncodedChunk,
    corpora_chunks,
    decode_or_none,
    ordered_map,
    sample_pairs,
    subset_side,
)
from .filters import REASONS, DirectionFilters, SeenHashes
from .language_id import MODEL_NAME, identify, model_language
from .lexical import learn_lexical_model
from .model_filter import LearnedThresholds, ModelFilter, learn_model_filter, model_checkpoints, self_trained_runs

COMMON_WORDS_PAIRS = 20_000  # the first pairs of a direction, whose in-language lines give its common words
_CHECK = "check data.src_lang/tgt_lang and the files, or turn the filter off:"
# The filter (config key under data.filters) behind each reason; None: not a filter of its own.
FILTER_OF = {"empty": None, "encoding": "text", "length": "length", "copy": "copies", "characters": "characters",
             "repeats": "repeats", "numbers": "numbers", "language": "language", "misaligned": "lexical",
             "model_misaligned": "model", "partly_aligned": "model", "too_long": None, "length_ratio": None,
             "duplicate": "duplicates"}


@dataclass
class DirectionCounts:
    name: str
    files: list[str]  # the direction's source files, by corpus number
    sides: list[str] = field(default_factory=list)  # every file of the direction, source and target
    read: int = 0
    kept: int = 0
    dropped: Counter = field(default_factory=Counter)
    examples: dict[str, list[dict]] = field(default_factory=dict)

    def add_examples(self, pairs: list[DroppedPair], source_file: str) -> None:
        for pair in pairs:
            shown = self.examples.setdefault(pair.reason, [])
            if len(shown) < EXAMPLES:
                shown.append({"file": source_file, "line": pair.line, "src": pair.src, "tgt": pair.tgt})


@dataclass
class CleaningReport:
    directions: list[DirectionCounts]
    warn_share: float
    settings: dict

    @property
    def read(self) -> int:
        return sum(d.read for d in self.directions)

    @property
    def kept(self) -> int:
        return sum(d.kept for d in self.directions)

    def dropped(self) -> dict[str, int]:
        """Pairs dropped per reason, all directions, in the order the filters run."""
        total = sum((d.dropped for d in self.directions), Counter())
        return {reason: total[reason] for reason in REASONS}

    def warnings(self) -> list[str]:
        """A filter that drops more than warn_share of a direction: usually a wrong language code or
        swapped files, not a dirty corpus."""
        out = []
        for d in self.directions:
            for reason in REASONS:
                if d.read and d.dropped[reason] > self.warn_share * d.read:
                    key = FILTER_OF[reason]
                    what = f"data.filters.{key}" if key else "data.max_len / data.max_len_ratio"
                    hint = (" (is data.src_lang/tgt_lang right, or are the files swapped?)"
                            if reason in ("language", "characters", "misaligned", "model_misaligned") else "")
                    out.append(f"filter '{reason}' dropped {d.dropped[reason] / d.read:.0%} of {d.name}'s "
                               f"{d.read:,} training pairs{hint}; see {what}")
        return out

    def check_kept(self) -> None:
        """A direction whose every training pair was dropped is an error naming the main reason
        (a file of another language or encoding, a wrong language code), not an empty run."""
        for d in self.directions:
            if d.read and not d.kept:
                reason, count = d.dropped.most_common(1)[0]
                src_lang, _, tgt_lang = d.name.partition("-")
                examples = d.examples.get("language", [])
                sides = {side: (lang, d.sides[k::2], [e[side] for e in examples])
                         for k, (side, lang) in enumerate((("src", src_lang), ("tgt", tgt_lang)))}
                raise all_dropped(f"every one of {d.name}'s {d.read:,} training pairs was dropped", reason, count,
                                  sides, f", first in {d.files[0]}")

    def to_json(self) -> dict:
        return {
            "pairs_read": self.read,
            "pairs_kept": self.kept,
            "dropped": self.dropped(),
            "directions": [{"name": d.name, "read": d.read, "kept": d.kept,
                            "dropped": {r: d.dropped[r] for r in REASONS if d.dropped[r]},
                            "examples": {r: d.examples[r] for r in REASONS if r in d.examples}}
                           for d in self.directions],
            "warnings": self.warnings(),
            "filters": self.settings,
        }

    def table(self) -> str:
        """Pairs read, dropped by each reason (share), kept: the one table `tfm prepare` prints."""
        read = max(self.read, 1)
        rows = [f"{'training pairs':<25}{'pairs':>11}{'share':>8}", "-" * 44,
                f"{'read':<25}{self.read:>11,}{'':>8}"]
        for reason, count in self.dropped().items():
            if count:
                rows.append(f"{'dropped: ' + reason:<25}{count:>11,}{count / read:>8.1%}")
        rows.append(f"{'kept':<25}{self.kept:>11,}{self.kept / read:>8.1%}")
        return "\n".join(rows)


class DroppedWriter(AtomicStream):
    """Every dropped pair with its reason, one JSON object a line, written to a temporary file and
    moved to `target` only when the whole split is through (an interrupted run leaves no half file)."""

    def __init__(self, target: Path):
        super().__init__(target, "w", encoding="utf-8")

    def add(self, direction: str, source_file: str, pairs: list[DroppedPair]) -> None:
        self.write("".join(json.dumps({"reason": pair.reason, "direction": direction, "file": source_file,
                                       "line": pair.line, "src": pair.src, "tgt": pair.tgt}, ensure_ascii=False) + "\n"
                           for pair in pairs))


@dataclass
class Cleaning:
    """The training split's filters and where their results go (`_encode_split`)."""

    filters: list[DirectionFilters]  # per direction
    report: CleaningReport
    dropped: DroppedWriter | None = None  # `--dropped FILE`
    seen: SeenHashes | None = None  # duplicates: the hashes of the pairs kept so far


def wrong_language_file(sides: dict[str, tuple[str, list[str], list]]) -> str:
    """Which file of a direction is in another language than its code, by the language most of its
    lines (the first 20 given) are identified as: ": …/train.fr reads as de, not fr", or "" where
    neither side is. `sides`: side → (language code, its files, some of its lines)."""
    for lang, files, lines in sides.values():
        found = Counter(identify(line)[0] for line in lines[:20] if line and line.strip())
        if found and files and (top := found.most_common(1)[0][0]) != (model_language(lang) or lang):
            return f": {files[0]} reads as {top}, not {lang} (a file of another language, or swapped?)"
    return ""


def all_dropped(what: str, reason: str, count: int, sides: dict[str, tuple[str, list, list]],
                where: str = "") -> TfmError:
    """The error for a direction whose every pair was dropped, by `reason` mostly: where a file's
    encoding, line ends or language explain it, that file and the fix; else the filter to check.
    `sides`: side → (language code, its files, some of its lines)."""
    files = [path for _, paths, _ in sides.values() for path in paths]
    why = next((f": {path}: {problem}" for path in files if (problem := text_file_problem(path))), "")
    if not why and reason == "language":
        why = wrong_language_file(sides)
    if why:
        return TfmError(f"{what} ({reason}: {count:,}){why}")
    return TfmError(f"{what} ({reason}: {count:,}{where}); {_CHECK} --set data.filters.{FILTER_OF[reason] or 'text'}"
                    ".enabled=false")


def clean_result(result: EncodedChunk, cleaning: Cleaning, source_file: str) -> None:
    """Drop a chunk's repeats of earlier pairs (in corpus order: the first is kept) and count
    everything the chunk's filters dropped in the report (and the --dropped file)."""
    counts = cleaning.report.directions[result.direction]
    dropped = list(result.dropped_pairs)
    if result.hashes is not None:
        new = cleaning.seen.first_seen(result.hashes)
        if not new.all():
            result.src, result.tgt = subset_side(result.src, new), subset_side(result.tgt, new)
            repeats = np.flatnonzero(~new)
            result.dropped["duplicate"] = len(repeats)
            for i in repeats:
                src, tgt = result.kept_text[i] if result.kept_text else (None, None)
                dropped.append(DroppedPair("duplicate", int(result.kept_lines[i]), src, tgt))
    counts.read += result.read
    counts.kept += len(result.src.lengths)
    counts.dropped.update(result.dropped)
    counts.add_examples(dropped, source_file)
    if cleaning.dropped is not None:
        cleaning.dropped.add(counts.name, source_file, dropped)


def make_cleaning(config: ExperimentConfig, corpora: list[list[Corpus]], dropped_file: Path | None,
                  filters: list[DirectionFilters]) -> Cleaning:
    """An empty report and the --dropped writer for a run's training split, with the directions'
    `filters` (`corpora`: each direction's training corpora)."""
    settings = config.data.filters
    reported = settings.model_dump()
    if filters and filters[0].learned is not None:  # the model filter's thresholds
        reported["model"]["learned"] = filters[0].learned.to_json()
    report = CleaningReport([DirectionCounts(d.name, [str(src) for src, _ in direction],
                                             [str(path) for pair in direction for path in pair])
                             for d, direction in zip(config.data.pairs, corpora)], settings.warn_share, reported)
    return Cleaning(filters, report,
                    DroppedWriter(dropped_file) if dropped_file is not None else None,
                    SeenHashes() if settings.duplicates.enabled else None)


def head_pairs(corpora: list[Corpus], n: int) -> tuple[list[str], list[str]]:
    """The first `n` pairs of the corpora that are valid UTF-8 (no pass over the rest)."""
    src, tgt = [], []
    for _, chunk in corpora_chunks(corpora, n, n):
        for i, (s, t) in enumerate(zip(chunk.src, chunk.tgt)):
            s, t = decode_or_none(s, "", chunk.first_line + i, True), decode_or_none(t, "", chunk.first_line + i, True)
            if s is not None and t is not None:
                src.append(s)
                tgt.append(t)
    return src, tgt


def build_filters(config: ExperimentConfig, corpora: list[list[Corpus]], seed: int) -> list[DirectionFilters]:
    """Each direction's filters; with data.filters.lexical on, each direction's lexical model,
    learned from a uniform sample of its training pairs (one more pass over its corpora)."""
    out = []
    for direction, direction_corpora in zip(config.data.pairs, corpora):
        lexical = None
        if config.data.filters.lexical.enabled:
            rule = config.data.filters.lexical
            src, tgt, _ = sample_pairs(direction_corpora, rule.sample_pairs, seed,
                                       config.data.train_limit, skip_invalid=True)
            lexical = learn_lexical_model(src, tgt, rule.recall, seed, rule.min_count)
        filters = DirectionFilters(config.data.filters, direction.src, direction.tgt, lexical)
        for side, lang in filters.unidentifiable_sides().items():
            warn(f"warning: data: language {lang!r} ({direction.name}'s {side}) is not one the language identifier knows "
                 f"({MODEL_NAME}, 176 languages): the language filter is off for that side")
        if config.data.filters.language.enabled:  # the first pairs of the direction teach its common words
            filters.learn_common_words(*head_pairs(direction_corpora, COMMON_WORDS_PAIRS))
        if config.data.filters.model.enabled:
            filters.scorer, filters.learned = model_filter(config, direction_corpora, filters, seed)
        out.append(filters)
    return out


def model_filter(config: ExperimentConfig, corpora: list[Corpus], filters: DirectionFilters,
                 seed: int) -> tuple[ModelFilter, LearnedThresholds]:
    """The direction's model filter: its models checked, its thresholds learned from a sample of the
    pairs the other filters keep (printed, and kept in the report's settings)."""
    rule = config.data.filters.model
    if len(config.data.pairs) != 1:
        raise TfmError("data.filters.model: scores the pairs of a run with one direction (data.src_lang → "
                       f"data.tgt_lang), not of {len(config.data.pairs)} directions")
    direction = config.data.pairs[0]
    if rule.forward is not None or rule.backward is not None:
        models = [model_checkpoints(rule.forward, rule.backward, direction.src, direction.tgt)]
    else:  # the models tfm trained itself, a set on each half of the corpus
        runs = self_trained_runs(config.run, direction.src, direction.tgt)
        if not all(run.is_dir() for pair in runs for run in pair):
            raise TfmError(f"data.filters.model: names no model, and the models tfm trains itself are not in "
                           f"{runs[0][0].parent.parent}: `tfm prepare` trains them first (or give forward/backward)")
        models = [model_checkpoints(str(fwd), str(bwd), direction.src, direction.tgt) for fwd, bwd in runs]
    src, tgt, _ = sample_pairs(corpora, rule.sample_pairs, seed, config.data.train_limit, skip_invalid=True)
    kept = [i for i, reason in enumerate(filters.reasons(src, tgt)) if reason is None]
    found, learned = learn_model_filter(rule, models, [src[i] for i in kept], [tgt[i] for i in kept], seed,
                                        threads=config.prepare.workers or 0)
    say(f"data.filters.model: {learned.describe()}")
    for warning in learned.loose(rule.clean_loss):
        warn(f"warning: data.filters.model: {warning}")
    return found, learned


def _sample_reasons(task: tuple[int, list[str], list[str]]) -> list[str | None]:
    direction, src, tgt = task
    return _sample_filters[direction].reasons(src, tgt, scored=False)


_sample_filters: list[DirectionFilters] = []


def _init_sample_filters(filters: list[DirectionFilters]) -> None:
    _sample_filters[:] = filters


def filter_sample(filters: DirectionFilters, src: list[str], tgt: list[str], workers: int, name: str,
                  files: list[Path] | None = None) -> tuple[list[str], list[str]]:
    """The pairs of a vocabulary sample that the direction's filters keep (each once, with the
    duplicate filter on): the vocabulary learns from the text training will see, not from markup,
    other languages and repeated lines.
    In `workers` processes (a million-pair sample takes 20 s in one). `files`: the corpus files the
    sample came from (named, with what is wrong with them, where every pair is dropped)."""
    chunk = 20_000
    tasks = ((0, src[i : i + chunk], tgt[i : i + chunk]) for i in range(0, len(src), chunk))
    reasons = [r for part in ordered_map(_sample_reasons, tasks, workers if len(src) > chunk else 1,
                                         _init_sample_filters, ([filters],)) for r in part]
    kept = [(s, t) for s, t, r in zip(src, tgt, reasons) if r is None]
    if filters.on("duplicates"):
        kept = list(dict.fromkeys(kept))
    if src and not kept:  # nothing to learn a vocabulary from, nor to train on
        reason, count = Counter(reasons).most_common(1)[0]
        files = files or []
        raise all_dropped(f"every one of {name}'s {len(src):,} training pairs sampled for the vocabulary was dropped",
                          reason, count, {"src": (filters.src_lang, files[0::2], src),
                                          "tgt": (filters.tgt_lang, files[1::2], tgt)})
    return [s for s, _ in kept], [t for _, t in kept]
