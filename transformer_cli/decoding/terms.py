"""Terminology, as text: what a line's translation must start with (a prefix), must contain
(constraints) and must not contain (avoided terms); the files they come from (`--constraints`
input lines, `--avoid`, `--glossary`); and the check of a finished translation against them.

Nothing here imports torch: the search side (token tables, the constrained beam) is in
decoding/constraints.py. Matching is on detokenized text, as a user reads it, in Unicode NFC (terms,
glossary entries and the text they are compared with alike: a term typed on macOS comes in
decomposed, NFD, and must still match): a constraint is met, and an avoided term present, where it
occurs as whole words, case-sensitive (not inside a longer word: "Hund" is not met by "Hundeeee",
and avoiding "Hund" does not forbid "Hunde").
"""

from __future__ import annotations

import functools
import re
import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..runtime.errors import TfmError
from ..runtime.files import decode_line, iter_raw_lines

PREFIX_MARK, AVOID_MARK, ESCAPE = "^", "!", "\\"  # in a --constraints line: ^prefix, !avoided, \literal


@dataclass(frozen=True)
class LineTerms:
    """One input line's terminology (target-language text)."""

    prefix: str = ""  # the translation starts with it
    constraints: tuple[str, ...] = ()  # each occurs in the translation
    avoid: tuple[str, ...] = ()  # none occurs in it (as whole words)
    glossary: tuple[tuple[str, str], ...] = ()  # (source term, target term) entries that fired on this line

    def __post_init__(self) -> None:  # NFC, however the terms came (files, options, serve requests)
        object.__setattr__(self, "prefix", nfc(self.prefix))
        object.__setattr__(self, "constraints", unique(nfc(c) for c in self.constraints))
        object.__setattr__(self, "avoid", unique(nfc(a) for a in self.avoid))

    @property
    def empty(self) -> bool:
        return not (self.prefix or self.constraints or self.avoid)

    def with_avoided(self, avoid: Iterable[str]) -> LineTerms:
        return replace(self, avoid=unique(self.avoid + tuple(avoid)))


@dataclass
class TermIds:
    """One line's terminology as target tokens (ids for tfm's engine, pieces for CTranslate2), as the
    search takes it: `avoid` holds every spelling of every avoided term."""

    prefix: list = field(default_factory=list)
    constraints: list[list] = field(default_factory=list)
    avoid: list[list] = field(default_factory=list)

    def room(self) -> int:
        """Output tokens the terms need, <eos> included: the length limit is raised to at least this."""
        return len(self.prefix) + sum(map(len, self.constraints)) + 1


def unique(texts: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(texts))


def nfc(text: str) -> str:
    """Unicode NFC: composed characters ("ü" as one code point, not "u" and a combining diaeresis)."""
    return text if text.isascii() else unicodedata.normalize("NFC", text)


# --------------------------------------------------------------------------- checks


@functools.lru_cache(maxsize=1 << 16)
def whole_word_pattern(term: str) -> re.Pattern:
    """`term` where it is not part of a longer word (no letter or digit right before or after it).
    Cached: every line is checked against the same terms (re's own cache holds 512 patterns, and
    a list of 1,000 avoided words recompiled each of them for every line)."""
    return re.compile(rf"(?<![^\W_]){re.escape(term)}(?![^\W_])")


def occurs_as_words(term: str, text: str) -> bool:
    """`term` in `text` as whole words; the substring test first, which rules most texts out."""
    return term in text and whole_word_pattern(term).search(text) is not None


def missing_constraints(text: str, terms: LineTerms) -> list[str]:
    """The constraints `text` does not contain as whole words (NFC)."""
    text = nfc(text)
    return [c for c in terms.constraints if not occurs_as_words(c, text)]


def avoided_present(text: str, terms: LineTerms) -> list[str]:
    text = nfc(text)
    return [a for a in terms.avoid if occurs_as_words(a, text)]


