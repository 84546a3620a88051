"""The photo/sketch embedder the index and the service load, seen through a Protocol.

The concrete class lives in `training.cdk.embedder`; everything here only relies on the
attributes and methods listed in `Embedder`, so tests can pass a small stand-in.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class Embedder(Protocol):
    """What a checkpoint gives us: sketch and photo sides mapping images to L numbers."""

    L: int
    backbone: str
    checkpoint_sha256: str
    config: dict

    def embed(self, images: list, modality: str, batch_size: int = 64) -> np.ndarray:
        """Images -> float32 array (N, L), coordinates ordered by singular value."""

    def preprocess(self, images: list, modality: str) -> Any:
        """Images -> tensor (N, 3, H, W)."""

    def backbone_features(self, batch: Any, modality: str) -> Any:
        """(N, 3, H, W) -> (N, D) backbone features."""

    def head(self, features: Any, modality: str) -> Any:
        """(N, D) -> (N, L) embeddings."""


def file_sha256(path: str | Path, chunk: int = 1 << 20) -> str:
    """Hex SHA-256 of a file's bytes (the identity of a checkpoint)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def load_embedder(checkpoint: str | Path, device: str | None = None) -> Embedder:
    """Load the embedder stored in a `training.cdk` checkpoint."""
    path = Path(checkpoint)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    try:
        from training.cdk.embedder import Embedder as CdkEmbedder
    except ImportError as err:  # the training package is part of this project
        raise RuntimeError(
            f"cannot load checkpoint {str(path)!r}: training.cdk.embedder is not importable ({err})"
        ) from err
    return CdkEmbedder.from_checkpoint(path, device=device)
