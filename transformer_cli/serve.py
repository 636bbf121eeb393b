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
A malformed request is a 4xx JSON error and changes nothing for the others. SIGTERM (and Ctrl-C)
stop accepting, let the requests in flight finish, and exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import signal
import socket
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .config import DecodeConfig
from .errors import TfmError
from .translate import TranslationEngine, Translation

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


# Per-request decode settings a client may choose; the rest (lengths, precision, batching) is the server's.
REQUEST_SETTINGS = tuple(name for name in TranslateRequest.model_fields if name != "text")


@dataclass
class Job:
    lines: list[str]
    decode: DecodeConfig
    done: asyncio.Future = field(repr=False)


Runner = Callable[[Callable[[], Any]], Awaitable[Any]]  # runs a call of the engine off the event loop


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

    async def translate(self, lines: list[str], decode: DecodeConfig) -> list[list[Translation]]:
        job = Job(lines, decode, asyncio.get_running_loop().create_future())
        await self.queue.put(job)
        return await job.done

    async def run(self) -> None:
        """Collect and decode batches until cancelled (two at once measured slower: smaller batches)."""
        loop = asyncio.get_running_loop()
        while True:
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
            for same in groups.values():
                await self._decode_together(same, same[0].decode)

    async def _decode_together(self, jobs: list[Job], decode: DecodeConfig) -> None:
        lines = [line for job in jobs for line in job.lines]
        decode = request_batch_decode(decode, len(lines), self.processes)
        try:
            results = await self.runner(lambda: self.engine.translate(lines, nbest=decode.nbest, decode=decode))
        except Exception as exc:  # noqa: BLE001 (the request's answer is the error; the server goes on)
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
    try:
        return DecodeConfig.model_validate({**base.model_dump(), **chosen})
    except ValidationError as exc:
        raise ValueError("; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())) from None


def response(results: list[list[Translation]], decode: DecodeConfig) -> dict:
    body: dict = {"translations": [r[0].text for r in results]}
    if decode.alignment:
        body["alignments"] = [r[0].alignment for r in results]
    if decode.nbest > 1:
        body["nbest"] = [[{"text": t.text, "score": t.score, **({"alignment": t.alignment} if decode.alignment else {})}
                          for t in r] for r in results]
    return body


def create_app(engine: TranslationEngine, runner: Runner, max_lines: int = 256, max_chars: int = 10_000,
               max_wait: float = 0.005, max_batch_lines: int = 256, processes: int = 1):
    """The FastAPI application serving `engine`, which decodes in `processes` processes, its calls
    made by `runner` (MainThreadDecoder.run)."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    batcher = Batcher(engine, max_wait, max_batch_lines, processes, runner)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        task = asyncio.create_task(batcher.run())
        yield
        task.cancel()

    app = FastAPI(title="tfm", description="Transformer translation (tfm serve)", lifespan=lifespan)

    def error(status: int, message: str) -> JSONResponse:
        return JSONResponse(status_code=status, content={"error": message})

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.post("/translate")
    async def translate(request: TranslateRequest):
        lines = [request.text] if isinstance(request.text, str) else request.text
        if len(lines) > max_lines:
            return error(413, f"text: {len(lines)} lines, more than this server's limit of {max_lines} a request")
        for number, line in enumerate(lines, start=1):
            if len(line) > max_chars:
                return error(413, f"text line {number}: {len(line)} characters, more than the limit of {max_chars}")
            if "\n" in line or "\r" in line:
                return error(422, f"text line {number}: contains a line break (send one sentence per list item)")
        try:
            decode = request_decode(engine.decode, request)
        except ValueError as exc:
            return error(422, str(exc))
        try:
            results = await batcher.translate(lines, decode)
        except TfmError as exc:
            return error(422, str(exc))
        return response(results, decode)

    return app


def serve(engine: TranslationEngine, host: str, port: int, ready: Callable[[], None] | None = None,
          **limits) -> None:
    """Serve until SIGTERM or Ctrl-C; requests in flight finish first. Returns normally (exit 0).
    `ready()` is called once the address is known to be free (before that, a bad one is an error)."""
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
    app = create_app(engine, decoder.run, processes=workers.processes if workers is not None else 1, **limits)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False))
    failure: list[BaseException] = []

    def http() -> None:  # uvicorn installs no signal handlers off the main thread: stop() below does
        try:
            server.run()
        except BaseException as exc:  # noqa: BLE001 (reported on the main thread)
            failure.append(exc)

    def stop(*_: Any) -> None:  # SIGTERM / Ctrl-C: stop accepting, finish the requests in flight; twice: now
        if server.should_exit:
            server.force_exit = True
        server.should_exit = True

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    thread = threading.Thread(target=http, name="tfm-http")
    try:
        thread.start()
        decoder.run_until(lambda: not thread.is_alive())
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        thread.join()
        engine.close()
    if not server.started:
        reason = f": {failure[0]}" if failure and not isinstance(failure[0], SystemExit) and str(failure[0]) else ""
        raise TfmError(f"cannot serve on {host}:{port}: the HTTP server did not start{reason}")
