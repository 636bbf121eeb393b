"""How long a model's input and output may be: what its position table holds, the one place these
rules are written. Shared by prepare (which cuts over-long lines), every engine and the memory
budget, without importing torch."""

from __future__ import annotations


def source_token_limit(max_positions: int) -> int:
    """Source tokens a line keeps, </s> excluded: with its </s> a source takes at most
    max_positions − 1 positions (as the target does with <bos>); longer lines are cut, with a
    warning where the user sees it. The one place this rule is written."""
    return max_positions - 2


def output_token_cap(max_positions: int) -> int:
    """The most output tokens any search may produce: <bos> takes the first position."""
    return max_positions - 1


def output_length_limit(src_len: int, a: float, b: int, max_positions: int) -> int:
    """The most output tokens a sentence of `src_len` tokens (<eos> included) may get:
    a · src_len + b, at most what the position table holds (min_len aside)."""
    cap = output_token_cap(max_positions)
    return max(min(int(min(a, float(cap)) * src_len) + min(b, cap), cap), 1)
