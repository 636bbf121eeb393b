"""Misaligned and partly aligned pairs, scored by translation models (`data.filters.model`).

Each pair is scored teacher-forced, two forward passes per model and pair: a forward model
(src→tgt) gives each target piece's log-probability given the source and given an empty source; a
backward model (tgt→src) the same for the source. Two scores:

- *misalignment*: how little the other side tells the model, the negative *source gain*
  H(t | empty) − H(t | s), cross-entropies per piece (the side's pieces and </s>); with both
  models, the mean of the two gains. A side that translates the other is far likelier given it than
  given nothing; one that does not is about as likely either way, however common or rare its words.
  (The cross-entropy H(t | s) itself, as dual conditional cross-entropy [Junczys-Dowmunt 2018]
  uses it, mixes alignment with how rare a sentence is: on Multi30k with 50% noise and the models
  tfm trains itself, at the 99th percentile of clean pairs' scores it caught 25% of misaligned
  pairs, the source gain 97.5%.)
- *overrun*: how much longer the target is than its source, in the model's pieces, than this
  corpus's translations are: (t − r·s) / √(t + r·s + 1), t and s the two sides' pieces and r the
  sample's median ratio t/s; a translation's length scatters more the longer it is, as a count
  does. Each way with a threshold of its own (the source's overrun is its negative). A target that
  translates the source and then goes on (a failed sentence split, merged segments) is longer by
  about the other sentence; the model barely sees it (the continuing pieces lower the source gain
  little). (Measured on Multi30k + 50% noise with the models tfm trains itself, at 1% of clean
  pairs: a model's best prefix ended by </s> against the whole side caught 13% of such targets, the
  log length ratio 88%, the overrun 94%.)

The thresholds are learned without labels, as the lexical filter's are: a sample of the training
pairs (after the rule filters) is scored as it is, re-paired at random (misaligned pairs of this
corpus) and with each target, and each source, run on by another pair's (partly aligned pairs).
Each score drops at most an estimated `clean_loss` of the sample's good pairs (`learn_threshold`;
the overrun's two thresholds half of it each), stops where it drops `recall` (`partial_recall`) of
the made-up pairs, and never drops more than `max_share` of the sample itself.

What scores (`engine`, `ModelFilter.use_engine`): CTranslate2's `score_batch` on each checkpoint's
conversion (`CT2Scorer`), or tfm's engine (`TorchScorer`). Models load lazily, once per process
(`tfm prepare`'s encoding workers are spawned, one thread each); the filter object itself pickles
without them.
"""

from __future__ import annotations

import multiprocessing
import random
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..experiment.rundir import RunDirectory, checkpoint_at
from ..runtime.cpu import usable_cores
from ..runtime.errors import TfmError
from ..runtime.files import content_hash

REASON_MISALIGNED, REASON_PARTLY = "model_misaligned", "partly_aligned"
SCORES = "source gain, overrun"  # in the fingerprint: a run prepared with other scores is prepared again
SAMPLING_ERRORS = 1.0  # the threshold's allowance for the estimate's sampling error, in standard errors
# No warning below this estimated loss of good pairs, whatever the budget: the 1,000-update models on
# Multi30k + 20% noise estimated 0.3% for a side of the overrun (0.125% its budget) and dropped 0.38%.
LOOSE_FLOOR = 0.005


def misalignment(forward_gain: np.ndarray | None, backward_gain: np.ndarray | None) -> np.ndarray:
    """(pairs,) the misalignment score: minus the mean source gain of the models there are."""
    gains = [gain for gain in (forward_gain, backward_gain) if gain is not None]
    assert gains
    return -sum(gains) / len(gains)


@dataclass
class PairScores:
    misalignment: np.ndarray  # (pairs,) higher: the sides tell each other less (minus the source gain)
    src_pieces: np.ndarray  # (pairs,) each side's length in the scoring model's pieces
    tgt_pieces: np.ndarray

    def overrun(self, ratio: float) -> np.ndarray:
        """(pairs,) how much longer each target is than `ratio` times its source, in standard
        deviations of a count (> 0: the target longer; the source's overrun is its negative)."""
        expected = ratio * self.src_pieces
        return (self.tgt_pieces - expected) / np.sqrt(self.tgt_pieces + expected + 1.0)


def median_ratio(scores: PairScores) -> float:
    """The sample's typical target/source length in pieces (1 without pairs)."""
    if not len(scores.src_pieces):
        return 1.0
    return float(np.exp(np.median(np.log((scores.tgt_pieces + 1.0) / (scores.src_pieces + 1.0)))))


