"""Word documents (.docx, read and written by python-docx): every paragraph of the body, of tables
(nested too), headers and footers is translated, and its runs — the stretches of one formatting:
bold, italic, a font, a colour, a link's text — keep their formatting over the words that translate
theirs. Runs are not moved (the document's XML keeps its shape): the translated paragraph is cut at
the places where each run's first word lands (through the word alignments), kept in order, and each
run takes the words up to the next cut. Everything else (styles, images, fields, numbering, page
layout) is the document's own and stays as it was."""

from __future__ import annotations

import io
import zipfile
import zlib
from typing import IO, Any

import lxml.etree

from ..decoding.translation import Translation
from ..runtime.errors import TfmError
from .markup import Run, plan_run, project, translated_run
from .plan import Plan

# A .docx is a zip archive: a few kB can unpack to gigabytes. Every member is read through these
# limits before python-docx (and lxml) sees it, so a document costs at most their size (and lxml's
# tree of it). A 500-page report's document.xml is ~5-10 MB; its images stay far below the total.
MAX_MEMBER_BYTES = 32 << 20  # one member, unpacked
MAX_UNPACKED_BYTES = 128 << 20  # all members together, unpacked
# ... and the text's parts (body, headers, footers, notes) are counted as they stream, before
# python-docx builds its tree: 700,000 one-word paragraphs (28 MB unpacked, within the sizes) cost
# the server 155 s and 1.2 GB before the line limit refused them. A 500-page report has ~10,000.
MAX_PARAGRAPHS = 100_000
MAX_RUNS = 500_000
WORD_NS = "{http://schemas.openxmlformats.org/wordprocessingml/2006/main}"
ARCHIVE_ERRORS = (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError, RuntimeError, zlib.error)


class DocumentTooLarge(TfmError):
    """A document over a size limit (the server answers 413)."""


def check_unpacked_size(data: bytes) -> None:
    """Unpack every member of the archive, counting, without keeping it: DocumentTooLarge past
    MAX_MEMBER_BYTES for one or MAX_UNPACKED_BYTES for all. The members are read, not their declared
    sizes trusted (a zip header can say anything)."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        members = archive.infolist()
    except ARCHIVE_ERRORS as exc:
        raise TfmError(f"not a Word (.docx) document ({type(exc).__name__}: {str(exc)[:200]})") from None
    total = 0
    for info in members:
        size = 0
        try:
            with archive.open(info) as member:
                while chunk := member.read(1 << 20):
                    size += len(chunk)
                    total += len(chunk)
                    if size > MAX_MEMBER_BYTES:
                        raise DocumentTooLarge(f"{info.filename[:100]} in the Word document unpacks to more than "
                                               f"{MAX_MEMBER_BYTES >> 20} MB, the limit for one part")
                    if total > MAX_UNPACKED_BYTES:
                        raise DocumentTooLarge(f"the Word document unpacks to more than {MAX_UNPACKED_BYTES >> 20} "
                                               "MB, the limit for a document")
            if info.filename.startswith("word/") and info.filename.endswith(".xml"):
                with archive.open(info) as member:
                    count_paragraphs(member, info.filename)
        except DocumentTooLarge:
            raise
        except (*ARCHIVE_ERRORS, lxml.etree.XMLSyntaxError) as exc:
            raise TfmError(f"not a Word (.docx) document ({info.filename[:100]}: {type(exc).__name__}: "
                           f"{str(exc)[:200]})") from None


def count_paragraphs(member: IO[bytes], name: str) -> None:
    """Stream a part's XML, counting its paragraphs and runs and keeping nothing (each element is
    cleared once read): DocumentTooLarge past MAX_PARAGRAPHS or MAX_RUNS."""
    paragraphs = runs = 0
    for _, element in lxml.etree.iterparse(member, events=("end",), tag=(f"{WORD_NS}p", f"{WORD_NS}r"),
                                           resolve_entities=False, no_network=True, huge_tree=False):
        paragraphs, runs = (paragraphs + 1, runs) if element.tag == f"{WORD_NS}p" else (paragraphs, runs + 1)
        element.clear(keep_tail=True)
        while element.getprevious() is not None:  # what was read before it: gone
            del element.getparent()[0]
        if paragraphs > MAX_PARAGRAPHS or runs > MAX_RUNS:
            what = f"{MAX_PARAGRAPHS:,} paragraphs" if paragraphs > MAX_PARAGRAPHS else f"{MAX_RUNS:,} runs"
            raise DocumentTooLarge(f"{name[:100]} in the Word document has more than {what}, the limit for a document")


def paragraphs_of(document: Any) -> list[Any]:
    """Every paragraph with text, once: the body's, those in table cells (merged cells repeat one
    cell; nested tables), and the sections' headers and footers."""
    # Elements by id(), each held here: lxml makes a new proxy for an element no one holds, and a
    # freed proxy's id() can come back as another element's.
    found, seen = [], {}

    def add(container: Any) -> None:
        for paragraph in container.paragraphs:
            if id(paragraph._p) not in seen and paragraph.text.strip():
                seen[id(paragraph._p)] = paragraph._p
                found.append(paragraph)
        for table in getattr(container, "tables", []):
            for row in table.rows:
                for cell in row.cells:
                    if id(cell._tc) not in seen:
                        seen[id(cell._tc)] = cell._tc
                        add(cell)

    add(document)
    for section in document.sections:
        for part in (section.header, section.footer):
            if not part.is_linked_to_previous:
                add(part)
    return found


def runs_of(paragraph: Any) -> list[Any]:
    """The paragraph's runs in order, a hyperlink's runs where the hyperlink is."""
    runs = []
    for item in paragraph.iter_inner_content():
        runs += item.runs if hasattr(item, "runs") else [item]
    return runs


def plan_word(data: bytes, lang: str | None) -> Plan:
    """The sentences of every paragraph; rebuild() gives the translated document's bytes."""
    try:
        import docx
    except ImportError:
        raise TfmError("Word documents need python-docx: pip install python-docx") from None
    check_unpacked_size(data)
    try:
        document = docx.Document(io.BytesIO(data))
    except Exception as exc:  # noqa: BLE001 (python-docx raises several kinds for a file that is not .docx)
        raise TfmError(f"not a Word (.docx) document ({type(exc).__name__}: {str(exc)[:200]})") from None
    sentences: list[str] = []
    planned = []
    for paragraph in paragraphs_of(document):
        runs = runs_of(paragraph)
        run = Run(text="".join(r.text for r in runs))
        starts, at = [], 0
        for r in runs:
            starts.append(at)
            at += len(r.text)
        plan_run(run, lang, sentences)
        planned.append((runs, starts, run))
    def rebuild(translations: list[Translation]) -> bytes:
        for runs, starts, run in planned:
            text, sentence_maps = translated_run(run, translations)
            cuts = [0]
            for start, r in zip(starts[1:], runs[1:]):
                lo, _ = project(start, start + len(r.text), sentence_maps, run.text, text) if r.text.strip() else (
                    cuts[-1], cuts[-1])
                while 0 < lo < len(text) and not text[lo - 1].isspace():  # a cut falls between words
                    lo -= 1
                cuts.append(max(lo, cuts[-1]))
            cuts.append(len(text))
            for k, r in enumerate(runs):
                r.text = text[cuts[k]:cuts[k + 1]]
        out = io.BytesIO()
        document.save(out)
        return out.getvalue()

    return Plan(sentences, rebuild, alignment=True)
