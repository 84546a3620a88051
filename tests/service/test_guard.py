"""Browsers as the attacker's hands, and saying too much: allowed hosts against DNS rebinding,
the Origin check on POSTs when keys are off, security headers and a content security policy
the page keeps to, error bodies without server paths, and the warning about a service open
beyond loopback."""

import logging
import re
from html.parser import HTMLParser

import httpx
import pytest
from fastapi.testclient import TestClient

from service.guard import (
    PAGE_HEADERS,
    host_allowed,
    is_loopback,
    same_origin,
    split_host,
    without_paths,
)
from service.main import create_app
from service.routes.web import STATIC_DIR
from tests.service.conftest import serve, sketch_png
from tests.service.test_edge import fake_engine

KEY = "k3y-0123456789abcdef0123456789abcdef"


# --- allowed hosts ---------------------------------------------------------------------------

def test_host_names_are_read_as_browsers_send_them():
    assert split_host("LocalHost:8000") == ("localhost", 8000)
    assert split_host("[::1]:8000") == ("::1", 8000)
    assert split_host("[0:0:0:0:0:0:0:1]") == ("::1", None)
    assert split_host("::1") == ("::1", None)  # an allowed_hosts entry
    assert split_host("example.org.") == ("example.org", None)
    assert split_host("127.000.0.1:80") == ("127.000.0.1", 80)  # not an address: a name
    for host in ("localhost", "app.localhost", "127.0.0.1", "127.1.2.3", "::1"):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "::", "localhost.example.org", "10.0.0.1", "example.org", ""):
        assert not is_loopback(host), host
    allowed = ["sketch.example.org", "*.example.net", "::1"]
    assert host_allowed("sketch.example.org", allowed) and host_allowed("a.example.net", allowed)
    assert host_allowed("::1", allowed) and not host_allowed("example.net", allowed)
    assert not host_allowed("evil.example", allowed) and host_allowed("evil.example", ["*"])


def test_on_loopback_only_loopback_host_names_are_served(fake_index, settings):
    """A page whose name an attacker rebinds to 127.0.0.1 sends its own name as Host."""
    with serve(create_app(settings, loader=lambda s: fake_engine(fake_index)), settings) as url:
        port = url.rsplit(":", 1)[1]
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost", "app.localhost"):
            assert httpx.get(f"{url}/info", headers={"Host": host}).status_code == 200, host
        for host in (f"rebound.example:{port}", "10.0.0.1", "localhost.example"):
            r = httpx.get(f"{url}/info", headers={"Host": host})
            assert r.status_code == 400, host
            assert r.json()["detail"].startswith(f"host {host.split(':')[0]!r} is not one")
        assert httpx.get(f"{url}/health", headers={"Host": "rebound.example"}).status_code == 400


def test_allowed_hosts_is_the_list_when_set(settings, engine):
    allowed = settings.model_copy(update={"allowed_hosts": ["sketch.example.org",
                                                            "*.example.net"]})
    with TestClient(create_app(allowed, loader=lambda s: engine)) as http:
        for host, status in [("sketch.example.org", 200), ("Sketch.Example.org:8443", 200),
                             ("a.b.example.net", 200), ("example.net", 400),
                             ("testserver", 400), ("evil.example", 400)]:
            assert http.get("/health", headers={"Host": host}).status_code == status, host
    # None, off loopback (the test client's "testserver"): any host
    with TestClient(create_app(settings, loader=lambda s: engine)) as http:
        assert http.get("/health", headers={"Host": "any.example"}).status_code == 200


# --- the Origin check ------------------------------------------------------------------------

def test_same_origin_compares_host_and_port():
    assert same_origin("http://127.0.0.1:8000", "127.0.0.1:8000")
    assert same_origin("http://localhost", "localhost:80")
    assert same_origin("https://sketch.example.org", "sketch.example.org")
    assert same_origin("http://[::1]:8000", "[::1]:8000")
    assert not same_origin("http://localhost:8001", "localhost:8000")
    assert not same_origin("https://evil.example", "localhost:8000")
    assert not same_origin("null", "localhost:8000") and not same_origin("null", "")
    assert not same_origin("http://localhost:x", "localhost:8000")


def test_without_keys_other_sites_cannot_post(client):
    """An HTML form on any page can POST to a keys-off service on localhost: it is refused
    by its Origin (or Sec-Fetch-Site), while pages of the service and CORS_ORIGINS pass."""
    def reload(**headers):
        return client.post("/admin/reload", headers=headers)

    for headers in ({"Origin": "https://evil.example"}, {"Origin": "null"},
                    {"Origin": "http://testserver:8080"},
                    {"Sec-Fetch-Site": "cross-site"}):
        r = reload(**headers)
        assert r.status_code == 403, headers
        assert r.json()["detail"].startswith("cross-site request refused: ")
    r = client.post("/retrieve", headers={"Origin": "https://evil.example"},
                    files={"file": ("s.png", sketch_png())})
    assert r.status_code == 403
    for headers in ({}, {"Origin": "http://testserver"}, {"Origin": "http://example.test"},
                    {"Sec-Fetch-Site": "same-origin"}):
        assert reload(**headers).status_code == 200, headers
    assert client.get("/info", headers={"Origin": "https://evil.example"}).status_code == 200


def test_with_keys_the_key_is_the_check(settings, engine):
    keyed = settings.model_copy(update={"api_keys": [KEY]})
    with TestClient(create_app(keyed, loader=lambda s: engine)) as http:
        r = http.post("/retrieve", headers={"Origin": "https://evil.example", "X-API-Key": KEY},
                      files={"file": ("s.png", sketch_png())})
        assert r.status_code == 200  # a page cannot send the key cross-site unasked (CORS)