def _batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Indices grouped by length into batches of at most `batch_tokens` padded pieces (one at least)."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * lengths[i] <= batch_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


class TorchScorer:
    """tfm's engine: the checkpoint's model, teacher-forced (one thread in an encoding worker)."""

    out_type = int  # its tokens: piece ids

    def __init__(self, checkpoint: Path):
        import torch

        from ..experiment.checkpoint import load_trained_model

        if multiprocessing.parent_process() is not None:  # an encoding worker: one of several
            torch.set_num_threads(1)
        trained = load_trained_model(checkpoint)
        self.model, self.src_sp, self.tgt_sp = trained.model, trained.src_sp, trained.tgt_sp
        self.max_positions = trained.model.cfg.max_positions

    def mean_log_probs(self, batches: list[tuple[list[list], list[list]]]) -> list[np.ndarray]:
        """Per batch of (sources, targets), (B,) each target's mean log-probability per piece (and
        its </s>) given its source (which may be empty)."""
        import torch

        from ..model.special_tokens import BOS_ID, EOS_ID
        from .batches import pad_batch

        out = []
        with torch.inference_mode():
            for sources, targets in batches:
                tgt_in, tgt_out = pad_batch(targets, prefix=BOS_ID), pad_batch(targets, suffix=EOS_ID)  # (B, T+1)
                log_probs = torch.log_softmax(self.model(pad_batch(sources, suffix=EOS_ID), tgt_in).float(), dim=-1)
                picked = log_probs.gather(-1, tgt_out.unsqueeze(-1)).squeeze(-1)  # (B, T+1)
                lengths = torch.tensor([len(target) + 1 for target in targets])  # (B,)
                scored = torch.arange(picked.shape[1]) < lengths.unsqueeze(1)  # (B, T+1)
                out.append(((picked * scored).sum(1) / lengths).numpy())
        return out


class CT2Scorer:
    """CTranslate2's `score_batch` on the checkpoint's conversion (interop/ct2_cache.py), int8 on
    the CPU: the same log-probabilities as tfm's engine up to int8's rounding, and faster
    (docs/training.md, "Which engine scores")."""

    out_type = str  # its tokens: pieces

    def __init__(self, directory: Path, compute_type: str | None = None, threads: int = 0):
        from ..interop.ct2 import import_ctranslate2, load_translator, read_export, resolve_compute_type

        exported = read_export(directory)
        self.src_sp, self.tgt_sp, self.max_positions = exported.src_sp, exported.tgt_sp, exported.max_positions
        supported = import_ctranslate2().get_supported_compute_types("cpu")
        self.compute_type = resolve_compute_type(compute_type or "auto", "cpu", supported)
        # one thread in an encoding worker (one of several); else a batch on each of `threads`
        # cores (0: every usable one; small batches score faster on one thread each than on several)
        worker = multiprocessing.parent_process() is not None
        self.translator = load_translator(directory, "cpu", self.compute_type, intra_threads=1,
                                          inter_threads=1 if worker else threads or usable_cores())

    def mean_log_probs(self, batches: list[tuple[list[list], list[list]]]) -> list[np.ndarray]:
        """As TorchScorer's; the batches submitted at once (run on the translator's threads)."""
        from ..interop.ct2 import first_line

        try:  # (the pieces are cut to the model's positions already)
            pending = [self.translator.score_batch(sources, targets, max_input_length=0, asynchronous=True)
                       for sources, targets in batches]
            return [np.array([np.mean(result.result().log_probs) for result in results]) for results in pending]
        except RuntimeError as exc:
            raise TfmError(f"CTranslate2 could not score pairs: {first_line(exc)}") from None


Scorer = TorchScorer | CT2Scorer


def _source_gain(scorer: Scorer, src_tokens: list[list], tgt_tokens: list[list], batch_tokens: int) -> np.ndarray:
    """(pairs,) one model's source gain of each target (its tokens) given its source: mean
    log-probability per piece (and </s>) given the source less that given an empty source."""
    gain = np.zeros(len(src_tokens))
    lengths = [max(len(s), len(t)) + 1 for s, t in zip(src_tokens, tgt_tokens)]
    batches = _batches(lengths, batch_tokens)
    requests = []
    for batch in batches:
        targets = [tgt_tokens[i] for i in batch]
        requests += [([src_tokens[i] for i in batch], targets), ([[] for _ in batch], targets)]
    means = scorer.mean_log_probs(requests)
    for k, batch in enumerate(batches):
        gain[batch] = means[2 * k] - means[2 * k + 1]  # given the source, given an empty one
    return gain


