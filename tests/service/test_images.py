import io

import pytest
from PIL import Image

from service.images import decode_image


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P"])  # transparent modes PNG can carry
def test_transparent_upload_is_flattened_onto_white(mode):
    # A black stroke on a fully transparent background: the background must become white.
    img = Image.new("RGBA", (16, 16), (0, 0, 0, 0))
    for x in range(16):
        img.putpixel((x, 8), (0, 0, 0, 255))
    if mode == "LA":
        img = img.convert("LA")
    elif mode == "P":
        img = img.convert("P")
        img.info["transparency"] = img.getpixel((0, 0))  # the background's palette index
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    out = decode_image(buf.getvalue(), "sketch.png", max_pixels=1024)
    assert out.mode == "RGB"
    assert out.getpixel((3, 2)) == (255, 255, 255)
    assert out.getpixel((3, 8)) == (0, 0, 0)
