"""Target-language tags: a piece `>>xx<<` at the start of a source line asks a model that
translates into several languages for language xx (the convention of OPUS-MT/Marian, whose
multilingual models `tfm import` brings in). `--tgt-lang xx` (decode.tgt_lang, a request's
"tgt_lang") adds the tag to every line that has none; a tag the model does not know, or a missing
one, is an error that lists the languages it knows, never a silent wrong language.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from ..runtime.errors import TfmError

TAG = re.compile(r"\u2581?>>([^\s<>]+)<<")  # a piece: with the word-start mark (imported OPUS-MT models) or without
LINE_TAG = re.compile(r"\s*>>([^\s<>]+)<<")


def known_languages(source_pieces: Iterable[str]) -> list[str]:
    """The languages whose tag is a piece of the source vocabulary (sorted)."""
    return sorted({m.group(1) for piece in source_pieces if (m := TAG.fullmatch(piece))})


def line_language(line: str) -> str | None:
    """The language a line's own tag asks for (None: it has none)."""
    match = LINE_TAG.match(line)
    return match.group(1) if match else None


class TargetLanguages:
    """What a model can be asked for: the languages of its `known` tags, or (no tag) `own`, the
    target language of its training config. A model with two or more tags translates into
    several: each line needs one."""

    def __init__(self, known: list[str], own: str | None):
        self.known, self.own = known, own

    @property
    def several(self) -> bool:
        return len(self.known) >= 2

    def describe(self) -> str:
        if self.known:
            return ", ".join(self.known)
        return f"{self.own or 'its target language'} only (it has no target-language tags)"

    def check(self, requested: str | None, what: str = "--tgt-lang") -> None:
        """A TfmError for a language the model cannot translate into."""
        if requested is None or requested in self.known or (requested == self.own and not self.several):
            return
        if not self.known:
            raise TfmError(f"{what} {requested}: this model translates into {self.describe()}")
        raise TfmError(f"{what} {requested}: the model knows no tag >>{requested}<<; it knows {self.describe()}")

    def tag_lines(self, lines: list[str], requested: str | None, first_line: int = 1) -> list[str]:
        """`lines` with the requested tag before each non-empty line that has none (where the
        model has that tag); a line's own tag is checked; a line without one for a model into
        several languages, with none requested, is an error naming it."""
        if not self.known:
            return lines  # no tags: a line that starts with >>…<< is text the user wrote
        tagged = []
        for number, line in enumerate(lines, start=first_line):
            own = line_language(line) if line.strip() else None
            if own is not None:
                self.check(own, f"input line {number}: tag")
            elif line.strip() and requested in self.known:
                line = f">>{requested}<< {line}"
            elif line.strip() and self.several:
                raise TfmError(f"input line {number}: this model translates into several languages ({self.describe()}): "
                               f"give --tgt-lang (or start the line with its tag, e.g. >>{self.known[0]}<<)")
            tagged.append(line)
        return tagged
