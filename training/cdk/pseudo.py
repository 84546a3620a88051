"""Pseudo-sketches: sketch-like views of a photo, made without training.

A view is a line drawing of the photo's contours: the eXtended Difference of Gaussians
(XDoG; Winnemoller, Kyprianidis and Olsen, Computers & Graphics 2012) or Canny's edges
give the contour pixels; short fragments (texture, noise) are dropped; the contours are
thinned to one-pixel curves (skeletonisation) and jittered by a small random affine map;
random strokes are left out; and the curves are drawn at a pen's width, dark on white, at
the side the sketches are embedded at. Each view is a function of (photo, style, seed)
alone, so a cache of their features stays valid and every run sees the same views.

Strokes are the thinned curves cut at their junctions: dropping a stroke removes one
piece of a contour, as a person leaves one out, rather than a whole outline.

    views = pseudo_sketches(photo, STYLES, seed=0, size=240)   # [PIL "RGB" image] per style
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from scipy import ndimage
from tqdm import tqdm

__all__ = ["Style", "STYLES", "SKETCH_STYLES", "pseudo_sketch", "pseudo_sketches",
           "sketch_view", "view_features", "view_seed"]

# the side the contours are found at: Sketchy's images are 256 px, and the filters' widths
# below are in pixels of this side, so a photo of any size gives the same drawing
WORK_SIDE = 256


@dataclass(frozen=True)
class Style:
    """How one kind of view is drawn. edges: "xdog" or "canny"; sigma: the smoothing of the
    edge filter in pixels at WORK_SIDE (larger: fewer, longer contours); threshold: the
    quantile of the edge response above which a pixel is a line (XDoG's difference of
    Gaussians, or Canny's high threshold on the gradient; higher: fewer lines); min_length:
    contour fragments of fewer pixels are dropped; width: the pen's width in pixels at
    WORK_SIDE; rotate (degrees), scale, shift (share of the side): the affine jitter's
    bounds; drop: the share of strokes left out."""

    edges: str = "xdog"
    sigma: float = 1.5
    threshold: float = 0.5
    min_length: int = 30
    width: int = 2
    rotate: float = 8.0
    scale: float = 0.08
    shift: float = 0.04
    drop: float = 0.15

    def __post_init__(self):
        if self.edges not in ("xdog", "canny"):
            raise ValueError(f"edges must be 'xdog' or 'canny', got {self.edges!r}")
        if not self.sigma > 0:
            raise ValueError(f"sigma must be positive, got {self.sigma!r}")
        if not 0 <= self.drop < 1:
            raise ValueError(f"drop must be in [0, 1), got {self.drop!r}")
        if self.width < 1 or self.min_length < 0:
            raise ValueError(f"width must be >= 1 and min_length >= 0, got {self.width!r}, "
                             f"{self.min_length!r}")
        if not 0 < self.threshold < 1:
            raise ValueError(f"threshold is a quantile in (0, 1), got {self.threshold!r}")


# Named styles. "contour": the object's outline and main inner lines (coarse XDoG, a
# thicker pen); "detail": finer XDoG lines; "canny": Canny's edges, which break where the
# contrast fades, as hurried strokes do.
STYLES: dict[str, Style] = {
    "contour": Style("xdog", sigma=2.0, threshold=0.92, min_length=40, width=3),
    "detail": Style("xdog", sigma=1.2, threshold=0.96, min_length=30, width=2),
    "canny": Style("canny", sigma=2.5, threshold=0.9, min_length=30, width=2),
}
# Views of drawn sketches (sketch_view): the same jitter and dropout, a thinner and a
# thicker pen than Sketchy's (about 2 px at 256).
SKETCH_STYLES: dict[str, Style] = {
    "thin": Style(min_length=5, width=1, drop=0.1),
    "thick": Style(min_length=5, width=4, drop=0.1),
}


def view_seed(seed: int, key: str) -> int:
    """A 63-bit seed from a run's ``seed`` and a view's ``key`` (its photo and style): the
    same view everywhere, whatever the order views are made in."""
    digest = hashlib.sha256(f"{int(seed)}|{key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _grey(photo: Image.Image) -> np.ndarray:
    """(WORK_SIDE, WORK_SIDE) float64 luminance in [0, 1]."""
    im = photo.convert("L").resize((WORK_SIDE, WORK_SIDE), Image.BICUBIC)
    return np.asarray(im, dtype=np.float64) / 255.0


def _xdog(grey: np.ndarray, sigma: float, quantile: float, p: float = 20.0,
          k: float = 1.6) -> np.ndarray:
    """Boolean line mask from XDoG's sharpened difference of Gaussians u = (1 + p) G_sigma -
    p G_{k sigma}, less the smoothed image itself: p (G_sigma - G_{k sigma}), whose dark side
    runs along edges (XDoG's filled dark regions left out; its soft ramp is cut, since the
    lines are thinned next). A pixel is a line where the response is in the top
    ``quantile`` share on the dark side, or in the top 2.5 quantile and connected to one
    (hysteresis, as Canny's: long contours stay whole, isolated texture goes). Quantiles
    rather than fixed levels give photos of any contrast a similar amount of ink."""
    from skimage.filters import apply_hysteresis_threshold

    dark = p * (ndimage.gaussian_filter(grey, k * sigma) - ndimage.gaussian_filter(grey, sigma))
    high = max(float(np.quantile(dark, 1 - quantile)), 1e-3)  # a flat photo has no lines
    low = min(float(np.quantile(dark, 1 - 2.5 * quantile)), high)
    return apply_hysteresis_threshold(dark, max(low, 1e-3), high)


def _canny(grey: np.ndarray, sigma: float, quantile: float) -> np.ndarray:
    from skimage.feature import canny  # local: only the canny style needs it loaded

    return canny(grey, sigma=sigma, low_threshold=quantile * 0.6, high_threshold=quantile,
                 use_quantiles=True)


def _strokes(lines: np.ndarray, min_length: int) -> np.ndarray:
    """(H, W) int labels of the strokes (0: paper): the line mask thinned to one-pixel
    curves, fragments shorter than min_length pixels dropped, and the curves cut at their
    junctions (pixels with more than two neighbours)."""
    from skimage.morphology import skeletonize  # local: scikit-image loads slowly

    skel = skeletonize(lines)
    eight = np.ones((3, 3), dtype=bool)
    labels, n = ndimage.label(skel, structure=eight)
    if n:
        sizes = np.bincount(labels.ravel(), minlength=n + 1)
        skel &= sizes[labels] >= min_length
    neighbours = ndimage.convolve(skel.astype(np.int32), eight.astype(np.int32),
                                  mode="constant") - 1
    pieces = skel & ~(neighbours > 2)
    labels, _ = ndimage.label(pieces, structure=eight)
    # junction pixels join the stroke of a neighbouring piece, so no gap is left there
    grown = ndimage.grey_dilation(labels, footprint=eight)
    return np.where(skel & (labels == 0), grown, labels)


def _jitter(strokes: np.ndarray, style: Style, rng: np.random.Generator) -> np.ndarray:
    """The stroke labels under a random affine map about the centre (nearest neighbour, so
    labels stay labels and curves stay one pixel wide)."""
    from skimage.transform import AffineTransform, warp

    side = strokes.shape[0]
    angle = np.deg2rad(rng.uniform(-style.rotate, style.rotate))
    scale = 1 + rng.uniform(-style.scale, style.scale)
    shift = rng.uniform(-style.shift, style.shift, size=2) * side
    centre = np.array([side / 2, side / 2])
    to_centre = AffineTransform(translation=-centre)
    move = AffineTransform(scale=scale, rotation=angle, translation=centre + shift)
    forward = to_centre + move  # centre, rotate and scale, move back and shift
    return warp(strokes, forward.inverse, order=0, mode="constant", cval=0,
                preserve_range=True).astype(strokes.dtype)


def pseudo_sketch(photo: Image.Image, style: Style, seed: int, size: int) -> Image.Image:
    """One view of ``photo`` in ``style``: an RGB image of side ``size``, dark strokes on a
    white background, a function of (photo, style, seed) alone."""
    _check_size(size)
    grey = _grey(photo)
    lines = (_xdog(grey, style.sigma, 1 - style.threshold) if style.edges == "xdog"
             else _canny(grey, style.sigma, style.threshold))
    return _draw(_strokes(lines, style.min_length), style, np.random.default_rng(seed), size)


def sketch_view(sketch: Image.Image, style: Style, seed: int, size: int) -> Image.Image:
    """An augmented view of a drawn ``sketch``: its strokes thinned, jittered by the style's
    affine bounds, some left out, and drawn again at the style's width (its edge filter is
    not used: the ink is the line). The same conventions as pseudo_sketch."""
    _check_size(size)
    lines = _grey(sketch) < 0.5
    return _draw(_strokes(lines, style.min_length), style, np.random.default_rng(seed), size)


def _check_size(size: int) -> None:
    if size < 8:
        raise ValueError(f"size must be at least 8 pixels, got {size}")


def _draw(strokes: np.ndarray, style: Style, rng: np.random.Generator,
          size: int) -> Image.Image:
    """Stroke labels -> the page: jittered, a share ``style.drop`` of strokes left out (the
    longest kept when none would be), drawn at the pen's width, resized to ``size``."""
    strokes = _jitter(strokes, style, rng)
    ids = np.unique(strokes[strokes > 0])
    kept = ids[rng.random(len(ids)) >= style.drop]
    if len(kept) == 0 and len(ids):  # never a blank page: keep the longest stroke
        kept = ids[[np.argmax(np.bincount(strokes.ravel())[ids])]]
    ink = np.isin(strokes, kept)
    if style.width > 1:
        r = (style.width - 1) / 2
        n = int(np.ceil(r))
        yy, xx = np.mgrid[-n : n + 1, -n : n + 1]
        ink = ndimage.binary_dilation(ink, structure=(xx**2 + yy**2) <= r * r + 0.5)
    page = Image.fromarray(np.where(ink, 0, 255).astype(np.uint8), "L")
    return page.resize((size, size), Image.BILINEAR).convert("RGB")


def pseudo_sketches(photo: Image.Image, styles: dict[str, Style], seed: int, size: int,
                    key: str = "") -> list[Image.Image]:
    """One view per style of ``styles``, in its order; view i is seeded by
    view_seed(seed, f"{key}|{name}"), ``key`` naming the photo (its path)."""
    return [pseudo_sketch(photo, style, view_seed(seed, f"{key}|{name}"), size)
            for name, style in styles.items()]


def view_features(files, view, tag: str, backbone, image_size: int, cache_dir,
                  batch_size: int = 64, device=None, desc: str = "views") -> torch.Tensor:
    """(N, D) backbone features of one view of each of ``files``: ``view`` (index, decoded
    image) -> PIL image (a pseudo-sketch of the photo, an augmented sketch), passed through the
    backbone as training's features are (training.cdk.features, at ``image_size``), and
    cached in ``cache_dir`` (None: not) under the files' key and ``tag``, which must name
    everything the view depends on (its style, its seed)."""
    from training.device import pick_device
    from training.images import images_to_tensor, load_image

    from .features import cache_key, cached_tensor

    files = [Path(f) for f in files]
    module, device = backbone.module, pick_device(device)
    path, key = None, ""
    if cache_dir is not None and files:
        key = hashlib.sha256((cache_key(files, backbone, module, image_size) + "|" + tag)
                             .encode()).hexdigest()
        path = Path(cache_dir) / f"{backbone.name}-{image_size}-views-{key[:24]}.pt"

    @torch.no_grad()
    def compute() -> torch.Tensor:
        m = module.to(device).eval()
        out = [torch.zeros(0, backbone.feature_dim)]
        for i in tqdm(range(0, len(files), batch_size), desc=desc, unit="batch", leave=False):
            ims = [view(j, load_image(f)) for j, f in enumerate(files[i : i + batch_size], i)]
            x = images_to_tensor(ims, image_size, backbone.mean, backbone.std).to(device)
            out.append(m(x).float().cpu())
        return torch.cat(out)

    return cached_tensor(path, key, files, (len(files),), 2, compute, what="view features")
