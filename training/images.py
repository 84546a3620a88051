"""The image decoder every layer uses: files and uploads -> RGB images -> model tensors.

Rules, the same for training, the index and the service:
* the pixel count is checked from the header before any pixel is decoded, the byte count
  before the file is opened;
* a truncated or damaged file is an error, never a half-grey image;
* the EXIF orientation is applied, so a photo taken sideways decodes upright;
* 16-bit grey (modes ``I;16*`` and ``I``) is scaled to 8 bits (v * 255 / 65535) rather than
  clipped, which would leave only black and white;
* transparent pixels (RGBA, LA, PA, palette or colour-key transparency) are composited onto
  white, the paper of a sketch;
* ``reduce_to`` (off by default; the service sets it) shrinks a large image while it is
  decoded, by an integer factor that keeps both sides >= ``reduce_to``: JPEG decodes at 1/2,
  1/4 or 1/8 scale (``Image.draft``), other formats are box-averaged (``Image.reduce``) before
  any full-size copy is converted, so a 4096x4096 RGBA upload never becomes four full-size
  RGBA/RGB copies.
Every error is an ``ImageError`` whose message names the file.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
from PIL import ExifTags, Image, ImageFile, ImageOps, UnidentifiedImageError

__all__ = [
    "FORMATS", "MAX_BYTES", "MAX_PIXELS", "ImageError", "EmptyImageError", "NotAnImageError",
    "TruncatedImageError", "ImageTooLargeError", "check_size", "load_image", "decode_image",
    "to_rgb", "images_to_tensor",
]

# Pillow's default, restated: a truncated file must be an error. Nothing here turns it on.
ImageFile.LOAD_TRUNCATED_IMAGES = False

FORMATS = ("JPEG", "PNG", "WEBP", "BMP")  # what training data and galleries may hold
MAX_PIXELS = 8192 * 8192  # below Pillow's own decompression-bomb limit (~89M)
MAX_BYTES = 256 * 1024 * 1024

SIXTEEN_BIT = ("I;16", "I;16L", "I;16B", "I;16N", "I")
TRANSPARENT = ("RGBA", "LA", "PA", "RGBa", "La")
REDUCIBLE = ("L", "LA", "RGB", "RGBA", "I", "CMYK", "YCbCr")  # modes Image.reduce accepts
# EXIF orientation -> the transpose that makes the image upright (as ImageOps.exif_transpose).
UPRIGHT = {
    2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM, 5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270, 7: Image.Transpose.TRANSVERSE, 8: Image.Transpose.ROTATE_90,
}


class ImageError(ValueError):
    """An image that cannot be used; the message names the file or upload."""


class EmptyImageError(ImageError):
    """Zero bytes."""


class NotAnImageError(ImageError):
    """Not one of the accepted formats."""


class TruncatedImageError(ImageError):
    """The header is fine but the pixel data is cut short or damaged."""


class ImageTooLargeError(ImageError):
    """Too many bytes, or too many pixels (a decompression bomb)."""


def check_size(n_bytes: int, limit: int, name: str) -> None:
    """ImageTooLargeError when ``n_bytes`` is over ``limit``."""
    if n_bytes > limit:
        raise ImageTooLargeError(f"{name!r} is over the limit of {limit} bytes")


def load_image(
    path: str | Path,
    max_pixels: int = MAX_PIXELS,
    max_bytes: int = MAX_BYTES,
    formats: tuple[str, ...] = FORMATS,
) -> Image.Image:
    """Decode the image file ``path`` as upright 8-bit RGB (rules in the module docstring)."""
    name = str(path)
    try:
        n_bytes = Path(path).stat().st_size
        check_size(n_bytes, max_bytes, name)
        with open(path, "rb") as fp:
            return _decode(fp, name, n_bytes, max_pixels, formats)
    except OSError as err:  # missing or unreadable file: still bad data, still named
        raise ImageError(f"cannot read image {name!r}: {err}") from err


def decode_image(
    data: bytes,
    name: str,
    max_pixels: int = MAX_PIXELS,
    max_bytes: int = MAX_BYTES,
    formats: tuple[str, ...] = FORMATS,
    reduce_to: int | None = None,
) -> Image.Image:
    """Decode image bytes (an upload called ``name``) as upright 8-bit RGB; with ``reduce_to``
    the result is shrunk by an integer factor keeping both sides >= ``reduce_to``."""
    check_size(len(data), max_bytes, name)
    return _decode(io.BytesIO(data), name, len(data), max_pixels, formats, reduce_to)


def _decode(fp: BinaryIO, name: str, n_bytes: int, max_pixels: int,
            formats: tuple[str, ...], reduce_to: int | None = None) -> Image.Image:
    if n_bytes == 0:
        raise EmptyImageError(f"{name!r} is empty (0 bytes)")
    try:
        img = Image.open(fp, formats=formats)
    except Image.DecompressionBombError as err:
        raise ImageTooLargeError(f"{name!r} has too many pixels: {err}") from err
    except (UnidentifiedImageError, OSError) as err:
        fp.seek(0)
        raise NotAnImageError(
            f"{name!r} is not a {'/'.join(formats)} image (starts with {fp.read(8)!r})"
        ) from err
    with img:
        width, height = img.size
        if width * height > max_pixels:
            raise ImageTooLargeError(f"{name!r} is {width}x{height} = {width * height} pixels; "
                                     f"the limit is {max_pixels}")
        try:
            if reduce_to is not None:
                img.draft(None, (reduce_to, reduce_to))  # JPEG only; others ignore it
            img.load()
            orientation = img.getexif().get(ExifTags.Base.Orientation, 1)
            if reduce_to is None and orientation != 1:
                ImageOps.exif_transpose(img, in_place=True)
        except Exception as err:  # noqa: BLE001 - decoders raise anything on damaged data
            raise TruncatedImageError(
                f"{name!r} is a damaged or truncated {img.format}: {type(err).__name__}: {err}"
            ) from err
        if reduce_to is None:
            return to_rgb(img)
        small = _reduce(img, reduce_to)
        if orientation in UPRIGHT:  # after shrinking: the transpose copies the small image
            small = small.transpose(UPRIGHT[orientation])
        return to_rgb(small)


def _reduce(im: Image.Image, min_side: int) -> Image.Image:
    """Shrink ``im`` by the largest integer factor that keeps both sides >= ``min_side``."""
    factor = min(im.width // min_side, im.height // min_side)
    if factor < 2:
        return im
    if im.mode not in REDUCIBLE or "transparency" in im.info:
        # Palette, 1-bit and 16-bit modes cannot be box-averaged, nor can a colour key
        # (averaged edges would no longer match it): convert first, at full size.
        im = to_rgb(im)
    return im.reduce(factor)


def _sixteen_to_eight(im: Image.Image) -> Image.Image:
    """16-bit grey -> "L" scaled by 255/65535 ("LA" when a colour key marks transparency)."""
    # int32 holds 65535 * 255 + 32767; int64 would double a full-size temporary.
    v = np.clip(np.asarray(im, dtype=np.int32), 0, 65535)  # (H, W)
    grey = Image.fromarray(((v * 255 + 32767) // 65535).astype(np.uint8), mode="L")
    key = im.info.get("transparency")
    if isinstance(key, int):
        alpha = Image.fromarray(np.where(v == key, 0, 255).astype(np.uint8), mode="L")
        return Image.merge("LA", (grey, alpha))
    return grey


def to_rgb(im: Image.Image) -> Image.Image:
    """An 8-bit RGB copy of any PIL image: 16-bit grey scaled, transparency onto white."""
    if im.mode in SIXTEEN_BIT:
        im = _sixteen_to_eight(im)
    if im.mode in TRANSPARENT or "transparency" in im.info:
        if im.mode != "RGBA":  # convert() would copy an RGBA image for nothing
            im = im.convert("RGBA")
        white = Image.new("RGBA", im.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, im).convert("RGB")
    return im.convert("RGB")


def images_to_tensor(images, size: int, mean, std) -> torch.Tensor:
    """List of PIL images -> (N, 3, size, size) float32, resized bilinearly, normalised."""
    if len(images) == 0:
        raise ValueError("images_to_tensor needs at least one image")
    arrs = []
    for i, im in enumerate(images):
        if not isinstance(im, Image.Image):
            raise TypeError(f"images[{i}] is {type(im).__name__}, not a PIL.Image.Image")
        im = to_rgb(im).resize((size, size), Image.BILINEAR)
        arrs.append(np.asarray(im, dtype=np.float32) / 255.0)  # (H, W, 3)
    x = torch.from_numpy(np.stack(arrs)).permute(0, 3, 1, 2).contiguous()  # (N, 3, H, W)
    m = torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1)
    s = torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1)
    return (x - m) / s
