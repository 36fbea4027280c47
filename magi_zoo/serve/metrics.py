"""`/metrics`: Prometheus text, through `prometheus_client` on a registry of the app's own.

queue length and jobs in flight per model; jobs ended by status; seconds per phase (queue:
waiting for a worker, run: generating and writing, load: a worker's start); worker
restarts; and per worker the compile counters of the loaded plan (compiled frames, graph
breaks, recompiles, compile seconds), read from the report after every job -- a request
after the first of its shape must leave `frames` unchanged, which is what "no compile on a
warm request" means, checkable from outside.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST

__all__ = ["Metrics", "CONTENT_TYPE_LATEST"]

# seconds: tiny CPU models answer in tens of milliseconds, a 14B video takes minutes
BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)


class Metrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.queue = Gauge("magi_zoo_queue_length", "jobs waiting for a worker", ["model"], registry=r)
        self.running = Gauge("magi_zoo_in_flight", "jobs running on a worker", ["model"], registry=r)
        self.jobs = Counter("magi_zoo_jobs", "jobs ended, by status", ["model", "status"], registry=r)
        self.seconds = Histogram("magi_zoo_phase_seconds", "seconds per phase of a job or worker",
                                 ["model", "phase"], buckets=BUCKETS, registry=r)
        self.restarts = Counter("magi_zoo_worker_restarts", "workers restarted after dying", ["model"], registry=r)
        self.rejected = Counter("magi_zoo_rejected", "requests refused (HTTP status)", ["status"], registry=r)
        self.compiled = Gauge("magi_zoo_compile_frames", "frames compiled by the worker's plan so far",
                              ["model", "worker"], registry=r)
        self.breaks = Gauge("magi_zoo_compile_graph_breaks", "graph breaks in the compiled regions",
                            ["model", "worker"], registry=r)
        self.recompiles = Gauge("magi_zoo_compile_recompiles", "recompiles of the compiled regions",
                                ["model", "worker"], registry=r)
        self.compile_s = Gauge("magi_zoo_compile_seconds", "seconds spent compiling", ["model", "worker"],
                               registry=r)
        self.cache_hit = Gauge("magi_zoo_compile_cache_hit", "1: the worker's plan loaded its compile artifacts "
                               "from the warm-start cache", ["model", "worker"], registry=r)

    def queued(self, model: str, n: int) -> None:
        self.queue.labels(model).set(n)

    def in_flight(self, model: str, n: int) -> None:
        self.running.labels(model).set(n)

    def ended(self, model: str, status: str) -> None:
        self.jobs.labels(model, status).inc()

    def phase(self, model: str, phase: str, seconds: float) -> None:
        self.seconds.labels(model, phase).observe(max(0.0, seconds))

    def restarted(self, model: str) -> None:
        self.restarts.labels(model).inc()

    def refused(self, status: int) -> None:
        self.rejected.labels(str(status)).inc()

    def loaded(self, model: str, worker: int, info: dict[str, Any]) -> None:
        self.phase(model, "load", info["load_s"])
        self.compile(model, worker, info["compile"])

    def compile(self, model: str, worker: int, info: dict[str, Any]) -> None:
        w = str(worker)
        self.compiled.labels(model, w).set(info["frames"])
        self.breaks.labels(model, w).set(info["graph_breaks"])
        self.recompiles.labels(model, w).set(info["recompiles"])
        self.compile_s.labels(model, w).set(info["compile_s"])
        self.cache_hit.labels(model, w).set(1 if info["cache"] == "hit" else 0)

    def text(self) -> bytes:
        return generate_latest(self.registry)
