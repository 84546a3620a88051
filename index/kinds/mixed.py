"""ivfsq48: cells on the leading coordinates, 8 bits for the leading `lead` coordinates of
each photo and 4 bits for the others, for wide galleries under a memory budget.

The embeddings' variance falls along the spectrum and the raw coordinates after the modes
add a second block (training.cdk.model.heads.RawProjection), so equal bits for every
coordinate (ivfsq8: dims bytes a photo) spend as much on the tail as on the leading modes.
FAISS's scalar quantizer has one bit width, so the 8-bit coordinates are stored as two
4-bit components: the coordinate rounded to the 4-bit grid (c) and what that rounding left
(r = x - c, coded on a grid 16 times finer). A photo x (dims) is stored as

    y = [c(x_1..x_lead), x_lead+1..x_dims, r(x_1..x_lead)]     (dims + lead) x 4 bits

and a query q is mapped to q' = [q, q_1..q_lead] (an `IndexPreTransform`), so
<q', y> = <q, x> up to the codes' rounding: a zero-padded d-prefix query still scores
exactly its d-prefix of the decoded vector. c is on the quantizer's own grid (the same
ranges are set for both: re-encoding a grid point gives it back), so it costs no error.

The cells are k-means clusters (Euclidean) of the first `coarse` coordinates, and a photo
goes to its nearest centre; a query picks its cells by the inner product of its leading
coordinates with the centres (the coarse quantizer reads only those): a query's cells are
then chosen by the leading modes that every d-prefix query shares, where cells of whole
vectors spread the top results of small-d queries over many cells. (Clustering and
assigning by inner product instead sends most photos to the few centres of largest norm,
and queries scan those crowded cells: docs/scale.md.)
The codes are absolute (not residuals from the cell centre).
"""

from __future__ import annotations

from dataclasses import dataclass

import faiss
import numpy as np

from index.kinds.base import DoesNotFit, register, row_map
from index.kinds.codes import IvfCodes
from index.kinds.floats import ID_BYTES

__all__ = ["MIXED", "MixedCodes"]

DEFAULT_LEAD = 64  # 8-bit coordinates when no budget sets them
COARSE_DIMS = 32  # coordinates the cells are clustered on
KMEANS_ITER = 20
QT4 = faiss.ScalarQuantizer.QT_4bit


def _code_bytes(dims: int, lead: int) -> int:
    return ((dims + lead) * 4 + 7) // 8


