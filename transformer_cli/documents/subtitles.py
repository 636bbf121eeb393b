"""Subtitles, SubRip (.srt) and WebVTT (.vtt): each cue's text is translated, its number, timing line
and settings are kept as they were, and the translation is wrapped over as many lines as the cue
had (balanced at spaces), so that it stays on screen as the original did. A cue is translated on
its own (a sentence that runs over two cues is two pieces: joining them would move words between
timings); a cue of dialogue lines ("- Hi." / "- Hello.") is one piece per line. Blocks without a
timing (the WEBVTT header, NOTE, STYLE and REGION blocks) are kept verbatim."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

from ..decoding.translation import Translation
from ..runtime.errors import TfmError
from .markup import Run, Span, plan_run, sentences_in_markup, translated_with_spans
from .plan import Plan, split_run

TIMING = re.compile(r"^\s*(\d+:)?\d{1,2}:\d{2}[,.]\d{3}\s*-->\s*(\d+:)?\d{1,2}:\d{2}[,.]\d{3}")
BLOCKS = re.compile(r"(\r?\n[ \t]*\r?\n\s*)")  # what separates two cues (kept as it is)
DIALOGUE = re.compile(r"^\s*[-–—]\s")  # a line spoken by another speaker
# Cue markup: SRT's <i> <b> <u> <font …>, WebVTT's <v Name> <c.class> <i> <b> <u> <lang xx> <ruby> <rt>
# and timestamps <00:01.500>, and ASS override codes {\an8} that many SRT files carry.
MAX_NESTING = 32  # cue tags open at once, at most, as spans; deeper ones are kept as points where they stand
CUE_TAG = re.compile(r"</?[A-Za-z][^<>\n]*>|<\d[\d:.]*>|\{\\[^{}\n]*\}")


@dataclass
class CueTag:
    opening: str  # the tag as written (a point: an ASS code, a timestamp, a closing tag never opened)
    name: str = ""  # its element's name ("" for a point)
    closing: str | None = None  # its closing tag as written; None: none (WebVTT leaves <v> open)
    order: int = 0  # its place among the cue's tags: at one place, tags keep their order


def cue_markup(text: str) -> tuple[str, list[Span]]:
    """A cue's text without its markup, and the markup as nested spans over that text (a tag left
    open runs to the end; a point is an empty span where it stood). Linear in the cue: the names
    left open are counted, not searched for at every closing tag (20,000 stray closings over
    20,000 open tags took 68 s); tags nested deeper than MAX_NESTING are points, so that nothing
    that walks the spans recurses as deep as a hostile cue nests."""
    pieces, length, top, stack, at = [], 0, [], [], 0
    open_names: Counter[str] = Counter()
    for match in CUE_TAG.finditer(text):
        pieces.append(text[at:match.start()])
        length += match.start() - at
        at, tag = match.end(), match.group(0)
        name = (re.match(r"</?([A-Za-z]+)", tag) or [None, ""])[1].lower()
        if tag.startswith("</") and open_names[name]:
            while stack:
                span = stack.pop()
                open_names[span.element.name] -= 1
                span.end = length
                if span.element.name == name:
                    span.element.closing = tag
                    break
            continue
        point = tag.startswith(("</", "{")) or tag[1].isdigit() or len(stack) >= MAX_NESTING
        span = Span(CueTag(tag, "" if point else name, order=match.start()), length, length, False)
        (stack[-1].children if stack else top).append(span)
        if span.element.name:
            stack.append(span)
            open_names[name] += 1
    plain = "".join(pieces) + text[at:]
    for span in stack:
        span.end = len(plain)
    return plain, top


def with_markup(text: str, spans: list[Span]) -> str:
    """The translated text with each span's tags at its target: at one place closings come before
    openings, the last opened closing first, and openings (and points) in their source order."""
    inserts: list[tuple[int, int, int, str]] = []

    def collect(spans: list[Span]) -> None:
        for span in spans:
            lo, hi = span.target
            tag = span.element
            if hi <= lo or not tag.name:  # a point, or a span that came out empty: kept together
                inserts.append((lo, 1, tag.order, tag.opening + (tag.closing or "") if tag.name else tag.opening))
            else:
                inserts.append((lo, 1, tag.order, tag.opening))
                if tag.closing:
                    inserts.append((hi, 0, -tag.order, tag.closing))
            collect(span.children)

    collect(spans)
    out, at = [], 0
    for place, _, _, tag in sorted(inserts, key=lambda insert: insert[:3]):
        out += [text[at:place], tag]
        at = place
    return "".join(out) + text[at:]


def marked_cue(text: str, lang: str | None, sentences: list[str]) -> tuple[Run | list, bool]:
    """A cue's (or a dialogue line's) text planned: split_run's pieces where it has no markup, else a
    markup Run whose spans follow its words, and whether placing them needs word alignments (a span
    over part of the text; one around all of it, and codes at either end, need none)."""
    plain, spans = cue_markup(text)
    if not spans:
        return split_run(text, lang, sentences), False
    run = Run(text=plain, spans=spans)
    plan_run(run, lang, sentences)
    first, last = len(plain) - len(plain.lstrip()), len(plain.rstrip())

    def inner(spans: list[Span]) -> bool:
        return any((not (span.start <= first and span.end >= last) and not span.start == span.end in (0, len(plain)))
                   or inner(span.children) for span in spans)

    return run, inner(spans)


def translated_cue(run: Run, translations: list[Translation]) -> str:
    """The cue's translation with its markup placed: spans around all of the text stay around all of
    it, codes at either end stay there, the others follow their words (markup.py's projection)."""
    plain = run.text
    first, last = len(plain) - len(plain.lstrip()), len(plain.rstrip())
    text = translated_with_spans(run, translations)

    def pin(spans: list[Span]) -> None:
        for span in spans:
            if span.start == span.end == 0:
                span.target = (0, 0)
            elif span.start <= first and span.end >= last and span.end > span.start:
                span.target = (0, len(text))
            elif span.start == span.end == len(plain):
                span.target = (len(text), len(text))
            pin(span.children)

    pin(run.spans)
    return with_markup(text, run.spans)


def wrap(text: str, lines: int) -> list[str]:
    """`text` over `lines` lines of about equal length, broken at spaces (fewer where it has fewer
    words). One pass over the words: each line takes words while it is short of its share of the
    characters still to place. Markup counts for nothing and is never broken (`<font color="x">`)."""
    marked = CUE_TAG.search(text) is not None
    if marked:  # the spaces inside tags are no places to break
        text = CUE_TAG.sub(lambda m: m.group(0).replace(" ", "\0"), text)
    words = text.split()
    lines = min(lines, len(words))
    if lines <= 1:
        return [text.replace("\0", " ")]

    def size_of(word: str) -> int:
        return len(CUE_TAG.sub("", word.replace("\0", " "))) if "<" in word or "{" in word else len(word)

    out: list[list[str]] = [[]]
    left = sum(map(size_of, words)) + len(words) - 1  # characters still to place, spaces between words included
    size = -1  # the current line's characters
    for k, word in enumerate(words):
        lines_left = lines - len(out) + 1
        share = left / lines_left
        words_after = len(words) - k
        if out[-1] and lines_left > 1 and (size + 1 + size_of(word) / 2 > share or words_after < lines_left):
            left -= size + 1
            out.append([])
            size = -1
        out[-1].append(word)
        size += 1 + size_of(word)
    return [" ".join(line).replace("\0", " ") if marked else " ".join(line) for line in out]


VTT_BLOCKS = ("WEBVTT", "NOTE", "STYLE", "REGION")  # WebVTT's blocks without a timing, kept as they are


def check_untimed_block(block: str, line: int, vtt: bool, first: bool) -> None:
    """A block of text without a timing line is a cue whose timing is malformed, or a file of another
    format: an error naming its line (it would stay untranslated without a word). WebVTT's header,
    NOTE, STYLE and REGION blocks are kept."""
    if vtt and (first or block.startswith(VTT_BLOCKS[1:])):
        return
    kind = "WebVTT" if vtt else "SubRip (.srt)"
    raise TfmError(f"line {line}: text without a timing line ('00:00:01,000 --> 00:00:04,000' before a cue's text): "
                   f"not a {kind} cue (a malformed timing, or a file of another format)")


def cues_of(lines: list[str], timing: int) -> list[tuple[int, int, int]]:
    """The cues of a block whose first timing line is `timing`: (first line, timing line, end) each. Two
    cues without a blank line between them (a second timing line, with its cue number before it)
    are two cues: their number and timing were translated as words, and the cue was gone."""
    cues, start = [], 0
    for j in range(timing + 1, len(lines)):
        if TIMING.match(lines[j]):
            cut = j - 1 if j - 1 > timing and lines[j - 1].strip().isdigit() else j
            cues.append((start, timing, cut))
            start, timing = cut, j
    return [*cues, (start, timing, len(lines))]


def cue_parts(text_lines: list[str], lang: str | None, sentences: list[str],
              aligned: set[int]) -> list[tuple[str, Run | list, int]]:
    """A cue's text planned: one piece per speaker where every line is a dialogue line, else one."""
    spoken = [line for line in text_lines if line.strip()]
    marks = [DIALOGUE.match(line) for line in spoken]
    if spoken and all(marks):  # one piece per speaker, one line each
        texts = [(mark.group(0), line[mark.end():], 1) for mark, line in zip(marks, spoken) if mark]
    else:
        texts = [("", " ".join(spoken), len(spoken))]
    parts: list[tuple[str, Run | list, int]] = []
    for mark, text, count in texts:
        run, inner = marked_cue(text, lang, sentences)
        if inner and isinstance(run, Run):
            aligned |= sentences_in_markup([run])
        parts.append((mark, run, count))
    return parts


def plan_subtitles(document: str, lang: str | None, vtt: bool = False) -> Plan:
    """The cues' texts as sentences; the file rebuilt with their translations, timings kept."""
    if vtt and document.strip() and not document.lstrip("\ufeff").startswith("WEBVTT"):
        raise TfmError("not a WebVTT file: it must start with WEBVTT")
    sentences: list[str] = []
    aligned: set[int] = set()  # sentences whose markup follows their words
    pieces: list = []  # kept text, or a cue's text: ([(dialogue mark, its run, lines)…], line end)
    line_number = 1  # of the block's first line
    for number, block in enumerate(BLOCKS.split(document)):  # blocks at even numbers, what separates them at odd
        body = block.rstrip("\r\n")
        eol = "\r\n" if "\r\n" in block else "\n"
        lines = body.split(eol)
        timing = next((i for i, line in enumerate(lines) if TIMING.match(line)), None)
        first_line = line_number + block[: len(block) - len(block.lstrip())].count("\n")
        line_number += block.count("\n")
        if timing is None or not block.strip():
            if number % 2 == 0 and block.strip():
                check_untimed_block(block.strip(), first_line, vtt, first=number == 0)
            pieces.append(block)
            continue
        cues = cues_of(lines, timing)
        for k, (start, cue_timing, end) in enumerate(cues):
            pieces.append(eol.join(lines[start: cue_timing + 1]) + eol)
            parts = cue_parts(lines[cue_timing + 1: end], lang, sentences, aligned)
            pieces += [(parts, eol), block[len(body):] if k == len(cues) - 1 else eol]

    def rebuild(translations: list[Translation]) -> str:
        out = []
        for piece in pieces:
            if isinstance(piece, str):
                out.append(piece)
                continue
            parts, eol = piece
            lines = []
            for mark, run, count in parts:
                text = translated_cue(run, translations) if isinstance(run, Run) else \
                    "".join(p if isinstance(p, str) else translations[p].text for p in run)
                wrapped = wrap(text, count)
                lines += [mark + wrapped[0], *wrapped[1:]]
            out.append(eol.join(lines))
        return "".join(out)

    return Plan(sentences, rebuild, alignment=bool(aligned), aligned=aligned or None)
