"""Documents through `tfm serve`: `"format"` in a /translate request, and POST /translate/file (the
file as the body, its name in the query, the translated file back). A document is planned
(documents/), its sentences go through the same checks, limits, fair share and batches as a request
of lines, and the document is rebuilt around their translations.

Reading and rebuilding a document run in processes of their own (`DocumentProcesses`), never on
the server's threads: the request's deadline stops a step (its process is killed), the memory a
parser took on a large document goes with its process, and the event loop answers everyone
meanwhile, however a parser fares."""

from __future__ import annotations

import asyncio
import io
import multiprocessing
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..decoding.budget import DeadlinePassed
from ..decoding.translation import Translation
from ..documents.formats import document_format, plan_document, read_document
from ..documents.word import DocumentTooLarge
from ..runtime.errors import TfmError
from .requests import TERM_FIELDS, RequestError, TranslateRequest

MEDIA_TYPES = {"text": "text/plain; charset=utf-8", "html": "text/html; charset=utf-8",
               "xml": "application/xml; charset=utf-8", "markdown": "text/markdown; charset=utf-8",
               "srt": "application/x-subrip; charset=utf-8", "vtt": "text/vtt; charset=utf-8",
               "docx": "application/vnd.openxmlformats-officedocument.wordprocessingml.document"}


@dataclass(frozen=True)
class PlannedSentences:
    """What the server needs of a document's plan (the plan itself, with its rebuild, stays in the
    process that read the document): its sentences and which alignments rebuilding reads."""

    sentences: list[str]
    alignment: bool
    aligned: set[int] | None


Document = tuple[str | bytes, str]  # (the document as sent: text, or a file's bytes; its format)


def request_documents(request: TranslateRequest) -> list[Document]:
    """A request of documents (`"format"`) as its documents; a RequestError (422) where it asks for
    what only a request of lines gets."""
    assert request.format is not None
    per_line = [name for name, given in (("nbest", (request.nbest or 1) > 1), ("alignment", bool(request.alignment)),
                                         *((name, getattr(request, name) is not None) for name in TERM_FIELDS)) if given]
    if per_line:
        raise RequestError(422, f"format {request.format}: a document gets one translation per sentence, rebuilt "
                                f"into the document: {', '.join(per_line)} are for requests of lines")
    texts = [request.text] if isinstance(request.text, str) else request.text
    return [(text, request.format) for text in texts]


def file_document(data: bytes, name: str, fmt: str | None) -> Document:
    """POST /translate/file's body and its format (`fmt`, else the name's extension; a name without
    a document extension is 415)."""
    try:
        fmt = document_format(fmt, Path(name))
    except TfmError as exc:
        raise RequestError(415, str(exc)) from None
    if fmt == "lines" and Path(name).suffix.lower() in (".txt", ".text"):
        fmt = "text"  # an uploaded text file is a document: its paragraphs are kept
    if fmt == "lines":
        raise RequestError(415, f"{safe_name(name)}: give a document (.txt, .html, .xml, .md, .srt, .vtt, .docx) "
                                "or ?format=")
    return data, fmt


def plans_of(documents: list[Document], lang: str | None, file_name: str | None):
    """Each document's plan (in the process that reads them); a document that cannot be read is a
    RequestError (413 over a size limit, 422 otherwise) naming it."""
    plans = []
    for number, (document, fmt) in enumerate(documents, start=1):
        try:
            if file_name is not None:  # a file's bytes, read as its format reads them
                document = read_document(io.BytesIO(document), safe_name(file_name),
                                         max(len(document), 1), fmt)  # type: ignore[arg-type]
            plans.append(plan_document(document, fmt, lang))
        except TfmError as exc:
            prefix = "" if file_name is not None else f"text {number}: "
            raise RequestError(failure_status(exc), f"{prefix}{exc}") from None
    return plans


def sentences_of(documents: list[Document], lang: str | None, file_name: str | None) -> list[PlannedSentences]:
    """Each document's sentences (run in a document process)."""
    return [PlannedSentences(plan.sentences, plan.alignment, plan.aligned)
            for plan in plans_of(documents, lang, file_name)]


def rebuilt_documents(documents: list[Document], lang: str | None, file_name: str | None,
                      translations: list[list[Translation]]) -> list[str | bytes]:
    """Each document rebuilt around its sentences' translations (run in a document process: the
    document is read again, in linear time, rather than its plan kept between the two steps)."""
    return [plan.rebuild(done) for plan, done in zip(plans_of(documents, lang, file_name), translations)]


def lines_of(planned: list[PlannedSentences], request: TranslateRequest) -> TranslateRequest:
    """The request of the documents' sentences, one a line, with alignments where the markup needs them."""
    lines = [sentence for plan in planned for sentence in plan.sentences]
    aligned = any(plan.alignment for plan in planned)
    return request.model_copy(update={"text": lines, "format": None,
                                      "alignment": True if aligned else request.alignment})


