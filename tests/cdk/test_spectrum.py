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


# photos with 3, 1, 0, 2, 1 and 1 sketches (instance pairing), and classes whose ratios of
# sketches to photos differ (class pairing)
UNEVEN_PHOTO_LABELS = np.array([0, 0, 1, 1, 1, 1])
UNEVEN_PHOTO_OF = np.array([0, 0, 0, 1, 3, 3, 4, 5])  # photo 2 has no sketch
UNEVEN_SKETCH_LABELS = UNEVEN_PHOTO_LABELS[UNEVEN_PHOTO_OF]  # 4 of class 0 (2 photos), 4 of 1 (4)


def _uneven_model(L: int = 3):
    from training.cdk.inputs import FeatureInputs, PairModel
    from training.cdk.model.heads import Head

    gen = torch.Generator().manual_seed(3)
    feats = {"sketch": torch.randn(len(UNEVEN_SKETCH_LABELS), 5, generator=gen),
             "photo": torch.randn(len(UNEVEN_PHOTO_LABELS), 5, generator=gen)}
    torch.manual_seed(0)
    model = PairModel({m: Head(5, 8, L, 16.0) for m in ("sketch", "photo")}, None)
    return model, FeatureInputs(feats, model), feats


@pytest.mark.parametrize("pairing, share", [("instance", 0.0), ("class", 0.0),
                                            ("class", 0.5)])
