"""The CDK's Rayleigh quotients (training.loss.cdk_singular_values with the sampler's joint
moment) against the kernel written out as a matrix and its SVD."""

import numpy as np
import pytest
import torch

from tests.cdk.reference import cdk_matrix, rayleigh_quotients
from training.cdk.data import PairSampler
from training.cdk.metrics import heldout_order, spectrum_order
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


def test_halves_alternate_within_classes_and_keep_pairs():
    sampler = PairSampler(SKETCH_LABELS, PHOTO_LABELS)
    (sa, pa), (sb, pb) = sampler.halves()
    for a, b, labels in ((sa, sb, SKETCH_LABELS), (pa, pb, PHOTO_LABELS)):
        assert sorted(torch.cat([a, b]).tolist()) == list(range(len(labels)))  # a partition
        for c in range(4):  # each class split evenly, alternating in file order
            rows = np.flatnonzero(labels == c)
            assert a.tolist() == sorted(a.tolist())
            assert set(rows[0::2]) <= set(a.tolist()) and set(rows[1::2]) <= set(b.tolist())
    # on a subset: alternation in the order given, positions index the given rows
    rows = torch.tensor([13, 2, 3, 0, 7])  # classes 2, 0, 0, 0, 1
    (sa, _), (sb, _) = sampler.halves(rows, None)
    assert rows[sa].tolist() == [13, 2, 0, 7] and rows[sb].tolist() == [3]
    # instance pairing: a sketch goes with its photo; one whose photo is absent goes nowhere
    photo_of = np.repeat(np.arange(12), 2)
    inst = PairSampler(SKETCH_LABELS, PHOTO_LABELS, "instance", photo_of)
    photos = torch.tensor([0, 1, 2, 4])
    (sa, pa), (sb, pb) = inst.halves(None, photos)
    assert photos[pa].tolist() == [0, 2, 4] and photos[pb].tolist() == [1]
    assert sa.tolist() == [0, 1, 4, 5, 8, 9] and sb.tolist() == [2, 3]


def test_heldout_order_flags_halves_that_disagree():
    agree = torch.tensor([1.0, 0.8, 0.9, 0.5])  # both halves see mode 3 above mode 2
    assert heldout_order(agree, agree + 0.01)["max_swap"] == 0.0
    b = torch.tensor([1.0, 0.9, 0.8, 0.5])  # the other half sees them the other way round
    out = heldout_order(agree, b)
    assert out["max_swap"] == pytest.approx(0.1) and out["rising_pairs"] == 1
    assert spectrum_order(agree)["max_swap"] == pytest.approx(0.1)  # as given: unsorted
