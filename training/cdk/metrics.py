"""Retrieval metrics: P@K and mAP@all (paper appendix definitions), the structure curves
(d most / least significant modes), the raw-feature baselines (cosine, PCA) and the
orthogonality of the learned functions.

Scores follow the Embedder convention: score(x, y; d) = <f_{1:d}(x), g_{1:d}(y)>.
"""

from __future__ import annotations

import numpy as np
import torch

from .model.hubness import Hubness, photo_penalty, with_penalty
from .model.smoothing import Expansion, Smoothing, expand_exact, smooth

__all__ = ["spectrum_order", "heldout_order", "retrieval_metrics", "structure_curves",
           "orthogonality_stats", "power_of_two_dims", "cosine_scores_metrics", "pca_curves",
           "service_metrics", "smoothed_metrics", "stored_gallery", "generalized_metrics",
           "corrected_metrics"]


def spectrum_order(sv, top: int = 32) -> dict:
    """How far the leading ``top`` singular values (L,) are from non-increasing order:
    max_swap = max_i (sv[i+1] - sv[i]) over adjacent pairs (0 when sorted), and how many
    adjacent pairs rise at all."""
    s = torch.as_tensor(sv, dtype=torch.float64)[:top]
    rise = (s[1:] - s[:-1]).clamp_min(0)
    return {"top": len(s), "max_swap": float(rise.max()) if len(rise) else 0.0,
            "rising_pairs": int((rise > 0).sum())}


def heldout_order(sv_a, sv_b, top: int = 32) -> dict:
    """Whether an order of the modes holds beyond the sample it was read from: the modes
    sorted by one half's estimates sv_a (L,), the other half's sv_b taken in that order
    (spectrum_order), and the same the other way round; the worse of the two. Halves that
    agree on the order give 0 however their values differ, so a small value says the order
    is the functions' own; where estimation noise decides it, the halves disagree."""
    a, b = (torch.as_tensor(v, dtype=torch.float64) for v in (sv_a, sv_b))
    one = spectrum_order(b[torch.argsort(a, descending=True, stable=True)], top)
    other = spectrum_order(a[torch.argsort(b, descending=True, stable=True)], top)
    return max(one, other, key=lambda o: o["max_swap"])


def _ap_and_pk(scores: torch.Tensor, rel: torch.Tensor, k: int,
               seen: torch.Tensor | None = None):
    """scores, rel: (Q, N). AP = sum_n P(n) (R(n) - R(n-1)) = mean of P(n) at the ranks n of
    the relevant items; ties broken by gallery index (stable sort). Returns (Q,), (Q,), and
    with ``seen`` (N,) bool the share of each query's top k that are seen photos (Q,), else
    None."""
    order = torch.sort(-scores, dim=1, stable=True).indices
    hits = torch.gather(rel, 1, order).double()  # (Q, N) relevance in ranked order
    cum = hits.cumsum(1)
    ranks = torch.arange(1, scores.shape[1] + 1, dtype=torch.float64)
    n_rel = hits.sum(1)
    ap = (hits * cum / ranks).sum(1) / n_rel.clamp_min(1)
    top = min(k, scores.shape[1])
    pk = cum[:, top - 1] / k
    share = None if seen is None else seen[order[:, :top]].double().mean(1)
    return ap, pk, share


def retrieval_metrics(f, g, q_labels, g_labels, k: int, chunk: int = 512, seen=None) -> dict:
    """mAP@all and P@k of queries f: (Q, d) against gallery g: (N, d) by inner product.
    A query with no relevant photo in the gallery is an error (its AP is undefined).
    ``seen``: (N,) bool, the photos of classes the model trained on; then "seen_at_k" is
    the mean share of a query's top k that are such photos."""
    f, g = torch.as_tensor(f).double(), torch.as_tensor(g).double()
    ql, gl = torch.as_tensor(np.asarray(q_labels)), torch.as_tensor(np.asarray(g_labels))
    missing = sorted(set(ql.tolist()) - set(gl.tolist()))
    if missing:
        raise ValueError(f"query labels {missing[:5]} have no photo in the gallery")
    if seen is not None:
        seen = torch.as_tensor(np.asarray(seen, dtype=bool))
        if seen.shape != (len(g),):
            raise ValueError(f"seen must be one bool per gallery photo ({len(g)}), got shape "
                             f"{tuple(seen.shape)}")
    aps, pks, shares = [], [], []
    for i in range(0, len(f), chunk):
        ap, pk, share = _ap_and_pk(f[i : i + chunk] @ g.T, ql[i : i + chunk, None] == gl[None],
                                   k, seen)
        aps.append(ap)
        pks.append(pk)
        shares.append(share)
    out = {"map_all": float(torch.cat(aps).mean()),
           "precision_at_k": float(torch.cat(pks).mean()), "k": int(k)}
    if seen is not None:
        out["seen_at_k"] = float(torch.cat(shares).mean())
    return out


