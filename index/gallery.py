"""Photo galleries on disk: find the photos, name them, embed them.

The folder layouts and the stray-file rule are `training.folders.scan_gallery`'s (a plain
`DIR/<class>/<photo>`, a paired folder or the official Sketchy Extended layout); photos are
decoded by `training.images.load_image`, as in training. A photo's id is its file stem; ids
must be unique in a gallery because `/photos/{id}` serves them.

Photos whose frozen-backbone features training already cached (`training.cdk.features`, the
checkpoint's `cache_dir`) skip the backbone and only go through the photo head
(`cached_features`); the others are decoded in DataLoader workers and embedded in order.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader
from tqdm import tqdm

from training.cdk.features import find_cached
from training.cdk.model.embedder import Embedder
from training.folders import DataError
from training.folders import scan_gallery as scan_folder
from training.images import load_image

log = logging.getLogger(__name__)

ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")


@dataclass(frozen=True)
class Photo:
    """One gallery photo: its id, its class, and its path relative to the gallery root."""

    id: str
    cls: str
    path: str


def scan_gallery(folder: str | Path) -> tuple[Path, list[Photo]]:
    """List the photos of a gallery folder, sorted by (class, file).

    Returns the resolved root (what `Photo.path` is relative to) and the photos. DataError
    when the folder has no class subfolders, no photos or a stray file, when two photos
    share an id or an id breaks `ID_PATTERN`, or when a photo is a link to a file outside
    the root (the service serves files below the root only).
    """
    root, by_class = scan_folder(folder)
    photos: list[Photo] = []
    seen: dict[str, str] = {}
    for cls, files in by_class.items():
        for f in files:
            pid = f.stem
            rel = f.relative_to(root).as_posix()
            if not f.resolve().is_relative_to(root):
                raise DataError(
                    f"photo {str(f)!r} is a link to {str(f.resolve())!r}, outside the photo "
                    f"folder {str(root)!r}; copy the file into the folder instead"
                )
            if not ID_PATTERN.match(pid):
                raise DataError(
                    f"photo {str(f)!r} has id {pid!r}; ids must match {ID_PATTERN.pattern}"
                )
            if pid in seen:
                raise DataError(f"photo id {pid!r} is used by both {seen[pid]!r} and {rel!r}")
            seen[pid] = rel
            photos.append(Photo(id=pid, cls=cls, path=rel))
    return root, photos


def feature_cache_dir(flag: str | None, embedder: Embedder) -> str | None:
    """The feature cache the commands read: `flag` (a folder, or "none" for no reuse), by
    default (None) the checkpoint's `cache_dir`, where its training cached its features."""
    folder = (embedder.config.get("cache_dir") or "none") if flag is None else flag
    return None if folder == "none" else folder


def cached_features(
    embedder: Embedder, root: Path, photos: list[Photo], cache_dir: str | Path | None
) -> tuple[list[int], torch.Tensor]:
    """Backbone features of those `photos` that training cached in `cache_dir` for this
    embedder's photo backbone (same weights, input size and normalisation; entries whose
    files changed are never used: `training.cdk.features.find_cached`): (positions (K,),
    features (K, D)). Nothing when `cache_dir` is None, nor for a fine-tuned checkpoint,
    whose photos always go through its own backbone."""
    if cache_dir is None:
        return [], torch.zeros(0, 0)
    if embedder.finetuned:
        log.info("fine-tuned backbone: every photo goes through it, none from %s", cache_dir)
        return [], torch.zeros(0, 0)
    bb = embedder.backbone_of("photo")
    positions, feats = find_cached([root / p.path for p in photos], bb, bb.module,
                                   embedder.image_size, cache_dir)
    log.info("feature cache %s holds the backbone features of %d of %d photos", cache_dir,
             len(positions), len(photos))
    return positions, feats


class PhotoFiles(torch.utils.data.Dataset):
    """Photo files decoded (`load_image`: errors name the file) and preprocessed by
    `transform` (`Embedder.transform()`), one (3, H, W) tensor per file, in order."""

    def __init__(self, paths: list[Path], transform):
        self.paths, self.transform = paths, transform

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.transform([load_image(self.paths[i])])[0]  # (3, H, W)


def embed_photos(
    embedder: Embedder,
    root: Path,
    photos: list[Photo],
    dims: int,
    batch_size: int = 32,
    progress: bool = True,
    cached: tuple[list[int], torch.Tensor] | None = None,
    workers: int = 0,
) -> np.ndarray:
    """Embed photos with the checkpoint's photo side; keep the top `dims` modes.

    `cached`: (positions, features (K, D)) from `cached_features`; those photos only go
    through the photo head. The others are decoded by `workers` DataLoader processes
    (0: this one) and go through backbone and head in batches of `batch_size`.
    Returns a C-contiguous float32 array (N, dims) in the order of `photos`.
    """
    if not 1 <= dims <= embedder.width:
        raise ValueError(f"dims={dims} is outside [1, width {embedder.width}]")
    positions, feats = cached or ([], None)
    out = np.empty((len(photos), dims), dtype=np.float32)
    for start in range(0, len(positions), 4096):
        rows = positions[start : start + 4096]
        emb = embedder.head(feats[start : start + 4096], "photo")  # (k, L)
        out[rows] = _checked(emb, len(rows), embedder.width)[:, :dims]
    done = set(positions)
    rest = [i for i in range(len(photos)) if i not in done]
    loader = DataLoader(PhotoFiles([root / photos[i].path for i in rest], embedder.transform()),
                        batch_size=batch_size, num_workers=workers if rest else 0)
    bar = tqdm(total=len(rest), desc="embedding photos", unit="img", disable=not progress)
    start = 0
    for batch in loader:  # (B, 3, H, W), in order
        rows = rest[start : start + len(batch)]
        out[rows] = _checked(embedder.encode(batch, "photo"), len(rows), embedder.width)[:, :dims]
        start += len(rows)
        bar.update(len(rows))
    bar.close()
    log.info("embedded %d photos from %s into %d dims: %d from cached backbone features, "
             "%d through the backbone", len(photos), root, dims, len(positions), len(rest))
    return out


def _checked(emb: torch.Tensor, n: int, L: int) -> np.ndarray:
    emb = np.asarray(emb.detach().cpu(), dtype=np.float32)
    if emb.shape != (n, L):
        raise ValueError(f"embedder returned shape {emb.shape}, expected {(n, L)}")
    return emb
