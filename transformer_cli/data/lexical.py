"""Misaligned pairs: a lexical translation score learned from the corpus itself (IBM Model 1).

A sample of the training pairs teaches word translation probabilities p(t|s) and p(s|t) by
expectation–maximisation (Brown et al. 1993, Model 1, with a NULL source word); a pair's score is
the mean log-probability of each side's words given the other side, averaged over both directions:
a source sentence paired with the translation of another sentence explains few of its words.

The threshold is learned too, without labels: the same sample's pairs re-paired at random are
misaligned pairs of this corpus's own vocabulary and lengths, and the threshold is the score below
which `recall` of them fall. OpusFilter's WordAlignFilter does the same with eflomal's alignment
scores and a hand-set threshold.

No torch: this runs in `tfm prepare`'s encoding workers. Memory: the model holds the probabilities
above `MIN_PROB` only; training holds one (pair, source word, target word) entry per co-occurrence
of the sample (a 50,000-pair sample of captions: about 8M entries, 150 MB).
"""

from __future__ import annotations

import random
import re
import zlib
from dataclasses import dataclass

import numpy as np

WORD = re.compile(r"\w+")
MIN_PROB = 1e-3  # probabilities below this are dropped from the model (and floored when scoring)
FLOOR = np.log(MIN_PROB / 10)  # log-probability of a word nothing on the other side explains
MAX_WORDS = 80  # longer sentences are left out of training (a failed sentence split teaches noise)
# Training holds one entry per (source word, target word) of each pair: each half of the sample
# stops at this many, whatever `sample_pairs` and the sentence lengths (about 400 MB at the peak).
MAX_ENTRIES = 15_000_000


def words(text: str) -> list[str]:
    return WORD.findall(text.casefold())


_MULTIPLIER = np.int64(-7046029254386353131)  # 0x9E3779B97F4A7C15 (Fibonacci hashing), as int64


def _slot_of(keys: np.ndarray, bits: int) -> np.ndarray:
    return ((keys * _MULTIPLIER) >> np.int64(64 - bits)) & np.int64((1 << bits) - 1)  # wraps: meant


@dataclass
class _Table:
    """p(target word | source word) for the (source id, target id) keys present, in an
    open-addressing hash table (numpy arrays, looked up vectorised: a binary search over the keys
    took two thirds of the scoring time)."""

    keys: np.ndarray  # (entries,) int64: source id · target vocabulary size + target id
    log_probs: np.ndarray  # (entries,) float32
    n_target: int
    slots: np.ndarray = None  # (2^bits,) int64: entry index or -1, at least twice the entries

    def __post_init__(self) -> None:
        bits = max(4, int(np.ceil(np.log2(max(2 * len(self.keys), 1)))))
        self.slots = np.full(1 << bits, -1, dtype=np.int64)
        waiting = np.arange(len(self.keys))
        slot = _slot_of(self.keys, bits)
        while len(waiting):  # linear probing, one round per probe step
            wanted = slot[waiting]
            free = self.slots[wanted] == -1
            taken, first = np.unique(wanted[free], return_index=True)
            self.slots[taken] = waiting[free][first]
            waiting = waiting[self.slots[slot[waiting]] != waiting]
            slot[waiting] = (slot[waiting] + 1) & (len(self.slots) - 1)

    def find(self, keys: np.ndarray) -> np.ndarray:
        """(queries,) the entry index of each key, or -1."""
        bits = len(self.slots).bit_length() - 1
        found = np.full(len(keys), -1, dtype=np.int64)
        active = np.arange(len(keys))
        slot = _slot_of(keys, bits)
        while len(active):
            entry = self.slots[slot[active]]
            hit = entry >= 0
            hit[hit] = self.keys[entry[hit]] == keys[active[hit]]
            found[active[hit]] = entry[hit]
            active = active[(entry >= 0) & ~hit]  # an empty slot ends the probe: not in the table
            slot[active] = (slot[active] + 1) & (len(self.slots) - 1)
        return found


@dataclass
class _Side:
    """One side of a batch of sentences, flattened: ids < 0 are words the model does not know."""

    ids: np.ndarray  # (words,) int64
    hashes: np.ndarray  # (words,) int64, equal for equal words whether known or not
    lengths: np.ndarray  # (sentences,) int64