def cosine_scores_metrics(x, y, q_labels, g_labels, k: int) -> dict:
    """Baseline on raw features: cosine similarity (rows L2-normalised, then inner product)."""
    x = torch.nn.functional.normalize(torch.as_tensor(x).double(), dim=1)
    y = torch.nn.functional.normalize(torch.as_tensor(y).double(), dim=1)
    return retrieval_metrics(x, y, q_labels, g_labels, k)


def pca_curves(train_x, train_y, x, y, q_labels, g_labels, k: int, dims) -> dict:
    """Raw-feature baseline at d dimensions: {"cosine": {d: metrics}, "inner": {d: metrics}}
    of retrieval after projecting the centred features onto the top-d principal axes of the
    pooled training features (train_x: (Ns, D) sketches, train_y: (Np, D) photos; x, y: test
    features), scored by cosine and by inner product (like the learned embeddings).
    The best d-dim linear summary of the raw features that needs no labels."""
    pool = torch.cat([torch.as_tensor(train_x), torch.as_tensor(train_y)]).double()
    mean = pool.mean(0)
    axes = torch.linalg.svd(pool - mean, full_matrices=False).Vh  # (min(N, D), D)
    zx = (torch.as_tensor(x).double() - mean) @ axes.T
    zy = (torch.as_tensor(y).double() - mean) @ axes.T
    return {name: {d: score(zx[:, :d], zy[:, :d], q_labels, g_labels, k)
                   for d in dims if d <= axes.shape[0]}
            for name, score in (("cosine", cosine_scores_metrics),
                                ("inner", retrieval_metrics))}


def power_of_two_dims(L: int) -> list[int]:
    """1, 2, 4, ..., up to L, and L itself."""
    dims = [1 << i for i in range(L.bit_length()) if (1 << i) <= L]
    return dims if dims[-1] == L else dims + [L]


def structure_curves(f, g, q_labels, g_labels, k: int) -> dict:
    """{"most": {d: metrics}, "least": {d: metrics}} with the d most significant modes
    (first d coordinates) and the d least significant ones (last d coordinates)."""
    L = f.shape[1]
    most, least = {}, {}
    for d in power_of_two_dims(L):
        most[d] = retrieval_metrics(f[:, :d], g[:, :d], q_labels, g_labels, k)
        least[d] = retrieval_metrics(f[:, L - d :], g[:, L - d :], q_labels, g_labels, k)
    return {"most": most, "least": least}


def smoothed_metrics(f, g, q_labels, g_labels, k: int, smoothing: Smoothing,
                     gallery: torch.Tensor | None = None) -> dict | None:
    """Retrieval against the smoothed gallery (training.cdk.model.smoothing), as index.build
    stores it: {"config", "map_all", "precision_at_k", "k", "map_by_dims",
    "precision_by_dims"}. The gallery is smoothed once with all L modes (neighbours found
    in the full embedding) and the d-mode numbers score its d-dim prefixes: what a
    ``dims=d`` query of a full index sees, and what an index built with ``--dims d``
    stores. None when ``smoothing`` is off. ``gallery``: g already smoothed by
    ``smoothing`` (``stored_gallery``), when the caller has it."""
    if not smoothing.active:
        return None
    gallery = stored_gallery(g, smoothing) if gallery is None else gallery
    return {"config": smoothing.as_dict(),
            **_by_prefix(f, gallery, q_labels, g_labels, k, Expansion(n=0))}


def service_metrics(f, g, q_labels, g_labels, k: int, smoothing: Smoothing,
                    expansion: Expansion, gallery: torch.Tensor | None = None) -> dict:
    """What the service returns: queries f, expanded by ``expansion`` on each d-prefix
    (training.cdk.model.smoothing.expand_exact), against the gallery g as index.build stores
    it (smoothed by ``smoothing``; ``gallery``: that, when the caller has it): {"smoothing",
    "expansion" (their configs, {} when off), "map_all", "precision_at_k", "k",
    "map_by_dims", "precision_by_dims"}."""
    gallery = stored_gallery(g, smoothing) if gallery is None else gallery
    return {"smoothing": smoothing.as_dict() if smoothing.active else {},
            "expansion": expansion.as_dict() if expansion.active else {},
            **_by_prefix(f, gallery, q_labels, g_labels, k, expansion)}


def corrected_metrics(f, g, q_labels, g_labels, k: int, smoothing: Smoothing,
                      expansion: Expansion, hubness: Hubness, sample: torch.Tensor,
                      gallery: torch.Tensor | None = None, seen=None) -> dict:
    """As service_metrics' full-width numbers, with the hubness correction
    (model.hubness): each stored photo (g smoothed, or ``gallery``) penalised by its
    scores against the sketches of ``sample`` (S, width), the penalty one more coordinate
    the queries (expanded as the service expands them) read. {"hubness", "map_all",
    "precision_at_k", "k"} (and "seen_at_k" with ``seen``)."""
    gallery = stored_gallery(g, smoothing) if gallery is None else gallery
    fq, gq = with_penalty(f, gallery, photo_penalty(gallery, sample, hubness))
    return {"hubness": hubness.as_dict(),
            **retrieval_metrics(expand_exact(fq, gq, expansion), gq, q_labels, g_labels, k,
                                seen=seen)}


