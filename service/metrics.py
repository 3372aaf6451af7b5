"""Prometheus metrics of one service instance (its own registry, served at `/metrics`)."""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
ERROR_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 1)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "rewa_requests", "HTTP requests", ["route", "status"], registry=self.registry
        )
        self.latency = Histogram(
            "rewa_request_seconds",
            "HTTP request latency",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.queue_depth = Gauge(
            "rewa_queue_depth", "requests queued or running on the device", registry=self.registry
        )
        self.jobs_waiting = Gauge(
            "rewa_jobs_waiting", "requests waiting for the device", registry=self.registry
        )
        self.jobs_running = Gauge(
            "rewa_jobs_running", "requests in the device call now running", registry=self.registry
        )
        self.queue_wait = Histogram(
            "rewa_queue_wait_seconds",
            "time from admission to the start of the request's device call",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.compute = Histogram(
            "rewa_compute_seconds",
            "time of the device call that computed the request",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.batch_requests = Histogram(
            "rewa_batch_requests",
            "requests merged into one device call",
            buckets=BATCH_BUCKETS,
            registry=self.registry,
        )
        self.batch_queries = Histogram(
            "rewa_batch_queries",
            "queries (heads x n) in one device call",
            buckets=BATCH_BUCKETS,
            registry=self.registry,
        )
        self.cache = Counter(
            "rewa_cache",
            "context cache lookups (hit, miss, extended: an earlier version plus appends)",
            ["result"],
            registry=self.registry,
        )
        self.attends_while_building = Counter(
            "rewa_attends_while_building",
            "attends answered while their index was being built, reading the keys no built "
            "index covers exactly",
            registry=self.registry,
        )
        self.cached_bytes = Gauge(
            "rewa_cache_bytes", "bytes of loaded contexts and indexes", registry=self.registry
        )
        self.build_seconds = Histogram(
            "rewa_index_build_seconds",
            "index build time per context version",
            ["kind"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.audit_errors = Histogram(
            "rewa_audit_error",
            "relative output error of an audited answer against exact attention "
            "(REWA_AUDIT_EVERY), one per head and audited query",
            buckets=ERROR_BUCKETS,
            registry=self.registry,
        )
        self.audit_cuts = Counter(
            "rewa_audit_cuts",
            "tail heads whose pieces were cut again at a size the audit chose",
            registry=self.registry,
        )
        self.audits_skipped = Counter(
            "rewa_audits_skipped",
            "attend calls whose audited rows were not audited: the audit thread was behind",
            registry=self.registry,
        )
        self.rejected = Counter(
            "rewa_rejected",
            "requests refused with 429: queue_full (REWA_QUEUE_SIZE), wait_timeout "
            "(not started within REWA_MAX_QUEUE_WAIT_S)",
            ["reason"],
            registry=self.registry,
        )

    def count(self, name: str) -> None:
        if name == "cache_hits":
            self.cache.labels("hit").inc()
        elif name == "cache_misses":
            self.cache.labels("miss").inc()
        elif name == "cache_extensions":
            self.cache.labels("extended").inc()
        elif name == "attends_while_building":
            self.attends_while_building.inc()
        elif name == "audits_skipped":
            self.audits_skipped.inc()

    def audited(self, errors) -> None:
        """Observe the audited errors (a tensor of any shape)."""
        for error in errors.flatten().tolist():
            self.audit_errors.observe(error)

    def index_build(self, kind: str, seconds: float) -> None:
        self.build_seconds.labels(kind).observe(seconds)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
