"""training.images: the one decoder of training, the index and the service."""

import io
import struct
import zlib

import numpy as np
import pytest
import torch
from PIL import Image

from training.images import (
    EmptyImageError,
    ImageError,
    ImageTooLargeError,
    NotAnImageError,
    TruncatedImageError,
    decode_image,
    load_image,
    to_rgb,
)


def encode(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def png_with_size(width: int, height: int) -> bytes:
    """A valid 1x1 PNG whose header claims width x height."""
    raw = bytearray(encode(Image.new("L", (1, 1)), "PNG"))
    ihdr = raw[12:29]  # b"IHDR" + 13 bytes of data
    ihdr[4:12] = struct.pack(">II", width, height)
    raw[12:29] = ihdr
    raw[29:33] = struct.pack(">I", zlib.crc32(bytes(ihdr)))
    return bytes(raw)


def stroke_on_clear() -> Image.Image:
    """A black row on a fully transparent 16x16 background."""
    img = Image.new("RGBA", (16, 16), (0, 0, 0, 0))
    for x in range(16):
        img.putpixel((x, 8), (0, 0, 0, 255))
    return img


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P"])  # transparent modes PNG can carry
def test_transparent_png_is_flattened_onto_white(mode):
    img = stroke_on_clear()
    if mode == "LA":
        img = img.convert("LA")
    elif mode == "P":
        img = img.convert("P")
        img.info["transparency"] = img.getpixel((0, 0))  # the background's palette index
    out = decode_image(encode(img, "PNG"), "sketch.png", max_pixels=1024)
    assert out.mode == "RGB"
    assert out.getpixel((3, 2)) == (255, 255, 255)
    assert out.getpixel((3, 8)) == (0, 0, 0)


def test_to_rgb_flattens_every_transparent_mode_onto_white():
    base = Image.new("RGBA", (4, 4), (0, 0, 0, 0))
    base.putpixel((1, 1), (0, 0, 0, 255))
    for mode in ("RGBA", "LA", "PA"):
        out = to_rgb(base.convert(mode))
        assert out.getpixel((0, 0)) == (255, 255, 255), mode
        assert out.getpixel((1, 1)) == (0, 0, 0), mode
    key = Image.new("RGB", (2, 1), (10, 20, 30))  # colour-key transparency (PNG tRNS)
    key.putpixel((1, 0), (1, 2, 3))
    key.info["transparency"] = (10, 20, 30)
    out = to_rgb(key)
    assert out.getpixel((0, 0)) == (255, 255, 255) and out.getpixel((1, 0)) == (1, 2, 3)


def blocks() -> np.ndarray:
    """(24, 40, 3) uint8: four flat coloured blocks, so every rotation is distinguishable."""
    a = np.zeros((24, 40, 3), np.uint8)
    a[:12, :20] = (255, 0, 0)
    a[:12, 20:] = (0, 255, 0)
    a[12:, :20] = (0, 0, 255)
    a[12:, 20:] = (255, 255, 255)
    return a


# EXIF orientation -> how the camera stored the upright picture (np.rot90 turns anticlockwise).
STORED = {3: lambda a: np.rot90(a, 2), 6: lambda a: np.rot90(a, 1), 8: lambda a: np.rot90(a, -1)}


@pytest.mark.parametrize("orientation", sorted(STORED))
def test_exif_rotated_jpeg_decodes_upright(tmp_path, orientation):
    upright = blocks()
    stored = Image.fromarray(np.ascontiguousarray(STORED[orientation](upright)))
    exif = Image.Exif()
    exif[0x0112] = orientation
    path = tmp_path / "camera.jpg"
    stored.save(path, "JPEG", quality=95, exif=exif.tobytes())
    out = np.asarray(load_image(path), dtype=np.float64)
    assert out.shape == upright.shape
    assert np.abs(out - upright).mean() < 8  # JPEG noise only; a wrong turn is ~100 off


def test_sixteen_bit_png_is_scaled_not_clipped(tmp_path):
    v = np.array([[0, 257, 1000, 32768, 51400, 65535]], np.uint16)
    path = tmp_path / "depth.png"
    Image.fromarray(v).save(path)
    assert Image.open(path).mode.startswith("I")  # really stored and read as 16-bit
    out = np.asarray(load_image(path))  # (1, 6, 3)
    # v * 255 / 65535 rounded: 257 -> 1, 1000 -> 3.89 -> 4, 32768 -> 127.5 -> 128, 51400 -> 200
    expected = [0, 1, 4, 128, 200, 255]
    np.testing.assert_array_equal(out[0], np.repeat(np.array(expected)[:, None], 3, axis=1))
    # Mode "I" (32-bit, how older Pillow reads 16-bit PNG) follows the same scale.
    as_i = to_rgb(Image.fromarray(v.astype(np.int32)))
    np.testing.assert_array_equal(np.asarray(as_i)[0, :, 0], expected)
    # A 16-bit colour key is transparency, hence white.
    Image.fromarray(v).save(path, transparency=1000)
    assert np.asarray(load_image(path))[0, 2].tolist() == [255, 255, 255]


def test_limits_are_checked_before_decoding(tmp_path):
    with pytest.raises(ImageTooLargeError, match=r"'big.png' is 2000x2000 = 4000000 pixels; "
                                                 r"the limit is 1000000"):
        decode_image(png_with_size(2000, 2000), "big.png", max_pixels=1_000_000)
    with pytest.raises(ImageTooLargeError, match="'bomb.png' has too many pixels"):
        decode_image(png_with_size(60_000, 60_000), "bomb.png")
    data = encode(Image.new("RGB", (8, 8)), "PNG")
    with pytest.raises(ImageTooLargeError, match="'s.png' is over the limit of 10 bytes"):
        decode_image(data, "s.png", max_bytes=10)
    path = tmp_path / "s.png"
    path.write_bytes(data)
    with pytest.raises(ImageTooLargeError, match=r"s\.png' is over the limit of 10 bytes"):
        load_image(path, max_bytes=10)
    with pytest.raises(ImageTooLargeError, match=r"s\.png' is 8x8 = 64 pixels"):
        load_image(path, max_pixels=63)
    assert load_image(path, max_pixels=64, max_bytes=len(data)).size == (8, 8)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_truncated_file_is_an_error_naming_it(tmp_path, fmt):
    rng = np.random.default_rng(0)
    data = encode(Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)), fmt)
    path = tmp_path / f"cut.{fmt.lower()}"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(TruncatedImageError, match=rf"cut\.{fmt.lower()}' is a damaged or "
                                                  rf"truncated {fmt}"):
        load_image(path)


