"""Turn uploaded bytes into a sketch image, refusing anything that is not a sane image."""

from __future__ import annotations

import io

from PIL import Image, ImageFile, UnidentifiedImageError

from training.cdk.images import to_rgb

# A truncated file must be an error, never a silently half-grey sketch.
ImageFile.LOAD_TRUNCATED_IMAGES = False

FORMATS = ("PNG", "JPEG", "WEBP")


class BadImageError(ValueError):
    """An upload that cannot be used as a sketch (base class)."""


class EmptyImageError(BadImageError):
    pass


class NotAnImageError(BadImageError):
    pass


class TruncatedImageError(BadImageError):
    pass


class ImageTooLargeError(BadImageError):
    """Too many pixels (a decompression bomb) or too many bytes."""


def check_size(data: bytes, limit: int, name: str) -> None:
    if len(data) > limit:
        raise ImageTooLargeError(f"{name!r} is over the upload limit of {limit} bytes")


def decode_image(data: bytes, name: str, max_pixels: int) -> Image.Image:
    """Decode an uploaded PNG/JPEG/WebP into RGB; transparency is flattened onto white.

    The pixel count is checked from the header before any pixel is decoded.
    """
    if not data:
        raise EmptyImageError(f"{name!r} is empty (0 bytes)")
    try:
        img = Image.open(io.BytesIO(data), formats=FORMATS)
    except Image.DecompressionBombError as err:
        raise ImageTooLargeError(f"{name!r} has too many pixels: {err}") from err
    except (UnidentifiedImageError, OSError) as err:
        raise NotAnImageError(
            f"{name!r} is not a {'/'.join(FORMATS)} image (starts with {data[:8]!r})"
        ) from err
    width, height = img.size
    if width * height > max_pixels:
        raise ImageTooLargeError(
            f"{name!r} is {width}x{height} = {width * height} pixels; the limit is {max_pixels}"
        )
    try:
        img.load()
    except (OSError, SyntaxError, ValueError) as err:
        msg = f"{name!r} is a damaged or truncated {img.format}: {err}"
        raise TruncatedImageError(msg) from err
    return to_rgb(img)
