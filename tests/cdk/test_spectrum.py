"""The CDK's Rayleigh quotients (training.loss.cdk_singular_values with the sampler's joint
moment) against the kernel written out as a matrix and its SVD."""

import numpy as np
import pytest
import torch

from tests.cdk.reference import cdk_matrix, rayleigh_quotients
from training.cdk.data import PairSampler
from training.loss import cdk_singular_values, singular_values

# 4 classes, 3 photos each and 2 sketches per photo: the sampler's marginals are uniform
SKETCH_LABELS = np.repeat(np.arange(4), 6)
PHOTO_LABELS = np.repeat(np.arange(4), 3)


def _sigma(f, g, sampler, **kw):
    return cdk_singular_values(f, g, sampler.joint_moment(f, g, **kw))


def test_rayleigh_quotients_match_the_kernel_matrix():
    gen = torch.Generator().manual_seed(0)
    f = torch.randn(len(SKETCH_LABELS), 5, generator=gen, dtype=torch.float64)
    g = torch.randn(len(PHOTO_LABELS), 5, generator=gen, dtype=torch.float64)
    sampler = PairSampler(SKETCH_LABELS, PHOTO_LABELS)
    K = cdk_matrix(SKETCH_LABELS, PHOTO_LABELS)
    torch.testing.assert_close(_sigma(f, g, sampler), rayleigh_quotients(f, g, K))


def test_exact_pairs_give_the_svd_and_errors_enter_to_second_order():
    S, P = len(SKETCH_LABELS), len(PHOTO_LABELS)
    K = cdk_matrix(SKETCH_LABELS, PHOTO_LABELS)
    U, s, Vh = torch.linalg.svd(K / (S * P) ** 0.5)  # the operator in orthonormal coordinates
    L = 3  # the CDK of 4 classes has rank 3
    f = (s[:L].sqrt() * U[:, :L]) * S**0.5
    g = (s[:L].sqrt() * Vh[:L].T) * P**0.5
    sampler = PairSampler(SKETCH_LABELS, PHOTO_LABELS)
    torch.testing.assert_close(_sigma(f, g, sampler), s[:L])
    torch.testing.assert_close(singular_values(f, g), s[:L])
    gen = torch.Generator().manual_seed(1)
    df = torch.randn(f.shape, generator=gen, dtype=f.dtype)
    dg = torch.randn(g.shape, generator=gen, dtype=g.dtype)
    err = {}
    for eps in (1e-2, 1e-3):
        fe, ge = f + eps * df, g + eps * dg
        err[eps] = ((_sigma(fe, ge, sampler) - s[:L]).abs().max(),
                    (singular_values(fe, ge) - s[:L]).abs().max())
    # ten times less perturbation: ~100x less error for the quotients, ~10x for the norms
    assert err[1e-2][0] / err[1e-3][0] > 50
    assert err[1e-2][1] / err[1e-3][1] < 20
    assert err[1e-3][0] < err[1e-3][1] / 10


def test_joint_moment_on_subsets_and_instance_pairs():
    gen = torch.Generator().manual_seed(2)
    f = torch.randn(len(SKETCH_LABELS), 3, generator=gen, dtype=torch.float64)
    g = torch.randn(len(PHOTO_LABELS), 3, generator=gen, dtype=torch.float64)
    sampler = PairSampler(SKETCH_LABELS, PHOTO_LABELS)
    s_idx, p_idx = torch.tensor([0, 5, 7, 20, 13]), torch.tensor([1, 2, 4, 11])  # no class-2 photo
    want = []
    for i in s_idx.tolist():
        mates = [j for j in p_idx.tolist() if PHOTO_LABELS[j] == SKETCH_LABELS[i]]
        if mates:
            want.append(f[i] * torch.stack([g[j] for j in mates]).mean(0))
    got = sampler.joint_moment(f[s_idx], g[p_idx], s_idx, p_idx)
    torch.testing.assert_close(got, torch.stack(want).mean(0))

    photo_of = np.repeat(np.arange(len(PHOTO_LABELS)), 2)
    inst = PairSampler(SKETCH_LABELS, PHOTO_LABELS, "instance", photo_of)
    torch.testing.assert_close(inst.joint_moment(f, g),
                               torch.stack([f[i] * g[photo_of[i]] for i in range(len(f))]).mean(0))
    p_sub = torch.tensor([3, 0])
    got = inst.joint_moment(f, g[p_sub], None, p_sub)
    want = torch.stack([f[i] * g[photo_of[i]] for i in range(len(f)) if photo_of[i] in (0, 3)])
    torch.testing.assert_close(got, want.mean(0))
    with pytest.raises(ValueError, match="no sketch"):
        inst.joint_moment(f[:2], g[[5]], torch.tensor([0, 1]), torch.tensor([5]))
    with pytest.raises(ValueError, match="disagree on L"):
        cdk_singular_values(f, g[:, :2], torch.zeros(3))
