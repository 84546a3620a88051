"""scanprefix: every photo's leading coordinates scanned as 4-bit fast-scan codes, the best
`k_factor` x k re-scored from finer codes of the whole vector. For 10^7 photos of today's
width within a few GB.

The stored dims are a spectrum: the leading modes carry most of the variance, and every
d-prefix query shares them. A photo x (dims) is stored in four parts, each in row order (the
row is the id):

    scan   the first `scan` coordinates, one 4-bit k-means code each, packed for FAISS's
           fast-scan kernels (scan / 2 bytes)
    fine   the first `fine` coordinates in float16 (2 fine bytes)
    lead   coordinates fine..lead, 8-bit scalar codes (lead - fine bytes)
    tail   coordinates lead.., rotated (OPQ: a learned rotation that evens out the
           sub-vectors) and product-coded, two coordinates in 8 bits ((dims - lead) / 2
           bytes)

A query on d coordinates scans every photo's scan codes with its first min(d, scan)
coordinates (zero-padded), keeps the best k_factor x max(k, 10) rows, scores each on the
d-prefix of its decoded fine, lead and tail codes, and returns the top k: the scores are the
exact inner products with the decoded d-prefix, and which rows are scored is decided by the
leading coordinates. There are no cells, so no neighbour is missed for sitting in a cell
not probed, and a query costs one pass over N x scan / 2 bytes (160 MB at 10^7 photos):
latency grows with N. docs/scale.md measures why these parts: at 10^7 photos cells lose
small-d neighbours, 8-bit codes alone misrank the closest ones at d = 16, and 4-bit codes
of two coordinates each pick the rows to re-score too coarsely.

The parts are FAISS indexes nested in `IndexRefine` containers, innermost first (`parts`),
so that one file holds them and the service maps it as it maps the others; `search` below is
what queries them (FAISS's own `IndexRefine.search` would not score the prefix).
"""

from __future__ import annotations

from dataclasses import dataclass

import faiss
import numpy as np

from index.kinds.base import DoesNotFit, register
from index.kinds.codes import IvfCodes

__all__ = ["SCAN", "ScanPrefix", "parts"]

SCAN_DIMS = 32  # coordinates in the fast-scan codes, one 4-bit code each
FINE_DIMS = 16  # leading coordinates kept in float16
DEFAULT_LEAD = 128  # coordinates with 8 bits or more when no budget sets them
K_FACTOR = 300  # rows re-scored per query: K_FACTOR x max(k, 10)
LEAST_K = 10
OPQ_ITER, OPQ_PQ_ITER = 10, 4  # the tail rotation's training rounds (FAISS: 50, 4)
MIN_COUNT = 39 * 256  # FAISS's least training points for the tail's 256 centroids
STEP = 16  # lead is planned in steps of 16 where dims allow
SQ = faiss.ScalarQuantizer


def _code_bytes(dims: int, params: dict) -> int:
    scan, fine, lead = params["scan"], params["fine"], params["lead"]
    return (scan + 1) // 2 + 2 * fine + (lead - fine) + (dims - lead + 1) // 2


def _select(width: int, start: int, stop: int) -> faiss.RemapDimensionsTransform:
    """A transform keeping coordinates start..stop of a `width`-wide vector."""
    transform = faiss.RemapDimensionsTransform(width, stop - start, False)
    faiss.copy_array_to_vector(np.arange(start, stop, dtype=np.int32), transform.map)
    return transform


def parts(index: faiss.Index) -> list[faiss.Index]:
    """[scan, fine, lead, tail] FAISS indexes of a scanprefix index, unwrapped."""
    return [faiss.downcast_index(w.index) for w in _wrappers(index)]


def _wrappers(index: faiss.Index) -> list[faiss.IndexPreTransform]:
    found, node = [], faiss.downcast_index(index)
    while isinstance(node, faiss.IndexRefine):
        found.append(faiss.downcast_index(node.refine_index))
        node = faiss.downcast_index(node.base_index)
    found.append(node)
    return found[::-1]