def test_spectrum_pass_weighs_photos_by_the_kernels_photo_marginal(pairing, share):
    """The spectrum pass's quotients and norms equal the CDK's written out over every
    (sketch, photo) pair of the sampler's p(x, y), whose photo marginal is not uniform
    here: the photos' moments are weighted by how often the batches draw each photo
    (counted over many epochs), not averaged over the photos. The batches draw each
    (sketch, photo) pair as often as p(x, y) says, the mixture of class and instance
    pairs included."""
    from tests.cdk.reference import pair_matrix, quotients_of_joint
    from training.cdk.spectrum import spectrum

    sampler = PairSampler(UNEVEN_SKETCH_LABELS, UNEVEN_PHOTO_LABELS, pairing, UNEVEN_PHOTO_OF,
                          instance_share=share)
    joint = pair_matrix(UNEVEN_SKETCH_LABELS, UNEVEN_PHOTO_LABELS, pairing, UNEVEN_PHOTO_OF,
                        share)
    pairs = torch.zeros(joint.shape, dtype=torch.float64)
    for epoch in range(2000):
        for s, p in sampler.epoch(0, epoch, 4):
            pairs.index_put_((s, p), torch.ones(len(s), dtype=torch.float64), accumulate=True)
    torch.testing.assert_close(sampler.photo_marginal(), joint.sum(0))
    counts = pairs.sum(0)
    assert (counts / counts.sum() - joint.sum(0)).abs().max() < 0.01  # 16,000 draws
    assert (pairs / pairs.sum() - joint).abs().max() < 0.01
    assert (joint.sum(0) - 1 / len(counts)).abs().max() > 0.05  # not uniform

    model, inputs, feats = _uneven_model()
    sigma, sigma_norm, held = spectrum(model, sampler, inputs, seed=0, heldout=True)
    with torch.no_grad():
        f, g = (model.heads[m](feats[m]) for m in ("sketch", "photo"))
    want, want_norm = quotients_of_joint(f, g, joint)
    torch.testing.assert_close(sigma.double(), want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(sigma_norm.double(), want_norm, atol=1e-6, rtol=1e-5)
    assert held is not None


def test_photo_marginal_on_subsets_is_the_restricted_kernels():
    """On given rows, the photo marginal is that of the pairs joint_moment reads there:
    sketches whose pair is among the given photos, each as likely."""
    inst = PairSampler(UNEVEN_SKETCH_LABELS, UNEVEN_PHOTO_LABELS, "instance", UNEVEN_PHOTO_OF)
    # sketches 0, 1, 4 and 6 of photos 0, 0, 3 and 4 (absent): photo 0 twice, 3 once, 2 never
    got = inst.photo_marginal(torch.tensor([0, 1, 4, 6]), torch.tensor([3, 0, 2]))
    torch.testing.assert_close(got, torch.tensor([1 / 3, 2 / 3, 0.0], dtype=torch.float64))
    cls = PairSampler(UNEVEN_SKETCH_LABELS, UNEVEN_PHOTO_LABELS)
    # sketches of classes 0, 0, 1 over photos 1 (class 0) and 2, 5 (class 1)
    got = cls.photo_marginal(torch.tensor([0, 3, 6]), torch.tensor([1, 2, 5]))
    torch.testing.assert_close(got, torch.tensor([2 / 3, 1 / 6, 1 / 6], dtype=torch.float64))
    with pytest.raises(ValueError, match="no sketch"):
        inst.photo_marginal(torch.tensor([6]), torch.tensor([0]))


def test_mixed_pairs_on_subsets_are_the_restricted_kernels():
    """A share a of instance pairs on given rows: a sketch whose own photo is there puts a
    on it and (1 - a) spread over its class's photos there; one whose photo is absent pairs
    within its class only. joint_moment and photo_marginal against that written out."""
    from tests.cdk.reference import quotients_of_joint

    a = 0.3
    mixed = PairSampler(UNEVEN_SKETCH_LABELS, UNEVEN_PHOTO_LABELS, "class", UNEVEN_PHOTO_OF,
                        instance_share=a)
    s_idx, p_idx = torch.tensor([0, 1, 4, 6, 7]), torch.tensor([3, 0, 2, 1, 5])
    joint = torch.zeros(len(s_idx), len(p_idx), dtype=torch.float64)
    for r, i in enumerate(s_idx.tolist()):
        mates = [k for k, j in enumerate(p_idx.tolist())
                 if UNEVEN_PHOTO_LABELS[j] == UNEVEN_SKETCH_LABELS[i]]
        own = [k for k, j in enumerate(p_idx.tolist()) if j == UNEVEN_PHOTO_OF[i]]
        for k in mates:
            joint[r, k] += (1 - a if own else 1.0) / len(mates)
        for k in own:
            joint[r, k] += a
    joint /= joint.sum()
    torch.testing.assert_close(mixed.photo_marginal(s_idx, p_idx), joint.sum(0))
    gen = torch.Generator().manual_seed(1)
    f = torch.randn(len(s_idx), 3, generator=gen, dtype=torch.float64)
    g = torch.randn(len(p_idx), 3, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(mixed.joint_moment(f, g, s_idx, p_idx),
                               torch.einsum("il,ij,jl->l", f, joint, g))
    want, _ = quotients_of_joint(f, g, joint)
    got = cdk_singular_values(f, g, mixed.joint_moment(f, g, s_idx, p_idx),
                              mixed.photo_marginal(s_idx, p_idx))
    torch.testing.assert_close(got, want)


def test_no_instance_share_draws_what_the_class_pairing_drew():
    """instance_share 0 leaves the class pairing's batches as they were, draw for draw (the
    extra draw comes after the class draw), and a share needs each sketch's photo."""
    plain = PairSampler(UNEVEN_SKETCH_LABELS, UNEVEN_PHOTO_LABELS)
    zero = PairSampler(UNEVEN_SKETCH_LABELS, UNEVEN_PHOTO_LABELS, "class", UNEVEN_PHOTO_OF,
                       instance_share=0.0)
    for (s1, p1), (s2, p2) in zip(plain.epoch(3, 1, 4), zero.epoch(3, 1, 4), strict=True):
        assert torch.equal(s1, s2) and torch.equal(p1, p2)
    with pytest.raises(ValueError, match="photo_of"):
        PairSampler(UNEVEN_SKETCH_LABELS, UNEVEN_PHOTO_LABELS, "class", None, 0.5)
    with pytest.raises(ValueError, match="instance_share"):
        PairSampler(UNEVEN_SKETCH_LABELS, UNEVEN_PHOTO_LABELS, "class", UNEVEN_PHOTO_OF, 1.5)