def test_other_bad_inputs_name_the_file(tmp_path):
    with pytest.raises(EmptyImageError, match="'e.png' is empty"):
        decode_image(b"", "e.png")
    with pytest.raises(NotAnImageError, match="'t.png' is not a PNG/JPEG/WEBP image"):
        decode_image(b"hello there", "t.png", formats=("PNG", "JPEG", "WEBP"))
    gif = encode(Image.new("RGB", (4, 4)), "GIF")
    with pytest.raises(NotAnImageError, match="'g.png' is not a PNG image"):
        decode_image(gif, "g.png", formats=("PNG",))
    with pytest.raises(ImageError, match="nowhere.jpg"):
        load_image(tmp_path / "nowhere.jpg")
    for cls in (EmptyImageError, NotAnImageError, TruncatedImageError, ImageTooLargeError):
        assert issubclass(cls, ImageError) and issubclass(cls, ValueError)


def test_training_and_index_embed_a_transparent_photo_alike(tmp_path, real_bundle):
    """The feature path of training and the gallery path of the index decode the same way."""
    from index.embed import embed_photos, photo_encoder
    from index.gallery import scan_gallery
    from training.cdk.checkpoint import load_checkpoint
    from training.cdk.features import extract_features
    from training.cdk.model.backbones import bare_backbone

    model = real_bundle  # photos mirror-averaged, as the cpu preset trains them
    ckpt = model.path.parent / "checkpoint.pt"  # what it was written from
    e = model.embedder("cpu")
    rng = np.random.default_rng(0)
    rgba = rng.integers(0, 255, (40, 48, 4), dtype=np.uint8)
    rgba[:, :24, 3] = 0  # left half fully transparent
    photo = tmp_path / "gallery" / "thing" / "p1.png"
    photo.parent.mkdir(parents=True)
    Image.fromarray(rgba, mode="RGBA").save(photo)

    bb = bare_backbone(e.backbone, e.photo_flip_average, e.pooling)  # as training builds it
    bb.module.load_state_dict(load_checkpoint(ckpt)["backbones"]["photo"])
    feats = extract_features([photo], bb, e.image_size, None, device="cpu")  # (1, D)
    trained = e.head(feats, "photo").numpy()  # (1, L)

    scan = scan_gallery(tmp_path / "gallery")

    root, photos = scan.root, scan.photos
    # in the views training embedded it (mirror-averaged, as its features)
    indexed = embed_photos(model, root, photos, photo_encoder(model, views=2),
                           progress=False).vectors  # (1, L)
    np.testing.assert_allclose(indexed, trained, rtol=1e-4, atol=1e-5)

    black = e.embed([Image.open(photo).convert("RGB")], "photo")  # transparent -> black
    assert not np.allclose(black, trained, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(e.preprocess([load_image(photo)], "photo"),
                               e.preprocess([Image.open(photo)], "photo"))


def strokes(size: tuple[int, int], seed: int = 0) -> np.ndarray:
    """(H, W) uint8: dark random blocks on white, not symmetric under any turn."""
    rng = np.random.default_rng(seed)
    w, h = size
    a = np.full((h, w), 255, np.uint8)
    for _ in range(12):
        x, y = rng.integers(0, w - w // 8), rng.integers(0, h - h // 8)
        a[y : y + h // 8, x : x + w // 16] = 0
    return a


@pytest.mark.parametrize("fmt,mode", [("PNG", "RGBA"), ("PNG", "P"), ("PNG", "I;16"),
                                      ("PNG", "L"), ("JPEG", "RGB")])
def test_reduce_to_shrinks_while_decoding_and_keeps_the_picture(fmt, mode):
    grey = strokes((1200, 900))  # (900, 1200)
    if mode == "I;16":
        img = Image.fromarray(grey.astype(np.uint16) * 257)
    elif mode == "RGBA":  # transparent background, opaque strokes
        img = Image.fromarray(np.stack([grey] * 3 + [255 - grey], -1), "RGBA")
    else:
        img = Image.fromarray(grey).convert(mode)
    data = encode(img, fmt)
    full = decode_image(data, "big")
    assert full.size == (1200, 900)  # the default is unchanged: no shrinking
    small = decode_image(data, "big", reduce_to=224)
    # JPEG decodes at 1/4 scale (draft), the others are box-averaged by 900 // 224 = 4.
    assert small.size == (300, 225) and small.mode == "RGB"
    reference = np.asarray(full.resize(small.size, Image.BOX), np.float64)
    assert np.abs(np.asarray(small, np.float64) - reference).mean() < 3
    assert decode_image(data, "big", reduce_to=500).size == (1200, 900)  # factor 1: untouched


@pytest.mark.parametrize("orientation", [3, 6, 8])
def test_reduce_to_applies_the_exif_orientation(orientation):
    upright = strokes((400, 200), seed=orientation)
    turn = {3: Image.Transpose.ROTATE_180, 6: Image.Transpose.ROTATE_90,
            8: Image.Transpose.ROTATE_270}[orientation]
    stored = Image.fromarray(upright).transpose(turn)
    exif = Image.Exif()
    exif[0x0112] = orientation
    data = encode(stored, "PNG", exif=exif.tobytes())
    small = decode_image(data, "turned", reduce_to=100)
    expected = decode_image(encode(Image.fromarray(upright), "PNG"), "upright", reduce_to=100)
    assert small.size == expected.size == (200, 100)
    np.testing.assert_array_equal(np.asarray(small), np.asarray(expected))
