"""Which format a document is in (`--format`, else its file's extension), reading it whole within a
size limit, and translating it: its sentences in the engine's chunks, then the document rebuilt."""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import replace
from pathlib import Path
from typing import IO

from ..decoding.translation import Translation, TranslationEngine, translated_chunks
from ..experiment.config import DecodeConfig
from ..runtime.console import warn
from ..runtime.errors import TfmError
from .markdown import plan_markdown
from .markup import plan_markup
from .plan import Plan, plan_text
from .subtitles import plan_subtitles
from .word import plan_word

# lines: one sentence a line, streamed (tfm translate's own); the others are documents, read whole.
FORMATS = ("lines", "text", "html", "xml", "markdown", "srt", "vtt", "docx")
# A .txt file stays one sentence a line, as tfm translate has always read it: paragraphs are --format text.
EXTENSIONS = {".html": "html", ".htm": "html", ".xhtml": "xml", ".xml": "xml",
              ".svg": "xml", ".srt": "srt", ".vtt": "vtt",
              ".md": "markdown", ".markdown": "markdown", ".docx": "docx"}
# Files that are not text: refused by name, before a byte is read.
NOT_TEXT = {".pdf", ".doc", ".odt", ".rtf", ".epub", ".pptx", ".xlsx", ".zip", ".png", ".jpg", ".jpeg",
            ".gif", ".webp", ".mp3", ".mp4", ".exe", ".bin"}
MAX_DOCUMENT_BYTES = 64 << 20  # a document is held in memory whole: 64 MB of text is ~500k sentences


def document_format(given: str | None, path: Path | None) -> str:
    """`given` (--format), else by the input file's extension; a file of another name (.txt too), or
    standard input, is read as lines (one sentence each)."""
    if given is not None:
        if given not in FORMATS:
            raise TfmError(f"--format {given}: choose {', '.join(FORMATS)}")
        return given
    suffix = path.suffix.lower() if path is not None else ""
    if suffix in NOT_TEXT:
        raise TfmError(f"{path}: {suffix} files are not text; tfm translates {', '.join(FORMATS)} "
                       "(a document's format by its extension: .html/.htm, .xml/.xhtml, .md, .srt, .vtt, .docx; --format text)")
    return EXTENSIONS.get(suffix, "lines")


def read_document(source: IO[bytes], name: str, limit: int = MAX_DOCUMENT_BYTES, fmt: str = "text") -> str | bytes:
    """The whole document: UTF-8 text (a byte-order mark dropped, no NUL byte), or for a Word file its
    bytes (a zip archive); at most `limit` bytes."""
    data = source.read(limit + 1)
    if len(data) > limit:
        raise TfmError(f"{name}: over {limit >> 20} MB: split the document, or translate it as lines")
    if fmt == "docx":
        if not data.startswith(b"PK\x03\x04"):
            raise TfmError(f"{name}: not a Word (.docx) document (it is not a zip archive)")
        return data
    if b"\0" in data:
        raise TfmError(f"{name}: not text (it holds NUL bytes)")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise TfmError(f"{name}: line {line}: not UTF-8 ({exc.reason} at byte {exc.start})") from None


def plan_document(document: str | bytes, fmt: str, lang: str | None) -> Plan:
    """The document's plan in its format; a TfmError where the document does not match the format
    (a text in which the format finds nothing to translate is not passed through as it is)."""
    if fmt == "docx":
        if not isinstance(document, bytes):
            raise TfmError("a Word document is a file: send its bytes")
        return plan_word(document, lang)
    if isinstance(document, bytes):
        raise TfmError(f"--format {fmt}: a text document, not bytes")
    if fmt == "text":
        plan = plan_text(document, lang)
    elif fmt in ("html", "xml"):
        plan = plan_markup(document, lang, xml=fmt == "xml")
    elif fmt == "markdown":
        plan = plan_markdown(document, lang)
    elif fmt in ("srt", "vtt"):
        return plan_subtitles(document, lang, vtt=fmt == "vtt")  # (checks its blocks itself)
    else:
        raise TfmError(f"--format {fmt}: not a document format ({', '.join(FORMATS[1:])})")
    if not plan.sentences and LETTER.search(without_markup(document) if fmt != "text" else document):
        raise TfmError(f"--format {fmt}: nothing to translate found in a document that has text: is it {fmt}? "
                       "(name its format with --format, or the request's \"format\")")
    return plan