@dataclass(frozen=True)
class MixedCodes(IvfCodes):
    def params(self, count: int, dims: int, nprobe: int = 0) -> dict:
        return {**super().params(count, dims, nprobe), "lead": min(dims, DEFAULT_LEAD),
                "coarse": min(dims, COARSE_DIMS)}

    def plan(self, count: int, dims: int, budget: int | None = None, nprobe: int = 0) -> dict:
        """With a budget: as many 8-bit leading coordinates (up to all) as fit."""
        params = self.params(count, dims, nprobe)
        if budget is None:
            return params
        for lead in range(dims, -1, -1):
            if self.memory(count, dims, {**params, "lead": lead}) <= budget:
                return {**params, "lead": lead}
        least = self.memory(count, dims, {**params, "lead": 0})
        raise DoesNotFit(f"{self.name} over {count} vectors of {dims} dims needs at least "
                         f"{least} bytes ({least / 2**30:.2f} G), more than {budget}", least)

    def memory(self, count: int, dims: int, params: dict) -> int:
        width = dims + params["lead"]
        fixed = params["nlist"] * params["coarse"] * 4 + 2 * width * 4 + width * dims * 4
        return count * (_code_bytes(dims, params["lead"]) + ID_BYTES) + fixed

    def train(self, sample: np.ndarray, params: dict) -> faiss.Index:
        n, dims = sample.shape
        lead, coarse, nlist = params["lead"], params["coarse"], params["nlist"]
        clustering = faiss.Clustering(coarse, nlist)
        clustering.niter, clustering.seed = KMEANS_ITER, 1234
        clustering.train(np.ascontiguousarray(sample[:, :coarse]), faiss.IndexFlatL2(coarse))
        cells = faiss.IndexFlatIP(coarse)  # queries pick cells by inner product
        cells.add(faiss.vector_to_array(clustering.centroids).reshape(nlist, coarse))
        quantizer = faiss.IndexPreTransform(faiss.RemapDimensionsTransform(dims + lead, coarse,
                                                                           False), cells)
        ivf = faiss.IndexIVFScalarQuantizer(quantizer, dims + lead, nlist, QT4,
                                            faiss.METRIC_INNER_PRODUCT, False)
        whole = faiss.ScalarQuantizer(dims, QT4)  # the grid of the x components
        whole.train(sample)
        grid = faiss.vector_to_array(whole.trained)  # vmin (dims), vdiff (dims)
        rounded = whole.decode(whole.compute_codes(sample))[:, :lead]
        fine = faiss.ScalarQuantizer(lead, QT4)
        if lead:
            fine.train(np.ascontiguousarray(sample[:, :lead] - rounded))
        fine_grid = faiss.vector_to_array(fine.trained) if lead else np.zeros(0, np.float32)
        trained = np.concatenate([grid[:dims], fine_grid[:lead], grid[dims:], fine_grid[lead:]])
        faiss.copy_array_to_vector(trained.astype(np.float32), ivf.sq.trained)
        ivf.is_trained = True
        ivf.nprobe = params["nprobe"]
        spread = np.zeros((dims + lead, dims), dtype=np.float32)  # q -> [q, q_1..q_lead]
        spread[np.arange(dims), np.arange(dims)] = 1
        spread[dims + np.arange(lead), np.arange(lead)] = 1
        transform = faiss.LinearTransform(dims, dims + lead, False)
        faiss.copy_array_to_vector(spread.ravel(), transform.A)
        transform.is_trained = True
        index = faiss.IndexPreTransform(transform, ivf)
        return index

    def encode(self, index: faiss.Index, vectors: np.ndarray) -> np.ndarray:
        ivf = faiss.downcast_index(faiss.extract_index_ivf(index))
        x = np.ascontiguousarray(vectors, dtype=np.float32)
        n, dims = x.shape
        lead = ivf.d - dims
        y = np.concatenate([x, np.zeros((n, lead), np.float32)], axis=1)  # (n, dims + lead)
        centres = faiss.downcast_index(faiss.downcast_index(ivf.quantizer).index)
        nearest = faiss.IndexFlatL2(centres.d)  # a photo goes to its nearest centre
        nearest.add(centres.reconstruct_n(0, centres.ntotal))
        cells = nearest.assign(np.ascontiguousarray(x[:, : centres.d]), 1).ravel()
        rounded = ivf.sq.decode(ivf.sq.compute_codes(y))[:, :lead]
        y[:, dims:] = x[:, :lead] - rounded
        y[:, :lead] = rounded
        codes = np.empty((n, ivf.sa_code_size()), dtype=np.uint8)
        ivf.encode_vectors(n, faiss.swig_ptr(y), faiss.swig_ptr(cells), faiss.swig_ptr(codes),
                           True)
        return codes

    def reconstruct(self, index: faiss.Index, start: int, count: int) -> np.ndarray:
        row_map(index)
        ivf = faiss.downcast_index(faiss.extract_index_ivf(index))
        return _fold(index, ivf, ivf.reconstruct_n(start, count))

    def vectors(self, index: faiss.Index, rows: np.ndarray, dims: int | None = None
                ) -> np.ndarray:
        row_map(index)
        ivf = faiss.downcast_index(faiss.extract_index_ivf(index))
        return _fold(index, ivf, ivf.reconstruct_batch(np.asarray(rows, dtype=np.int64)))


def _fold(index: faiss.Index, ivf: faiss.IndexIVF, y: np.ndarray) -> np.ndarray:
    """Decoded rows (count, dims + lead) -> vectors (count, dims): the lead's remainders
    added back to its rounded coordinates."""
    dims = index.d
    x = y[:, :dims].copy()
    x[:, : ivf.d - dims] += y[:, dims:]
    return x


MIXED = register(MixedCodes(
    "ivfsq48", "cells on the leading coordinates + 8-bit codes for the first `lead` "
    "coordinates, 4-bit for the rest", rank=3))
