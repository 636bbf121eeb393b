"""`tfm serve`: a translation engine behind an HTTP JSON API (FastAPI + uvicorn: pip install -e '.[serve]').

    GET  /health     → {"status": "ok"}
    POST /translate  {"text": "…" | ["…", …], optional decode settings} → {"translations": ["…", …]}
    GET  /docs       the OpenAPI page

Requests that arrive together are decoded together (dynamic batching): a `Batcher` collects what
arrives within `max_wait` seconds of the first waiting request (and whatever queued while the
previous batch was decoding), up to `max_batch_lines` lines, and translates requests with the same
settings as one call of the engine, their lines dealt into one batch per decoding process
(decode.workers, forked before the server starts any thread) with sentences of every length in
each (decode.batching: balanced), so that the processes finish together. The engine runs on the
main thread and the HTTP event loop on a thread of its own (`MainThreadDecoder`), so the server
keeps accepting while it decodes.
One client never hurts another (docs/reliability.md, "tfm serve under abuse"):
- a request is checked alone before it joins a batch (its JSON, every line valid Unicode, the
  line and character limits, its decode settings, and what it would cost to decode: the work
  budget); a body over `max_body_bytes` is refused (413) before it is read to the end;
- a batch that fails is retried request by request, so only the request that fails gets an error;
- a decoding process that dies is noticed at once: the requests it was decoding get 503, and the
  next batch forks a fresh pool;
- an error is one JSON object `{"error": "…"}` (never the request echoed back) and at most one log
  line, with a traceback only under `--debug`.
Time is budgeted like memory: a request whose estimated work is over decode.max_work gets 413
before it is decoded; one whose decoding runs past `--request-timeout` gets 504 and tfm's engine
stops its search between two steps, so that the requests queued behind it are served (their wait
does not count against them); a connection that
does not send its headers within `--header-timeout` is closed.
SIGTERM, SIGINT (Ctrl-C) and SIGHUP (the terminal went away) stop accepting, let the requests in
flight finish for up to `--shutdown-grace` seconds (5 by default; then, or at a second signal, their
decoding is cut), and exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import signal
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, Optional

from fastapi import Request  # the file endpoint's raw body (FastAPI reads annotations from the module)

from ..data.language_id import identify
from ..decoding.budget import DeadlinePassed, stop_searches
from ..decoding.terms import LineTerms
from ..decoding.translation import TranslationEngine
from ..experiment.config import DecodeConfig
from ..runtime.console import discard_writes, warn
from ..runtime.errors import TfmError
from ..runtime.signals import Terminated, outputs_a_hangup_takes
from .access import AccessLog, ApiKeys, Quotas
from .batcher import Batcher, MainThreadDecoder, Runner, on_a_thread_of_its_own
from .documents import (
    MEDIA_TYPES,
    DocumentProcesses,
    file_document,
    lines_of,
    rebuilt_documents,
    request_documents,
    sentences_of,
    translated_name,
    translations_of,
)
from .gate import Gate, request_state
from .metrics import ServerMetrics, decoding_processes
from .page import PAGE
from .requests import (
    DetectRequest,
    RequestError,
    TranslateRequest,
    check_lines,
    error_status,
    failure_message,
    log_failure,
    request_decode,
    request_steering,
    response,
    validation_message,
    within_budget,
)
from .transport import BodyLimit, header_timeout_protocol

FILE_BODY = {"requestBody": {"required": True, "content": {"application/octet-stream": {
    "schema": {"type": "string", "format": "binary"}}}}}  # POST /translate/file: the document's bytes
DEADLINE_SLACK = 1.0  # seconds an answer from CTranslate2 (which cannot stop a batch) is waited for past the timeout
SHUTDOWN_GRACE = 5.0  # seconds requests in flight may take after SIGTERM/SIGINT/SIGHUP before they are cut (default)
# Lines of a /detect request identified in one turn on the decoding thread (~1 ms a 10,000-character
# line): a turn waits at most a few ms for the next client's, or a translation batch.
DETECT_CHUNK = 16
HEADER_TIMEOUT = 10.0  # seconds a connection may take to send a request's headers (slowloris)


async def by_deadline(translation: Awaitable[Any], engine: TranslationEngine, deadline: float) -> Any:
    """The translation's result. tfm's engine stops its own search at the timeout; an engine that
    cannot (CTranslate2, whose batch runs on) is answered DeadlinePassed once `deadline`
    (time.monotonic(), the request's arrival + timeout) is past by DEADLINE_SLACK."""
    if engine.stops_at_deadline:
        return await translation
    try:
        return await asyncio.wait_for(translation, deadline - time.monotonic() + DEADLINE_SLACK)
    except asyncio.TimeoutError:
        raise DeadlinePassed("the request ran past its deadline") from None


LexicalFactory = Callable[[], TranslationEngine]
Loader = Callable[[], tuple[TranslationEngine, LexicalFactory | None]]  # a reload: the engine anew, and its lexical factory


class Endpoints:
    """What the endpoints share: the engine, its batcher and the limits; `translate` is POST /translate,
    `reload` takes up the model anew (SIGUSR1)."""

    def __init__(self, engine: TranslationEngine, batcher: Batcher, runner: Runner, limits: dict,
                 budget: Callable[[list[str], DecodeConfig, list[LineTerms] | None], None] | None,
                 lexical_engine: LexicalFactory | None, quotas: Quotas | None,
                 metrics: ServerMetrics | None, debug: bool, load: Loader | None = None):
        self.engine, self.batcher, self.runner, self.budget = engine, batcher, runner, budget
        self.max_lines, self.max_chars = limits["max_lines"], limits["max_chars"]
        self.max_wait, self.max_batch_lines = limits["max_wait"], limits["max_batch_lines"]
        self.request_timeout = limits["request_timeout"]
        self.lexical_engine, self.quotas, self.metrics, self.debug = lexical_engine, quotas, metrics, debug
        self.routed: list[tuple[TranslationEngine, Batcher]] = []
        self.made: list[TranslationEngine] = []  # engines made for requests (app.state.engines)
        self.retiring: list[TranslationEngine] = []  # replaced by a reload, closed once their batches are done
        self.tasks: list[asyncio.Task] = []
        self.making = asyncio.Lock()
        self.load, self.reloading = load, asyncio.Lock()
        self.loop: asyncio.AbstractEventLoop | None = None  # the event loop's, once it runs
        self.detecting: dict[str, list] = {}  # client → [its turn's lock, its requests identifying]
        self.documents = DocumentProcesses()  # where documents are read and rebuilt

    def engines(self) -> list[TranslationEngine]:
        """Every engine the server holds: to cut their decoding and close them at the end."""
        return [self.engine, *self.made, *self.retiring]

    def request_reload(self) -> bool:
        """From any thread (SIGUSR1's handler): reload on the event loop. False before it runs."""
        if self.loop is None or self.load is None:
            return False
        self.loop.call_soon_threadsafe(lambda: self.tasks.append(asyncio.create_task(self.reload())))
        return True

    async def reload(self) -> bool:
        """Load the model anew beside the one serving, and swap it in once it has translated a line:
        batches decoding finish on the old model, which is closed after them. A model that fails to
        load or to translate is not taken up, and the old one serves on. One reload at a time."""
        assert self.load is not None
        async with self.reloading:
            try:
                engine, lexical = await on_a_thread_of_its_own(self.load, "tfm-reload")
            except Exception as exc:  # noqa: BLE001 (the old model serves on)
                return self._reload_failed(exc)
            try:
                await self.runner(lambda: take_up(engine))
            except Exception as exc:  # noqa: BLE001 (the old model serves on)
                await self.runner(engine.close)
                return self._reload_failed(exc)
            old, old_route = self.engine, self.routed
            if self.budget is not None and self.budget == getattr(old, "check_budget", None):
                self.budget = getattr(engine, "check_budget", None)
            self.engine = self.batcher.engine = engine
            self.lexical_engine, self.routed = lexical, []
            self._retire(old, self.batcher)
            for made, batcher in old_route:  # its queue is drained on the old model, then it ends
                self._retire(made, batcher, drain=True)
            if self.metrics is not None:
                self.metrics.reloaded(engine.describe())
            warn(f"tfm serve: reloaded the model; now {engine.describe()}")
            return True

    def _retire(self, engine: TranslationEngine, batcher: Batcher, drain: bool = False) -> None:
        if engine in self.made:
            self.made.remove(engine)
        self.retiring.append(engine)

        async def retire() -> None:
            await batcher.retire(engine, drain)
            self.retiring.remove(engine)

        self.tasks.append(asyncio.create_task(retire()))

    def _reload_failed(self, exc: Exception) -> bool:
        if self.metrics is not None:
            self.metrics.reloads.labels(outcome="failed").inc()
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        warn(f"tfm serve: reload failed, the model loaded before serves on: {message[:500]}")
        return False

    async def lexical_route(self) -> tuple[TranslationEngine, Batcher]:
        """tfm's engine and its batcher, made at the first request that needs them."""
        async with self.making:
            if not self.routed:
                assert self.lexical_engine is not None
                made = await self.runner(self.lexical_engine)  # loads the model on the decoding thread
                self.made.append(made)
                batcher = Batcher(made, self.max_wait, self.max_batch_lines, 1, self.runner)
                self.routed.append((made, batcher))
                batcher.task = asyncio.create_task(batcher.run())
                self.tasks.append(batcher.task)
                warn(f"tfm serve: requests with constraints or avoided terms decode with {made.describe()}: "
                     "CTranslate2 offers target prefixes only")
        return self.routed[0]

    async def checked(self, request: TranslateRequest, lines: list[str]):
        """The request's decode settings, terms, engine, batcher; a RequestError where it may not be decoded."""
        check_lines(lines, self.max_lines, self.max_chars)
        try:
            decode = request_decode(self.engine.decode, request)
        except ValueError as exc:
            raise RequestError(422, str(exc)) from None
        unsupported = self.engine.unsupported(decode)
        # Word alignments (asked for, or for a document's markup) come from tfm's engine beside CTranslate2.
        aligned_aside = bool(unsupported and decode.alignment and self.lexical_engine is not None
                             and not self.engine.unsupported(decode.model_copy(update={"alignment": False})))
        if unsupported and not aligned_aside:
            raise RequestError(422, f"{unsupported} (this server decodes with {self.engine.describe()})")
        check_source_language(self.engine, request.src_lang)
        terms = request_steering(self.engine, request, decode, lines, self.max_chars)
        target, queue, check = self.engine, self.batcher, self.budget
        if aligned_aside or (terms and self.lexical_engine is not None and any(t.constraints or t.avoid for t in terms)):
            target, queue = await self.lexical_route()
            check = target.check_budget
        if terms:
            try:
                target.check_terms(terms, decode)
            except TfmError as exc:
                raise RequestError(422, f"{exc} (this server decodes with {target.describe()})") from None
        within_budget(check, lines, decode, terms)
        return decode, terms, target, queue

    async def translate(self, request: TranslateRequest, state: dict, metered: bool = False):
        """POST /translate; `metered`: the lines of documents whose characters the client's quota
        has paid already (translate_read), so they are not counted again."""
        if request.format is not None:
            return await self.translate_documents(request, state)
        arrived = time.monotonic()
        lines = [request.text] if isinstance(request.text, str) else request.text
        client = state.get("client", "")
        admitted = False
        try:
            decode, terms, target, queue = await self.checked(request, lines)
            chars = sum(map(len, lines))
            state["lines"] = len(lines)
            if not metered:
                state["chars"] = chars
                refused = self.admit(client, chars)
                if refused is not None:
                    return refused
                admitted = self.quotas is not None
            results = await by_deadline(queue.translate(lines, decode, terms, self.request_timeout, client), target,
                                        arrived + self.request_timeout)
        except Exception as exc:  # noqa: BLE001 (the request's answer is the error; the server goes on)
            status = error_status(exc)
            log_failure(status, exc, self.debug)
            return error_answer(status, failure_message(status, exc, self.request_timeout))
        finally:
            if admitted:
                self.quotas.release(client)
        if self.metrics is not None:
            self.metrics.characters.inc(state["chars"])
            self.metrics.sentences.inc(len(lines))
        body = response(results, decode, terms, target)
        if request.src_lang == "auto":
            body["src_lang"] = [language for language, _ in await self.identified(lines, client)]
        return body

    def admit(self, client: str, chars: int):
        """None where the client's quotas admit `chars` more (then `quotas.release` it when answered),
        else the error answer (413/429)."""
        if self.quotas is None:
            return None
        refused = self.quotas.admit(client, chars)
        if refused is None:
            return None
        if self.metrics is not None:
            self.metrics.rejected.labels(reason="quota").inc()
        return error_answer(*refused)

    async def detect(self, lines: list[str], state: dict):
        """POST /detect: each line's language; metered as translation is (the line limits, the
        client's quotas, turns with the other clients)."""
        client = state.get("client", "")
        try:
            check_lines(lines, self.max_lines, self.max_chars)
        except RequestError as exc:
            return error_answer(exc.status, str(exc))
        state.update(chars=sum(map(len, lines)), lines=len(lines))
        refused = self.admit(client, state["chars"])
        if refused is not None:
            return refused
        try:
            found = await self.identified(lines, client)
        finally:
            if self.quotas is not None:
                self.quotas.release(client)
        return {"detections": [{"language": language, "confidence": round(p, 4)} for language, p in found]}

    async def identified(self, lines: list[str], client: str) -> list[tuple[str | None, float]]:
        """Each line's language (None for a blank one) and its probability. Identified on the
        decoding thread, DETECT_CHUNK lines a turn, one turn of a client's at a time: a client's long
        requests take turns with the other clients' and with translation batches, and never hold the
        event loop (which answers everyone)."""
        turn = self.detecting.setdefault(client, [asyncio.Lock(), 0])
        turn[1] += 1
        found: list[tuple[str | None, float]] = []
        try:
            for at in range(0, len(lines), DETECT_CHUNK):
                chunk = lines[at:at + DETECT_CHUNK]
                async with turn[0]:
                    found += await self.runner(
                        lambda chunk=chunk: [identify(line, one_line=True) if line.strip() else (None, 0.0)
                                             for line in chunk])
        finally:
            turn[1] -= 1
            if not turn[1]:
                del self.detecting[client]
        return found


    async def translate_documents(self, request: TranslateRequest, state: dict):
        """Documents (`"format"`): their sentences translated as a request of lines, then rebuilt."""
        try:
            documents = request_documents(request)
        except RequestError as exc:
            return error_answer(exc.status, str(exc))
        answer = await self.translate_read(documents, None, request, state)
        return {"translations": answer} if isinstance(answer, list) else answer

    async def translate_file(self, data: bytes, name: str, fmt: str | None, state: dict):
        """POST /translate/file: the document's bytes in, the translated file out (or an error answer)."""
        from fastapi.responses import Response

        try:
            document = file_document(data, name, fmt)
        except RequestError as exc:
            return error_answer(exc.status, str(exc))
        answer = await self.translate_read([document], name, TranslateRequest(text=[]), state)
        if not isinstance(answer, list):
            return answer
        translated = answer[0]
        filename = translated_name(name, self.engine.decode.tgt_lang or self.engine.target_languages().own)
        return Response(translated if isinstance(translated, bytes) else translated.encode("utf-8"),
                        media_type=MEDIA_TYPES[document[1]],
                        headers={"Content-Disposition": f'attachment; filename="{filename}"'})

    async def translate_read(self, documents: list, file_name: str | None, request: TranslateRequest, state: dict):
        """The documents read, their sentences translated and the documents rebuilt, each step of
        reading in a document process under the request's deadline; the characters read are what
        the client's quota pays (a document with nothing to translate costs what it sent)."""
        deadline = time.monotonic() + self.request_timeout
        client = state.get("client", "")
        state["chars"] = sum(len(document) for document, _ in documents)
        refused = self.admit(client, state["chars"])
        if refused is not None:
            return refused
        lang = self.engine.own_source_language
        try:
            read, word = state["chars"], any(fmt == "docx" for _, fmt in documents)
            planned = await self.documents.run(sentences_of, (documents, lang, file_name), deadline, read, word)
            answer = await self.translate(lines_of(planned, request), state, metered=True)
            if not isinstance(answer, dict):
                return answer
            # Rebuilding has a deadline of its own: the translation's time was not the document's.
            return await self.documents.run(rebuilt_documents, (documents, lang, file_name, translations_of(
                planned, answer)), time.monotonic() + self.request_timeout, read, word)
        except (RequestError, DeadlinePassed) as exc:
            status = error_status(exc)
            log_failure(status, exc, self.debug)
            return error_answer(status, str(exc) if status != 504 else
                                f"reading the document ran past {self.request_timeout:g} s, this server's limit "
                                "(tfm serve --request-timeout): send a smaller document")
        finally:
            if self.quotas is not None:
                self.quotas.release(client)


def take_up(engine: TranslationEngine) -> None:
    """Make a freshly loaded engine ready to serve (its decoding processes forked), or raise: a model
    that cannot translate one line is not swapped in."""
    workers = engine.decoding_workers() if hasattr(engine, "decoding_workers") else None
    if workers is not None:
        workers.start()
    if len(engine.translate(["tfm"], warn_long=False)) != 1:
        raise TfmError("the new model did not translate a test line")


def error_answer(status: int, message: str, retry_after: int | None = None):
    from fastapi.responses import JSONResponse

    headers = {"Retry-After": str(retry_after or 1)} if status in (429, 503) else None
    return JSONResponse(status_code=status, content={"error": message}, headers=headers)


def check_source_language(engine: TranslationEngine, src_lang: str | None) -> None:
    """A request's src_lang: auto (identified, then translated as it is), or the model's source language."""
    if src_lang is None or src_lang == "auto" or engine.own_source_language in (None, src_lang):
        return
    raise RequestError(422, f"src_lang {src_lang}: this model translates from {engine.own_source_language} "
                            "(or give auto)")


def languages(engine: TranslationEngine) -> dict:
    """GET /languages: what the model translates from and into."""
    targets = engine.target_languages()
    return {"source": list(engine.source_languages) or ([engine.own_source_language] if engine.own_source_language else []),
            "target": list(targets.known) or ([targets.own] if targets.own else []), "multilingual": targets.several,
            "detection": "fastText lid.176 (POST /detect)"}


def create_app(engine: TranslationEngine, runner: Runner, max_lines: int = 256, max_chars: int = 10_000,
               max_wait: float = 0.005, max_batch_lines: int = 256, processes: int = 1, request_timeout: float = 60.0,
               budget: Callable[[list[str], DecodeConfig, list[LineTerms] | None], None] | None = None, debug: bool = False,
               lexical_engine: LexicalFactory | None = None, quotas: Quotas | None = None,
               metrics: ServerMetrics | None = None, load: Loader | None = None):
    """The FastAPI application serving `engine`, which decodes in `processes` processes, its calls
    made by `runner` (MainThreadDecoder.run). `budget(lines, decode, terms)` raises a TfmError for a
    request that would cost more than the server allows. `lexical_engine()` makes the engine that
    requests with constraints or avoided terms go to where `engine` cannot apply them (tfm's,
    beside CTranslate2), at the first such request; `app.state.engines` lists the engines made.
    `request_timeout`: seconds a request may take from its arrival; past it the answer is 504 (tfm's
    engine stops its search there; CTranslate2's batch runs on, bounded by decode.max_work).
    `quotas`: per client (Gate names it); `metrics`: GET /metrics; `load`: makes the engine anew for
    a reload (`app.state.endpoints.request_reload()`)."""
    from fastapi import FastAPI, Query
    from fastapi.responses import HTMLResponse, Response

    batcher = Batcher(engine, max_wait, max_batch_lines, processes, runner)
    limits = dict(max_lines=max_lines, max_chars=max_chars, max_wait=max_wait, max_batch_lines=max_batch_lines,
                  request_timeout=request_timeout)
    endpoints = Endpoints(engine, batcher, runner, limits, budget, lexical_engine, quotas, metrics, debug, load)
    if metrics is not None:
        batcher.observe_batch = metrics.batch_lines.observe

    @contextlib.asynccontextmanager
    async def lifespan(app):
        endpoints.loop = asyncio.get_running_loop()
        endpoints.tasks.append(asyncio.create_task(batcher.run()))
        endpoints.tasks.append(asyncio.create_task(asyncio.to_thread(endpoints.documents.warm)))
        yield
        for task in endpoints.tasks:
            task.cancel()
        endpoints.documents.close()

    app = FastAPI(title="tfm", description="Transformer translation (tfm serve)", lifespan=lifespan)
    app.state.engines, app.state.endpoints = endpoints.made, endpoints
    answer_errors_in_one_line(app, debug)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/languages")
    async def model_languages() -> dict:
        return languages(endpoints.engine)

    @app.post("/detect")
    async def detect(request: DetectRequest):
        return await endpoints.detect([request.text] if isinstance(request.text, str) else request.text,
                                      request_state())

    @app.get("/metrics")
    async def prometheus_metrics():
        if metrics is None:
            return error_answer(404, "this server keeps no metrics")
        metrics.queue_depth.set(batcher.queue.count)
        metrics.processes.set(decoding_processes(endpoints.engine))
        metrics.restarts.set(max(0, getattr(getattr(endpoints.engine, "workers", None), "forks", 0) - 1))
        content, media_type = metrics.render()
        return Response(content, media_type=media_type)

    @app.post("/translate")
    async def translate(request: TranslateRequest):
        return await endpoints.translate(request, request_state())

    @app.post("/translate/file", response_class=Response, openapi_extra=FILE_BODY)
    async def translate_file(request: Request, name: str = Query(..., min_length=1, max_length=255),
                             format: Optional[str] = Query(None, max_length=16)):
        """A document as the request body (its name says its format, or ?format=): the translated file back."""
        return await endpoints.translate_file(await request.body(), name, format, request_state())

    @app.get("/", response_class=HTMLResponse)
    async def page():
        return HTMLResponse(PAGE)

    return app


def answer_errors_in_one_line(app: Any, debug: bool) -> None:
    """`app`'s answers to a malformed request (422), an HTTP error of the framework's (a body that
    is not UTF-8) and a bug (500, the server goes on): one line each, as every other error."""
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request, exc: RequestValidationError):
        return error_answer(422, validation_message(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException):  # e.g. a body that is not UTF-8
        return error_answer(exc.status_code, f"request: {str(exc.detail)[:300]}")

    @app.exception_handler(Exception)
    async def failed(request, exc: Exception):  # a bug: one line, the server goes on
        log_failure(500, exc, debug)
        return error_answer(500, f"internal error ({type(exc).__name__}); the server goes on")


def check_address(host: str, port: int) -> None:
    """A TfmError (one line) where `host`:`port` cannot be listened on, said before the HTTP server's
    thread starts (where it would only be a failure of that thread)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise TfmError(f"cannot serve on {host}:{port}: {exc.strerror or exc}") from None


class Shutdown:
    """`tfm serve`'s signal handler: the first SIGTERM, SIGINT or SIGHUP stops accepting and lets
    the requests in flight finish for `grace` seconds, then cuts their decoding (they get 503); a
    second signal cuts at once (`Terminated`, raised on the main thread between two steps)."""

    def __init__(self, server: Any, endpoints: Endpoints, grace: float = SHUTDOWN_GRACE):
        self.server, self.endpoints, self.grace_seconds = server, endpoints, grace
        self.hangup = getattr(signal, "SIGHUP", None)
        self.terminal_outputs = outputs_a_hangup_takes()
        self.grace: list[threading.Timer] = []

    def stop(self, signum: int, frame: Any) -> None:
        if signum == self.hangup:  # the terminal is gone: every later write to it would fail
            discard_writes(self.terminal_outputs)
        if self.server.should_exit:
            self.server.force_exit = True
            raise Terminated(signum)
        self.server.should_exit = True
        if not self.grace:  # a decoding that outlasts the grace is stopped: its requests get 503
            self.grace.append(threading.Timer(self.grace_seconds, self.cut_decoding))
            self.grace[0].daemon = True
            self.grace[0].start()

    def cut_decoding(self) -> None:
        stop_searches()  # tfm's engine in this process: at its next step
        for made in self.endpoints.engines():
            pool = getattr(made, "workers", None)
            if pool is not None:
                pool.stop_now()  # its decoding processes

    def cancel(self) -> None:
        for timer in self.grace:
            timer.cancel()


def serve(engine: TranslationEngine, host: str, port: int, ready: Callable[[], None] | None = None,
          max_body_bytes: int = 1 << 20, debug: bool = False,
          lexical_engine: LexicalFactory | None = None, header_timeout: float = HEADER_TIMEOUT,
          keys: ApiKeys | None = None, quotas: Quotas | None = None, access_log: AccessLog | None = None,
          model_name: str = "", reload: Loader | None = None, forwarded_allow_ips: str | None = None,
          shutdown_grace: float = SHUTDOWN_GRACE, **limits) -> None:
    """Serve until SIGTERM, SIGINT or SIGHUP; requests in flight get `shutdown_grace` seconds to
    finish, then the decoding is cut (a second signal cuts it at once). Returns normally (exit 0).
    `ready()` is called once the address is known to be free (before that, a bad one is an error).
    `lexical_engine`: see `create_app`. `keys`: the API keys every endpoint but /health needs;
    `quotas` per client; `access_log`: one line per request (serve/access.py). `reload`: makes the
    engine anew from the same files; SIGUSR1 calls it and swaps the new model in (Endpoints.reload).
    `forwarded_allow_ips`: the proxies (addresses, networks, or *) whose X-Forwarded-For names the
    client; None: no proxy header is read, the connection's address is the client (for quotas and
    the access log: a client could otherwise name itself anew with every request)."""
    import uvicorn

    workers = engine.decoding_workers() if hasattr(engine, "decoding_workers") else None
    if workers is not None:
        workers.start()  # forked now, while this process has no thread but torch's

    check_address(host, port)  # a clear error first
    if ready is not None:
        ready()
    decoder = MainThreadDecoder()
    metrics = ServerMetrics(engine.describe(), model_name)
    app = create_app(engine, decoder.run, processes=workers.processes if workers is not None else engine.budget_processes(),
                     debug=debug, budget=getattr(engine, "check_budget", None), lexical_engine=lexical_engine,
                     quotas=quotas, metrics=metrics, load=reload, **limits)
    endpoints: Endpoints = app.state.endpoints
    gate = Gate(BodyLimit(app, max_body_bytes), keys, metrics, access_log)
    server = uvicorn.Server(uvicorn.Config(gate, host=host, port=port,
                                           http=header_timeout_protocol(header_timeout),
                                           proxy_headers=forwarded_allow_ips is not None,
                                           forwarded_allow_ips=forwarded_allow_ips or "",
                                           timeout_graceful_shutdown=math.ceil(shutdown_grace) + 2,
                                           log_level="debug" if debug else "critical", access_log=False))
    failure: list[BaseException] = []

    def http() -> None:  # uvicorn installs no signal handlers off the main thread: stop() below does
        try:
            server.run()
        except BaseException as exc:  # noqa: BLE001 (reported on the main thread)
            failure.append(exc)

    shutdown = Shutdown(server, endpoints, shutdown_grace)

    def reload_model(signum: int, frame: Any) -> None:  # on the main thread, maybe mid-batch: only asks
        if not endpoints.request_reload():
            warn("tfm serve: SIGUSR1 before the server runs: no reload")

    handled = [s for s in (signal.SIGINT, signal.SIGTERM, shutdown.hangup) if s is not None]
    previous = {s: signal.signal(s, shutdown.stop) for s in handled if signal.getsignal(s) is not signal.SIG_IGN}
    if reload is not None and hasattr(signal, "SIGUSR1"):
        previous[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, reload_model)
    thread = threading.Thread(target=http, name="tfm-http")
    try:
        thread.start()
        decoder.run_until(lambda: not thread.is_alive())
    except (Terminated, KeyboardInterrupt):  # a second signal: now, requests still decoding get no answer
        if not server.should_exit:
            raise
    finally:
        shutdown.cancel()
        for s, handler in previous.items():
            signal.signal(s, handler)
        thread.join()
        for made in endpoints.engines():
            made.close()
    if not server.started:
        reason = f": {failure[0]}" if failure and not isinstance(failure[0], SystemExit) and str(failure[0]) else ""
        raise TfmError(f"cannot serve on {host}:{port}: the HTTP server did not start{reason}")

