"""Sentence splitting, by sentencex (Wikimedia's rule-based segmenter): as accurate as pysbd on
Multi30k and WMT14 in tfm's languages, tens of times faster, and it knows Czech — with one
boundary it misses added back (scripts/compare_segmenters.py, docs/translation.md)."""

from __future__ import annotations

import functools
import re

FALLBACK_LANGUAGE = "en"  # a model without a source language (a multilingual one) splits by English rules

# A full stop after a word, then a number: "… eine Landschaft. 2 Mädchen sitzen." sentencex's German
# and Czech rules never end a sentence before a digit (so that "am 3. Mai" stays whole); tfm ends one
# there when the word before the stop has 4+ letters and sentencex itself would end a sentence after
# that word before a capital (so "Nr. 5", "S. 12", "ca. 30", "Sept. 2019" stay whole).
BEFORE_A_NUMBER = re.compile(r"(?<![^\W\d_])([^\W\d_]{4,})[.!?]\s+(?=\d)")


@functools.lru_cache(maxsize=4096)
def ends_a_sentence(lang: str, word: str) -> bool:
    """Whether sentencex takes `word.` before a capitalised word as a sentence's end (not an abbreviation)."""
    import sentencex

    return len(list(sentencex.segment(lang, f"{word}. Xaver kam."))) > 1


def sentences_before_numbers(lang: str, text: str, start: int, end: int) -> list[tuple[int, int]]:
    """The span text[start:end] cut after each full stop that ends a sentence before a number."""
    spans = []
    for match in BEFORE_A_NUMBER.finditer(text, start, end):
        if ends_a_sentence(lang, match.group(1)):
            cut = match.start(1) + len(match.group(1)) + 1
            spans.append((start, cut))
            start = match.end()
    return [*spans, (start, end)]


def sentence_spans(text: str, lang: str | None) -> list[tuple[int, int]]:
    """(start, end) of each sentence of `text`, surrounding whitespace left out; a line break is
    not a sentence end by itself (hard-wrapped prose), punctuation is."""
    import sentencex

    lang = lang or FALLBACK_LANGUAGE
    spans, at = [], 0
    for part in sentencex.segment(lang, text.replace("\n", " ")):
        start = at + len(part) - len(part.lstrip())
        end = at + len(part.rstrip())
        at += len(part)
        if end > start:
            spans.extend(sentences_before_numbers(lang, text, start, end))
    if at != len(text):  # the segmenter gave back other text than it was given: the text as one sentence
        stripped = text.strip()
        return [(text.index(stripped), text.index(stripped) + len(stripped))] if stripped else []
    return spans
