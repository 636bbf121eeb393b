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
flight finish for up to SHUTDOWN_GRACE seconds (then, or at a second signal, their decoding is cut),
and exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import queue
import signal
import socket
import threading
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..decoding.budget import DeadlinePassed, SearchesStopped, stop_searches
from ..decoding.engine import CheckpointReplaced
from ..decoding.terms import LineTerms, conflicts, unique
from ..decoding.translation import MAX_CONSTRAINTS, Translation, TranslationEngine
from ..decoding.workers import DecodingProcessDied
from ..experiment.config import DecodeConfig, refuse_booleans_as_numbers
from ..runtime.console import discard_writes, warn
from ..runtime.errors import TfmError
from ..runtime.signals import Terminated, outputs_a_hangup_takes


class TranslateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    text: str | list[str]
    beam: int | None = Field(None, ge=1, le=64)
    nbest: int | None = Field(None, ge=1, le=64)
    alignment: bool | None = None
    sample: bool | None = None
    top_k: int | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    temperature: float | None = Field(None, gt=0.0)
    seed: int | None = Field(None, ge=0, lt=2**63)
    # Text each translation starts with (target language): one for every line, or one per line ("": none).
    prefix: str | list[str] | None = None
    # Per line, the terms its translation must contain (beam search, tfm's engine).
    constraints: list[list[str]] | None = None
    # Terms no translation may contain: one list for every line, or one list per line.
    avoid: list[str] | list[list[str]] | None = None
    # The target language of a model that translates into several (its tag >>xx<< starts each line without one).
    tgt_lang: str | None = Field(None, min_length=1, max_length=32, pattern=r"^[^\s<>]+$")

    @model_validator(mode="before")
    @classmethod
    def _no_booleans_as_numbers(cls, data: Any) -> Any:  # {"beam": true} is no beam 1
        return refuse_booleans_as_numbers(cls, data)

    @field_validator("text", "prefix", "constraints", "avoid")
    @classmethod
    def _valid_unicode(cls, text: str | list | None) -> str | list | None:
        """JSON may carry lone surrogates (`"\\ud800"`): no tokenizer takes them."""
        if text is None:
            return text
        for number, line in enumerate([text] if isinstance(text, str) else text, start=1):
            for item in [line] if isinstance(line, str) else line:
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError as exc:
                    raise ValueError(f"line {number}: not valid Unicode ({exc.reason} at character {exc.start})") from None
        return text


