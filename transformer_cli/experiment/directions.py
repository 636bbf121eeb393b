"""Translation directions of a multilingual run, and how often training draws each.

A run lists `data.directions` (`[en-de, de-en, en-fr, …]`); each direction's files are
`<prefix>.<src>` and `<prefix>.<tgt>` of the same `data.train` / `valid` / `test` prefixes (corpora
aligned across languages, as Multi30k, Europarl or TED are). `tfm prepare` writes all directions'
pairs one after the other, each source led by its target-language tag `>>tgt<<`, and records where
each direction's pairs lie (`DirectionRange`). Training then draws every epoch's pairs by
temperature sampling (`epoch_sample`): direction d with n_d pairs is drawn at the rate
p_d ∝ (n_d / N)^(1/T), so T = 1 follows the data's sizes, T → ∞ treats directions alike, and the
default T = 5 (as M2M-100 and mBART-50 train) lifts small directions without repeating them to
exhaustion. No torch here: prepare and evaluate import it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # numpy is imported where sampling happens: reading a config imports neither it nor torch
    import numpy as np

LANGUAGE = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,31}")  # no "-": it separates source from target


@dataclass(frozen=True)
class Direction:
    src: str
    tgt: str

    @property
    def name(self) -> str:
        return f"{self.src}-{self.tgt}"


def parse_direction(text: str) -> Direction:
    """'en-de' → Direction('en', 'de'); a ValueError says what is wrong."""
    src, dash, tgt = str(text).partition("-")
    if not dash or not LANGUAGE.fullmatch(src) or not LANGUAGE.fullmatch(tgt):
        raise ValueError(f"{text!r} is not a direction: write source-target with language codes of letters, "
                         "digits and '_', e.g. en-de")
    if src == tgt:
        raise ValueError(f"{text!r}: the source and target language are the same")
    return Direction(src, tgt)


def parse_directions(spec: str, what: str) -> list[Direction]:
    """'de-fr,fr-cs' (a command line's comma-separated list) → directions; ValueError names `what`."""
    names = [part.strip() for part in spec.split(",") if part.strip()]
    if not names:
        raise ValueError(f"{what} {spec!r}: give directions such as en-de,de-en")
    try:
        return list(dict.fromkeys(parse_direction(name) for name in names))
    except ValueError as exc:
        raise ValueError(f"{what}: {exc}") from None


def tag(language: str) -> str:
    """The target-language tag, as a line of text starts with it."""
    return f">>{language}<<"


def tag_piece(language: str) -> str:
    """The tag's piece in the vocabulary (a sentencepiece user symbol): with the word-start mark,
    as a line's first word is encoded, so that ">>de<< A man" is the pieces ▁>>de<< ▁A ▁man (as
    in OPUS-MT's vocabularies), one piece for the tag."""
    return "\u2581" + tag(language)


@dataclass(frozen=True)
class DirectionRange:
    """Where one direction's pairs lie in a prepared split: pairs [start, end)."""

    direction: str
    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start


def split_ranges(directions: list[dict], split: str) -> list[DirectionRange]:
    """The directions of a prepared split, from prepare.json's (a run prepared before directions
    were recorded: none)."""
    return [DirectionRange(d["name"], *d[split]) for d in directions]


def sampling_rates(sizes: list[int], temperature: float) -> np.ndarray:
    """p_d ∝ (n_d / N)^(1/T): each direction's share of the pairs drawn (sums to 1)."""
    import numpy as np
    counts = np.asarray(sizes, dtype=np.float64)
    if counts.sum() <= 0:
        return np.full(len(counts), 1.0 / max(len(counts), 1))
    weights = np.where(counts > 0, (counts / counts.sum()) ** (1.0 / temperature), 0.0)
    return weights / weights.sum()


def epoch_sample(ranges: list[DirectionRange], temperature: float, seed: int) -> np.ndarray:
    """One epoch's pair indices, as many as the split holds, drawn from the directions at their
    sampling rates: a direction drawn more often than it has pairs repeats them in fresh random
    orders, one drawn less often takes a random subset. Sorted, so that the result depends only on
    (ranges, temperature, seed): resume is exact."""
    import numpy as np

    rng = np.random.default_rng(seed)
    total = sum(r.size for r in ranges)
    rates = sampling_rates([r.size for r in ranges], temperature)
    wanted = _largest_remainder(rates * total)
    drawn = []
    for r, count in zip(ranges, wanted):
        if r.size == 0 or count == 0:
            continue
        full, rest = divmod(int(count), r.size)
        drawn += [np.arange(r.start, r.end)] * full
        drawn.append(r.start + rng.choice(r.size, size=rest, replace=False))
    return np.sort(np.concatenate(drawn)) if drawn else np.zeros(0, dtype=np.int64)


def _largest_remainder(shares: np.ndarray) -> np.ndarray:
    """Whole counts summing to round(sum(shares)), each within 1 of its share."""
    import numpy as np

    floors = np.floor(shares).astype(np.int64)
    short = int(round(shares.sum())) - int(floors.sum())
    if short > 0:
        floors[np.argsort(floors - shares)[:short]] += 1
    return floors
