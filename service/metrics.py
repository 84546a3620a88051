"""`GET /metrics` in the Prometheus text format (prometheus_client), one registry per app.

    sketchsvd_requests_total{route, method, status}   answered requests (route: the path
                                                       template, e.g. /photos/{photo_id})
    sketchsvd_request_seconds{route}                   latency histogram, whole request
    sketchsvd_stage_seconds{stage}                     retrieval stages: decode, preprocess,
                                                       encode, search (as in Server-Timing)
    sketchsvd_admitted_total, sketchsvd_rejected_total retrieval requests admitted / refused
                                                       (503, over max_pending)
    sketchsvd_in_flight                                retrieval requests admitted now
    sketchsvd_uploads, sketchsvd_uploads_refused_total bodies arriving now / requests refused
                                                       with 429 (max_uploads_per_client)
    sketchsvd_inference_slots_busy, _slots             slots computing now / their number
    sketchsvd_index_photos, sketchsvd_index_info{version, kind}, sketchsvd_index_versions_open,
    sketchsvd_index_reloads_total, sketchsvd_index_refusals_total
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Receive, Scope, Send

from service.middleware import timed
from service.policy import RouteTable

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0)
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
STAGE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                 1.0)


class _State(Collector):
    """Values read when scraped: admission, slots, the index served."""

    def __init__(self, app_state):
        self.state = app_state

    def collect(self) -> Iterator:
        s = self.state
        yield CounterMetricFamily("sketchsvd_admitted", "retrieval requests admitted",
                                  value=s.admission.admitted)
        yield CounterMetricFamily("sketchsvd_rejected", "retrieval requests refused with 503 "
                                  "(over max_pending)", value=s.admission.rejected)
        yield GaugeMetricFamily("sketchsvd_in_flight", "retrieval requests admitted now",
                                value=s.admission.active)
        yield GaugeMetricFamily("sketchsvd_uploads", "request bodies arriving now",
                                value=sum(s.uploads.by_client.values()))
        yield CounterMetricFamily("sketchsvd_uploads_refused", "requests refused with 429 "
                                  "(max_uploads_per_client)", value=s.uploads.refused)
        yield GaugeMetricFamily("sketchsvd_inference_slots_busy", "retrievals computing now",
                                value=s.slots.borrowed_tokens)
        yield GaugeMetricFamily("sketchsvd_inference_slots", "retrievals that may compute at "
                                "once", value=s.slots.total_tokens)
        yield from self._index()

    def _index(self) -> Iterator:
        engine, reloader = self.state.engine, getattr(self.state, "reloader", None)
        if engine is None:
            return
        gallery, version = engine.galleries.current()
        yield GaugeMetricFamily("sketchsvd_index_photos", "photos in the index served",
                                value=len(gallery))
        info = GaugeMetricFamily("sketchsvd_index_info", "the index version served",
                                 labels=["version", "kind"])
        info.add_metric([version or "", gallery.sidecar.kind], 1)
        yield info
        yield GaugeMetricFamily("sketchsvd_index_versions_open", "index versions open (the "
                                "served one and retired ones still in use)",
                                value=engine.galleries.open_versions)
        if reloader is not None:
            yield CounterMetricFamily("sketchsvd_index_reloads", "new index versions served",
                                      value=reloader.reloads)
            yield CounterMetricFamily("sketchsvd_index_refusals", "index versions refused",
                                      value=reloader.refusals)


class Metrics:
    """The app's metrics; `render()` is the /metrics body."""

    def __init__(self, app_state):
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("sketchsvd_requests", "HTTP requests answered",
                                ["route", "method", "status"], registry=self.registry)
        self.latency = Histogram("sketchsvd_request_seconds", "request latency, first byte "
                                 "received to last byte sent", ["route"],
                                 buckets=LATENCY_BUCKETS, registry=self.registry)
        self.stages = Histogram("sketchsvd_stage_seconds", "time in each retrieval stage "
                                "(a batch's queries together)", ["stage"],
                                buckets=STAGE_BUCKETS, registry=self.registry)
        self.registry.register(_State(app_state))

    def observe_stages(self, timings) -> None:
        for stage in timings.STAGES:
            self.stages.labels(stage).observe(getattr(timings, stage))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class MetricsMiddleware:
    """Counts every HTTP request by its route's path template, method and status, and
    observes its latency."""

    def __init__(self, app: ASGIApp, table: RouteTable, metrics: Metrics):
        self.app = app
        self.table = table
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        def count(status: int, seconds: float) -> None:
            route = self.table.rule(scope).name
            method = scope["method"] if scope["method"] in METHODS else "other"
            self.metrics.requests.labels(route, method, str(status)).inc()
            self.metrics.latency.labels(route).observe(seconds)

        await timed(self.app, scope, receive, send, count)
