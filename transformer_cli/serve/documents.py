"""Documents through `tfm serve`: `"format"` in a /translate request, and POST /translate/file (the
file as the body, its name in the query, the translated file back). A document is planned
(documents/), its sentences go through the same checks, limits, fair share and batches as a request
of lines, and the document is rebuilt around their translations."""

from __future__ import annotations

import io
import re
from pathlib import Path

from ..decoding.translation import Translation
from ..documents.formats import document_format, plan_document, read_document
from ..documents.plan import Plan
from ..documents.word import DocumentTooLarge
from ..runtime.errors import TfmError
from .requests import TERM_FIELDS, RequestError, TranslateRequest

MEDIA_TYPES = {"text": "text/plain; charset=utf-8", "html": "text/html; charset=utf-8",
               "xml": "application/xml; charset=utf-8", "markdown": "text/markdown; charset=utf-8",
               "srt": "application/x-subrip; charset=utf-8", "vtt": "text/vtt; charset=utf-8",
               "docx": "application/vnd.openxmlformats-officedocument.wordprocessingml.document"}


def planned(request: TranslateRequest, lang: str | None) -> tuple[list[Plan], TranslateRequest]:
    """Each document's plan, and the request of their sentences as lines (with alignments where the
    markup needs them); a document that cannot be read is a RequestError (422)."""
    assert request.format is not None
    per_line = [name for name, given in (("nbest", (request.nbest or 1) > 1), ("alignment", bool(request.alignment)),
                                         *((name, getattr(request, name) is not None) for name in TERM_FIELDS)) if given]
    if per_line:
        raise RequestError(422, f"format {request.format}: a document gets one translation per sentence, rebuilt "
                                f"into the document: {', '.join(per_line)} are for requests of lines")
    documents = [request.text] if isinstance(request.text, str) else request.text
    plans = []
    for number, document in enumerate(documents, start=1):
        try:
            plans.append(plan_document(document, request.format, lang))
        except TfmError as exc:
            raise RequestError(failure_status(exc), f"text {number}: {exc}") from None
    return plans, lines_of(plans, request)


def lines_of(plans: list[Plan], request: TranslateRequest) -> TranslateRequest:
    """The request of the plans' sentences, one a line, with alignments where the markup needs them."""
    lines = [sentence for plan in plans for sentence in plan.sentences]
    aligned = any(plan.alignment for plan in plans)
    return request.model_copy(update={"text": lines, "format": None,
                                      "alignment": True if aligned else request.alignment})


def rebuilt(plans: list[Plan], body: dict) -> dict:
    """The answer to a request of documents, from the answer to the request of their sentences."""
    texts, alignments = body["translations"], body.get("alignments") or [None] * len(body["translations"])
    documents, at = [], 0
    for plan in plans:
        n = len(plan.sentences)
        documents.append(plan.rebuild([Translation(text, 0.0, 0, alignment)
                                       for text, alignment in zip(texts[at:at + n], alignments[at:at + n])]))
        at += n
    return {"translations": documents}


def file_planned(data: bytes, name: str, fmt: str | None, lang: str | None) -> tuple[str, Plan, TranslateRequest]:
    """POST /translate/file's body: its format (`fmt`, else the name's extension; a name without a
    document extension is 415), its plan and the request of its sentences."""
    try:
        fmt = document_format(fmt, Path(name))
    except TfmError as exc:
        raise RequestError(415, str(exc)) from None
    if fmt == "lines" and Path(name).suffix.lower() in (".txt", ".text"):
        fmt = "text"  # an uploaded text file is a document: its paragraphs are kept
    if fmt == "lines":
        raise RequestError(415, f"{safe_name(name)}: give a document (.txt, .html, .xml, .md, .srt, .vtt, .docx) "
                                "or ?format=")
    try:
        plan = plan_document(read_document(io.BytesIO(data), safe_name(name), max(len(data), 1), fmt), fmt, lang)
    except TfmError as exc:
        raise RequestError(failure_status(exc), str(exc)) from None
    return fmt, plan, lines_of([plan], TranslateRequest(text=[]))


def failure_status(exc: TfmError) -> int:
    """413 for a document over a size limit (a zip bomb among them), 422 for one that cannot be read."""
    return 413 if isinstance(exc, DocumentTooLarge) else 422


def safe_name(name: str) -> str:
    """A file name fit for a header and a log line: its last part, only letters, digits and ._-"""
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "_", name.replace("\\", "/").rsplit("/", 1)[-1])[:100].strip("._")
    return cleaned or "document"


def translated_name(name: str, tgt_lang: str | None) -> str:
    path = Path(safe_name(name))
    return f"{path.stem}.{tgt_lang or 'translated'}{path.suffix}"
