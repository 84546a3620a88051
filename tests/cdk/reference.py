"""Brute-force references for the CDK spectrum: the kernel as an explicit matrix over every
(sketch, photo) pair of a labelled set, with uniform marginals over the images."""

from __future__ import annotations

import numpy as np
import torch


def cdk_matrix(sketch_labels, photo_labels) -> torch.Tensor:
    """K[i, j] = p(x_i, y_j) / (p(x_i) p(y_j)) - 1 for class pairing: p(x_i) = 1 / S,
    p(y_j) = 1 / P, p(x_i, y_j) = p(x_i) 1[c_i = c_j] / #photos of c_i."""
    sl, pl = np.asarray(sketch_labels), np.asarray(photo_labels)
    S, P = len(sl), len(pl)
    K = np.zeros((S, P))
    for i in range(S):
        n_c = (pl == sl[i]).sum()
        for j in range(P):
            joint = (1.0 / S) * (pl[j] == sl[i]) / n_c
            K[i, j] = joint / (1.0 / S * 1.0 / P) - 1.0
    return torch.as_tensor(K)


def rayleigh_quotients(f, g, K) -> torch.Tensor:
    """<f_l, K g_l> / (|f_l| |g_l|) with the inner products of the uniform marginals:
    <a, K b> = sum_ij a_i K_ij b_j / (S P), |a|^2 = sum_i a_i^2 / S."""
    f, g = torch.as_tensor(f).double(), torch.as_tensor(g).double()
    S, P = K.shape
    num = torch.einsum("il,ij,jl->l", f, K, g) / (S * P)
    return num / ((f**2).sum(0) / S * (g**2).sum(0) / P).sqrt()


def pair_matrix(sketch_labels, photo_labels, pairing: str = "class", photo_of=None,
                share: float = 0.0) -> torch.Tensor:
    """(S, P) p(x_i, y_j) as the pair sampler's definition states it: every sketch equally
    likely; class pairing: a photo of the sketch's class uniformly, or with probability
    ``share`` the photo it was drawn from; instance pairing: the photo it was drawn from."""
    sl, pl = np.asarray(sketch_labels), np.asarray(photo_labels)
    a = 1.0 if pairing == "instance" else share
    S, P = len(sl), len(pl)
    joint = np.zeros((S, P))
    for i in range(S):
        for j in range(P):
            own = float(photo_of[i] == j) if a > 0 else 0.0
            same = (pl[j] == sl[i]) / (pl == sl[i]).sum()
            joint[i, j] = (a * own + (1 - a) * same) / S
    return torch.as_tensor(joint)


def quotients_of_joint(f, g, joint) -> tuple[torch.Tensor, torch.Tensor]:
    """(Rayleigh quotients, sqrt(E f^2 E g^2)) of the CDK of the joint distribution ``joint``
    (S, P), every expectation a sum over all pairs: the marginals are joint's row and
    column sums."""
    f, g = torch.as_tensor(f).double(), torch.as_tensor(g).double()
    px, py = joint.sum(1), joint.sum(0)
    L = f.shape[1]
    cross, ff, gg = (torch.zeros(L, dtype=torch.float64) for _ in range(3))
    for i in range(len(px)):
        ff += px[i] * f[i] ** 2
        for j in range(len(py)):
            cross += joint[i, j] * f[i] * g[j]
    for j in range(len(py)):
        gg += py[j] * g[j] ** 2
    cross -= (px @ f) * (py @ g)
    return cross / (ff * gg).sqrt(), (ff * gg).sqrt()
