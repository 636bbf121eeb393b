"""Which language a line is in: a character n-gram naive Bayes classifier trained on a run's own
training text (one sample per language), for the off-target rate of a multilingual model (the share
of its translations that are not in the language asked for). Small and stated rather than a
downloaded model: on Multi30k's four languages it tells held-out references apart almost always
(tests/test_multilingual.py measures it), which is what an off-target rate needs.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

from .corpus import sample_lines

ORDERS = (1, 2, 3)  # character n-gram lengths


def char_ngrams(text: str) -> list[str]:
    padded = f" {' '.join(text.lower().split())} "
    return [padded[i : i + n] for n in ORDERS for i in range(len(padded) - n + 1)]


class LanguageId:
    """Multinomial naive Bayes over character 1–3-grams, add-one smoothed."""

    def __init__(self, samples: dict[str, list[str]]):
        self.languages = sorted(samples)
        counts = {language: Counter(g for line in lines for g in char_ngrams(line))
                  for language, lines in samples.items()}
        vocabulary = len(set().union(*counts.values())) + 1
        self.log_prob: dict[str, dict[str, float]] = {}
        self.unseen: dict[str, float] = {}
        for language, counter in counts.items():
            total = sum(counter.values()) + vocabulary
            self.log_prob[language] = {g: math.log((c + 1) / total) for g, c in counter.items()}
            self.unseen[language] = math.log(1 / total)

    @classmethod
    def from_files(cls, files: dict[str, list[Path]], lines_per_language: int = 5000, seed: int = 1) -> LanguageId:
        return cls({language: sample_lines(paths, lines_per_language, seed) for language, paths in files.items()})

    def identify(self, text: str) -> str:
        grams = char_ngrams(text)
        return max(self.languages, key=lambda language: sum(
            self.log_prob[language].get(g, self.unseen[language]) for g in grams))

    def off_target_rate(self, lines: list[str], language: str) -> float:
        """The share of the non-empty `lines` not identified as `language`."""
        lines = [line for line in lines if line.strip()]
        return sum(self.identify(line) != language for line in lines) / len(lines) if lines else 0.0