def stored_gallery(g, smoothing: Smoothing) -> torch.Tensor:
    """The photo embeddings g (N, width) as index.build stores them: float32, smoothed by
    ``smoothing`` (unchanged when it is off)."""
    return smooth(torch.as_tensor(g).float(), smoothing)


def _by_prefix(f, g, q_labels, g_labels, k: int, expansion: Expansion, seen=None) -> dict:
    """Metrics of the whole embedding and of each power-of-two d-prefix, the queries
    expanded on that prefix (with ``seen``, the share of seen photos in the top k too)."""
    f, g = torch.as_tensor(f).float(), torch.as_tensor(g).float()
    by = {d: retrieval_metrics(expand_exact(f[:, :d], g[:, :d], expansion), g[:, :d],
                               q_labels, g_labels, k, seen=seen)
          for d in power_of_two_dims(f.shape[1])}
    out = {**by[f.shape[1]], "map_by_dims": {str(d): m["map_all"] for d, m in by.items()},
           "precision_by_dims": {str(d): m["precision_at_k"] for d, m in by.items()}}
    if seen is not None:
        out["seen_at_k_by_dims"] = {str(d): m["seen_at_k"] for d, m in by.items()}
    return out


def generalized_metrics(f, g, q_labels, g_labels, seen, k: int, smoothing: Smoothing,
                        expansion: Expansion, learned: int | None = None,
                        gallery: torch.Tensor | None = None, hubness: Hubness | None = None,
                        sample: torch.Tensor | None = None) -> dict:
    """Generalized retrieval (generalized zero-shot SBIR): queries f (Q, width) of classes
    held out of training ranked against the whole gallery g (N, width), the photos of the
    classes the model trained on (``seen`` (N,) bool) included, as a served index holds
    them. {"map_all", "precision_at_k", "k", "seen_at_k" (the mean share of a query's top k
    taken by seen photos): the plain gallery; "service": the same as the service answers
    (the whole gallery smoothed by ``smoothing``, the queries expanded by ``expansion`` on
    each d-prefix against it), with "map_by_dims", "precision_by_dims",
    "seen_at_k_by_dims"; "learned": the first ``learned`` coordinates (the learned modes)
    against the plain gallery, when given; "gallery", "seen_photos": the counts}.
    ``gallery``: g as the index stores it, when the caller has it (else g smoothed here);
    with an active ``hubness`` and its ``sample`` of sketches, "corrected": the service's
    numbers with the hubness correction (corrected_metrics), else null."""
    seen = np.asarray(seen, dtype=bool)
    gallery = stored_gallery(g, smoothing) if gallery is None else gallery
    out = {**retrieval_metrics(f, g, q_labels, g_labels, k, seen=seen),
           "service": {"smoothing": smoothing.as_dict() if smoothing.active else {},
                       "expansion": expansion.as_dict() if expansion.active else {},
                       **_by_prefix(f, gallery, q_labels, g_labels, k, expansion, seen)},
           "learned": None, "gallery": int(len(seen)), "seen_photos": int(seen.sum()),
           "corrected": None}
    if hubness is not None and hubness.active:
        out["corrected"] = corrected_metrics(f, g, q_labels, g_labels, k, smoothing,
                                             expansion, hubness, sample, gallery, seen)
    if learned is not None:
        f, g = torch.as_tensor(f), torch.as_tensor(g)
        out["learned"] = retrieval_metrics(f[:, :learned], g[:, :learned], q_labels,
                                           g_labels, k, seen=seen)
    return out


def orthogonality_stats(z: torch.Tensor) -> dict:
    """How orthogonal the learned functions are on samples z: (N, L): the normalised Gram
    C_ij = E[z_i z_j] / sqrt(E z_i^2 E z_j^2); reports max and RMS of |C_ij|, i != j, and
    the largest |E z_l| / sqrt(E z_l^2) (orthogonality to the constant mode)."""
    z = torch.as_tensor(z).double()
    gram = z.T @ z / len(z)
    d = gram.diag().clamp_min(1e-30).sqrt()
    c = gram / d[:, None] / d[None, :]
    off = c[~torch.eye(len(c), dtype=torch.bool)]
    mean_ratio = (z.mean(0).abs() / d).max()
    return {"max_abs_offdiag": float(off.abs().max()) if off.numel() else 0.0,
            "rms_offdiag": float(off.pow(2).mean().sqrt()) if off.numel() else 0.0,
            "max_abs_mean_ratio": float(mean_ratio)}
