"""`GET /metrics`: the server's counters in Prometheus's text format, kept by the Prometheus
project's own client library (prometheus-client) in a registry of the app's own, so that two apps
in one process (tests) never share counts."""

from __future__ import annotations

from typing import Any


class ServerMetrics:
    """What an operator watches: requests by endpoint and status, their latency, the characters and
    sentences translated, the batches' sizes, the queue, the decoding processes, the model."""

    def __init__(self, engine_name: str, model: str):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        self.requests = Counter("tfm_requests", "Requests answered, by endpoint and status",
                                ["endpoint", "status"], registry=self.registry)
        self.latency = Histogram("tfm_request_seconds", "Seconds from a request's arrival to its answer", ["endpoint"],
                                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
                                 registry=self.registry)
        self.characters = Counter("tfm_characters", "Characters of text translated", registry=self.registry)
        self.sentences = Counter("tfm_sentences", "Lines of text translated", registry=self.registry)
        self.batch_lines = Histogram("tfm_batch_lines", "Lines in each batch the engine decodes",
                                     buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512), registry=self.registry)
        self.queue_depth = Gauge("tfm_queue_requests", "Requests waiting for a batch", registry=self.registry)
        self.processes = Gauge("tfm_decoding_processes", "Decoding processes alive", registry=self.registry)
        self.restarts = Gauge("tfm_decoding_pool_restarts", "Decoding pools forked anew after a process died",
                              registry=self.registry)
        self.rejected = Counter("tfm_quota_rejections", "Requests refused by a quota or a missing key, by reason",
                                ["reason"], registry=self.registry)
        self.model = model
        self.info = Gauge("tfm_model_info", "The model served (value 1)", ["model", "engine"], registry=self.registry)
        self.info.labels(model=model, engine=engine_name).set(1)
        self.loaded = Gauge("tfm_model_loaded_timestamp_seconds", "When the model served was loaded (Unix time)",
                            registry=self.registry)
        self.loaded.set_to_current_time()
        self.reloads = Counter("tfm_model_reloads", "Reloads of the model (SIGUSR1), by outcome: ok, failed",
                               ["outcome"], registry=self.registry)

    def reloaded(self, engine_name: str) -> None:
        self.info.clear()
        self.info.labels(model=self.model, engine=engine_name).set(1)
        self.loaded.set_to_current_time()
        self.reloads.labels(outcome="ok").inc()

    def answered(self, endpoint: str, status: int, seconds: float) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()
        self.latency.labels(endpoint=endpoint).observe(seconds)

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def decoding_processes(engine: Any) -> int:
    """Decoding processes alive: a pool's live processes, else the engine's own count."""
    pool = getattr(engine, "workers", None)
    alive = getattr(pool, "alive", None)
    if callable(alive):
        return int(alive())
    return int(engine.decoding_processes)
