"""Corpus cleaning: which training pairs `tfm prepare` drops, and why (`data.filters`).

Each pair meets the filters in this order and is counted at the first that drops it:

    empty        a side empty or whitespace only (always on)
    encoding     invalid UTF-8, a NUL byte, a control character or U+FFFD on a side   (text)
    length       fragments (both sides under min_words words), a side over max_words words or
                 max_chars characters, or with more than max_sentences sentences       (length)
    copy         the target is the source, or nearly: word-set overlap ≥ max_overlap  (copies)
    characters   a side with too few letters, or letters of another script            (characters)
    repeats      a word making up too much of a side (crawl garbage)                  (repeats)
    numbers      the sides' digits disagree                                           (numbers)
    language     a side identified as another language than its own                   (language)
    misaligned   a low lexical translation score (data/lexical.py; off by default)    (lexical)
    model_misaligned  a high (dual) cross-entropy under translation models             (model)
    partly_aligned    a side that goes on past the translation of the other            (model)
                 (data/model_filter.py; off by default)
    too_long     a side over data.max_len pieces (after encoding)
    length_ratio the sides' pieces differ by more than data.max_len_ratio (after encoding)
    duplicate    a pair (or source) seen before in the direction, by an 8-byte hash   (duplicates)

Everything up to `partly_aligned` runs on text, before encoding (a dropped pair is never encoded),
in the encoding workers; `duplicate` runs in the main process, in corpus order, so the first of
equal pairs is kept whatever the number of workers. No torch here (the model filter imports it
in the workers that score).
"""

from __future__ import annotations

import difflib
import hashlib
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from .language_id import identify, model_language
from .lexical import LexicalModel

if TYPE_CHECKING:
    from ..experiment.config import FiltersConfig
    from .model_filter import LearnedThresholds, ModelFilter

COMMON_MIN_HITS, COMMON_MIN_SHARE = 2, 0.4  # `plainly_in_language`: at least 2 words and 40% of them
# The reasons in the order the filters run (the report lists them so).
REASONS = ("empty", "encoding", "length", "copy", "characters", "repeats", "numbers", "language", "misaligned",
           "model_misaligned", "partly_aligned", "too_long", "length_ratio", "duplicate")

_NONZERO_DIGIT = re.compile("[1-9]")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\ufffd]")  # tab is allowed
_NOT_LETTER = re.compile(r"[^\w\s]+|[\d_]+")  # what is neither a letter nor white space
_SENTENCE_END = re.compile(r"[.!?…。！？][\"'»”’)\]]*\s+(\w)")  # followed by a word: a boundary if it is capitalised

# Letters of the script each language is written in (a language not listed is not checked).
_LATIN = "A-Za-z\u00aa\u00ba\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u024f\u1e00-\u1eff"
_HAN = "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
_SCRIPTS = {
    "latin": _LATIN,
    "cyrillic": "\u0400-\u052f",
    "greek": "\u0370-\u03ff\u1f00-\u1fff",
    "arabic": "\u0600-\u06ff\u0750-\u077f\u08a0-\u08ff\ufb50-\ufdff\ufe70-\ufeff",
    "hebrew": "\u0590-\u05ff\ufb1d-\ufb4f",
    "devanagari": "\u0900-\u097f",
    "thai": "\u0e00-\u0e7f",
    "han": _HAN,
    "japanese": _HAN + "\u3040-\u30ff\u31f0-\u31ff",
    "korean": _HAN + "\uac00-\ud7af\u1100-\u11ff\u3130-\u318f",
}
_LANGUAGE_SCRIPT = {
    **dict.fromkeys("af az br bs ca cs cy da de en eo es et eu fi fo fr fy ga gd gl hr ht hu id is it la lb lt "
                    "lv mg ms mt nb nl nn no oc pl pt rm ro sk sl so sq sv sw tl tr uz vi wa yo zu".split(), "latin"),
    **dict.fromkeys("be bg kk ky mk mn ru tg tt uk".split(), "cyrillic"),
    "el": "greek", **dict.fromkeys("ar fa ps ur ug".split(), "arabic"), **dict.fromkeys("he yi".split(), "hebrew"),
    **dict.fromkeys("hi mr ne sa".split(), "devanagari"), "th": "thai", "zh": "han", "ja": "japanese", "ko": "korean",
}


