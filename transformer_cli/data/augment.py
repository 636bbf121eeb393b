"""Training pairs as people type them: case and noise augmentation (`data.augment`).

Each epoch draws afresh which training pairs are changed and how (seeded by train.seed + epoch, so
a resumed run draws what an unbroken one would): a pair's source is put in lower case (chat, where
German nouns lose their capitals) or in ALL CAPS as the engines read it (lowered again: ß as ss),
the target as written; or both sides in Title Case; its source gets typos (a share of its words,
each with one character swapped, dropped, doubled or replaced by a neighbouring key) and loses its
final punctuation. The text modifiers are plain functions on strings: `tfm evaluate --augment`
builds its test variants from the same ones.

`shouted` and `titled` tell an ALL-CAPS and a Title Case line, which tfm's engines translate in
lower case and answer in their casing (decode.casing); `ends_with_punctuation`, whether a
translation keeps its final punctuation (decode.end_punctuation). Nothing here imports torch: the
CTranslate2 engine reads it too; data/augmented_data.py draws each epoch's pairs for training.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..experiment.config import AugmentConfig
from ..runtime.errors import TfmError

PUNCTUATION = ".!?;:,…。！？"  # what may end a sentence
END_PUNCTUATION = re.compile(rf"[\s{re.escape(PUNCTUATION)}]+$")
WORD = re.compile(r"\S+")
# Keys beside each other on a QWERTY/QWERTZ keyboard (rows, and the keys above and below).
_ROWS = ("qwertyuiop", "asdfghjkl", "zxcvbnm")


def _neighbours() -> dict[str, str]:
    where = {key: (r, c) for r, row in enumerate(_ROWS) for c, key in enumerate(row)}
    out = {}
    for key, (r, c) in where.items():
        near = [k for k, (r2, c2) in where.items() if k != key and abs(r2 - r) <= 1 and abs(c2 - c) <= 1]
        out[key] = "".join(sorted(near))
    return out


NEIGHBOURS = _neighbours()
TYPOS = ("swap", "drop", "repeat", "neighbour")


def shouted(text: str) -> bool:
    """Whether a line is written in ALL CAPS: two cased letters at least, none of them lower case."""
    cased = 0
    for ch in text:
        if ch.islower():
            return False
        cased += ch.isupper()
    return cased >= 2


def titled(text: str) -> bool:
    """Whether a line is written in Title Case: three words or more that start with a letter, each
    with a capital, and not in ALL CAPS (a sentence of German or English has lower-case words)."""
    words = [word for word in text.split() if word[0].isalpha()]
    return len(words) >= 3 and all(word[0].isupper() for word in words) and not shouted(text)


def shouted_as_read(text: str) -> str:
    """A sentence as it reaches the model when it was typed in ALL CAPS: upper case lowered again,
    which spells ß as ss ("WEISS" → "weiss"), as a German writer in capitals does."""
    return text.upper().lower()


def upper(text: str) -> str:
    return text.upper()


def lower(text: str) -> str:
    return text.lower()


# A line as tfm's engines read it when it came in ALL CAPS or Title Case (decode.casing follow).
as_read = lower


def title(text: str) -> str:
    """Every word's first letter a capital, the rest as written ("a man's hat" → "A Man's Hat")."""
    return WORD.sub(lambda m: m.group(0)[:1].upper() + m.group(0)[1:], text)


def without_end_punctuation(text: str) -> str:
    """The line without its final punctuation (and the spaces before it)."""
    return END_PUNCTUATION.sub("", text)


def ends_with_punctuation(text: str) -> bool:
    return bool(END_PUNCTUATION.search(text)) and bool(text.strip(" " + PUNCTUATION))


def typo(word: str, rng: random.Random) -> str:
    """One typing error in `word` (at least two letters): two neighbouring letters swapped, a
    letter dropped or doubled, or one replaced by a key beside it (in the letter's case)."""
    letters = [i for i, ch in enumerate(word) if ch.isalpha()]
    if len(letters) < 2:
        return word
    kind = TYPOS[rng.randrange(len(TYPOS))]
    i = letters[rng.randrange(len(letters))]
    if kind == "swap":
        j = i + 1 if i + 1 < len(word) and word[i + 1].isalpha() else i - 1
        if j < 0 or not word[j].isalpha() or word[i] == word[j]:
            kind = "drop"  # nothing to swap with (or a swap would change nothing)
        else:
            a, b = min(i, j), max(i, j)
            return word[:a] + word[b] + word[a] + word[b + 1:]
    if kind == "drop":
        return word[:i] + word[i + 1:]
    if kind == "repeat":
        return word[:i + 1] + word[i] + word[i + 1:]
    near = NEIGHBOURS.get(word[i].lower(), "")
    if not near:
        return word[:i] + word[i + 1:]
    key = near[rng.randrange(len(near))]
    return word[:i] + (key.upper() if word[i].isupper() else key) + word[i + 1:]


def with_typos(text: str, rng: random.Random, word_rate: float, at_least_one: bool = False) -> str:
    """`text` with each word of two letters or more mistyped at `word_rate` (`at_least_one`: one
    such word where none was drawn, as for a training pair drawn for typos)."""
    words = list(WORD.finditer(text))
    typable = [k for k, m in enumerate(words) if sum(ch.isalpha() for ch in m.group(0)) >= 2]
    if not typable:
        return text
    chosen = {k for k in typable if rng.random() < word_rate}
    if not chosen and at_least_one:
        chosen = {typable[rng.randrange(len(typable))]}
    out, last = [], 0
    for k, m in enumerate(words):
        out.append(text[last:m.start()])
        out.append(typo(m.group(0), rng) if k in chosen else m.group(0))
        last = m.end()
    out.append(text[last:])
    return "".join(out)


