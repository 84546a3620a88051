"""The drawing page in headless Chromium: draw with mouse and touch, move the slider, upload;
all of it within the page's content security policy."""

import shutil
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]

sync_api = pytest.importorskip("playwright.sync_api",
                               reason="playwright is not installed (pip install playwright)")
if not CHROMIUM.is_file() and not shutil.which("chromium"):
    pytest.skip(f"no Chromium at {CHROMIUM}", allow_module_level=True)


@pytest.fixture(scope="module")
def browser():
    """One Chromium for the module: Playwright's sync API allows one driver per thread."""
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=ARGS)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def page(browser, live_server):
    context = browser.new_context(has_touch=True, viewport={"width": 1000, "height": 800})
    context.add_init_script(CSP_WATCH)
    pg = context.new_page()
    pg.csp = pg.goto(live_server + "/").headers.get("content-security-policy")
    pg.wait_for_selector("body[data-ready='1']", timeout=20_000)
    yield pg
    context.close()


# Every violation of the page's content security policy, as the browser reports it.
CSP_WATCH = """window.cspViolations = [];
document.addEventListener('securitypolicyviolation',
    e => window.cspViolations.push(e.violatedDirective + ' ' + e.blockedURI));"""


def drawn_pixels(page) -> int:
    """Number of dark pixels on the canvas."""
    return page.evaluate("""() => {
        const c = document.getElementById('canvas');
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let n = 0;
        for (let i = 0; i < d.length; i += 4) if (d[i] < 128) n++;
        return n;
    }""")


def shown_images(page) -> list[dict]:
    page.wait_for_function("""() => {
        const imgs = [...document.querySelectorAll('#results .hit img')];
        return imgs.length > 0 && imgs.every(i => i.complete && i.naturalWidth > 0);
    }""", timeout=20_000)
    return page.eval_on_selector_all(
        "#results .hit", "els => els.map(e => ({src: e.querySelector('img').src, "
        "w: e.querySelector('img').naturalWidth, caption: e.textContent}))")


def test_mouse_strokes_return_photos(page):
    assert page.input_value("#dims") == "8"  # slider max set from /info
    box = page.locator("#canvas").bounding_box()
    with page.expect_response(lambda r: "/retrieve?dims=8" in r.url) as resp:
        page.mouse.move(box["x"] + 40, box["y"] + 40)
        page.mouse.down()
        for i in range(1, 20):
            page.mouse.move(box["x"] + 40 + 8 * i, box["y"] + 40 + 5 * i)
        page.mouse.up()
    assert resp.value.status == 200
    assert drawn_pixels(page) > 100
    hits = shown_images(page)
    assert len(hits) == 6 and all(h["w"] > 0 for h in hits)
    assert all("/photos/" in h["src"] for h in hits)
    assert page.text_content("#status").startswith("6 photos, d = 8")


def test_touch_stroke_and_dims_slider(page):
    page.click("#clear")
    assert drawn_pixels(page) == 0
    box = page.locator("#canvas").bounding_box()
    cdp = page.context.new_cdp_session(page)
    x0, y0 = box["x"] + 30, box["y"] + 200

    def touch(kind, x, y):
        points = [] if kind == "touchEnd" else [{"x": x, "y": y, "id": 1}]
        cdp.send("Input.dispatchTouchEvent", {"type": kind, "touchPoints": points})

    with page.expect_response(lambda r: "/retrieve?" in r.url) as resp:
        touch("touchStart", x0, y0)
        for i in range(1, 15):
            touch("touchMove", x0 + 12 * i, y0 - 9 * i)
        touch("touchEnd", 0, 0)
    assert resp.value.status == 200
    assert drawn_pixels(page) > 100
    assert len(shown_images(page)) == 6

    with page.expect_response(lambda r: "/retrieve?dims=3&k=6" in r.url) as resp:
        page.locator("#dims").fill("3")
    assert resp.value.json()["dims"] == 3
    # predicates as functions: a bare expression is evaluated by eval, which the page's CSP
    # (no 'unsafe-eval') refuses
    page.wait_for_function("() => document.getElementById('status').textContent"
                           ".includes('d = 3')")