def script_of(language: str) -> str | None:
    """The script a language code is written in (`de`, `pt_BR`, `zh-Hans`), None when not known."""
    return _LANGUAGE_SCRIPT.get(re.split(r"[-_]", language.lower(), maxsplit=1)[0])


@dataclass
class DirectionFilters:
    """What the workers need to filter one direction's pairs: the settings (`data.filters`), the
    direction's languages, and the lexical model and model filter learned for it (or None), with
    the model filter's thresholds as learned (the cleaning report keeps them)."""

    settings: FiltersConfig
    src_lang: str
    tgt_lang: str
    lexical: LexicalModel | None = None
    scorer: ModelFilter | None = None
    learned: LearnedThresholds | None = None
    # each side's most frequent words, from lines fastText identified as its language
    # (`learn_common_words`): a line made mostly of them skips the identifier
    common_words: dict[str, frozenset[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._enabled = {name: rule.enabled for name in type(self.settings).model_fields
                         if hasattr(rule := getattr(self.settings, name), "enabled")}
        self._latin = {"src": script_of(self.src_lang) == "latin", "tgt": script_of(self.tgt_lang) == "latin"}
        # letters (\w less digits and _) outside the script of each side's language
        self._other_script = {side: (re.compile(rf"[^\W\d_{_SCRIPTS[s]}]+") if (s := script_of(lang)) else None)
                              for side, lang in (("src", self.src_lang), ("tgt", self.tgt_lang))}
        self._language = ({side: model_language(lang) for side, lang in (("src", self.src_lang), ("tgt", self.tgt_lang))}
                          if self.settings.language.enabled else {"src": None, "tgt": None})

    def unidentifiable_sides(self) -> dict[str, str]:
        """With the language filter on: the sides (source, target) whose language the identifier does
        not know (a code it has no model for, `tlh`, a typo): the filter cannot check them."""
        if not self.settings.language.enabled:
            return {}
        return {side: lang for side, key, lang in (("source", "src", self.src_lang), ("target", "tgt", self.tgt_lang))
                if self._language[key] is None}

    def on(self, name: str) -> bool:
        return self._enabled[name]

    # ------------------------------------------------------------------ one pair's text checks

    def _length(self, src_tokens: list[str], tgt_tokens: list[str], src: str, tgt: str) -> bool:
        rule = self.settings.length
        longest = max(len(src_tokens), len(tgt_tokens))
        if longest < rule.min_words or longest > rule.max_words:
            return True
        if max(len(src), len(tgt)) > rule.max_chars:
            return True
        return max(sentences(src), sentences(tgt)) > rule.max_sentences

    def _characters(self, text: str, tokens: list[str], side: str) -> bool:
        rule = self.settings.characters
        visible = sum(map(len, tokens))
        letters = visible - sum(map(len, _NOT_LETTER.findall(text)))
        if letters < rule.min_letters * visible:
            return True
        script = self._other_script[side]  # letters outside the language's script (clean text: none)
        if script is None or not letters or (text.isascii() and self._latin[side]):
            return False
        return sum(map(len, script.findall(text))) > (1 - rule.min_script) * letters

    def _repeats(self, tokens: list[str]) -> bool:
        rule = self.settings.repeats
        if len(tokens) < rule.min_words:
            return False
        # the most frequent token occurs at most len - distinct + 1 times: most lines end here
        if len(tokens) - len(set(tokens)) + 1 <= rule.max_share * len(tokens):
            return False
        return Counter(tokens).most_common(1)[0][1] > rule.max_share * len(tokens)

    def reason(self, src: str | None, tgt: str | None) -> str | None:
        """The first text filter that drops the pair (None: kept so far), language identification
        and the lexical score aside. `None` text: undecodable."""
        if src is None or tgt is None:
            return "encoding"
        return self._reason(src, tgt, src.casefold().split(), tgt.casefold().split())

    def _reason(self, src: str, tgt: str, src_tokens: list[str], tgt_tokens: list[str]) -> str | None:
        """`reason`, with each side's case-folded words (computed once for every filter)."""
        if not src_tokens or not tgt_tokens:
            return "empty"
        on = self._enabled
        if on["text"] and (_CONTROL.search(src) or _CONTROL.search(tgt)):
            return "encoding"
        if on["length"] and self._length(src_tokens, tgt_tokens, src, tgt):
            return "length"
        if on["copies"] and is_copy(src, tgt, self.settings.copies.max_overlap, src_tokens, tgt_tokens):
            return "copy"
        if on["characters"] and (self._characters(src, src_tokens, "src") or
                                 self._characters(tgt, tgt_tokens, "tgt")):
            return "characters"
        if on["repeats"] and (self._repeats(src_tokens) or self._repeats(tgt_tokens)):
            return "repeats"
        if on["numbers"] and numbers_similarity(src, tgt) < self.settings.numbers.min_similarity:
            return "numbers"
        return None

    def plainly_in_language(self, text: str, side: str, tokens: list[str] | None = None) -> bool:
        """Most of the line's words are among the most frequent of its side's language and fewer
        among the other side's: identification would only confirm it (at a tenth of its cost)."""
        own = self.common_words.get(side)
        if not own:
            return False
        tokens = text.casefold().split() if tokens is None else tokens
        hits = sum(map(own.__contains__, tokens))
        if hits < COMMON_MIN_HITS or hits < COMMON_MIN_SHARE * len(tokens):
            return False
        return hits > sum(map(self.common_words.get("tgt" if side == "src" else "src", frozenset()).__contains__, tokens))

    def _wrong_language(self, src: str, tgt: str, src_tokens: list[str] | None = None,
                        tgt_tokens: list[str] | None = None) -> bool:
        min_words = self.settings.language.min_words
        for side, text, tokens in (("src", src, src_tokens), ("tgt", tgt, tgt_tokens)):
            expected = self._language[side]
            if tokens is None:
                tokens = text.casefold().split()
            if expected is not None and len(tokens) >= min_words and not self.plainly_in_language(text, side, tokens) and \
                    identify(text, one_line=True)[0] != expected:
                return True
        return False

    def learn_common_words(self, src: list[str], tgt: list[str], top: int = 100) -> None:
        """Each side's `top` most frequent words, counted over the lines of `src`/`tgt` that
        fastText identifies as the side's language (a file in the wrong language yields none, and
        every line of it then meets the identifier)."""
        for side, lines in (("src", src), ("tgt", tgt)):
            expected = self._language[side]
            if expected is None:
                continue
            counts = Counter(token for line in lines if identify(line)[0] == expected
                             for token in line.casefold().split())
            self.common_words[side] = frozenset(word for word, _ in counts.most_common(top))

    def reasons(self, src: list[str | None], tgt: list[str | None], scored: bool = True) -> list[str | None]:
        """Each pair's reason to be dropped by the filters, or None; `scored=False` leaves the model
        filter out (a vocabulary sample: its pairs' words count, not their alignment)."""
        found: list[str | None] = []
        check_language = self._language["src"] or self._language["tgt"]
        for s, t in zip(src, tgt):
            if s is None or t is None:
                found.append("encoding")
                continue
            s_tokens, t_tokens = s.casefold().split(), t.casefold().split()
            reason = self._reason(s, t, s_tokens, t_tokens)
            if reason is None and check_language and self._wrong_language(s, t, s_tokens, t_tokens):
                reason = "language"
            found.append(reason)
        if self.lexical is not None and self.on("lexical"):
            open_rows = [i for i, r in enumerate(found) if r is None]
            if open_rows:
                bad = self.lexical.misaligned([src[i] for i in open_rows], [tgt[i] for i in open_rows])
                for i in np.asarray(open_rows)[bad]:
                    found[i] = "misaligned"
        if scored and self.scorer is not None and self.on("model"):
            open_rows = [i for i, r in enumerate(found) if r is None]
            scores = self.scorer.reasons([src[i] for i in open_rows], [tgt[i] for i in open_rows])  # type: ignore[misc]
            for i, reason in zip(open_rows, scores):
                found[i] = reason
        return found


def sentences(text: str) -> int:
    """Sentences in a line: 1 + the sentence ends followed by a capitalised word."""
    return 1 + sum(map(str.isupper, _SENTENCE_END.findall(text)))


def is_copy(src: str, tgt: str, max_overlap: float, src_tokens: list[str] | None = None,
            tgt_tokens: list[str] | None = None) -> bool:
    """The target is the source untranslated: the same text, or sets of case-folded words that
    overlap by `max_overlap` or more (Jaccard)."""
    if src.strip() == tgt.strip():
        return True
    a = set(src.casefold().split() if src_tokens is None else src_tokens)
    b = set(tgt.casefold().split() if tgt_tokens is None else tgt_tokens)
    return bool(a and b) and len(a & b) >= max_overlap * len(a | b)


def numbers_similarity(src: str, tgt: str) -> float:
    """How alike the sides' non-zero digits are, in order (OpusFilter's NonZeroNumeralsFilter:
    zeros are left out so 1,000 and 1.000.000 style differences weigh less); 1.0 without digits.
    Unlike OpusFilter, a single digit on one side alone is no mismatch: "vier Kühe" is "4 cows"."""
    if not _NONZERO_DIGIT.search(src) and not _NONZERO_DIGIT.search(tgt):
        return 1.0
    a, b = _NONZERO_DIGIT.findall(src), _NONZERO_DIGIT.findall(tgt)
    if len(a) + len(b) <= 1:
        return 1.0
    return difflib.SequenceMatcher(None, a, b, autojunk=False).ratio()


def pair_hashes(src: list[str], tgt: list[str], by: str, direction: int) -> np.ndarray:
    """(pairs,) uint64: an 8-byte digest of each pair (or source, `by`), of its direction."""
    out = np.empty(len(src), dtype=np.uint64)
    for i, (s, t) in enumerate(zip(src, tgt)):
        text = f"{direction}\t{s}" if by == "source" else f"{direction}\t{s}\t{t}"
        out[i] = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
    return out


class SeenHashes:
    """The set of hashes seen so far, in sorted numpy runs merged like a binary counter (a run of n
    hashes is merged with the next only when that is no larger than 2n): 8 bytes a pair and
    O(log n) runs to search, where a Python set would take about 70 bytes a pair."""

    def __init__(self) -> None:
        self.runs: list[np.ndarray] = []

    def __len__(self) -> int:
        return sum(len(run) for run in self.runs)

    def first_seen(self, hashes: np.ndarray) -> np.ndarray:
        """(n,) bool: which of `hashes` are new (not seen before, nor earlier in `hashes`); adds them."""
        new = np.zeros(len(hashes), dtype=bool)
        if not len(hashes):
            return new
        _, first = np.unique(hashes, return_index=True)
        new[first] = True
        for run in self.runs:
            where = np.minimum(np.searchsorted(run, hashes), len(run) - 1)
            new &= run[where] != hashes
        run = np.sort(hashes[new])
        while self.runs and len(self.runs[-1]) <= 2 * len(run):
            run = np.sort(np.concatenate([self.runs.pop(), run]))
        self.runs.append(run)
        return new
