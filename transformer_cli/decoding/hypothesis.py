"""What a search returns: shared by every engine (tfm's own search, CTranslate2) and by the memory
budget, without importing torch. How long its input and output may be is the model's
(model/lengths.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Hypothesis:
    tokens: list  # ids (tfm's engine) or pieces (CTranslate2), without <bos>/<eos>
    score: float  # length-normalised log-probability (greedy: plain sum of log-probs)