def test_upload_button(page, tmp_path, small_sketches):
    sketch = tmp_path / "upload.png"
    sketch.write_bytes(small_sketches[2])
    with page.expect_response(lambda r: "/retrieve?" in r.url) as resp:
        page.set_input_files("#upload", str(sketch))
    assert resp.value.status == 200
    assert len(shown_images(page)) == 6


def test_error_is_shown_for_a_bad_upload(page, tmp_path):
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not an image")
    with page.expect_response(lambda r: "/retrieve?" in r.url) as resp:
        page.set_input_files("#upload", str(bad))
    assert resp.value.status == 415
    page.wait_for_function("() => document.getElementById('status').className === 'error'")
    assert "is not a PNG/JPEG/WEBP image" in page.text_content("#status")


def test_drawing_and_uploading_break_no_rule_of_the_pages_policy(page):
    """After the tests above (strokes, touch, slider, uploads and their previews)."""
    assert page.csp and "frame-ancestors 'none'" in page.csp
    assert page.evaluate("window.cspViolations") == []


def test_the_page_asks_for_the_key_when_the_service_needs_one(real_index, browser):
    from service.main import create_app
    from service.settings import Settings
    from tests.service.conftest import serve

    settings = Settings(index=real_index, max_k=20, default_k=6, api_keys=["page-key"],
                        encoder="torch")
    with serve(create_app(settings), settings) as url:
        context = browser.new_context()  # the module's browser, a fresh session
        page = context.new_page()
        page.goto(url + "/")  # the page itself is open
        page.wait_for_selector("#key-form:not([hidden])", timeout=20_000)
        assert "needs an API key" in page.text_content("#status")
        page.fill("#api-key", "wrong")
        page.click("#key-form button")
        page.wait_for_function("() => document.getElementById('status').textContent"
                               ".includes('refused')")
        page.fill("#api-key", "page-key")
        page.click("#key-form button")
        page.wait_for_selector("body[data-ready='1']", timeout=20_000)
        assert page.input_value("#dims") == "8"
        box = page.locator("#canvas").bounding_box()
        with page.expect_response(lambda r: "/retrieve?" in r.url) as resp:
            page.mouse.move(box["x"] + 40, box["y"] + 40)
            page.mouse.down()
            page.mouse.move(box["x"] + 120, box["y"] + 90)
            page.mouse.up()
        assert resp.value.status == 200
        hits = shown_images(page)  # <img src> of signed URLs: loaded without a header
        assert len(hits) == 6 and all("sig=" in h["src"] for h in hits)
        context.close()


def test_a_flat_gallery_is_captioned_by_file_name(browser, tmp_path, small_sketches):
    """Photos without a class folder: the page names each by its file, never 'null', and
    the model line counts photos without classes."""
    from PIL import Image

    from index.build import build_index
    from index.store import load_index
    from service.main import create_app
    from service.retrieval import RetrievalEngine
    from service.settings import Settings
    from tests.fakes import FakeModel
    from tests.service.conftest import serve

    flat = tmp_path / "my photos"
    flat.mkdir()
    for i in range(6):
        Image.new("RGB", (16, 16), (40 * i, 90, 200 - 30 * i)).save(flat / f"beach day {i}.png")
    model = FakeModel(L=8)
    build_index(model, flat, tmp_path / "index", progress=False)
    settings = Settings(index=tmp_path / "index", default_k=6)
    engine = RetrievalEngine(model, load_index(tmp_path / "index"), settings.max_pixels)
    sketch = tmp_path / "q.png"
    sketch.write_bytes(small_sketches[0])
    with serve(create_app(settings, loader=lambda s: engine), settings) as url:
        context = browser.new_context()
        pg = context.new_page()
        pg.goto(url + "/")
        pg.wait_for_selector("body[data-ready='1']", timeout=20_000)
        assert "6 photos" in pg.text_content("#model-info")
        assert "classes" not in pg.text_content("#model-info")
        with pg.expect_response(lambda r: "/retrieve?" in r.url):
            pg.set_input_files("#upload", str(sketch))
        captions = [h["caption"] for h in shown_images(pg)]
        context.close()
    assert len(captions) == 6 and all(c.startswith("beach day ") for c in captions), captions
