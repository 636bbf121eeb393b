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

Models load lazily, once per process (`tfm prepare`'s encoding workers are spawned, one thread
each); the filter object itself pickles without them.
"""

from __future__ import annotations

import multiprocessing
import random
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..experiment.rundir import RunDirectory
from ..runtime.errors import TfmError
from ..runtime.files import content_hash

REASON_MISALIGNED, REASON_PARTLY = "model_misaligned", "partly_aligned"
SCORES = "source gain, overrun"  # in the fingerprint: a run prepared with other scores is prepared again
SAMPLING_ERRORS = 1.0  # the threshold's allowance for the estimate's sampling error, in standard errors


def checkpoint_of(path: str | Path) -> Path:
    """A run directory's default checkpoint, or the checkpoint file itself."""
    path = Path(path)
    return RunDirectory(path).default_checkpoint() if path.is_dir() else path


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


def _source_gain(trained: Any, src_ids: list[list[int]], tgt_ids: list[list[int]], batch_tokens: int
                 ) -> np.ndarray:
    """(pairs,) one model's source gain of each target (pieces, its vocabularies') given its source:
    mean log-probability per piece (and </s>) given the source less that given an empty source."""
    import torch

    from ..model.special_tokens import BOS_ID, EOS_ID
    from .batches import pad_batch

    gain = np.zeros(len(src_ids))
    lengths = [max(len(s), len(t)) + 1 for s, t in zip(src_ids, tgt_ids)]
    with torch.inference_mode():
        for batch in _batches(lengths, batch_tokens):
            tgt = [tgt_ids[i] for i in batch]
            tgt_in, tgt_out = pad_batch(tgt, prefix=BOS_ID), pad_batch(tgt, suffix=EOS_ID)  # (B, T+1)
            given = {}
            for name, src in (("source", pad_batch([src_ids[i] for i in batch], suffix=EOS_ID)),  # (B, S)
                              ("empty", torch.full((len(batch), 1), EOS_ID, dtype=torch.long))):  # (B, 1)
                log_probs = torch.log_softmax(trained.model(src, tgt_in).float(), dim=-1)  # (B, T+1, V)
                given[name] = log_probs.gather(-1, tgt_out.unsqueeze(-1)).squeeze(-1).numpy()  # (B, T+1)
            for row, i in enumerate(batch):
                end = len(tgt_ids[i]) + 1
                gain[i] = given["source"][row, :end].mean() - given["empty"][row, :end].mean()
    return gain


def _pieces(trained: Any, sources: list[str], targets: list[str]) -> tuple[list[list[int]], list[list[int]]]:
    """The model's pieces of each source and target, cut as its positions allow."""
    from ..model.lengths import source_token_limit

    limit = source_token_limit(trained.model.cfg.max_positions)
    return ([ids[:limit] for ids in trained.src_sp.encode(sources, out_type=int)],
            [ids[:limit] for ids in trained.tgt_sp.encode(targets, out_type=int)])


def _side_log_probs(trained: Any, sources: list[str], targets: list[str], batch_tokens: int
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One model's source gain of each target given its source, and the two sides' pieces, (pairs,) each."""
    src_ids, tgt_ids = _pieces(trained, sources, targets)
    return (_source_gain(trained, src_ids, tgt_ids, batch_tokens), np.array([len(ids) for ids in src_ids], dtype=float),
            np.array([len(ids) for ids in tgt_ids], dtype=float))


# Models tfm trains itself (training/filter_models.py) learn the corpus they score, noise included:
# trained on it all, they find its misaligned pairs likely. So the corpus is split in two halves by a
# hash of each pair's text (a pair and its duplicates fall in one), each half trains a set of models,
# and each pair is scored by the set that never saw it.
FOLDS = 2


def fold_of(src: str, tgt: str) -> int:
    """The half of the corpus a pair belongs to (a hash of its text, the same in every process)."""
    return zlib.crc32(f"{src}\t{tgt}".encode("utf-8", "surrogatepass")) % FOLDS


Models = tuple[Path | None, Path | None]  # (forward checkpoint, backward checkpoint)


def fold_folder(run_dir: Path, fold: int) -> Path:
    """Where the models tfm trains on fold `fold` live (run directories), with the fold's pairs."""
    return Path(run_dir) / "filter_models" / f"half{fold + 1}"


def self_trained_runs(run_dir: Path, src_lang: str, tgt_lang: str) -> list[tuple[Path, Path]]:
    """(forward run, backward run) of each fold, as training/filter_models.py trains them."""
    return [(fold_folder(run_dir, k) / f"{src_lang}-{tgt_lang}", fold_folder(run_dir, k) / f"{tgt_lang}-{src_lang}")
            for k in range(FOLDS)]


@dataclass
class ModelFilter:
    """The scoring models (paths) and the learned thresholds; `reasons` drops pairs above them.
    `models`: one (forward, backward) set, which scores every pair, or one per fold: fold k's pairs
    are scored by the set trained on the other fold."""

    models: list[Models]
    batch_tokens: int
    misaligned_above: float = float("inf")
    length_ratio: float = 1.0  # this corpus's target/source length in pieces (the overrun's r)
    target_longer_above: float = float("inf")  # overrun above this: partly aligned
    source_longer_above: float = float("inf")  # minus the overrun above this: partly aligned
    _loaded: dict[Path, Any] = field(default_factory=dict, repr=False, compare=False)

    def __getstate__(self) -> dict:  # to the encoding workers: paths and thresholds, not the models
        return {**self.__dict__, "_loaded": {}}

    def _model(self, path: Path) -> Any:
        if path not in self._loaded:
            import torch

            from ..experiment.checkpoint import load_trained_model

            if multiprocessing.parent_process() is not None:  # an encoding worker: one of several
                torch.set_num_threads(1)
            self._loaded[path] = load_trained_model(path)
        return self._loaded[path]

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
        checkpoint = checkpoint_of(path)
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
                       seed: int) -> tuple[ModelFilter, dict]:
    """The filter with thresholds learned from the sample pairs `src`/`tgt` (`rule`: the config's
    data.filters.model), and what was learned, for the report."""
    found = ModelFilter(models, rule.batch_tokens)
    n = len(src)
    if n < 2:
        return found, {"sample_pairs": n, "misaligned_above": None, "target_longer_above": None,
                       "source_longer_above": None}
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
    return found, {
        "sample_pairs": n,
        "misaligned_above": round(above["misalignment"], 4),
        "length_ratio": round(found.length_ratio, 4),
        "target_longer_above": round(above["target"], 4),
        "source_longer_above": round(above["source"], 4),
        "sample_dropped": round(float(np.mean(~kept(real, ""))), 4),
        "misalignment": learned["misalignment"].report(),
        "target_longer": learned["target"].report(),
        "source_longer": learned["source"].report(),
    }
