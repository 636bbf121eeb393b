"""Subtitles, SubRip (.srt) and WebVTT (.vtt): each cue's text is translated, its number, timing line
and settings are kept as they were, and the translation is wrapped over as many lines as the cue
had (balanced at spaces), so that it stays on screen as the original did. A cue is translated on
its own (a sentence that runs over two cues is two pieces: joining them would move words between
timings); a cue of dialogue lines ("- Hi." / "- Hello.") is one piece per line. Blocks without a
timing (the WEBVTT header, NOTE, STYLE and REGION blocks) are kept verbatim."""

from __future__ import annotations

import re

from ..decoding.translation import Translation
from ..runtime.errors import TfmError
from .plan import Plan, split_run

TIMING = re.compile(r"^\s*(\d+:)?\d{1,2}:\d{2}[,.]\d{3}\s*-->\s*(\d+:)?\d{1,2}:\d{2}[,.]\d{3}")
BLOCKS = re.compile(r"(\r?\n[ \t]*\r?\n\s*)")  # what separates two cues (kept as it is)
DIALOGUE = re.compile(r"^\s*[-–—]\s")  # a line spoken by another speaker


def wrap(text: str, lines: int) -> list[str]:
    """`text` over `lines` lines of about equal length, broken at spaces (fewer where it has fewer
    words). One pass over the words: each line takes words while it is short of its share of the
    characters still to place."""
    words = text.split()
    lines = min(lines, len(words))
    if lines <= 1:
        return [text]
    out: list[list[str]] = [[]]
    left = len(" ".join(words))  # characters still to place, spaces between words included
    size = -1  # the current line's characters
    for k, word in enumerate(words):
        lines_left = lines - len(out) + 1
        share = left / lines_left
        words_after = len(words) - k
        if out[-1] and lines_left > 1 and (size + 1 + len(word) / 2 > share or words_after < lines_left):
            left -= size + 1
            out.append([])
            size = -1
        out[-1].append(word)
        size += 1 + len(word)
    return [" ".join(line) for line in out]


def plan_subtitles(document: str, lang: str | None, vtt: bool = False) -> Plan:
    """The cues' texts as sentences; the file rebuilt with their translations, timings kept."""
    if vtt and document.strip() and not document.lstrip("\ufeff").startswith("WEBVTT"):
        raise TfmError("not a WebVTT file: it must start with WEBVTT")
    sentences: list[str] = []
    pieces: list = []  # kept text, or a cue's text: ([(dialogue mark, its run, lines)…], line end)
    for block in BLOCKS.split(document):
        body = block.rstrip("\r\n")
        eol = "\r\n" if "\r\n" in block else "\n"
        lines = body.split(eol)
        timing = next((i for i, line in enumerate(lines) if TIMING.match(line)), None)
        if timing is None or not block.strip():
            pieces.append(block)
            continue
        pieces.append(eol.join(lines[: timing + 1]) + eol)
        spoken = [line for line in lines[timing + 1:] if line.strip()]
        marks = [DIALOGUE.match(line) for line in spoken]
        if spoken and all(marks):  # one piece per speaker, one line each
            parts = [(mark.group(0), split_run(line[mark.end():], lang, sentences), 1)
                     for mark, line in zip(marks, spoken) if mark]
        else:
            parts = [("", split_run(" ".join(spoken), lang, sentences), len(spoken))]
        pieces += [(parts, eol), block[len(body):]]

    def rebuild(translations: list[Translation]) -> str:
        out = []
        for piece in pieces:
            if isinstance(piece, str):
                out.append(piece)
                continue
            parts, eol = piece
            lines = []
            for mark, run, count in parts:
                wrapped = wrap("".join(p if isinstance(p, str) else translations[p].text for p in run), count)
                lines += [mark + wrapped[0], *wrapped[1:]]
            out.append(eol.join(lines))
        return "".join(out)

    return Plan(sentences, rebuild)
