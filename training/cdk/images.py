"""Image decoding and normalisation shared by feature extraction and the Embedder."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image

from training.folders import DataError

__all__ = ["DataError", "load_image", "to_rgb", "images_to_tensor"]


def to_rgb(im: Image.Image) -> Image.Image:
    """RGB view of any PIL image; transparent pixels (RGBA / LA / PA / palette sketches) become
    white, the paper of a sketch, rather than black."""
    if im.mode in ("RGBA", "LA", "PA") or (im.mode == "P" and "transparency" in im.info):
        im = im.convert("RGBA")
        bg = Image.new("RGBA", im.size, (255, 255, 255, 255))
        return Image.alpha_composite(bg, im).convert("RGB")
    return im.convert("RGB")


def load_image(path: str | Path) -> Image.Image:
    """Decode ``path`` fully as RGB; a DataError names the file if it cannot be read."""
    try:
        with Image.open(path) as im:
            im.load()
            return to_rgb(im)
    except Exception as e:  # noqa: BLE001 - any decoder failure is bad data
        raise DataError(f"cannot read image {str(path)!r}: {type(e).__name__}: {e}") from e


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
