"""Dynamic batching: requests that arrive together are decoded together, on the thread that holds
the engine (`MainThreadDecoder`), by a `Batcher` per engine."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import queue
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from ..decoding.terms import LineTerms
from ..decoding.translation import Translation, TranslationEngine
from ..decoding.workers import DecodingProcessDied
from ..experiment.config import DecodeConfig


@dataclass
class Job:
    lines: list[str]
    decode: DecodeConfig
    done: asyncio.Future = field(repr=False)
    terms: list[LineTerms] | None = None  # per line
    timeout: float | None = None  # seconds its decoding may take (--request-timeout)
    client: str = ""  # who sent it (its API key's name, or its address): the unit of fair share
    number: int = 0  # arrival order
    settings: str = ""  # its decode settings as JSON: requests with the same decode together


Runner = Callable[[Callable[[], Any]], Awaitable[Any]]  # runs a call of the engine off the event loop


IN_FLIGHT = 2  # request batches decoding at once (Batcher.run)


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


async def on_a_thread_of_its_own(call: Callable[[], Any], name: str) -> Any:
    """`call()` made on a new thread that ends with it, awaited from the event loop: loading a model
    beside the decoding thread. (A thread that lives on would keep an OpenMP team of its own once it
    ran a torch op; MainThreadDecoder says why that slows the decoding down.)"""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def run() -> None:
        try:
            outcome, error = call(), None
        except Exception as exc:  # noqa: BLE001 (handed to the awaiting coroutine)
            outcome, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits for it any more
            loop.call_soon_threadsafe(_settle, future, outcome, error)

    threading.Thread(target=run, name=name, daemon=True).start()
    return await future


def request_batch_decode(decode: DecodeConfig, lines: int, processes: int) -> DecodeConfig:
    """The settings one request batch of `lines` lines decodes with: with several processes, a
    batch for each, long and short sentences in each (decode.batching: balanced), so that the
    processes finish together."""
    if processes <= 1:
        return decode
    return decode.model_copy(update={"batching": "balanced",
                                     "batch_size": max(1, min(decode.batch_size, -(-lines // processes)))})


HALF_LIFE = 10.0  # seconds after which a client's past decoding weighs half as much on its turn
RECENT = 1.0  # seconds after its last answer a client still counts as active (it is sending its next request)
SLACK = 0.25  # seconds of decoding a client may be ahead of twice the others' mean and still take its turn
WAIT_STEP = 0.02  # seconds between two looks at a queue whose only waiting client is over its share


class FairQueue:
    """Requests waiting for a batch, per client, taken in fair share: the next request is the oldest
    one of the client that has used the engine least lately (its decoding seconds, halved every
    HALF_LIFE seconds). While other clients are active (waiting, decoding, or answered within RECENT
    seconds), a client that has used more than twice their mean (and SLACK seconds), or that has a
    batch decoding already, waits: one client's flood of heavy requests gets its share of the engine and no more, and a
    single request of another client goes in the next batch. Alone, a client takes everything
    (the engine never idles while a request waits for it)."""

    def __init__(self) -> None:
        self.waiting: dict[str, collections.deque[Job]] = {}
        self.used: dict[str, tuple[float, float]] = {}  # client → (decoding seconds, when last updated)
        self.decoding: collections.Counter[str] = collections.Counter()  # client → batches in flight
        self.answered: dict[str, float] = {}  # client → when its last batch ended
        self.arrived = asyncio.Event()
        self.count = 0
        self.numbered = itertools.count()

    def put(self, job: Job) -> None:
        job.number = next(self.numbered)
        job.settings = job.settings or job.decode.model_dump_json()
        self.waiting.setdefault(job.client, collections.deque()).append(job)
        self.count += 1
        self.arrived.set()

    def usage(self, client: str, now: float) -> float:
        seconds, at = self.used.get(client, (0.0, now))
        return seconds * 0.5 ** ((now - at) / HALF_LIFE)

    def charge(self, client: str, seconds: float) -> None:
        now = time.monotonic()
        self.used[client] = (self.usage(client, now) + seconds, now)
        if len(self.used) > 10_000:  # clients by address are many: forget those whose use has faded
            self.used = {c: (u, t) for c, (u, t) in self.used.items() if self.usage(c, now) > 1e-3}

    def started(self, clients: set[str]) -> None:
        self.decoding.update(clients)

    def ended(self, clients: set[str]) -> None:
        now = time.monotonic()
        self.decoding.subtract(clients)
        for client in clients:
            self.answered[client] = now
        self.decoding += collections.Counter()  # drops the zeros
        self.arrived.set()  # a client over its share may now be within it

    def _eligible(self, now: float) -> Callable[[str], bool]:
        """Whether a waiting client may take its turn now (computed once per take: O(clients))."""
        for client in [c for c, t in self.answered.items() if now - t >= RECENT]:
            del self.answered[client]  # no longer active
        active = set(self.waiting) | set(self.decoding) | set(self.answered)
        usage = {c: self.usage(c, now) for c in active}
        total, others = sum(usage.values()), len(active) - 1

        def eligible(client: str) -> bool:
            if others <= 0:
                return True  # alone: it takes everything
            if self.decoding[client]:
                return False
            return usage[client] <= 2 * (total - usage[client]) / others + SLACK

        return eligible

    def take(self, settings: str | None = None) -> Job | None:
        """The next request in fair share (`settings`: only one decoded with these), or None."""
        now = time.monotonic()
        eligible = self._eligible(now)
        candidates = [c for c, jobs in self.waiting.items()
                      if (settings is None or jobs[0].settings == settings) and eligible(c)]
        if not candidates:
            return None
        client = min(candidates, key=lambda c: (self.usage(c, now), self.waiting[c][0].number))
        job = self.waiting[client].popleft()
        if not self.waiting[client]:
            del self.waiting[client]
        self.count -= 1
        return job

    async def get(self) -> Job:
        """The next request in fair share, once there is one."""
        while True:
            job = self.take()
            if job is not None:
                return job
            self.arrived.clear()
            with contextlib.suppress(asyncio.TimeoutError):  # time alone lets a client back within its share
                await asyncio.wait_for(self.arrived.wait(), WAIT_STEP if self.count else None)


class Batcher:
    """Collects concurrent requests into batches for one engine, decoded one batch at a time by
    `runner` (MainThreadDecoder.run)."""

    def __init__(self, engine: TranslationEngine, max_wait: float, max_batch_lines: int, processes: int,
                 runner: Runner):
        self.engine, self.max_wait, self.max_batch_lines = engine, max_wait, max_batch_lines
        self.processes = processes  # decoding processes: each call's lines are split into this many batches at least
        self.queue = FairQueue()
        self.runner = runner
        self.observe_batch: Callable[[int], None] = lambda lines: None  # metrics: each batch's size
        self.busy: collections.Counter[int] = collections.Counter()  # id(engine) → its batches decoding
        self.task: asyncio.Task | None = None  # its run(), where the app keeps it

    async def retire(self, engine: TranslationEngine, drain: bool = False) -> None:
        """Close `engine` (replaced by a reload) once the batches it was decoding have finished, and
        with `drain` (a batcher whose engine is not replaced) once no request waits in its queue."""
        while self.busy[id(engine)] or (drain and self.queue.count):
            await asyncio.sleep(0.02)
        del self.busy[id(engine)]
        await self.runner(engine.close)
        if drain and self.task is not None:
            self.task.cancel()  # nothing will come to this batcher any more

    async def translate(self, lines: list[str], decode: DecodeConfig, terms: list[LineTerms] | None = None,
                        timeout: float | None = None, client: str = "") -> list[list[Translation]]:
        job = Job(lines, decode, asyncio.get_running_loop().create_future(), terms, timeout, client)
        self.queue.put(job)
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
            first = await self.queue.get()
            jobs = [first]
            settings = first.settings  # requests with the same settings decode together
            deadline = loop.time() + self.max_wait
            while sum(len(j.lines) for j in jobs) < self.max_batch_lines:
                job = self.queue.take(settings)
                if job is not None:
                    jobs.append(job)
                    continue
                if loop.time() >= deadline:
                    break
                self.queue.arrived.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.queue.arrived.wait(), deadline - loop.time())
            clients = {job.client for job in jobs}
            self.queue.started(clients)
            task = asyncio.create_task(self._decode_fairly(jobs, first.decode))
            finishing.add(task)
            task.add_done_callback(finishing.discard)
            task.add_done_callback(lambda _, done=clients: self.queue.ended(done))
            task.add_done_callback(lambda _: in_flight.release())
            await asyncio.sleep(0)  # the task starts its batch before the next is collected

    async def _decode_fairly(self, jobs: list[Job], decode: DecodeConfig) -> None:
        """Decode the batch and charge its clients their share of its time (by lines)."""
        started = time.monotonic()
        self.observe_batch(sum(len(job.lines) for job in jobs))
        try:
            await self._decode_together(jobs, decode)
        finally:
            seconds = time.monotonic() - started
            total = sum(len(job.lines) for job in jobs) or 1
            for job in jobs:
                self.queue.charge(job.client, seconds * len(job.lines) / total)

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
        engine = self.engine  # the batch decodes on the model it started with, whatever a reload swaps in meanwhile

        def start() -> Callable[[], list[list[Translation]]]:  # long lines are cut silently: one client must not flood the log
            deadline = None if timeout is None else time.monotonic() + timeout  # from the start of its decoding
            return engine.translate_later(lines, decode, warn_long=False,
                                          terms=terms, deadline=deadline)

        self.busy[id(engine)] += 1
        try:
            try:
                if engine.decodes_in_background:  # waited for off the decoding thread, which starts the next batch
                    results = await asyncio.to_thread(await self.runner(start))
                else:
                    results = await self.runner(lambda: start()())
            finally:
                self.busy[id(engine)] -= 1
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