LETTER = re.compile(r"[^\W\d_]")
CODE_ELEMENT = re.compile(r"<(script|style)\b", re.I)
CODE_END = {name: re.compile(rf"</{name}\s*>", re.I) for name in ("script", "style")}


def without_markup(document: str) -> str:
    """What a reader sees of markup: the text outside script and style elements, comments and tags
    (a document with letters there in which its format found no sentence is in another format).
    One pass, each search starting where the last construct ended and a search that found no end
    never made again: linear in the document (a regex of lazy scans rescanned to the end for every
    unclosed comment: 78 s for 160 kB of `<!--`)."""
    out, at, unclosed = [], 0, set()
    while (start := document.find("<", at)) >= 0:
        out.append(document[at:start])
        end = -1
        code = CODE_ELEMENT.match(document, start)
        if code and code.group(1).lower() not in unclosed:
            found = CODE_END[code.group(1).lower()].search(document, start)
            end = found.end() if found else -1
            if not found:
                unclosed.add(code.group(1).lower())
        elif document.startswith("<!--", start) and "-->" not in unclosed:
            end = document.find("-->", start + 4)
            end = end + 3 if end >= 0 else -1
            if end < 0:
                unclosed.add("-->")
        if end < 0:  # a tag, to its ">"; without one anywhere after, the rest is text
            end = document.find(">", start)
            if end < 0:
                out.append(document[start:])
                return "".join(out)
            end += 1
        out.append(" ")
        at = end
    out.append(document[at:])
    return "".join(out)


def translate_document(engine: TranslationEngine, document: str | bytes, fmt: str,
                       decode: DecodeConfig | None = None) -> tuple[str | bytes, int, int]:
    """The document translated in its format (under `decode`; None: the engine's settings), its
    sentences and their target tokens. Markup needs the engine's word alignments (decode.alignment:
    tfm's engine)."""
    plan = plan_document(document, fmt, engine.own_source_language)
    if plan.alignment and not engine.decode.alignment and fmt in ("srt", "vtt"):
        # Subtitles translate without alignments; their markup inside a cue then keeps its place.
        warn(f"warning: --format {fmt}: markup inside cues is placed where it stood, not by its words (this "
             "engine makes no word alignments: give --alignment, with a checkpoint)")
        plan = replace(plan, alignment=False, aligned=None)
    if plan.alignment and not engine.decode.alignment:
        raise TfmError(f"--format {fmt} places the tags through word alignments: the engine must make them "
                       "(decode.alignment, tfm's engine)")
    # Aligning is a forced pass of tfm's model over each translation: only the sentences markup lies in
    # (one search for all of them, batched as lines are).
    translations = translated(engine, plan.sentences, decode, align_only=plan.aligned if plan.alignment else None)
    return plan.rebuild(translations), len(translations), sum(t.n_tokens for t in translations)


def translated(engine: TranslationEngine, sentences: list[str], decode: DecodeConfig | None,
               align_only: Collection[int] | None = None) -> list[Translation]:
    """Each sentence's best translation, in the chunks `tfm translate` takes; with word alignments
    for `align_only` (the sentences' numbers; None: all, where the engine makes them)."""
    decode = (engine.decode if decode is None else decode).updated(nbest=1)
    return [results[0] for _, _, chunk in translated_chunks(engine, sentences, decode, read_ahead=True,
                                                              align_only=align_only) for results in chunk]
