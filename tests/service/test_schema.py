"""Property-based API tests generated from the service's own OpenAPI schema (schemathesis):
every answer has a documented status, content type and body shape, and no input gives a 5xx.
Bounded: a few examples per operation."""

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given  # noqa: E402
from hypothesis import settings as hypothesis_settings  # noqa: E402
from schemathesis.checks import positive_data_acceptance  # noqa: E402

from service.main import create_app  # noqa: E402


def test_api_conforms_to_its_schema(settings, engine):
    app = create_app(settings, loader=lambda s: engine)
    app.state.engine = engine  # what the lifespan does; the ASGI transport does not run it
    api = schemathesis.openapi.from_asgi("/openapi.json", app)
    operations = [result.ok() for result in api.get_all_operations()]
    assert {op.path for op in operations} >= {"/retrieve", "/retrieve/batch", "/health",
                                               "/info", "/photos/{photo_id}"}
    for op in operations:

        @given(case=op.as_strategy())
        @hypothesis_settings(max_examples=12, deadline=None, derandomize=True, database=None,
                             suppress_health_check=list(HealthCheck))
        def conforms(case):
            # Not positive_data_acceptance: a schema cannot say "a decodable image", so
            # schema-valid random bytes are rightly refused (400/415, documented).
            case.call_and_validate(excluded_checks=[positive_data_acceptance])

        conforms()


def test_schema_states_the_bounds_and_the_errors(settings, engine):
    spec = create_app(settings, loader=lambda s: engine)
    spec.state.engine = engine
    doc = spec.openapi()
    for path in ("/retrieve", "/retrieve/batch"):
        op = doc["paths"][path]["post"]
        params = {p["name"]: p["schema"]["anyOf"][0] for p in op["parameters"]}
        assert (params["dims"]["minimum"], params["dims"]["maximum"]) == (1, engine.dims)
        assert (params["k"]["minimum"], params["k"]["maximum"]) == (1, settings.max_k)
        assert {"400", "408", "413", "415", "422", "503"} <= set(op["responses"])
        for code in ("400", "413", "422", "503"):
            ref = op["responses"][code]["content"]["application/json"]["schema"]["$ref"]
            assert ref.endswith("/ErrorOut")
    assert "404" in doc["paths"]["/photos/{photo_id}"]["get"]["responses"]
    assert doc["components"]["schemas"]["ErrorOut"]["required"] == ["detail"]