def translations_of(planned: list[PlannedSentences], body: dict) -> list[list[Translation]]:
    """The answer to the request of the sentences, document by document."""
    texts, alignments = body["translations"], body.get("alignments") or [None] * len(body["translations"])
    per_document, at = [], 0
    for plan in planned:
        n = len(plan.sentences)
        per_document.append([Translation(text, 0.0, 0, alignment)
                             for text, alignment in zip(texts[at:at + n], alignments[at:at + n])])
        at += n
    return per_document


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


def _document_steps(connection: Any) -> None:
    """A document process: steps `(work, args)` in, each answered ("ok", value), ("refused",
    (status, message)) or ("failed", "Type: message"), until the server closes the pipe."""
    while True:
        try:
            work, args = connection.recv()
        except (EOFError, OSError):
            return
        try:
            outcome: tuple = ("ok", work(*args))
        except RequestError as exc:
            outcome = ("refused", (exc.status, str(exc)))
        except Exception as exc:  # noqa: BLE001 (a parser's bug is the request's 500, the server goes on)
            outcome = ("failed", f"{type(exc).__name__}: {exc}")
        connection.send(outcome)


class _DocumentProcess:
    def __init__(self, context: Any):
        self.connection, theirs = context.Pipe()
        self.process = context.Process(target=_document_steps, args=(theirs,), daemon=True)
        self.process.start()
        theirs.close()

    def close(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        self.connection.close()


# A process that has read a document this large is replaced after it: what a parser allocated goes
# back to the system with the process, not kept by its allocator.
RENEW_AFTER_CHARS = 1 << 20
# Documents up to this size (text, not a Word file) are read on one of the server's threads: every
# reader is linear in its input, so one this small takes milliseconds, and a round trip to a document
# process would cost a request of one paragraph about a third of its answers per second on 2 cores
# (scripts/bench_serve.py --format text; docs/performance.md).
IN_THREAD_CHARS = 16 << 10


class DocumentProcesses:
    """Document work in long-lived processes of their own, at most `at_once` steps together (the
    others wait their turn, within their deadline). A step past its deadline has its process killed
    (a fresh one takes its place); so does a step of a large document once it is done. Processes
    come from a fork server that imported the document readers once."""

    def __init__(self, at_once: int | None = None):
        self.at_once = at_once or max(2, os.cpu_count() or 1)
        methods = multiprocessing.get_all_start_methods()
        self.context: Any = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
        if "forkserver" in methods:
            self.context.set_forkserver_preload([__name__])
        self.slots: asyncio.Semaphore | None = None
        self.idle: list[_DocumentProcess] = []
        self.lock = threading.Lock()

    async def run(self, work: Callable[..., Any], args: tuple, deadline: float, chars: int = 0,
                  word: bool = False) -> Any:
        """`work(*args)` in a document process; DeadlinePassed where it has not answered by
        `deadline` (time.monotonic(); the process is killed), its RequestError as it raised it.
        `chars`: the size of the documents it reads (a large one renews the process after it; one
        of at most IN_THREAD_CHARS is read on a thread of the server, unless it is a Word file,
        `word`, whose size says nothing of what it unpacks to)."""
        if chars <= IN_THREAD_CHARS and not word:
            return await asyncio.to_thread(work, *args)
        if self.slots is None:
            self.slots = asyncio.Semaphore(self.at_once)
        async with self.slots:
            return await asyncio.to_thread(self._run, work, args, deadline, chars, word)

    def warm(self) -> None:
        """Start the fork server and one document process ahead of the first document (the server
        calls it as it starts): the first upload does not wait ~0.5 s for them, and the server's
        memory holds them from the start."""
        worker = _DocumentProcess(self.context)
        with self.lock:
            self.idle.append(worker)

    def _run(self, work: Callable[..., Any], args: tuple, deadline: float, chars: int, word: bool) -> Any:
        with self.lock:
            worker = self.idle.pop() if self.idle else None
        kept = False
        try:
            if worker is None or not worker.process.is_alive():
                if worker is not None:
                    worker.close()
                worker = _DocumentProcess(self.context)
            worker.connection.send((work, args))
            if not worker.connection.poll(max(0.0, deadline - time.monotonic())):
                raise DeadlinePassed("reading the document ran past the request's deadline")
            outcome, value = worker.connection.recv()
            kept = chars <= RENEW_AFTER_CHARS and not word  # (a Word file's size says nothing of what it unpacked)
        except (EOFError, OSError):
            exit_code = worker.process.exitcode if worker is not None else None
            raise RequestError(500, f"the document's process ended without an answer (exit code {exit_code}); "
                                    "the server goes on") from None
        finally:
            if worker is not None:
                if kept:
                    with self.lock:
                        self.idle.append(worker)
                else:
                    worker.close()
        if outcome == "refused":
            raise RequestError(*value)
        if outcome == "failed":
            raise RequestError(500, f"internal error reading the document ({value}); the server goes on")
        return value

    def close(self) -> None:
        with self.lock:
            idle, self.idle = self.idle, []
        for worker in idle:
            worker.close()
