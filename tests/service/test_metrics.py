"""GET /metrics over real HTTP: parsed by the Prometheus text parser, its counters equal to
the requests sent, the stage histograms to the retrievals run, the gauges to the state."""

import httpx
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from service.client import Client, ServiceError
from service.main import create_app
from tests.service.conftest import serve, sketch_png


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of a /metrics body (the official parser)."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def requests(metrics: dict, route: str, method: str, status: int) -> float:
    key = ("sketchsvd_requests_total",
           (("method", method), ("route", route), ("status", str(status))))
    return metrics.get(key, 0.0)


def test_counters_match_the_requests_sent(settings, engine):
    app = create_app(settings, loader=lambda s: engine)
    with serve(app, settings) as url, Client(url) as service:
        for seed in range(5):
            service.retrieve(sketch_png(seed=seed), k=3)
        hits = service.retrieve_batch([sketch_png(seed=7), sketch_png(seed=8)], k=2)
        for _ in range(2):
            try:
                service.retrieve(b"not an image")
            except ServiceError as err:
                assert err.status == 415
        for hit in hits[0].hits:
            service.photo(hit)
        assert httpx.get(f"{url}/photos/nope").status_code == 404
        assert service.health() and service.info()
        text = service.metrics()
    got = samples(text)
    assert requests(got, "/retrieve", "POST", 200) == 5
    assert requests(got, "/retrieve", "POST", 415) == 2
    assert requests(got, "/retrieve/batch", "POST", 200) == 1
    assert requests(got, "/photos/{photo_id}", "GET", 200) == 2
    assert requests(got, "/photos/{photo_id}", "GET", 404) == 1
    assert requests(got, "/health", "GET", 200) == 1
    assert requests(got, "/info", "GET", 200) == 1
    assert requests(got, "/metrics", "GET", 200) == 0  # counted once it is answered
    assert got[("sketchsvd_request_seconds_count", (("route", "/retrieve"),))] == 7
    for stage in ("decode", "preprocess", "encode", "search"):  # the 6 successful retrievals
        assert got[("sketchsvd_stage_seconds_count", (("stage", stage),))] == 6
    assert got[("sketchsvd_admitted_total", ())] == 8
    assert got[("sketchsvd_rejected_total", ())] == 0
    assert got[("sketchsvd_in_flight", ())] == 0
    assert got[("sketchsvd_inference_slots_busy", ())] == 0
    assert got[("sketchsvd_inference_slots", ())] == settings.inference_slots
    assert got[("sketchsvd_index_photos", ())] == 15
    version = engine.galleries.current()[1]
    assert got[("sketchsvd_index_info", (("kind", "flat"), ("version", version)))] == 1
    assert got[("sketchsvd_index_versions_open", ())] == 1
    assert got[("sketchsvd_index_reloads_total", ())] == 0


def test_refused_requests_and_unknown_routes_are_counted(settings, engine):
    app = create_app(settings, loader=lambda s: engine)
    with TestClient(app) as client:
        app.state.admission.active = app.state.admission.limit  # as if the cap were reached
        assert client.post("/retrieve", files={"file": ("s.png", sketch_png())}
                           ).status_code == 503
        app.state.admission.active = 0
        assert client.get("/no/such/path").status_code == 404
        assert client.request("BREW", "/").status_code == 405
        got = samples(client.get("/metrics").text)
    assert got[("sketchsvd_rejected_total", ())] == 1
    assert requests(got, "/retrieve", "POST", 503) == 1
    assert requests(got, "unmatched", "GET", 404) == 1
    assert requests(got, "unmatched", "other", 405) == 1
