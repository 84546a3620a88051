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