def _side(sentences: list[list[str]], vocab: dict[str, int]) -> _Side:
    flat = [w for sentence in sentences for w in sentence]
    return _Side(np.fromiter((vocab.get(w, -1) for w in flat), dtype=np.int64, count=len(flat)),
                 np.fromiter(map(hash, flat), dtype=np.int64, count=len(flat)),
                 np.fromiter(map(len, sentences), dtype=np.int64, count=len(sentences)))


def _cross(src: _Side, tgt: _Side) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every (source position or NULL, target position) of each pair, vectorised over the batch:
    (source positions, -1 for NULL; target positions; group = the target position, for sums over
    the source words of each target word)."""
    pair_of_target = np.repeat(np.arange(len(tgt.lengths)), tgt.lengths)  # (target words,)
    per_group = src.lengths[pair_of_target] + 1  # each target word meets NULL and its source's words
    groups = np.repeat(np.arange(len(pair_of_target)), per_group)  # (entries,)
    first_entry = np.cumsum(per_group) - per_group
    within = np.arange(len(groups)) - first_entry[groups]  # 0 = NULL, k = source word k-1
    src_start = np.cumsum(src.lengths) - src.lengths
    src_pos = np.where(within > 0, src_start[pair_of_target][groups] + within - 1, -1)
    return src_pos, groups, per_group


def _vocabulary(sentences: list[list[str]], min_count: int) -> dict[str, int]:
    """Words seen at least `min_count` times, numbered from 1 (0 is NULL). Rarer words stay out of
    the model: trained on the corpus it scores, Model 1 would otherwise explain a rare word by
    whatever stood beside it, and a misaligned pair with rare words would score as aligned."""
    counts: dict[str, int] = {}
    for sentence in sentences:
        for w in sentence:
            counts[w] = counts.get(w, 0) + 1
    frequent = sorted(w for w, c in counts.items() if c >= min_count)
    return {w: i for i, w in enumerate(frequent, start=1)}


def train_model1(src: _Side, tgt: _Side, n_source: int, n_target: int, iterations: int = 5) -> _Table:
    """p(t|s) by EM over the co-occurrences of known words (source id 0: NULL)."""
    src_pos, groups, _ = _cross(src, tgt)
    s_ids = np.where(src_pos >= 0, src.ids[np.maximum(src_pos, 0)], 0)
    t_ids = tgt.ids[groups]
    usable = (s_ids >= 0) & (t_ids >= 0)  # unknown words take no part
    s_ids, t_ids, groups = s_ids[usable], t_ids[usable], groups[usable]
    keys, entry_param = np.unique(s_ids * n_target + t_ids, return_inverse=True)
    del s_ids, t_ids
    param_source = keys // n_target
    probs = np.ones(len(keys), dtype=np.float64)
    for _ in range(iterations):
        p = probs[entry_param]  # (entries,)
        p /= np.bincount(groups, p)[groups]  # posterior of each source word for its target word
        counts = np.bincount(entry_param, p, minlength=len(keys))
        probs = counts / np.bincount(param_source, counts, minlength=n_source)[param_source]
    keep = probs >= MIN_PROB
    return _Table(keys[keep], np.log(probs[keep]).astype(np.float32), n_target)


def _direction_scores(table: _Table, src: _Side, tgt: _Side) -> np.ndarray:
    """Mean over each pair's target words of log p(t | source sentence) (Model 1: the mean over the
    source words and NULL); NaN where no target word counts. A word the model does not know counts
    as explained when the other side has it too (names, numbers), and is left out otherwise."""
    scores = np.full(len(tgt.lengths), np.nan)
    if not len(tgt.ids):
        return scores
    src_pos, groups, per_group = _cross(src, tgt)
    s_ids = np.where(src_pos >= 0, src.ids[np.maximum(src_pos, 0)], 0)
    t_ids = tgt.ids[groups]
    keys = s_ids * table.n_target + t_ids
    p = np.zeros(len(keys))
    known = (s_ids >= 0) & (t_ids >= 0)
    entry = np.full(len(keys), -1, dtype=np.int64)
    entry[known] = table.find(keys[known])
    found = entry >= 0
    p[found] = np.exp(table.log_probs[entry[found]].astype(np.float64))
    n_words = len(tgt.ids)
    prob = np.bincount(groups, p, minlength=n_words) / per_group  # (target words,)
    same = (src_pos >= 0) & (src.hashes[np.maximum(src_pos, 0)] == tgt.hashes[groups])
    shared = np.bincount(groups, same, minlength=n_words) > 0
    logp = np.log(np.maximum(np.where(shared, np.maximum(prob, 0.5), prob), np.exp(FLOOR)))
    counted = (tgt.ids >= 0) | shared
    pair_of_target = np.repeat(np.arange(len(tgt.lengths)), tgt.lengths)
    total = np.bincount(pair_of_target, np.where(counted, logp, 0.0), minlength=len(tgt.lengths))
    n = np.bincount(pair_of_target, counted, minlength=len(tgt.lengths))
    has = n > 0
    scores[has] = total[has] / n[has]
    return scores


def _half(src_text: list[str]) -> np.ndarray:
    """(pairs,) 0 or 1: which half of the sample a pair belongs to, by a stable hash of its source
    (the same in every worker process, unlike Python's `hash`)."""
    return np.fromiter((zlib.crc32(s.encode()) & 1 for s in src_text), dtype=np.int64, count=len(src_text))


@dataclass
class LexicalModel:
    """IBM Model 1 both ways, twice: one pair of models per half of the sample. Each pair is scored
    by the models of the half it is not in (cross-fitting): Model 1 trained on a misaligned pair
    learns to explain it, and would then score it as aligned."""

    src_vocab: dict[str, int]  # word → id (from 1; 0 is NULL)
    tgt_vocab: dict[str, int]
    halves: list[tuple[_Table, _Table]]  # per half: p(tgt word | src word), p(src word | tgt word)
    threshold: float

    def scores(self, src_text: list[str], tgt_text: list[str]) -> np.ndarray:
        """(pairs,) the pairs' scores, higher = better aligned; NaN where no word can be scored."""
        scores = np.full(len(src_text), np.nan)
        half = _half(src_text)
        for which, (forward, backward) in enumerate(self.halves):
            rows = np.flatnonzero(half != which)  # the pairs this half's models never saw
            src = _side([words(src_text[i])[:MAX_WORDS] for i in rows], self.src_vocab)
            tgt = _side([words(tgt_text[i])[:MAX_WORDS] for i in rows], self.tgt_vocab)
            scores[rows] = (_direction_scores(forward, src, tgt) + _direction_scores(backward, tgt, src)) / 2
        return scores

    def misaligned(self, src_text: list[str], tgt_text: list[str]) -> np.ndarray:
        """(pairs,) bool: the pairs scored below the threshold (a pair that cannot be scored is kept)."""
        scores = self.scores(src_text, tgt_text)
        return ~np.isnan(scores) & (scores < self.threshold)


def learn_lexical_model(src_text: list[str], tgt_text: list[str], recall: float, seed: int,
                        min_count: int = 3, iterations: int = 5) -> LexicalModel:
    """Model 1 both ways on each half of the sample's pairs, and the threshold that puts `recall`
    of the same pairs re-paired at random below it."""
    src_words, tgt_words = list(map(words, src_text)), list(map(words, tgt_text))
    src_vocab, tgt_vocab = _vocabulary(src_words, min_count), _vocabulary(tgt_words, min_count)
    n_src, n_tgt = len(src_vocab) + 1, len(tgt_vocab) + 1
    half = _half(src_text)
    halves = []
    for which in (0, 1):
        rows, entries = [], 0
        for i in np.flatnonzero(half == which):
            if len(src_words[i]) <= MAX_WORDS and len(tgt_words[i]) <= MAX_WORDS:
                entries += (len(src_words[i]) + 1) * len(tgt_words[i])
                if entries > MAX_ENTRIES:
                    break
                rows.append(i)
        src = _side([src_words[i] for i in rows], src_vocab)
        tgt = _side([tgt_words[i] for i in rows], tgt_vocab)
        halves.append((train_model1(src, tgt, n_src, n_tgt, iterations), train_model1(tgt, src, n_tgt, n_src, iterations)))
    model = LexicalModel(src_vocab, tgt_vocab, halves, threshold=float("-inf"))
    order = list(range(len(tgt_text)))
    random.Random(seed).shuffle(order)
    shuffled = model.scores(src_text, [tgt_text[i] for i in order])
    shuffled = shuffled[~np.isnan(shuffled)]
    if len(shuffled):
        model.threshold = float(np.quantile(shuffled, recall))
    return model