class RequestError(Exception):
    """A request that gets an error answer: `status` and one line."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def error_status(exc: BaseException) -> int:
    """The HTTP status of a failed decode: the server's fault or the request's."""
    if isinstance(exc, RequestError):
        return exc.status
    if isinstance(exc, (DecodingProcessDied, SearchesStopped)):
        return 503  # the pool is forked anew for the next batch, or the server is stopping: try again
    if isinstance(exc, CheckpointReplaced):
        return 503  # the server's own state: the operator restarts it
    if isinstance(exc, DeadlinePassed):
        return 504
    return 422 if isinstance(exc, TfmError) else 500


# Per-request decode settings a client may choose; the rest (lengths, precision, batching) is the server's.
TERM_FIELDS = ("prefix", "constraints", "avoid")
REQUEST_SETTINGS = tuple(name for name in TranslateRequest.model_fields if name not in ("text", *TERM_FIELDS))
MAX_TERMS = MAX_CONSTRAINTS  # constraints, and avoided terms, a line may have
SAMPLING_SETTINGS = ("top_k", "top_p", "temperature", "seed")  # meaningful only with sample


@dataclass
class Job:
    lines: list[str]
    decode: DecodeConfig
    done: asyncio.Future = field(repr=False)
    terms: list[LineTerms] | None = None  # per line
    timeout: float | None = None  # seconds its decoding may take (--request-timeout)


Runner = Callable[[Callable[[], Any]], Awaitable[Any]]  # runs a call of the engine off the event loop
IN_FLIGHT = 2  # request batches decoding at once (Batcher.run)
DEADLINE_SLACK = 1.0  # seconds an answer from CTranslate2 (which cannot stop a batch) is waited for past the timeout
SHUTDOWN_GRACE = 5.0  # seconds requests in flight may take after SIGTERM/SIGINT/SIGHUP before they are cut
HEADER_TIMEOUT = 10.0  # seconds a connection may take to send a request's headers (slowloris)


class MainThreadDecoder:
    """Runs the engine's calls on the thread that calls `run_until`: the main thread in `serve`.

    Torch's CPU ops run in parallel through OpenMP, which keeps a team of threads for each thread
    that calls them. A second thread running the model (a decode thread beside the main thread,
    which loaded and prepared it) doubles the OpenMP threads; libgomp then sees more threads than
    cores and stops spinning between ops, and every small op waits for a wake-up: one-sentence
    requests decoded 2.7x slower on 2 cores (106 vs 39 ms). So the model only ever runs on the
    main thread, and the event loop runs on another.
    """

    def __init__(self) -> None:
        self.calls: queue.Queue[tuple[Callable[[], Any], asyncio.AbstractEventLoop, asyncio.Future]] = queue.Queue()

    async def run(self, call: Callable[[], Any]) -> Any:
        """Awaitable from the event loop: `call()` made on the decoding thread."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.calls.put((call, loop, future))
        return await future

    def run_until(self, finished: Callable[[], bool]) -> None:
        """Make the calls handed over, until `finished()` and none is left."""
        while not (finished() and self.calls.empty()):
            try:
                call, loop, future = self.calls.get(timeout=0.05)
            except queue.Empty:
                continue
            try:
                outcome, error = call(), None
            except Exception as exc:  # noqa: BLE001 (the request's answer is the error; the server goes on)
                outcome, error = None, exc
            with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits for it any more
                loop.call_soon_threadsafe(_settle, future, outcome, error)


def _settle(future: asyncio.Future, outcome: Any, error: BaseException | None) -> None:
    if not future.done():  # a client that went away has cancelled its future
        future.set_exception(error) if error is not None else future.set_result(outcome)