def as_written(text: str) -> str:
    return text


CASES: dict[str, Callable[[str], str]] = {"upper": upper, "title": title, "lower": lower}
CASE_ORDER = ("upper", "title", "lower")
# Training's casings, source and target: ALL CAPS as the engines read it (lowered, decode.casing) with
# the target as written, Title Case on both sides (a short line, or an exported model, sees it as
# typed), lower case on the source alone.
TRAINING_CASES: dict[str, tuple[Callable[[str], str], Callable[[str], str]]] = {
    "upper": (shouted_as_read, as_written), "title": (title, title), "lower": (lower, as_written)}


@dataclass(frozen=True)
class Draw:
    """What an epoch does to one pair: its casing (None: as written), typos, end punctuation."""

    case: str | None = None
    typos: bool = False
    end_punctuation: bool = False

    def __bool__(self) -> bool:
        return self.case is not None or self.typos or self.end_punctuation


def draw_modifiers(cfg: AugmentConfig, rng: np.random.Generator, count: int) -> list[tuple[int, Draw]]:
    """The pairs (positions of `count`) an epoch changes and how: each modifier at its rate, at
    most one casing per pair, typos and end punctuation independently of it."""
    u = rng.random((count, 3))  # (count, 3): casing, typos, punctuation
    edges = np.cumsum([getattr(cfg, name) for name in CASE_ORDER])
    case = np.searchsorted(edges, u[:, 0], side="right")  # (count,) index into CASE_ORDER; 3: none
    typos, punct = u[:, 1] < cfg.typos, u[:, 2] < cfg.end_punctuation
    changed = np.flatnonzero((case < len(CASE_ORDER)) | typos | punct)
    return [(int(k), Draw(CASE_ORDER[case[k]] if case[k] < len(CASE_ORDER) else None, bool(typos[k]),
                          bool(punct[k]))) for k in changed]


def apply_modifiers(src: str, tgt: str, draw: Draw, word_rate: float, rng: random.Random) -> tuple[str, str]:
    """A pair as `draw` says (TRAINING_CASES: ALL CAPS as the engines read it, Title Case on both
    sides, lower case on the source), typos in the source, the source's final punctuation off. The
    target keeps its own: a model that learns to end without it ends early (trained on both sides
    off, 15% of the pairs, the quickstart's test2016 output was 4–10% short: brevity penalty 0.89–0.92
    against 0.97); decode.end_punctuation takes it off where the input has none."""
    if draw.case is not None:
        on_source, on_target = TRAINING_CASES[draw.case]
        src, tgt = on_source(src), on_target(tgt)
    if draw.typos:
        src = with_typos(src, rng, word_rate, at_least_one=True)
    if draw.end_punctuation and ends_with_punctuation(src):
        src = without_end_punctuation(src)
    return src, tgt


def cased_like_training(sentences: list[str], cfg: AugmentConfig, seed: int, source: bool = True) -> list[str]:
    """The vocabulary's sample cased as training will case it (each sentence drawn at the casing
    rates; `source` False: a target side, TRAINING_CASES' second): an 8k BPE learned on
    sentence case alone spells lower-case German nouns in 20% more pieces, learned so in 5% more,
    at the same length of clean text (Multi30k de-en; docs/training.md)."""
    out = list(sentences)
    for k, draw in draw_modifiers(cfg, np.random.default_rng((seed, 0xCA5E)), len(out)):
        if draw.case is not None:
            out[k] = TRAINING_CASES[draw.case][0 if source else 1](out[k])
    return out


# The test variants `tfm evaluate --augment` scores: the split as people type it. Case variants are
# scored without case (the reference keeps its casing, the question is the words).
VARIANTS = ("upper", "title", "lower", "typos", "nopunct", "mix")
CASELESS = {"upper", "title", "lower", "mix"}
VARIANT_SEED = 20260  # fixed: every run's variants are the same lines


def parse_variants(spec: str) -> list[str]:
    """`--augment upper,title` → the variants, in VARIANTS' order; `all`: every one."""
    names = [name.strip().lower() for name in spec.split(",") if name.strip()]
    if names == ["all"]:
        return list(VARIANTS)
    unknown = [name for name in names if name not in VARIANTS]
    if unknown or not names:
        raise TfmError(f"--augment {spec!r}: unknown variant {unknown[0] if unknown else ''!r} "
                       f"(choose from {', '.join(VARIANTS)}, or all)")
    return [name for name in VARIANTS if name in names]


def variant_line(name: str, src: str, ref: str, rng: random.Random) -> tuple[str, str]:
    """One test line (source, reference) as variant `name` types it; `mix` draws one of the others."""
    if name == "mix":
        name = VARIANTS[rng.randrange(len(VARIANTS) - 1)]
    if name in CASES:
        return CASES[name](src), ref
    if name == "typos":
        return with_typos(src, rng, 0.125), ref
    if ends_with_punctuation(src):  # nopunct: both sides, as a user who types none gets none back
        return without_end_punctuation(src), without_end_punctuation(ref)
    return src, ref


def split_variant(name: str, sources: list[str], references: list[str]) -> tuple[list[str], list[str]]:
    """A test split's sources and references as variant `name`: the same lines on every run
    (seeded by VARIANT_SEED and the line's number)."""
    pairs = [variant_line(name, s, r, random.Random(f"{VARIANT_SEED}:{name}:{k}")) if s.strip() else (s, r)
             for k, (s, r) in enumerate(zip(sources, references))]
    return [p[0] for p in pairs], [p[1] for p in pairs]
