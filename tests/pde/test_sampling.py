"""The mixture sampling distribution: its log-density is a normalised density (quadrature)
equal to an independent torch.distributions mixture and its sampler draws from it (radial
CDF and second moment); checkpoints of another format are refused."""

import dataclasses
import math

import pytest
import torch

from training.pde import quadrature
from training.pde.checkpoint import CHECKPOINT, load_checkpoint, load_train_state
from training.pde.config import Config, preset, problem_of
from training.pde.problems import make_problem
from training.pde.train import train

WIDE, NARROW, SHARE = 16.0, 2.0, 0.3


def _reference(wide, narrow, share):
    mix = torch.distributions.Categorical(torch.tensor([1 - share, share], dtype=torch.float64))
    comp = torch.distributions.Independent(
        torch.distributions.Normal(torch.zeros(2, 2, dtype=torch.float64),
                                   torch.tensor([[wide] * 2, [narrow] * 2], dtype=torch.float64)),
        1,
    )
    return torch.distributions.MixtureSameFamily(mix, comp)


def test_mixture_log_density_integrates_to_one_and_matches_torch_distributions():
    p = make_problem("hydrogen", train_std=WIDE, mix_std=NARROW, mix_fraction=SHARE)
    x, w = quadrature.polar_gauss(200.0, "cpu", 40000)  # 12.5 wide stds: tail < 1e-30
    x, w = x.double(), w.double()
    total = (w * p.log_weight(x).exp()).sum().item()
    assert abs(total - 1) < 1e-4
    # the narrow component alone holds SHARE of the mass within r <= 2 * 2.5 ...
    inner = (x.norm(dim=-1) < 5.0).double()
    ref = SHARE * (1 - math.exp(-25 / (2 * NARROW**2))) + (1 - SHARE) * (
        1 - math.exp(-25 / (2 * WIDE**2)))
    assert abs((w * inner * p.log_weight(x).exp()).sum().item() - ref) < 1e-3
    # ... and pointwise the density is the independent mixture's, also far out where the
    # narrow component underflows in float64
    pts = torch.tensor([[0.0, 0.0], [1.0, -2.0], [7.0, 3.0], [60.0, -80.0], [300.0, 1.0]],
                       dtype=torch.float64)
    torch.testing.assert_close(p.log_weight(pts), _reference(WIDE, NARROW, SHARE).log_prob(pts),
                               rtol=1e-12, atol=1e-12)


def test_mixture_sampler_draws_from_its_density():
    p = make_problem("hydrogen", train_std=WIDE, mix_std=NARROW, mix_fraction=SHARE)
    n = 200_000
    x = p.sample(n, torch.Generator().manual_seed(0), "cpu", torch.float64)
    r = x.norm(dim=-1)
    # radial CDF of a 2D Gaussian mixture: sum_k a_k (1 - exp(-r^2 / (2 s_k^2)))
    for radius in [1.0, 3.0, 6.0, 16.0, 40.0]:
        cdf = SHARE * (1 - math.exp(-(radius**2) / (2 * NARROW**2))) + (1 - SHARE) * (
            1 - math.exp(-(radius**2) / (2 * WIDE**2)))
        got = (r < radius).double().mean().item()
        assert abs(got - cdf) < 4 * math.sqrt(cdf * (1 - cdf) / n) + 1e-9, (radius, got, cdf)
    second = 2 * (SHARE * NARROW**2 + (1 - SHARE) * WIDE**2)  # E|x|^2
    assert abs((r**2).mean().item() / second - 1) < 0.01
    # importance weights are right: E_p[1_{|x|<5} / p(x)] is the disk's area
    est = ((r < 5).double() * torch.exp(-p.log_weight(x))).mean().item()
    assert abs(est / (math.pi * 25) - 1) < 0.02


def test_without_a_mixture_the_draws_are_the_plain_gaussian_ones():
    p = make_problem("hydrogen")
    x = p.sample(64, torch.Generator().manual_seed(5), "cpu", torch.float32)
    z = torch.randn(64, 2, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(x, 16.0 * z, rtol=0, atol=0)


def test_mixture_settings_are_validated():
    with pytest.raises(ValueError, match="mix_fraction must be in \\[0, 1\\), got 1.5"):
        make_problem("hydrogen", mix_std=2.0, mix_fraction=1.5)
    with pytest.raises(ValueError, match="needs mix_std > 0, got 0.0"):
        make_problem("hydrogen", mix_fraction=0.2)
    with pytest.raises(ValueError, match="train_mix_fraction must be in \\[0, 1\\), got -0.1"):
        Config(train_mix_fraction=-0.1)
    with pytest.raises(ValueError, match="needs train_mix_std > 0, got 0.0"):
        Config(train_mix_fraction=0.25)
    p = problem_of(Config(train_std=12.0, train_mix_std=3.0, train_mix_fraction=0.25))
    assert (p.train_std, p.mix_std, p.mix_fraction) == (12.0, 3.0, 0.25)


def test_a_checkpoint_of_another_format_is_refused_with_a_message(tmp_path):
    config = preset("cpu", make_problem("hydrogen"), iterations=2, batch_size=16,
                    fourier_features=4, hidden=8, threads=1, out=str(tmp_path),
                    ritz_samples=0)
    train(config, progress=False)
    path = tmp_path / CHECKPOINT
    loaded, _, _ = load_checkpoint(path)
    assert loaded == config
    ckpt = load_train_state(path)
    del ckpt["format"]  # as the code before the Schrodinger problems wrote it
    torch.save(ckpt, path)
    with pytest.raises(ValueError, match="of format 1, this version reads format 2"):
        load_checkpoint(path)


def test_a_checkpoint_written_before_a_field_was_renamed_loads_and_resumes(tmp_path):
    """Files of this format that stored the number of modes as ``n_modes`` load with it as
    ``modes``, and a run resumes from them."""
    config = preset("cpu", make_problem("hydrogen"), iterations=2, batch_size=16,
                    fourier_features=4, hidden=8, threads=1, out=str(tmp_path),
                    ritz_samples=0, modes=16)
    train(config, progress=False)
    path = tmp_path / CHECKPOINT
    ckpt = torch.load(path, weights_only=True)
    ckpt["config"] = {("n_modes" if k == "modes" else k): v for k, v in ckpt["config"].items()}
    torch.save(ckpt, path)
    loaded, model, _ = load_checkpoint(path)
    assert loaded == config and model.modes == 16
    train(dataclasses.replace(config, resume=True), progress=False)  # same settings: resumes
    assert load_train_state(path)["step"] == 2