def _rotation(index: faiss.Index) -> faiss.LinearTransform:
    """The tail's learned rotation (second in its wrapper's chain, after the selection)."""
    return faiss.downcast_VectorTransform(_wrappers(index)[-1].chain.at(1))


@dataclass(frozen=True)
class ScanPrefix(IvfCodes):
    """Built block by block as the IVF code kinds are (train on a sample, encode each block,
    add its codes), without their cells."""

    def params(self, count: int, dims: int, nprobe: int = 0) -> dict:
        if count < MIN_COUNT:
            raise ValueError(f"{self.name} trains 256 centroids per tail sub-vector and needs "
                             f"at least {MIN_COUNT} vectors, the gallery has {count}; use "
                             "ivfsq8 or flat")
        if dims < 4:
            raise ValueError(f"{self.name} needs dims >= 4, got {dims}")
        lead = min(dims - 2, DEFAULT_LEAD)
        return {**_shape(lead - (dims - lead) % 2), "k_factor": K_FACTOR}

    def plan(self, count: int, dims: int, budget: int | None = None, nprobe: int = 0) -> dict:
        """With a budget: the most coordinates with 8 bits or more that fit (a multiple of
        16, plus one for odd dims, where dims allow; the tail an even number of them)."""
        params = self.params(count, dims, nprobe)
        if budget is None:
            return params
        for lead in range(params["lead"], 1, -1):
            if (dims - lead) % 2 or ((lead - dims % 2) % STEP and lead >= STEP):
                continue
            fitted = {**params, **_shape(lead)}
            if self.memory(count, dims, fitted) <= budget:
                return fitted
        least = self.memory(count, dims, {**params, **_shape(2 + dims % 2)})
        raise DoesNotFit(f"{self.name} over {count} vectors of {dims} dims needs at least "
                         f"{least} bytes ({least / 2**30:.2f} G), more than {budget}", least)

    def memory(self, count: int, dims: int, params: dict) -> int:
        rows = -(-count // 32) * 32  # fast-scan codes are packed 32 rows a block
        tail = dims - params["lead"]
        fixed = 16 * params["scan"] * 4 + 2 * dims * 4 + 256 * tail * 4 + tail * tail * 4
        return count * _code_bytes(dims, params) + (rows - count) * params["scan"] // 2 + fixed

    def train(self, sample: np.ndarray, params: dict) -> faiss.Index:
        n, dims = sample.shape
        scan, fine, lead = params["scan"], params["fine"], params["lead"]
        if not (1 <= scan <= lead and 1 <= fine < lead < dims and (dims - lead) % 2 == 0):
            raise ValueError(f"{self.name} needs scan <= lead, fine < lead < dims and dims - "
                             f"lead even, got scan {scan}, fine {fine}, lead {lead}, dims {dims}")
        x = np.ascontiguousarray(sample, dtype=np.float32)
        made = [(faiss.IndexPQFastScan(scan, scan, 4, faiss.METRIC_INNER_PRODUCT), 0, scan),
                (faiss.IndexScalarQuantizer(fine, SQ.QT_fp16, faiss.METRIC_INNER_PRODUCT), 0,
                 fine),
                (faiss.IndexScalarQuantizer(lead - fine, SQ.QT_8bit,
                                            faiss.METRIC_INNER_PRODUCT), fine, lead),
                (faiss.IndexPQ(dims - lead, (dims - lead) // 2, 8, faiss.METRIC_INNER_PRODUCT),
                 lead, dims)]
        wrapped = []
        for part, start, stop in made[:3]:
            part.train(np.ascontiguousarray(x[:, start:stop]))
            wrapped.append(faiss.IndexPreTransform(_select(dims, start, stop), part))
        tail_pq, start, stop = made[3]
        rotation = faiss.OPQMatrix(stop - start, tail_pq.pq.M)
        rotation.niter, rotation.niter_pq = OPQ_ITER, OPQ_PQ_ITER
        rotation.train(np.ascontiguousarray(x[:, start:stop]))
        tail_pq.train(rotation.apply(np.ascontiguousarray(x[:, start:stop])))
        tail = faiss.IndexPreTransform(rotation, tail_pq)
        tail.prepend_transform(_select(dims, start, stop))
        wrapped.append(tail)
        index = wrapped[0]
        for part in wrapped[1:]:
            index = faiss.IndexRefine(index, part)
        index.k_factor = params["k_factor"]  # kept in the file (FAISS reads 1 to 1,000)
        return index

    def encode(self, index: faiss.Index, vectors: np.ndarray) -> np.ndarray:
        """(n, dims) -> the four parts' codes side by side, per row (each part's wrapper
        selects its coordinates, and turns the tail's, before encoding them)."""
        x = np.ascontiguousarray(vectors, dtype=np.float32)
        return np.concatenate([wrapper.sa_encode(x) for wrapper in _wrappers(index)], 1)

    def add_codes(self, index: faiss.Index, codes: np.ndarray, start: int) -> None:
        scanned, *rest = parts(index)
        if rest[0].ntotal != start:
            raise ValueError(f"{self.name} appends rows in order: the index has "
                             f"{rest[0].ntotal} rows, the codes start at row {start}")
        cut = np.cumsum([0] + [p.sa_code_size() for p in (scanned, *rest)])
        # FAISS packs fast-scan codes only from vectors: each row's decoded centroids,
        # which encode back to the same codes (checked)
        centroids = scanned.sa_decode(np.ascontiguousarray(codes[:, : cut[1]]))
        if not np.array_equal(scanned.sa_encode(centroids), codes[:, : cut[1]]):
            raise RuntimeError(f"{self.name}: fast-scan codes did not survive decoding")
        scanned.add(centroids)
        for i, part in enumerate(rest, 1):
            part.add_sa_codes(np.ascontiguousarray(codes[:, cut[i] : cut[i + 1]]))
        node = faiss.downcast_index(index)
        while True:  # the containers and wrappers count rows too
            node.ntotal = rest[0].ntotal
            if not isinstance(node, faiss.IndexRefine):
                break
            node.refine_index.ntotal = rest[0].ntotal
            node = faiss.downcast_index(node.base_index)

    def search(self, index: faiss.Index, queries: np.ndarray, k: int
               ) -> tuple[np.ndarray, np.ndarray]:
        q = np.ascontiguousarray(queries, dtype=np.float32)
        factor = faiss.downcast_index(index).k_factor
        rows = self._scan(index, q, max(k, int(factor * max(k, LEAST_K))))
        found = rows >= 0
        picked, owner = rows[found], np.nonzero(found)[0]
        turned = self._turned(index, q)[owner]
        scores = np.zeros(len(picked), dtype=np.float32)
        start = 0
        for part, width in self._widths(index, q.shape[1]):  # part by part: no copy of all
            scores += np.einsum("rd,rd->r", _decode_rows(part, picked)[:, :width],
                                turned[:, start : start + width])
            start += width
        full = np.full(rows.shape, -np.inf, dtype=np.float32)
        full[found] = scores
        top = np.argsort(-full, axis=1, kind="stable")[:, :k]
        best, rows = np.take_along_axis(full, top, 1), np.take_along_axis(rows, top, 1)
        rows[~np.isfinite(best)] = -1
        return best, rows

    def pool(self, index: faiss.Index, queries: np.ndarray, count: int
             ) -> tuple[np.ndarray, list[np.ndarray], np.ndarray]:
        """The rows a search for the top 10 decodes (k_factor x 10 by the scan codes; more
        when `count` is larger), decoded once in the scoring basis (the tail rotated, the
        queries turned instead of the rows): a search for `count` photos would decode
        k_factor x `count` rows, several searches' worth."""
        q = np.ascontiguousarray(queries, dtype=np.float32)
        factor = faiss.downcast_index(index).k_factor
        rows = self._scan(index, q, max(count, int(factor * LEAST_K)))
        return (rows, [self._coded(index, r[r >= 0], q.shape[1]) for r in rows],
                self._turned(index, q))

    @staticmethod
    def _scan(index: faiss.Index, q: np.ndarray, count: int) -> np.ndarray:
        """(N, count') rows whose scan codes score best against the queries' leading
        coordinates (zero-padded): the rows a search decodes and scores."""
        scanned, fine = parts(index)[:2]
        probe = np.zeros((len(q), scanned.d), dtype=np.float32)
        probe[:, : min(q.shape[1], scanned.d)] = q[:, : scanned.d]
        return scanned.search(probe, min(count, fine.ntotal))[1]

    @staticmethod
    def _turned(index: faiss.Index, q: np.ndarray) -> np.ndarray:
        """(N, d') d-prefix queries in the scoring basis: d' = d up to fine + lead; past
        that, their tail coordinates (zero-padded) rotated as the tail's codes are, all of
        them (<q, R^T y> = <R q, y>)."""
        fine, lead, tail = parts(index)[1:]
        n, d = q.shape
        start = fine.d + lead.d
        if d <= start:
            return q
        padded = np.zeros((n, tail.d), dtype=np.float32)
        padded[:, : d - start] = q[:, start:]
        turned = _rotation(index).apply(padded)
        return np.ascontiguousarray(np.concatenate([q[:, :start], turned], 1))

    @staticmethod
    def _widths(index: faiss.Index, d: int) -> list[tuple[faiss.Index, int]]:
        """(part, its columns) of the scoring basis of a d-prefix (_turned): the fine and
        lead coordinates up to d, and past them the whole rotated tail as stored."""
        fine, lead, tail = parts(index)[1:]
        widths = [(fine, min(d, fine.d)), (lead, min(d - fine.d, lead.d)), (tail, tail.d)]
        return [(part, w) for (part, w), start in zip(widths, (0, fine.d, fine.d + lead.d),
                                                      strict=True) if d > start]

    def _coded(self, index: faiss.Index, rows: np.ndarray, d: int) -> np.ndarray:
        """(M, d') decoded rows in the scoring basis of a d-prefix (_turned)."""
        return np.concatenate([_decode_rows(part, rows)[:, :w]
                               for part, w in self._widths(index, d)], 1)

    def reconstruct(self, index: faiss.Index, start: int, count: int) -> np.ndarray:
        return self.vectors(index, np.arange(start, start + count))

    def vectors(self, index: faiss.Index, rows: np.ndarray, dims: int | None = None
                ) -> np.ndarray:
        """Decoded part by part, the parts past the first `dims` coordinates left out."""
        fine, lead, tail = parts(index)[1:]
        rows = np.asarray(rows, dtype=np.int64)
        out = [_decode_rows(fine, rows)]
        if dims is None or dims > fine.d:
            out.append(_decode_rows(lead, rows))
        if dims is None or dims > fine.d + lead.d:
            rotated = np.ascontiguousarray(_decode_rows(tail, rows))
            out.append(_rotation(index).reverse_transform(rotated))
        return np.concatenate(out, 1)


def _decode_rows(part: faiss.IndexFlatCodes, rows: np.ndarray) -> np.ndarray:
    """The decoded vectors of `rows` of a flat code index: its codes (mapped from the file
    in a served index) gathered and decoded as one batch, 10-15 times faster here than
    FAISS's `reconstruct_batch`, which decodes row by row."""
    codes = faiss.rev_swig_ptr(part.codes.data(), part.ntotal * part.code_size)
    return part.sa_decode(codes.reshape(part.ntotal, part.code_size)[rows])


def _shape(lead: int) -> dict:
    """scan, fine and lead for `lead` coordinates with 8 bits or more."""
    return {"scan": min(SCAN_DIMS, lead), "fine": min(FINE_DIMS, lead - 1), "lead": lead}


SCAN = register(ScanPrefix(
    "scanprefix", "4-bit fast-scan codes of the leading coordinates scanned for every photo, "
    "the best k_factor x k re-scored from float16, 8-bit and rotated product codes of the "
    "whole vector",
    rank=2.5))