# --- headers ---------------------------------------------------------------------------------

def test_the_page_keeps_to_itself(client):
    page = client.get("/")
    csp = page.headers["content-security-policy"]
    assert "frame-ancestors 'none'" in csp and "script-src 'self'" in csp
    assert "default-src 'none'" in csp and "'unsafe-inline'" not in csp
    assert page.headers["x-frame-options"] == "DENY"
    for r in (page, client.get("/static/app.js"), client.get("/info"), client.get("/nope")):
        assert r.headers["x-content-type-options"] == "nosniff"
        assert r.headers["referrer-policy"] == "no-referrer"
    assert "content-security-policy" not in client.get("/docs").headers  # its CDN scripts


class _Inline(HTMLParser):
    """What a content security policy without 'unsafe-inline' would block."""

    def __init__(self):
        super().__init__()
        self.found, self.scripts, self.styles = [], [], []
        self._in_script = False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.found += [f"{tag} {a}" for a in attrs if a.startswith("on") or a == "style"]
        if tag == "style":
            self.found.append("<style>")
        if tag == "script":
            self.scripts.append(attrs.get("src"))
            self._in_script = True
        if tag == "link" and attrs.get("rel") == "stylesheet":
            self.styles.append(attrs.get("href"))

    def handle_endtag(self, tag):
        self._in_script = self._in_script and tag != "script"

    def handle_data(self, data):
        if self._in_script and data.strip():
            self.found.append("inline script")


def test_the_page_needs_nothing_its_policy_forbids():
    page = _Inline()
    page.feed((STATIC_DIR / "index.html").read_text(encoding="utf-8"))
    assert page.found == []
    assert page.scripts and all(s and s.startswith("/static/") for s in page.scripts)
    assert page.styles and all(s.startswith("/static/") for s in page.styles)
    script = (STATIC_DIR / "app.js").read_text(encoding="utf-8")
    # no eval-like code, no inline handlers written by the script, fetches to this origin
    assert not re.search(r"\beval\(|new Function\(|innerHTML|setAttribute\(\"on", script)
    assert not re.search(r"fetch\(\s*[\"']https?:", script)
    policy = dict(d.strip().split(" ", 1) for d in
                  PAGE_HEADERS["Content-Security-Policy"].split(";"))
    if "createObjectURL" in script:  # the upload's preview is a blob: image
        assert "blob:" in policy["img-src"]


# --- no server paths in error bodies ---------------------------------------------------------

def test_paths_are_shortened_to_their_last_component():
    assert without_paths("index '/srv/runs/index' was built from sketch sha256 ab... "
                         "(/srv/other/o.pt), --out /srv/runs/index; see x/y.png") == (
        "index '.../index' was built from sketch sha256 ab... (.../o.pt), --out "
        ".../index; see x/y.png")
    assert without_paths('file "/my photos/a b.jpg" is missing') == (
        'file ".../a b.jpg" is missing')
    # unquoted, a space ends the path: what follows is relative, the server's part is gone
    assert without_paths("(/srv/other run/o.pt)") == "(.../other run/o.pt)"
    assert without_paths("k=5 is outside [1, 20]; 3 KiB/s; image/png") == (
        "k=5 is outside [1, 20]; 3 KiB/s; image/png")


def test_a_refused_index_version_is_named_without_server_paths(tmp_path, settings):
    from index.build import build_index
    from tests.fakes import FakeModel, make_gallery
    from tests.service.test_reload import app_of

    photos = make_gallery(tmp_path / "photos", classes=2, per_class=3)
    embedder = FakeModel(L=8)
    build_index(embedder, photos, tmp_path / "index", progress=False)
    with TestClient(app_of(settings, tmp_path, embedder)) as http:
        other = FakeModel(L=8, seed=5)
        other.path = tmp_path / "other-model"
        build_index(other, photos, tmp_path / "index", progress=False)
        r = http.post("/admin/reload")
        assert r.status_code == 409
        detail = r.json()["detail"]
        assert "was built with the model bundle of sha256" in detail
        assert "(.../other-model)" in detail
        assert str(tmp_path) not in detail and "/tmp" not in detail, detail
        (tmp_path / "index" / "CURRENT").write_text("nope\n")
        detail = http.post("/admin/reload").json()["detail"]
        assert "'.../CURRENT' holds 'nope'" in detail and str(tmp_path) not in detail


# --- a service open beyond loopback ----------------------------------------------------------

@pytest.mark.parametrize("host, keys, warned", [
    ("0.0.0.0", [], True), ("::", [], True), ("192.168.1.5", [], True),
    ("sketch.example.org", [], True), ("0.0.0.0", [KEY], False), ("127.0.0.1", [], False),
    ("localhost", [], False), ("::1", [], False)])
def test_listening_beyond_loopback_without_keys_is_warned(settings, engine, caplog, host, keys,
                                                          warned):
    app = create_app(settings.model_copy(update={"host": host, "api_keys": keys}),
                     loader=lambda s: engine)
    with caplog.at_level(logging.WARNING, logger="service.main"), TestClient(app) as http:
        warnings = http.get("/info", headers={"X-API-Key": KEY}).json()["warnings"]
    logged = [r.getMessage() for r in caplog.records if r.name == "service.main"]
    assert logged == warnings
    if warned:
        (warning,) = warnings
        assert warning.startswith(f"listening on {host}, beyond loopback, without API keys")
        assert "API_KEYS" in warning
    else:
        assert warnings == []
