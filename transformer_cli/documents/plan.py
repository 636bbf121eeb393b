"""What every document format gives the translator: the sentences to translate, one line each, and
how to rebuild the document from their translations."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from ..decoding.translation import Translation
from .sentences import sentence_spans


@dataclass
class Plan:
    sentences: list[str]  # one translation unit each, whitespace-normalised (a line of `tfm translate`)
    rebuild: Callable[[list[Translation]], str | bytes]  # the document from the sentences' translations (bytes: .docx)
    alignment: bool = False  # rebuilding needs each translation's word alignment (markup)
    # The sentences whose alignments rebuilding reads (those markup lies in or around); None: all of them.
    aligned: set[int] | None = None


def one_line(text: str) -> str:
    """A sentence as the engine takes it: its words separated by single spaces (a sentence that ran
    over several lines of the document is one line to translate)."""
    return " ".join(text.split())


def split_run(text: str, lang: str | None, sentences: list[str], spans: bool = False) -> list:
    """`text` as what stays (whitespace around and between sentences, verbatim) and the numbers of its
    sentences, which are appended to `sentences` (with `spans`: (number, start, end) in `text`)."""
    pieces: list = []
    at = 0
    for start, end in sentence_spans(text, lang):
        pieces += [text[at:start], (len(sentences), start, end) if spans else len(sentences)]
        sentences.append(one_line(text[start:end]))
        at = end
    pieces.append(text[at:])
    return pieces


BLANK_LINES = re.compile(r"(\n[ \t\r\f\v]*\n\s*)")  # what separates two paragraphs (kept as it is)


def plan_text(document: str, lang: str | None) -> Plan:
    """Plain text: paragraphs (separated by blank lines), each split into sentences; blank lines,
    the line breaks between sentences and the whitespace around each paragraph are kept, a line
    break inside a sentence becomes a space (the sentence is translated whole)."""
    sentences: list[str] = []
    pieces: list[str | int] = []
    for part in BLANK_LINES.split(document):
        pieces += split_run(part, lang, sentences) if part.strip() else [part]

    def rebuild(translations: list[Translation]) -> str:
        return "".join(p if isinstance(p, str) else translations[p].text for p in pieces)

    return Plan(sentences, rebuild)