def conflicts(terms: LineTerms) -> str | None:
    """Why no translation can satisfy `terms` (a prefix or constraint holding an avoided term)."""
    for avoided in terms.avoid if terms.prefix or terms.constraints else ():
        if terms.prefix and occurs_as_words(avoided, terms.prefix):
            return f"the prefix {terms.prefix!r} contains the avoided term {avoided!r}"
        for constraint in terms.constraints:
            if occurs_as_words(avoided, constraint):
                return f"the constraint {constraint!r} contains the avoided term {avoided!r}"
    return None


def check_term(text: str, what: str) -> str:
    """A term as given (one line, not blank) → it without surrounding spaces (they would have to
    occur in the translation too); a TfmError naming `what` otherwise."""
    if not text.strip():
        raise TfmError(f"{what}: an empty term")
    if any(c in text for c in "\t\r\n"):
        raise TfmError(f"{what}: a term is one line without tabs")
    return text.strip()


# --------------------------------------------------------------------------- spellings


def spellings(text: str, piece_ids: dict[str, int], limit: int = 32) -> list[list[int]]:
    """Token sequences that detokenize to `text` (sentencepiece pieces, "▁" for a space), fewest
    pieces first, at most `limit`. Forbidding a term means forbidding each of them: a search that
    finds the usual spelling ("▁Hund") blocked takes another ("▁Hu" "nd") just as readily."""
    n = len(text)
    # ways[i]: pieces that can start at character i and lead to the end
    reachable = [False] * (n + 1)
    reachable[n] = True
    starts: list[list[tuple[int, int]]] = [[] for _ in range(n + 1)]  # (end, id)
    longest = max(map(len, piece_ids), default=0)
    for i in range(n - 1, -1, -1):
        for j in range(i + 1, min(n, i + longest) + 1):
            piece = piece_ids.get(text[i:j])
            if piece is not None and reachable[j]:
                starts[i].append((j, piece))
        reachable[i] = bool(starts[i])
    if not reachable[0]:
        return []
    found: list[list[int]] = []
    frontier: list[tuple[int, list[int]]] = [(0, [])]
    while frontier and len(found) < limit:  # breadth first: by number of pieces
        next_frontier = []
        for position, ids in frontier:
            for end, piece in sorted(starts[position], key=lambda s: -s[0]):
                if end == n:
                    found.append(ids + [piece])
                else:
                    next_frontier.append((end, ids + [piece]))
        frontier = next_frontier[: limit * 8]
    return found[:limit]


# --------------------------------------------------------------------------- files


def split_constraints_line(line: str, where: str) -> tuple[str, LineTerms]:
    """A `--constraints` input line, `source<TAB>term<TAB>term…` (fairseq's format), → the source and
    its terms. A field `^text` is the line's prefix, `!text` a term to avoid on this line; a leading
    backslash keeps a term's first character literal (`\\^2`). `source<TAB>` alone: no terms; an
    empty line is an empty source."""
    if not line.strip():
        return "", LineTerms()
    if "\t" not in line:
        raise TfmError(f"{where}: no tab: --constraints reads source<TAB>term<TAB>term… lines")
    source, *fields = line.split("\t")
    if fields == [""]:
        return source, LineTerms()
    prefix, constraints, avoid = "", [], []
    for number, text in enumerate(fields, start=1):
        what = f"{where}, field {number + 1}"
        if text.startswith(PREFIX_MARK):
            if prefix:
                raise TfmError(f"{what}: a second prefix (a line has at most one ^prefix)")
            prefix = check_term(text[1:], what)
        elif text.startswith(AVOID_MARK):
            avoid.append(check_term(text[1:], what))
        else:
            constraints.append(check_term(text[1:] if text.startswith(ESCAPE) else text, what))
    terms = LineTerms(prefix, unique(constraints), unique(avoid))
    problem = conflicts(terms)
    if problem:
        raise TfmError(f"{where}: {problem}")
    return source, terms


