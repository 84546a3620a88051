"""The hubness correction (CSLS with a fixed sketch sample): the penalty against a loop
written out, the extra coordinate's inner product, and the corrected metrics against the
rule applied by hand."""

import numpy as np
import pytest
import torch

from training.cdk.metrics import corrected_metrics, retrieval_metrics
from training.cdk.model.hubness import Hubness, photo_penalty, with_penalty
from training.cdk.model.smoothing import Expansion, Smoothing, expand_exact, smooth


def _loop_penalty(g: np.ndarray, sample: np.ndarray, k: int, weight: float) -> np.ndarray:
    return np.array([weight * np.mean(sorted((y @ x for x in sample), reverse=True)[:k])
                     for y in g])


def test_penalty_matches_a_loop_and_the_coordinate_subtracts_it():
    gen = torch.Generator().manual_seed(0)
    g, sample, f = (torch.randn(n, 5, generator=gen) for n in (23, 9, 4))
    p = photo_penalty(g, sample, Hubness(k=3, weight=0.7), chunk=5)
    np.testing.assert_allclose(p.numpy(), _loop_penalty(g.double().numpy(),
                                                        sample.double().numpy(), 3, 0.7),
                               rtol=1e-5)
    fq, gq = with_penalty(f, g, p)
    torch.testing.assert_close(fq @ gq.T, f @ g.T - p[None, :])
    # k larger than the sample: the mean over all of it
    big = photo_penalty(g, sample, Hubness(k=50, weight=1.0))
    torch.testing.assert_close(big, (g @ sample.T).mean(1), rtol=1e-5, atol=1e-6)


def test_corrected_metrics_apply_the_rule_after_smoothing_and_before_expansion():
    gen = torch.Generator().manual_seed(1)
    centres = torch.randn(4, 6, generator=gen)
    labels = np.arange(40) % 4
    g = centres[labels] + 0.8 * torch.randn(40, 6, generator=gen)
    f = centres[labels[:12]] + 0.8 * torch.randn(12, 6, generator=gen)
    sample = centres[[0, 0, 1, 1]] + 0.3 * torch.randn(4, 6, generator=gen)
    sm, ex, hub = Smoothing(k=3, weight=2.0, rounds=1), Expansion(n=2), Hubness(2, 0.8)
    seen = labels < 2
    m = corrected_metrics(f, g, labels[:12], labels, 5, sm, ex, hub, sample, seen=seen)
    gs = smooth(g, sm)
    pen = torch.tensor(_loop_penalty(gs.double().numpy(), sample.double().numpy(), 2, 0.8))
    fq = torch.cat([f, torch.ones(12, 1)], 1)
    gq = torch.cat([gs, -pen.float()[:, None]], 1)
    want = retrieval_metrics(expand_exact(fq, gq, ex), gq, labels[:12], labels, 5, seen=seen)
    for key in ("map_all", "precision_at_k", "seen_at_k"):
        assert m[key] == pytest.approx(want[key], abs=1e-6)
    assert m["hubness"] == {"k": 2, "weight": 0.8}
    # the photos near the sample (classes 0 and 1) lose places in the top 5
    plain = retrieval_metrics(expand_exact(f, gs, ex), gs, labels[:12], labels, 5, seen=seen)
    assert m["seen_at_k"] < plain["seen_at_k"]


def test_bad_settings_and_shapes_are_refused():
    with pytest.raises(ValueError, match="hubness k"):
        Hubness(k=0)
    with pytest.raises(ValueError, match="hubness weight"):
        Hubness(weight=-1.0)
    assert not Hubness(weight=0.0).active
    with pytest.raises(ValueError, match="at least one sketch"):
        photo_penalty(torch.zeros(3, 2), torch.zeros(0, 2), Hubness())
    with pytest.raises(ValueError, match="width"):
        photo_penalty(torch.zeros(3, 2), torch.zeros(4, 3), Hubness())
    with pytest.raises(ValueError, match="one number per photo"):
        with_penalty(torch.zeros(1, 2), torch.zeros(3, 2), torch.zeros(2))
