"""The two embedding heads f (sketch) and g (photo): backbone features (N, D) -> (N, modes).

Each head standardises its input with fixed statistics of the training features (stored
as buffers so a checkpoint carries them), applies an MLP with one hidden layer, and caps
the output norm at mu: the paper's regulariser ||f(x)||_2 <= mu that keeps the unbounded
LoRA objective's iterates bounded. While training, the standardised input may be multiplied
by a dropout mask that the training loop draws (``input_scale``; training.cdk.train draws
it for the whole global batch, so a run on W processes equals a run on one).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["Head", "MODALITIES", "RawProjection", "embedding", "fit_raw_projections",
           "retrieval_embedding"]

MODALITIES = ("sketch", "photo")


def retrieval_embedding(z: torch.Tensor, unit: bool) -> torch.Tensor:
    """What retrieval uses of head outputs z (N, modes): z itself, or with ``unit`` each row
    scaled to unit length (an all-zero row stays zero). Scaling a query changes no ranking;
    scaling the photos removes their lengths from the score, so over every coordinate it is
    a cosine, and a d-prefix score is that of the prefixes of unit vectors (the stored photos are
    not scaled again per d)."""
    if not unit:
        return z
    return z / z.norm(dim=1, keepdim=True).clamp_min(1e-12)


class Head(nn.Module):
    """(N, in_dim) features -> (N, modes) singular-function values with row norm <= mu."""

    def __init__(self, in_dim: int, hidden: int, modes: int, mu: float):
        super().__init__()
        for name, v in (("in_dim", in_dim), ("hidden", hidden), ("modes", modes)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if not mu > 0:
            raise ValueError(f"mu must be positive, got {mu!r}")
        self.in_dim, self.hidden, self.modes, self.mu = in_dim, hidden, modes, float(mu)
        self.register_buffer("feat_mean", torch.zeros(in_dim))
        self.register_buffer("feat_std", torch.ones(in_dim))
        self.mlp = nn.Sequential(nn.Linear(in_dim, hidden), nn.ReLU(), nn.Linear(hidden, modes))

    @torch.no_grad()
    def set_feature_stats(self, feats: torch.Tensor) -> None:
        """Standardise inputs with the mean/std of training features feats: (N, in_dim)."""
        self.feat_mean.copy_(feats.mean(0))
        self.feat_std.copy_(feats.std(0).clamp_min(1e-6))

    def arch(self) -> dict:
        return {"in_dim": self.in_dim, "hidden": self.hidden, "modes": self.modes, "mu": self.mu}

    @torch.no_grad()
    def permute_modes(self, perm: torch.Tensor) -> None:
        """Output coordinate l becomes the former coordinate perm[l] (the output layer's
        rows are permuted; the norm cap is invariant to the order)."""
        perm = torch.as_tensor(perm, dtype=torch.long)
        if sorted(perm.tolist()) != list(range(self.modes)):
            raise ValueError(f"perm must be a permutation of 0..{self.modes - 1}")
        out = self.mlp[-1]
        out.weight.copy_(out.weight[perm.to(out.weight.device)])
        out.bias.copy_(out.bias[perm.to(out.bias.device)])

    def forward(self, x: torch.Tensor, input_scale: torch.Tensor | None = None) -> torch.Tensor:
        """input_scale: (N, in_dim) factors applied to the standardised input (a dropout
        mask divided by the keep probability), or None (every embedding)."""
        x = (x - self.feat_mean) / self.feat_std  # (N, in_dim)
        if input_scale is not None:
            x = x * input_scale
        z = self.mlp(x)  # (N, modes)
        # Radial cap: rescale rows whose norm exceeds mu onto the sphere of radius mu.
        norm = z.norm(dim=1, keepdim=True).clamp_min(1e-12)
        return z * torch.clamp(self.mu / norm, max=1.0)


class RawProjection(nn.Module):
    """(N, D) backbone features -> (N, p): the features centred by their modality's training
    mean, projected on p principal axes shared by both modalities (``axes``: (D, p), each
    column possibly scaled, see fit_raw_projections), scaled to length sqrt(weight).
    Appended to the unit-length learned embedding, it adds weight x the cosine of the
    projected features to the score (``--raw-dims``, ``--raw-weight``, ``--raw-whiten``)."""

    def __init__(self, mean: torch.Tensor, axes: torch.Tensor, weight: float):
        super().__init__()
        if mean.ndim != 1 or axes.ndim != 2 or axes.shape[0] != mean.shape[0]:
            raise ValueError(f"mean (D,) and axes (D, p) do not fit: {tuple(mean.shape)}, "
                             f"{tuple(axes.shape)}")
        if not weight > 0:
            raise ValueError(f"weight must be positive, got {weight!r}")
        self.register_buffer("mean", mean.float().clone())
        self.register_buffer("axes", axes.float().clone())
        self.weight = float(weight)

    @property
    def dims(self) -> int:
        return self.axes.shape[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = (x - self.mean) @ self.axes  # (N, p)
        return retrieval_embedding(z, True) * self.weight**0.5


def fit_raw_projections(sketch_feats: torch.Tensor, photo_feats: torch.Tensor, dims: int,
                        weight: float, whiten: float = 0.0) -> dict[str, RawProjection]:
    """One RawProjection per modality from training features (N_s, D) and (N_p, D): each
    modality centred by its own mean (the modalities' offset is removed), and the top
    ``dims`` principal axes of the centred rows of both together (eigenvectors of their
    second-moment matrix, in float64, by decreasing eigenvalue). ``whiten`` p in [0, 1]:
    each coordinate divided by its standard deviation over those rows to the power p (0:
    plain projection; 1: full PCA whitening; between: shrunk whitening, which lifts the
    weaker axes without letting the noisiest ones dominate the cosine)."""
    D = sketch_feats.shape[1]
    if photo_feats.shape[1] != D:
        raise ValueError(f"sketch and photo features differ in width: {D}, "
                         f"{photo_feats.shape[1]}")
    if not 1 <= dims <= D:
        raise ValueError(f"raw_dims must be in [1, {D}] (the backbone's feature width), "
                         f"got {dims}")
    if not 0.0 <= whiten <= 1.0:
        raise ValueError(f"raw_whiten must be in [0, 1], got {whiten!r}")
    means = {"sketch": sketch_feats.double().mean(0), "photo": photo_feats.double().mean(0)}
    second = torch.zeros(D, D, dtype=torch.float64)
    for x, m in ((sketch_feats, means["sketch"]), (photo_feats, means["photo"])):
        for i in range(0, len(x), 8192):
            c = x[i : i + 8192].double() - m
            second += c.T @ c
    second /= len(sketch_feats) + len(photo_feats)
    try:
        vals, vecs = torch.linalg.eigh(second)  # ascending
        axes, vals = vecs[:, -dims:].flip(1), vals[-dims:].flip(0)  # the largest first
    except torch.linalg.LinAlgError:
        # LAPACK's eigh can fail to converge on a matrix of low rank (fewer rows than D,
        # many equal zero eigenvalues); the SVD of a symmetric PSD matrix gives the same
        # axes, largest first.
        vecs, vals, _ = torch.linalg.svd(second)
        axes, vals = vecs[:, :dims], vals[:dims]
    if whiten:
        # variances floored relative to the largest: an axis of (near) zero variance keeps
        # (near) zero coordinates instead of amplified rounding noise
        var = vals.clamp_min(float(vals[0]) * 1e-6).clamp_min(1e-30)
        axes = axes / var ** (whiten / 2)
    return {m: RawProjection(means[m], axes, weight) for m in MODALITIES}


def embedding(z: torch.Tensor, features: torch.Tensor, unit: bool,
              raw: RawProjection | None) -> torch.Tensor:
    """The embedding retrieval scores, from a head's outputs z (N, modes) on backbone
    features (N, D): ``retrieval_embedding`` of z, then ``raw``'s coordinates of the
    features when given: (N, modes + raw.dims). The Embedder, the exported encoder and
    training's evaluation all embed through this."""
    z = retrieval_embedding(z, unit)
    return z if raw is None else torch.cat([z, raw(features)], dim=1)