def read_term_list(path: Path) -> tuple[str, ...]:
    """An `--avoid` file: one target word or phrase per line (empty lines skipped)."""
    terms = []
    for number, raw in enumerate(iter_raw_lines(path), start=1):
        text = decode_line(raw, path, number)
        if text:
            terms.append(check_term(text, f"{path}: line {number}"))
    if not terms:
        raise TfmError(f"{path}: no terms in it (one target word or phrase per line)")
    return unique(terms)


@dataclass(frozen=True)
class Glossary:
    """Source term → target term. Where a source term occurs in a line (whole words, case-insensitive),
    its target term becomes a constraint of that line."""

    entries: tuple[tuple[str, str], ...]

    @classmethod
    def read(cls, path: Path) -> Glossary:
        """`source term<TAB>target term` per line; empty lines skipped."""
        entries: list[tuple[str, str]] = []
        seen: dict[str, int] = {}
        for number, raw in enumerate(iter_raw_lines(path), start=1):
            text = decode_line(raw, path, number)
            if not text:
                continue
            where = f"{path}: line {number}"
            fields = text.split("\t")
            if len(fields) != 2:
                raise TfmError(f"{where}: {len(fields)} fields: a glossary line is source term<TAB>target term")
            source, target = check_term(fields[0], f"{where}, source term"), check_term(fields[1], f"{where}, target term")
            key = nfc(source.strip()).casefold()
            if key in seen:
                raise TfmError(f"{where}: the source term {source!r} is also on line {seen[key]} (one target per term)")
            seen[key] = number
            entries.append((nfc(source.strip()), nfc(target.strip())))
        if not entries:
            raise TfmError(f"{path}: no entries in it (source term<TAB>target term per line)")
        return cls(tuple(entries))

    @functools.cached_property
    def folded(self) -> tuple[str, ...]:
        return tuple(s.casefold() for s, _ in self.entries)

    def matches(self, line: str) -> tuple[tuple[str, str], ...]:
        """The entries whose source term occurs in `line`."""
        folded = nfc(line).casefold()
        return tuple(entry for entry, source in zip(self.entries, self.folded) if occurs_as_words(source, folded))

    def apply(self, line: str, terms: LineTerms) -> LineTerms:
        """`terms` with the target terms of the entries that fire on `line` added as constraints."""
        fired = self.matches(line)
        if not fired:
            return terms
        return replace(terms, constraints=unique(terms.constraints + tuple(t for _, t in fired)), glossary=fired)


@dataclass(frozen=True)
class Terminology:
    """What `tfm translate` applies to every chunk of its input: `--constraints` (input lines are
    source<TAB>term…), `--prefix`, `--avoid` and `--glossary`."""

    constraints_input: bool = False
    prefix: str = ""
    avoid: tuple[str, ...] = ()
    glossary: Glossary | None = None
    name: str = "standard input"

    @property
    def active(self) -> bool:
        return bool(self.constraints_input or self.prefix or self.avoid or self.glossary)

    def __call__(self, chunk: list[str], first_line: int) -> tuple[list[str], list[LineTerms] | None]:
        """A chunk of input lines (numbered from `first_line`) → their sources and terms."""
        sources, found = [], []
        for number, line in enumerate(chunk, start=first_line):
            where = f"{self.name}: line {number}"
            source, terms = split_constraints_line(line, where) if self.constraints_input else (line, LineTerms())
            if self.prefix and terms.prefix and terms.prefix != nfc(self.prefix):
                raise TfmError(f"{where}: its own ^prefix {terms.prefix!r} and --prefix {self.prefix!r}: a translation "
                               "starts with one prefix (give it on the line or with --prefix)")
            if self.prefix and not terms.prefix:
                terms = replace(terms, prefix=self.prefix)
            if self.avoid:
                terms = terms.with_avoided(self.avoid)
            if self.glossary is not None and source.strip():
                terms = self.glossary.apply(source, terms)
            problem = conflicts(terms)
            if problem:
                raise TfmError(f"{where}: {problem}")
            sources.append(source)
            found.append(terms)
        return sources, found if any(not t.empty for t in found) else None
