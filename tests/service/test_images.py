"""Uploads decode as training.images decodes them: EXIF orientation applied, 16-bit scaled
(not clipped), whether or not the service shrinks them while decoding."""

import io

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image, ImageDraw

from index.store import load_index
from service.main import create_app
from service.retrieval import RetrievalEngine


def upright_sketch() -> np.ndarray:
    """(64, 128) uint8: strokes that no turn or flip maps onto themselves."""
    img = Image.new("L", (128, 64), 230)
    draw = ImageDraw.Draw(img)
    draw.line([(5, 5), (120, 10), (60, 60)], fill=20, width=5)
    draw.rectangle([(90, 30), (110, 55)], fill=90)
    return np.asarray(img)


def png(img: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "PNG", **kw)
    return buf.getvalue()


@pytest.fixture(params=[None, 32], ids=["full-size", "shrunk"])
def client(request, fake_index, settings):
    index_dir, embedder = fake_index
    engine = RetrievalEngine(embedder, load_index(index_dir, embedder.sha256),
                             settings.max_pixels, decode_side=request.param)
    with TestClient(create_app(settings, loader=lambda s: engine)) as c:
        yield c


def results(client, data: bytes) -> list[tuple[str, float]]:
    r = client.post("/retrieve", params={"k": 15}, files={"file": ("s.png", data, "image/png")})
    assert r.status_code == 200, r.text
    return [(h["id"], h["score"]) for h in r.json()["results"]]


def assert_same(a, b):
    assert [i for i, _ in a] == [i for i, _ in b]
    np.testing.assert_allclose([s for _, s in a], [s for _, s in b], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("orientation,turn", [(3, Image.Transpose.ROTATE_180),
                                              (6, Image.Transpose.ROTATE_90),
                                              (8, Image.Transpose.ROTATE_270)])
def test_exif_rotated_upload_ranks_as_the_upright_one(client, orientation, turn):
    upright = Image.fromarray(upright_sketch())
    exif = Image.Exif()
    exif[0x0112] = orientation  # "turn the stored pixels by this to show them upright"
    rotated = png(upright.transpose(turn), exif=exif.tobytes())
    expected = results(client, png(upright))
    assert_same(results(client, rotated), expected)
    # Without the tag the stored pixels rank differently: the test can tell.
    assert [i for i, _ in results(client, png(upright.transpose(turn)))] != \
        [i for i, _ in expected]


def test_sixteen_bit_upload_is_scaled_not_clipped(client):
    grey = upright_sketch()
    sixteen = Image.fromarray(grey.astype(np.uint16) * 257)  # v * 257: exactly v in 8 bits
    data = png(sixteen)
    assert Image.open(io.BytesIO(data)).mode.startswith("I")
    assert_same(results(client, data), results(client, png(Image.fromarray(grey))))
    # Clipping (every value > 255 -> white) would have been a different query.
    clipped = Image.fromarray(np.where(grey.astype(np.uint16) * 257 > 255, 255, 0)
                              .astype(np.uint8))
    assert [i for i, _ in results(client, png(clipped))] != [i for i, _ in results(client, data)]
