"""The hubness correction of the stored photos (training.cdk.model.hubness): each photo's
penalty, computed once at build time against the model bundle's sample of training
sketches, stored as one more coordinate of its vector (minus the penalty), so a full-width
query with a 1 appended ranks by score - penalty in any index kind, and query expansion and
re-scoring carry the coordinate along. A d-prefix query (dims < the stored dims) does not
read it.

The correction applies to an index that stores the embeddings' whole width (the default);
an index of a shorter prefix stores none (the penalty is measured on the whole width).
"""

from __future__ import annotations

import hashlib
import logging
from functools import partial

import numpy as np
import torch

from index.blocks import Block
from index.neighbours import Store
from training.cdk.model.hubness import Hubness, photo_penalty

__all__ = ["correction_of", "corrected_blocks", "corrected"]

log = logging.getLogger(__name__)


def correction_of(model, dims: int) -> Hubness | None:
    """The correction an index of `model`'s first `dims` coordinates stores, or None: the
    model has none, or the index stores a shorter prefix than the whole width."""
    hub = model.inference.hubness_correction()
    if not hub.active:
        return None
    if dims != model.width:
        log.info("no hubness correction: the index stores %d of %d coordinates", dims,
                 model.width)
        return None
    return hub


def corrected(vectors: np.ndarray, sample: torch.Tensor, hub: Hubness) -> np.ndarray:
    """(n, w) stored vectors -> (n, w + 1): minus each one's penalty appended."""
    penalty = photo_penalty(torch.from_numpy(np.asarray(vectors, np.float32)), sample, hub)
    return np.hstack([np.asarray(vectors, np.float32), -penalty.numpy()[:, None]])


def _corrected_block(block: Block, sample: torch.Tensor, hub: Hubness) -> np.ndarray:
    return corrected(np.asarray(block.load(), np.float32), sample, hub)


def corrected_blocks(blocks: list[Block], sample: torch.Tensor, hub: Hubness, store: Store,
                     tag: str) -> list[Block]:
    """The blocks with their penalty column, kept by `store` (in memory, or files beside a
    sharded build's shards, named by `tag`, the blocks and the correction)."""
    digest = hashlib.sha256(f"{tag}|{hub.as_dict()}|{len(sample)}".encode())
    for b in blocks:
        digest.update(f"|{b.name}|{b.start}|{b.count}".encode())
    sig = digest.hexdigest()[:16]
    return [store(f"hubness-{sig}-{b.name}", b.start, partial(_corrected_block, b, sample, hub))
            for b in blocks]