def request_batch_decode(decode: DecodeConfig, lines: int, processes: int) -> DecodeConfig:
    """The settings one request batch of `lines` lines decodes with: with several processes, a
    batch for each, long and short sentences in each (decode.batching: balanced), so that the
    processes finish together."""
    if processes <= 1:
        return decode
    return decode.model_copy(update={"batching": "balanced",
                                     "batch_size": max(1, min(decode.batch_size, -(-lines // processes)))})


class Batcher:
    """Collects concurrent requests into batches for one engine, decoded one batch at a time by
    `runner` (MainThreadDecoder.run)."""

    def __init__(self, engine: TranslationEngine, max_wait: float, max_batch_lines: int, processes: int,
                 runner: Runner):
        self.engine, self.max_wait, self.max_batch_lines = engine, max_wait, max_batch_lines
        self.processes = processes  # decoding processes: each call's lines are split into this many batches at least
        self.queue: asyncio.Queue[Job] = asyncio.Queue()
        self.runner = runner

    async def translate(self, lines: list[str], decode: DecodeConfig, terms: list[LineTerms] | None = None,
                        timeout: float | None = None) -> list[list[Translation]]:
        job = Job(lines, decode, asyncio.get_running_loop().create_future(), terms, timeout)
        await self.queue.put(job)
        return await job.done

    async def run(self) -> None:
        """Collect and decode batches until cancelled. A batch is started on the decoding thread and
        finished off it (`TranslationEngine.translate_later`), so that an engine decoding in the
        background (CTranslate2) gets the next batch while it finishes this one and its threads never
        wait at a batch's end; at most IN_FLIGHT batches at once. tfm's engine decodes the whole batch
        when it is started: for it one batch at a time, collected while the last one decoded (two at
        once measured slower: smaller batches)."""
        loop = asyncio.get_running_loop()
        in_flight = asyncio.Semaphore(IN_FLIGHT if self.engine.decodes_in_background else 1)
        finishing: set[asyncio.Task] = set()
        while True:
            await in_flight.acquire()  # a batch is collected once it can start: as large as it can be
            jobs = [await self.queue.get()]
            deadline = loop.time() + self.max_wait
            while sum(len(j.lines) for j in jobs) < self.max_batch_lines:
                try:
                    jobs.append(self.queue.get_nowait() if not self.queue.empty() else
                                await asyncio.wait_for(self.queue.get(), deadline - loop.time()))
                except (asyncio.TimeoutError, ValueError):
                    break
            groups: dict[str, list[Job]] = {}  # requests with the same settings decode together
            for job in jobs:
                groups.setdefault(job.decode.model_dump_json(), []).append(job)
            for number, same in enumerate(groups.values()):
                if number:
                    await in_flight.acquire()
                task = asyncio.create_task(self._decode_together(same, same[0].decode))
                finishing.add(task)
                task.add_done_callback(finishing.discard)
                task.add_done_callback(lambda _: in_flight.release())
                await asyncio.sleep(0)  # the task starts its batch before the next is collected

    async def _decode_together(self, jobs: list[Job], decode: DecodeConfig) -> None:
        jobs = [job for job in jobs if not job.done.done()]  # a client that went away cancelled its future
        if not jobs:
            return
        # tfm's engine stops the search between two steps once it has decoded for the requests'
        # timeout: a request that would hold the engine longer is cut there (504), and the requests
        # queued behind it, whose waiting does not count against them, are served next.
        timeouts = [job.timeout for job in jobs]
        timeout = None if None in timeouts else max(timeouts)  # type: ignore[type-var]
        lines = [line for job in jobs for line in job.lines]
        terms = ([t for job in jobs for t in (job.terms or [LineTerms()] * len(job.lines))]
                 if any(job.terms for job in jobs) else None)  # each line keeps its request's terms
        decode = request_batch_decode(decode, len(lines), self.processes)
        def start() -> Callable[[], list[list[Translation]]]:  # long lines are cut silently: one client must not flood the log
            deadline = None if timeout is None else time.monotonic() + timeout  # from the start of its decoding
            return self.engine.translate_later(lines, nbest=decode.nbest, decode=decode, warn_long=False,
                                               terms=terms, deadline=deadline)

        try:
            if self.engine.decodes_in_background:  # waited for off the decoding thread, which starts the next batch
                results = await asyncio.to_thread(await self.runner(start))
            else:
                results = await self.runner(lambda: start()())
        except Exception as exc:  # noqa: BLE001 (the request's answer is the error; the server goes on)
            if len(jobs) > 1 and not isinstance(exc, DecodingProcessDied):
                for job in jobs:  # isolation: only the request that fails alone gets the error
                    await self._decode_together([job], job.decode)
                return
            for job in jobs:
                if not job.done.done():
                    job.done.set_exception(exc)
            return
        start = 0
        for job in jobs:
            if not job.done.done():  # a client that went away has cancelled its future
                job.done.set_result(results[start : start + len(job.lines)])
            start += len(job.lines)


def request_decode(base: DecodeConfig, request: TranslateRequest) -> DecodeConfig:
    """The server's decode settings with the request's choices; a rule across them broken → ValueError."""
    chosen = {name: getattr(request, name) for name in REQUEST_SETTINGS if getattr(request, name) is not None}
    settings = base.model_dump()
    if chosen.get("sample") is False:  # the server's sampling settings go with its sampling
        settings.update({name: DecodeConfig.model_fields[name].default for name in SAMPLING_SETTINGS})
    try:
        return DecodeConfig.model_validate({**settings, **chosen})
    except ValidationError as exc:
        raise ValueError("; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())) from None


def per_line(name: str, value: Any, lines: list[str], one_for_all: bool) -> list:
    """A request field given once for every line (`one_for_all`) or as a list as long as text."""
    values = [value] * len(lines) if one_for_all else value
    if len(values) != len(lines):
        raise RequestError(422, f"{name}: {len(values)} given for {len(lines)} lines of text (give "
                                f"{'one for every line, or ' if name != 'constraints' else ''}a list as long as text)")
    return values


def request_steering(engine: TranslationEngine, request: TranslateRequest, decode: DecodeConfig, lines: list[str],
                     max_chars: int) -> list[LineTerms] | None:
    """A request's target language checked against the model's tags (each line's too), and its
    terms (`request_terms`); a RequestError otherwise."""
    try:
        engine.target_languages().check(decode.tgt_lang, "tgt_lang")
        engine.target_languages().tag_lines(lines, decode.tgt_lang)
    except TfmError as exc:
        raise RequestError(422, str(exc)) from None
    return request_terms(request, lines, max_chars)


def request_terms(request: TranslateRequest, lines: list[str], max_chars: int) -> list[LineTerms] | None:
    """Each line's prefix, constraints and avoided terms from the request; a RequestError (422, or
    413 over the limits) naming the field and line otherwise."""
    if all(getattr(request, name) is None for name in TERM_FIELDS):
        return None
    prefixes = per_line("prefix", request.prefix or "", lines, not isinstance(request.prefix, list))
    constraints = per_line("constraints", request.constraints or [], lines, request.constraints is None)
    avoid = request.avoid or []
    avoids = per_line("avoid", avoid, lines, not avoid or all(isinstance(a, str) for a in avoid))
    found = []
    for number, (prefix, musts, avoided) in enumerate(zip(prefixes, constraints, avoids), start=1):
        if not isinstance(prefix, str) or not isinstance(musts, list) or not isinstance(avoided, list) \
                or not all(isinstance(t, str) for t in [*musts, *avoided]):
            raise RequestError(422, f"line {number}: avoid is a list of strings, or one such list per line")
        for name, texts in (("prefix", [prefix] if prefix else []), ("constraints", musts), ("avoid", avoided)):
            if len(texts) > MAX_TERMS:
                raise RequestError(413, f"{name} line {number}: {len(texts)} terms, more than the limit of {MAX_TERMS}")
            for text in texts:
                if len(text) > max_chars:
                    raise RequestError(413, f"{name} line {number}: {len(text)} characters, more than the limit of "
                                            f"{max_chars} (tfm serve --max-chars)")
                if "\n" in text or "\r" in text:
                    raise RequestError(422, f"{name} line {number}: a line break (a {name} term is one line)")
                if name != "prefix" and "\t" in text:
                    raise RequestError(422, f"{name} line {number}: a tab (a term is one line without tabs)")
                if name != "prefix" and not text.strip():
                    raise RequestError(422, f"{name} line {number}: an empty term")
        terms = LineTerms(prefix if prefix.strip() else "", unique(t.strip() for t in musts),
                          unique(t.strip() for t in avoided))
        problem = conflicts(terms)
        if problem:
            raise RequestError(422, f"line {number}: {problem}")
        found.append(terms)
    return found if any(not t.empty for t in found) else None


def response(results: list[list[Translation]], decode: DecodeConfig, terms: list[LineTerms] | None = None) -> dict:
    body: dict = {"translations": [r[0].text for r in results]}
    if terms is not None and any(t.constraints for t in terms):  # what did not fit a line's length limit
        body["unmet"] = [list(r[0].unmet) for r in results]
    if decode.alignment:
        body["alignments"] = [r[0].alignment for r in results]
    if decode.nbest > 1:
        body["nbest"] = [[{"text": t.text, "score": t.score, **({"alignment": t.alignment} if decode.alignment else {})}
                          for t in r] for r in results]
    return body


def check_lines(lines: list[str], max_lines: int, max_chars: int) -> None:
    """The limits of one request's text: RequestError (413, 422) naming the line."""
    if len(lines) > max_lines:
        raise RequestError(413, f"text: {len(lines)} lines, more than this server's limit of {max_lines} a "
                                "request (tfm serve --max-lines)")
    for number, line in enumerate(lines, start=1):
        if len(line) > max_chars:
            raise RequestError(413, f"text line {number}: {len(line)} characters, more than the limit of "
                                    f"{max_chars} (tfm serve --max-chars)")
        if "\n" in line or "\r" in line:
            raise RequestError(422, f"text line {number}: contains a line break (send one sentence per list item)")


def validation_message(errors: list[dict], limit: int = 300) -> str:
    """pydantic's errors in one short line, without the input (which may be megabytes)."""
    parts = []
    for e in errors:
        if e.get("type") == "json_invalid":
            parts.append("request body: not valid JSON")
            continue
        where = ".".join(str(p) for p in e.get("loc", ()) if p not in ("body", "str", "list[str]"))
        message = str(e.get("msg", "invalid"))
        parts.append(f"{where}: {message.removeprefix('Value error, ')}" if where else message)
    text = "; ".join(dict.fromkeys(parts))
    return text if len(text) <= limit else text[: limit - 1] + "…"


class BodyLimit:
    """ASGI wrapper: a request body over `limit` bytes gets 413 before it is read to the end (by its
    Content-Length, or as soon as a streamed body passes the limit); the rest pass unchanged."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            return await self._refuse(send, declared.decode("latin-1")[:20])
        body = bytearray()
        while True:  # read it here, bounded, and hand it on whole
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            body += message.get("body", b"")
            if len(body) > self.limit:
                return await self._refuse(send, f"more than {len(body)}")
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send, size: str) -> None:
        content = json.dumps({"error": f"request body: {size} bytes, more than this server's limit of "
                                       f"{self.limit} (tfm serve --max-body-bytes)"}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"connection", b"close"),
                                (b"content-length", str(len(content)).encode())]})
        await send({"type": "http.response.body", "body": content})


def within_budget(check: Callable[[list[str], DecodeConfig, list[LineTerms] | None], None] | None, lines: list[str],
                  decode: DecodeConfig, terms: list[LineTerms] | None) -> None:
    """RequestError 413 where `check` (the engine's work and memory budget) refuses the request."""
    if check is not None:
        try:
            check(lines, decode, terms)
        except TfmError as exc:
            raise RequestError(413, str(exc)) from None


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


def failure_message(status: int, exc: BaseException, request_timeout: float) -> str:
    """What a failed request is told: its own error, or what the server's trouble means for it."""
    if status == 504:
        return (f"the request's decoding ran past {request_timeout:g} s, this server's limit "
                "(tfm serve --request-timeout): send fewer lines or a smaller beam")
    if status < 500 or isinstance(exc, (DecodingProcessDied, SearchesStopped, CheckpointReplaced)):
        return str(exc)
    return f"internal error ({type(exc).__name__}); the server goes on"


def log_failure(status: int, exc: BaseException, debug: bool) -> None:
    """One line per failed request that is the server's concern (5xx); a traceback only with --debug."""
    if status < 500:
        return
    warn(f"tfm serve: {status}: {type(exc).__name__}: {str(exc)[:300]}")
    if debug:
        warn("".join(traceback.format_exception(exc)).rstrip())


def create_app(engine: TranslationEngine, runner: Runner, max_lines: int = 256, max_chars: int = 10_000,
               max_wait: float = 0.005, max_batch_lines: int = 256, processes: int = 1, request_timeout: float = 60.0,
               budget: Callable[[list[str], DecodeConfig, list[LineTerms] | None], None] | None = None, debug: bool = False,
               lexical_engine: Callable[[], TranslationEngine] | None = None):
    """The FastAPI application serving `engine`, which decodes in `processes` processes, its calls
    made by `runner` (MainThreadDecoder.run). `budget(lines, decode, terms)` raises a TfmError for a
    request that would cost more than the server allows. `lexical_engine()` makes the engine that
    requests with constraints or avoided terms go to where `engine` cannot apply them (tfm's,
    beside CTranslate2), at the first such request; `app.state.engines` lists the engines made.
    `request_timeout`: seconds a request may take from its arrival; past it the answer is 504 (tfm's
    engine stops its search there; CTranslate2's batch runs on, bounded by decode.max_work)."""
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    batcher = Batcher(engine, max_wait, max_batch_lines, processes, runner)
    tasks: list[asyncio.Task] = []
    routed: list[tuple[TranslationEngine, Batcher]] = []
    making = asyncio.Lock()

    @contextlib.asynccontextmanager
    async def lifespan(app):
        tasks.append(asyncio.create_task(batcher.run()))
        yield
        for task in tasks:
            task.cancel()

    app = FastAPI(title="tfm", description="Transformer translation (tfm serve)", lifespan=lifespan)
    app.state.engines = []

    async def lexical_route() -> tuple[TranslationEngine, Batcher]:
        """tfm's engine and its batcher, made at the first request that needs them."""
        async with making:
            if not routed:
                assert lexical_engine is not None
                made = await runner(lexical_engine)  # loads the model on the decoding thread
                app.state.engines.append(made)
                routed.append((made, Batcher(made, max_wait, max_batch_lines, 1, runner)))
                tasks.append(asyncio.create_task(routed[0][1].run()))
                warn(f"tfm serve: requests with constraints or avoided terms decode with {made.describe()}: "
                     "CTranslate2 offers target prefixes only")
        return routed[0]

    def error(status: int, message: str) -> JSONResponse:
        headers = {"Retry-After": "1"} if status == 503 else None
        return JSONResponse(status_code=status, content={"error": message}, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request, exc: RequestValidationError) -> JSONResponse:
        return error(422, validation_message(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException) -> JSONResponse:  # e.g. a body that is not UTF-8
        return error(exc.status_code, f"request: {str(exc.detail)[:300]}")

    @app.exception_handler(Exception)
    async def failed(request, exc: Exception) -> JSONResponse:  # a bug: one line, the server goes on
        log_failure(500, exc, debug)
        return error(500, f"internal error ({type(exc).__name__}); the server goes on")

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.post("/translate")
    async def translate(request: TranslateRequest):
        arrived = time.monotonic()
        lines = [request.text] if isinstance(request.text, str) else request.text
        try:
            check_lines(lines, max_lines, max_chars)
            try:
                decode = request_decode(engine.decode, request)
            except ValueError as exc:
                raise RequestError(422, str(exc)) from None
            unsupported = engine.unsupported(decode)
            if unsupported:
                raise RequestError(422, f"{unsupported} (this server decodes with {engine.describe()})")
            terms = request_steering(engine, request, decode, lines, max_chars)
            target, queue, check = engine, batcher, budget
            if terms and lexical_engine is not None and any(t.constraints or t.avoid for t in terms):
                target, queue = await lexical_route()
                check = target.check_budget
            if terms:
                try:
                    target.check_terms(terms, decode.beam, decode)
                except TfmError as exc:
                    raise RequestError(422, f"{exc} (this server decodes with {target.describe()})") from None
            within_budget(check, lines, decode, terms)
            results = await by_deadline(queue.translate(lines, decode, terms, request_timeout), target,
                                        arrived + request_timeout)
        except Exception as exc:  # noqa: BLE001 (the request's answer is the error; the server goes on)
            status = error_status(exc)
            log_failure(status, exc, debug)
            return error(status, failure_message(status, exc, request_timeout))
        return response(results, decode, terms)

    return app


def listening_address(host: str) -> tuple[str, bool]:
    """`--host` → (the address as a URL writes it, whether it is loopback only); an empty or
    unresolvable host is a TfmError (an unset `$HOST` must not mean every interface)."""
    import ipaddress

    if not host.strip():
        raise TfmError("--host is empty: give an address, e.g. 127.0.0.1 (this machine only, the default) "
                       "or 0.0.0.0 (every interface)")
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise TfmError(f"--host {host!r}: not an address this machine can listen on ({exc})") from None
    loopback = all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)
    return (f"[{host}]" if ":" in host else host), loopback


def header_timeout_protocol(timeout: float) -> type:
    """uvicorn's HTTP/1.1 protocol (h11) with a deadline for each request's headers: a connection
    that has not sent a whole request head `timeout` seconds after it opened (or after its last
    response) is closed. uvicorn has a keep-alive timeout for idle connections, but none for a
    client that sends its headers a byte at a time (slowloris), which held connections forever."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeout(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def _await_headers(self) -> None:
            self._stop_waiting()
            self._header_timer = self.loop.call_later(timeout, self._headers_too_slow)

        def _stop_waiting(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._await_headers()

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE:  # the head is in
                self._stop_waiting()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._await_headers()  # the next request's head, on a kept-alive connection

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_waiting()
            super().connection_lost(exc)

    return HeaderTimeout


def serve(engine: TranslationEngine, host: str, port: int, ready: Callable[[], None] | None = None,
          max_body_bytes: int = 1 << 20, debug: bool = False,
          lexical_engine: Callable[[], TranslationEngine] | None = None, header_timeout: float = HEADER_TIMEOUT,
          **limits) -> None:
    """Serve until SIGTERM, SIGINT or SIGHUP; requests in flight get SHUTDOWN_GRACE seconds to
    finish, then the decoding is cut (a second signal cuts it at once). Returns normally (exit 0).
    `ready()` is called once the address is known to be free (before that, a bad one is an error).
    `lexical_engine`: see `create_app`."""
    import uvicorn

    workers = engine.decoding_workers() if hasattr(engine, "decoding_workers") else None
    if workers is not None:
        workers.start()  # forked now, while this process has no thread but torch's

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:  # a clear error first
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise TfmError(f"cannot serve on {host}:{port}: {exc.strerror or exc}") from None
    if ready is not None:
        ready()
    decoder = MainThreadDecoder()
    app = create_app(engine, decoder.run, processes=workers.processes if workers is not None else engine.budget_processes(),
                     debug=debug, budget=getattr(engine, "check_budget", None), lexical_engine=lexical_engine,
                     **limits)
    server = uvicorn.Server(uvicorn.Config(BodyLimit(app, max_body_bytes), host=host, port=port,
                                           http=header_timeout_protocol(header_timeout),
                                           timeout_graceful_shutdown=int(SHUTDOWN_GRACE) + 2,
                                           log_level="debug" if debug else "critical", access_log=False))
    failure: list[BaseException] = []

    def http() -> None:  # uvicorn installs no signal handlers off the main thread: stop() below does
        try:
            server.run()
        except BaseException as exc:  # noqa: BLE001 (reported on the main thread)
            failure.append(exc)

    hangup = getattr(signal, "SIGHUP", None)
    terminal_outputs = outputs_a_hangup_takes()

    grace: list[threading.Timer] = []

    def stop(signum: int, frame: Any) -> None:  # stop accepting, finish the requests in flight; twice: now
        if signum == hangup:  # the terminal is gone: every later write to it would fail
            discard_writes(terminal_outputs)
        if server.should_exit:
            server.force_exit = True
            raise Terminated(signum)  # out of the decoding on this (the main) thread, between two steps
        server.should_exit = True
        if not grace:  # a decoding that outlasts the grace is stopped: its requests get 503
            grace.append(threading.Timer(SHUTDOWN_GRACE, cut_decoding))
            grace[0].daemon = True
            grace[0].start()

    def cut_decoding() -> None:
        stop_searches()  # tfm's engine in this process: at its next step
        for made in [engine, *app.state.engines]:
            pool = getattr(made, "workers", None)
            if pool is not None:
                pool.stop_now()  # its decoding processes

    handled = [s for s in (signal.SIGINT, signal.SIGTERM, hangup) if s is not None]
    previous = {s: signal.signal(s, stop) for s in handled if signal.getsignal(s) is not signal.SIG_IGN}
    thread = threading.Thread(target=http, name="tfm-http")
    try:
        thread.start()
        decoder.run_until(lambda: not thread.is_alive())
    except (Terminated, KeyboardInterrupt):  # a second signal: now, requests still decoding get no answer
        if not server.should_exit:
            raise
    finally:
        for timer in grace:
            timer.cancel()
        for s, handler in previous.items():
            signal.signal(s, handler)
        thread.join()
        for made in [engine, *app.state.engines]:
            made.close()
    if not server.started:
        reason = f": {failure[0]}" if failure and not isinstance(failure[0], SystemExit) and str(failure[0]) else ""
        raise TfmError(f"cannot serve on {host}:{port}: the HTTP server did not start{reason}")

