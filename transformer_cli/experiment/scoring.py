"""Scoring a hypothesis: how a search ranks what it found and when it may stop, in one place.

A hypothesis's *total* is the plain sum of its tokens' log-probabilities (</s> included). Beam
search ranks by the total divided by a length penalty, so that longer outputs are not punished for
having more (negative) terms; greedy search and sampling keep the plain total. The engines differ
in the penalty only:

- tfm's own search: GNMT's (Wu et al., 2016), ((5 + length) / 6) ** alpha;
- CTranslate2: length ** alpha (also Hugging Face `generate`'s `length_penalty`, Marian's default 1).

`decode.length_penalty` is alpha for both. Everything here is arithmetic on numbers (or anything
that supports `+`, `/` and `**`, such as a tensor): no torch, so the engines' settings, the
importers and distillation read the same rules as the search (which imports this wing).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, TypeVar

Number = TypeVar("Number")
Convention = Literal["gnmt", "length"]  # tfm's search; CTranslate2 (and Hugging Face generate)

# Hugging Face `generate` divides a beam's score by length ** length_penalty, 1.0 in Marian's (OPUS-MT)
# generation configs: an imported model's `decode.length_penalty`.
MARIAN_LENGTH_PENALTY = 1.0


def gnmt_length_penalty(length: Number, alpha: float) -> Number:
    """GNMT's divisor for an output of `length` tokens: ((5 + length) / 6) ** alpha (1 at length 1)."""
    return ((5.0 + length) / 6.0) ** alpha  # type: ignore[operator]


def length_penalty(length: float, alpha: float, convention: Convention = "gnmt") -> float:
    """The divisor that `convention`'s beam search applies to a total of `length` tokens."""
    return gnmt_length_penalty(length, alpha) if convention == "gnmt" else float(length) ** alpha


def search_alpha(alpha: float, beam: int) -> float:
    """The alpha a search applies: `decode.length_penalty` for beam search, 0 (no normalisation) for
    greedy search, where one hypothesis per sentence has nothing to be ranked against."""
    return alpha if beam > 1 else 0.0


def normalised_score(total: float, length: int, alpha: float, beam: int, convention: Convention = "gnmt") -> float:
    """The score a search reports for a hypothesis of `length` tokens whose log-probabilities sum to `total`."""
    return total / length_penalty(length, search_alpha(alpha, beam), convention)


def total_log_prob(score: float, length: int, alpha: float, beam: int, convention: Convention = "gnmt") -> float:
    """`normalised_score` undone: the plain sum of log-probabilities behind a search's `score`."""
    return score * length_penalty(length, search_alpha(alpha, beam), convention)


def finished_needed(constrained: Sequence[bool], nbest: int, beam: int, alpha: float) -> list[int]:
    """Beam search's stopping rule: per sentence (whether it has positive constraints), how many
    finished hypotheses it waits for before it may stop, once the best of them beats its best live
    beam ended now.

    With alpha = 0 a live beam's score only falls, so beating the best live beam now is final:
    `nbest`. With alpha > 0 a longer hypothesis can still overtake it (the penalty grows with
    length): the beam's size, as CTranslate2 waits for with a length penalty. A sentence with
    constraints waits for `nbest` only: its </s> is barred until every term is placed (no
    improbable early ends to outwait), and the beams that have placed them all are few: waiting for
    a beam's worth took 1.6x the steps for no gain in BLEU (docs/translation.md)."""
    return [nbest if alpha == 0 or has_constraints else max(nbest, beam) for has_constraints in constrained]