def _pieces(scorer: Scorer, sources: list[str], targets: list[str]) -> tuple[list[list], list[list]]:
    """The model's tokens of each source and target, cut as its positions allow."""
    from ..model.lengths import source_token_limit

    limit = source_token_limit(scorer.max_positions)
    return ([tokens[:limit] for tokens in scorer.src_sp.encode(sources, out_type=scorer.out_type)],
            [tokens[:limit] for tokens in scorer.tgt_sp.encode(targets, out_type=scorer.out_type)])


def _side_log_probs(scorer: Scorer, sources: list[str], targets: list[str], batch_tokens: int
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One model's source gain of each target given its source, and the two sides' pieces, (pairs,) each."""
    src_tokens, tgt_tokens = _pieces(scorer, sources, targets)
    return (_source_gain(scorer, src_tokens, tgt_tokens, batch_tokens),
            np.array([len(tokens) for tokens in src_tokens], dtype=float),
            np.array([len(tokens) for tokens in tgt_tokens], dtype=float))


# Models tfm trains itself (training/filter_models.py) learn the corpus they score, noise included:
# trained on it all, they find its misaligned pairs likely. So the corpus is split in two halves by a
# hash of each pair's text (a pair and its duplicates fall in one), each half trains a set of models,
# and each pair is scored by the set that never saw it.
FOLDS = 2


def fold_of(src: str, tgt: str) -> int:
    """The half of the corpus a pair belongs to (a hash of its text, the same in every process)."""
    return zlib.crc32(f"{src}\t{tgt}".encode("utf-8", "surrogatepass")) % FOLDS


Models = tuple[Path | None, Path | None]  # (forward checkpoint, backward checkpoint)


def self_trained_runs(run: RunDirectory, src_lang: str, tgt_lang: str) -> list[tuple[Path, Path]]:
    """(forward run, backward run) of each fold, as training/filter_models.py trains them."""
    return [(run.filter_model_half(k) / f"{src_lang}-{tgt_lang}", run.filter_model_half(k) / f"{tgt_lang}-{src_lang}")
            for k in range(FOLDS)]


@dataclass
class ModelFilter:
    """The scoring models (paths) and the learned thresholds; `reasons` drops pairs above them.
    `models`: one (forward, backward) set, which scores every pair, or one per fold: fold k's pairs
    are scored by the set trained on the other fold."""

    models: list[Models]
    batch_tokens: int
    engine: str = "torch"  # what scores: "torch" (tfm's engine) or "ctranslate2" (`conversions`)
    conversions: dict[Path, Path] = field(default_factory=dict)  # checkpoint → its CTranslate2 conversion
    threads: int = 0  # CTranslate2's threads outside the encoding workers (prepare.workers; 0: every core)
    misaligned_above: float = float("inf")
    length_ratio: float = 1.0  # this corpus's target/source length in pieces (the overrun's r)
    target_longer_above: float = float("inf")  # overrun above this: partly aligned
    source_longer_above: float = float("inf")  # minus the overrun above this: partly aligned
    _loaded: dict[Path, Scorer] = field(default_factory=dict, repr=False, compare=False)

    def __getstate__(self) -> dict:  # to the encoding workers: paths and thresholds, not the models
        return {**self.__dict__, "_loaded": {}}

    def _model(self, path: Path) -> Scorer:
        if path not in self._loaded:
            self._loaded[path] = (CT2Scorer(self.conversions[path], threads=self.threads) if self.engine == "ctranslate2"
                                  else TorchScorer(path))
        return self._loaded[path]

    def use_engine(self, choice: str) -> str:
        """data.filters.model.engine → the engine that scores, described: ctranslate2 converts each
        checkpoint (kept beside it, as `decode.engine: auto` does) and loads it; auto does the
        same where it can, and scores with tfm's engine otherwise (saying why); torch: tfm's engine."""
        if choice == "torch":
            return "torch"
        from ..interop.ct2 import import_ctranslate2
        from ..interop.ct2_cache import cached_conversion

        checkpoints = sorted({path for pair in self.models for path in pair if path is not None})
        notes = []
        try:
            import_ctranslate2()
            for checkpoint in checkpoints:
                conversion = cached_conversion(checkpoint)
                notes += [conversion.note] if conversion.note else []
                self._loaded[checkpoint] = CT2Scorer(conversion.directory, threads=self.threads)
                self.conversions[checkpoint] = conversion.directory
        except TfmError as exc:
            self._loaded.clear()
            self.conversions.clear()
            if choice == "ctranslate2":
                raise TfmError(f"data.filters.model.engine: ctranslate2: {exc}") from None
            return f"torch (CTranslate2 cannot score here: {exc})"
        self.engine = "ctranslate2"
        scorer = self._loaded[checkpoints[0]]
        assert isinstance(scorer, CT2Scorer)
        return "; ".join([f"ctranslate2 {scorer.compute_type}", *notes])

    def _scored_by(self, src: list[str], tgt: list[str]) -> list[int]:
        """Each pair's set of models: the only one, or the other fold's."""
        if len(self.models) == 1:
            return [0] * len(src)
        return [(fold_of(s, t) + 1) % len(self.models) for s, t in zip(src, tgt)]

    def scores(self, src: list[str], tgt: list[str]) -> PairScores:
        misaligned, src_pieces, tgt_pieces = np.zeros(len(src)), np.zeros(len(src)), np.zeros(len(src))
        by = np.array(self._scored_by(src, tgt), dtype=int)
        for which, (forward_path, backward_path) in enumerate(self.models):
            rows = np.flatnonzero(by == which)
            if not len(rows):
                continue
            some_src, some_tgt = [src[i] for i in rows], [tgt[i] for i in rows]
            forward = backward = None
            if backward_path is not None:
                backward, tgt_pieces[rows], src_pieces[rows] = _side_log_probs(
                    self._model(backward_path), some_tgt, some_src, self.batch_tokens)
            if forward_path is not None:  # its pieces measure the lengths where there are both
                forward, src_pieces[rows], tgt_pieces[rows] = _side_log_probs(
                    self._model(forward_path), some_src, some_tgt, self.batch_tokens)
            misaligned[rows] = misalignment(forward, backward)
        return PairScores(misaligned, src_pieces, tgt_pieces)

    def reasons(self, src: list[str], tgt: list[str]) -> list[str | None]:
        """Each pair's reason to be dropped by the model scores, or None."""
        if not src:
            return []
        scores = self.scores(src, tgt)
        return [REASON_MISALIGNED if score > self.misaligned_above
                else REASON_PARTLY if over > self.target_longer_above or -over > self.source_longer_above else None
                for score, over in zip(scores.misalignment, scores.overrun(self.length_ratio))]


def check_model(path: str, key: str, src_lang: str, tgt_lang: str) -> Path:
    """The checkpoint a `data.filters.model` key names, loaded once to check it: a missing path,
    an unreadable checkpoint or a model of other languages is a one-line error naming the key."""
    from ..experiment.checkpoint import load_trained_model

    try:
        if not Path(path).exists():
            raise TfmError(f"{path}: no such run directory or checkpoint")
        checkpoint = checkpoint_at(path)
        config = load_trained_model(checkpoint).config
    except TfmError as err:
        raise TfmError(f"data.filters.model.{key}: {err}") from None
    pairs = config.data.pairs
    if len(pairs) != 1 or (pairs[0].src, pairs[0].tgt) != (src_lang, tgt_lang):
        raise TfmError(f"data.filters.model.{key}: {path} translates {', '.join(p.name for p in pairs)}, "
                       f"not {src_lang}-{tgt_lang}")
    return checkpoint


def model_checkpoints(forward: str | None, backward: str | None, src_lang: str, tgt_lang: str) -> Models:
    """The checkpoints of a forward (src→tgt) and a backward (tgt→src) run or file, each checked."""
    return (check_model(forward, "forward", src_lang, tgt_lang) if forward else None,
            check_model(backward, "backward", tgt_lang, src_lang) if backward else None)


def model_identity(checkpoint: Path) -> str:
    """A digest of the checkpoint's bytes: the fingerprint of a prepared run names its scoring models."""
    return content_hash(checkpoint)[:16]


def _quantile(values: np.ndarray, q: float) -> float:
    return float(np.quantile(values, q)) if len(values) else float("inf")


@dataclass
class Threshold:
    value: float
    noise: float  # estimated share of the sample that is like the made-up pairs
    recall: float  # share of the made-up pairs above the threshold
    clean_loss: float  # estimated share of the sample's other pairs above it

    def report(self) -> dict:
        return {name: round(value, 4) for name, value in self.__dict__.items()}


@dataclass(frozen=True)
class LearnedThresholds:
    """What `learn_model_filter` learned from its sample pairs, as the cleaning report keeps it: the
    engine that scored, each score's threshold (None: too few pairs to learn from), this corpus's
    target/source length ratio and the share of the sample the thresholds drop."""

    sample_pairs: int
    engine: str
    misalignment: Threshold | None = None
    target_longer: Threshold | None = None  # the overrun's
    source_longer: Threshold | None = None  # minus the overrun's
    median_length_ratio: float = 1.0
    sample_dropped: float = 0.0

    def to_json(self) -> dict:
        above = {f"{name}_above": None if rule is None else round(rule.value, 4) for name, rule in (
            ("misaligned", self.misalignment), ("target_longer", self.target_longer), ("source_longer", self.source_longer))}
        if self.misalignment is None or self.target_longer is None or self.source_longer is None:
            return {"sample_pairs": self.sample_pairs, "engine": self.engine, **above}
        return {"sample_pairs": self.sample_pairs, "engine": self.engine, "misaligned_above": above["misaligned_above"],
                "median_length_ratio": round(self.median_length_ratio, 4),  # (not the rule reason length_ratio)
                "target_longer_above": above["target_longer_above"], "source_longer_above": above["source_longer_above"],
                "sample_dropped": round(self.sample_dropped, 4), "misalignment": self.misalignment.report(),
                "target_longer": self.target_longer.report(), "source_longer": self.source_longer.report()}

    def describe(self) -> str:
        thresholds = self.to_json()
        return (f"scored by {self.engine}; thresholds from {self.sample_pairs:,} sample pairs: misalignment above "
                f"{thresholds['misaligned_above']} → model_misaligned, overrun above {thresholds['target_longer_above']} "
                f"(target longer) or below -{thresholds['source_longer_above']} (source longer) → partly_aligned "
                f"({round(self.sample_dropped, 4):.1%} of the sample)")

    def loose(self, clean_loss: float) -> list[str]:
        """What to warn of: a threshold whose estimated loss of good pairs is over twice its budget
        (`clean_loss`, half of it each way for the overrun) and over LOOSE_FLOOR. The estimate is
        loose where the models barely tell the corpus's pairs from the made-up bad ones (a weak
        model: a 100-step one, forward only, dropped 29% of clean Multi30k at an estimated 4.9%)."""
        out = []
        for score, rule, budget in (("misalignment", self.misalignment, clean_loss),
                                    ("target longer", self.target_longer, clean_loss / 2),
                                    ("source longer", self.source_longer, clean_loss / 2)):
            estimate = 0.0 if rule is None else round(rule.clean_loss, 4)
            if estimate > max(2 * budget, LOOSE_FLOOR):
                out.append(f"the {score} threshold may drop good pairs: {estimate:.1%} of them by the estimate "
                           f"(clean_loss {budget:.2%}), {round(self.sample_dropped, 4):.1%} of the sample in all; the "
                           "models barely tell this corpus's pairs from made-up bad ones: better models (forward "
                           "and backward), or the filter off")
        return out


def _share_above(values: np.ndarray, points: np.ndarray) -> np.ndarray:
    """(points,) the share of `values` above each point."""
    return 1 - np.searchsorted(np.sort(values), points, side="right") / max(len(values), 1)


def bad_share(real: np.ndarray, made_up: np.ndarray) -> float:
    """The estimated share of the sample's pairs that are like the made-up bad ones. Above the
    made-up pairs' q-quantile lie (1 − q) of the bad pairs and fewer good ones, so the sample's share
    there over (1 − q) bounds the bad share from above, and nearly meets it where the scores
    separate well; the median of that bound at q = 0.5 … 0.9 (one point alone is noisy with a few
    dozen bad pairs in the sample). Lower quantiles let more good pairs in where a weak model's
    scores overlap (q from 0.1: 6.9% of clean Multi30k pairs dropped instead of 4.4%)."""
    if not len(real) or not len(made_up):
        return 0.0
    bounds = [np.mean(real > np.quantile(made_up, q)) / (1 - q) for q in (0.5, 0.6, 0.7, 0.8, 0.9)]
    return float(min(1.0, np.median(bounds)))


def learn_threshold(real: np.ndarray, made_up: np.ndarray, recall: float, clean_loss: float,
                    max_share: float) -> Threshold:
    """The score above which a pair is dropped, from the sample's scores (`real`) and those of the
    made-up bad pairs: the lowest that drops at most an estimated `clean_loss` of the sample's good
    pairs, but no lower than what drops `recall` of the made-up pairs, nor than what drops
    `max_share` of the sample. The sample is a mixture of good pairs and bad ones like the made-up
    pairs (`bad_share` of it), so the good pairs' share above a point is what the sample has there
    less the bad pairs' part: (sample above − bad share · made-up above) / (1 − bad share)."""
    noise = bad_share(real, made_up)
    points = np.unique(real)  # ascending
    real_above, made_above = _share_above(real, points), _share_above(made_up, points)
    good_above = (real_above - noise * made_above) / max(1 - noise, 1e-9)
    # within the budget up to the estimate's sampling error (a few dozen bad pairs in the sample
    # scatter it by more than the budget)
    error = np.sqrt(real_above * (1 - real_above) / len(real) +
                    noise ** 2 * made_above * (1 - made_above) / max(len(made_up), 1)) / max(1 - noise, 1e-9)
    within = np.logical_and.accumulate((good_above <= clean_loss + SAMPLING_ERRORS * error)[::-1])[::-1]
    by_clean = float(points[within.argmax()]) if within.any() and noise < 1 else float("inf")
    value = max(by_clean, _quantile(made_up, 1 - recall), _quantile(real, 1 - max_share))
    found = float(_share_above(made_up, np.array([value]))[0]) if len(made_up) else 0.0
    good = float(_share_above(real, np.array([value]))[0] - noise * found) / max(1 - noise, 1e-9)
    return Threshold(value, noise, found, max(good, 0.0))


def learn_model_filter(rule: Any, models: list[Models], src: list[str], tgt: list[str],
                       seed: int, threads: int = 0) -> tuple[ModelFilter, LearnedThresholds]:
    """The filter with thresholds learned from the sample pairs `src`/`tgt` (`rule`: the config's
    data.filters.model), and what was learned, for the report."""
    found = ModelFilter(models, rule.batch_tokens, threads=threads)
    engine = found.use_engine(rule.engine)
    n = len(src)
    if n < 2:
        return found, LearnedThresholds(n, engine)
    rng = random.Random(seed)
    other = np.array([(i + 1 + rng.randrange(n - 1)) % n for i in range(n)])  # another pair, never the same
    real = found.scores(src, tgt)
    repaired = found.scores(src, [tgt[j] for j in other])
    target_on = found.scores(src, [f"{t} {tgt[j]}" for t, j in zip(tgt, other)])  # each target run on
    source_on = found.scores([f"{s} {src[j]}" for s, j in zip(src, other)], tgt)  # each source run on
    # Each score's good pairs are the sample's pairs the others keep (a partly aligned pair has a
    # higher misalignment too, a misaligned one may be longer, and neither is like the other score's
    # made-up pairs); its made-up pairs are those the others keep too, made of two pairs all keep
    # (a misaligned pair run on is no partly aligned pair). Three rounds, the overrun first.
    found.length_ratio = median_ratio(real)
    longer = {"target": target_on, "source": source_on}
    above = {"misalignment": float("inf"), "target": float("inf"), "source": float("inf")}

    def by_name(scores: PairScores) -> dict[str, np.ndarray]:
        over = scores.overrun(found.length_ratio)
        return {"misalignment": scores.misalignment, "target": over, "source": -over}

    def kept(scores: PairScores, but: str) -> np.ndarray:
        keep = np.ones(len(scores.misalignment), dtype=bool)
        for name, score in by_name(scores).items():
            if name != but:
                keep &= score <= above[name]
        return keep

    learned: dict[str, Threshold] = {}
    for _ in range(3):
        for side, made in longer.items():
            good = kept(real, "")
            learned[side] = learn_threshold(by_name(real)[side][kept(real, side)],
                                            by_name(made)[side][good & good[other] & kept(made, side)],
                                            rule.partial_recall, rule.clean_loss / 2, rule.max_share)
            above[side] = learned[side].value
        good = kept(real, "")
        learned["misalignment"] = learn_threshold(real.misalignment[kept(real, "misalignment")],
                                                  repaired.misalignment[good & good[other] & kept(repaired, "misalignment")],
                                                  rule.recall, rule.clean_loss, rule.max_share)
        above["misalignment"] = learned["misalignment"].value
    found.misaligned_above = above["misalignment"]
    found.target_longer_above, found.source_longer_above = above["target"], above["source"]
    return found, LearnedThresholds(n, engine, learned["misalignment"], learned["target"], learned["source"],
                                    found.length_ratio, float(np.mean(~kept(real, ""))))
