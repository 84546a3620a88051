import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from training.cdk import train as train_mod
from training.cdk.checkpoint import load_checkpoint
from training.cdk.config import make_config
from training.cdk.data import PairSampler, Sampler
from training.cdk.train import TrainData

from .ddp_worker import ddp_worker, synthetic_backbone, synthetic_data


def _cfg(tmp_path, **kw):
    # raw_dims=2: the synthetic features are 4-6 wide
    # instance_share=0: the synthetic data name no photo per sketch (the class kernel)
    base = dict(modes=4, hidden=16, batch_size=8, epochs=3, lr=0.05, raw_dims=2,
                instance_share=0.0, out=str(tmp_path))
    return make_config("cpu", **{**base, **kw})


def _heads(path):
    ck = load_checkpoint(path)
    return ck["heads"], ck


def test_ddp_two_processes_equal_one(tmp_path):
    cfg = _cfg(tmp_path)
    single = train_mod.train(cfg, synthetic_data(), synthetic_backbone(), tmp_path / "one")
    mp.spawn(ddp_worker, args=(2, str(tmp_path / "init"), cfg, str(tmp_path / "ddp")),
             nprocs=2, join=True)
    ddp_heads, ck = _heads(tmp_path / "ddp" / "checkpoint.pt")
    one_heads, ck1 = _heads(tmp_path / "one" / "checkpoint.pt")
    assert ck["epoch"] == ck1["epoch"] == 3
    torch.testing.assert_close(ck["raw"]["axes"], ck1["raw"]["axes"])
    for m in ("sketch", "photo"):
        for k, v in one_heads[m].items():
            torch.testing.assert_close(ddp_heads[m][k], v, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(single.heads[m].state_dict()[k], v)
    # the runs moved the weights: the comparison is not between two initialisations
    torch.manual_seed(cfg.seed)
    init = train_mod.Head(6, 16, 4, 16.0)
    assert not torch.allclose(init.mlp[0].weight, one_heads["sketch"]["mlp.0.weight"])


def test_resume_after_interruption_equals_uninterrupted(tmp_path, monkeypatch):
    monkeypatch.setattr(train_mod, "CHECKPOINT_SECONDS", 0.0)  # a checkpoint every epoch
    cfg = _cfg(tmp_path)
    train_mod.train(cfg, synthetic_data(), synthetic_backbone(), tmp_path / "full")

    real_save, calls = train_mod.save_checkpoint, []

    def crash_after_first(*a, **k):
        real_save(*a, **k)
        calls.append(1)
        raise KeyboardInterrupt("simulated interruption")

    monkeypatch.setattr(train_mod, "save_checkpoint", crash_after_first)
    with pytest.raises(KeyboardInterrupt):
        train_mod.train(cfg, synthetic_data(), synthetic_backbone(), tmp_path / "cut")
    assert load_checkpoint(tmp_path / "cut" / "checkpoint.pt")["epoch"] == 1
    monkeypatch.setattr(train_mod, "save_checkpoint", real_save)
    res = train_mod.train(cfg, synthetic_data(), synthetic_backbone(), tmp_path / "cut")
    full, ck = _heads(tmp_path / "full" / "checkpoint.pt")
    cut, ck2 = _heads(tmp_path / "cut" / "checkpoint.pt")
    for m in ("sketch", "photo"):
        for k, v in full[m].items():
            torch.testing.assert_close(cut[m][k], v)
    assert ck2["train_state"] is None and len(ck2["history"]) == 3
    # cosine schedule over the whole run, also across the restart: lr = lr0 (1 + cos(pi e / E)) / 2
    cosine = [0.5 * cfg.lr * (1 + np.cos(np.pi * e / cfg.epochs)) for e in (1, 2, 3)]
    np.testing.assert_allclose([h["lr"] for h in ck2["history"]], cosine, atol=1e-12)
    torch.testing.assert_close(res.singular_values, ck["singular_values"])
    # A different config in the same folder is refused, not silently mixed.
    with pytest.raises(ValueError, match="lr"):
        train_mod.train(_cfg(tmp_path, lr=0.01), synthetic_data(), synthetic_backbone(),
                        tmp_path / "cut")


def _discrete_cdk_problem(n=200):
    """Sketch and photo 'features' are one-hot states; classes mix states with known
    p(x|c), p(y|c). Returns TrainData and the exact singular values of the sampler's CDK,
    sigma of D_x^-1/2 P D_y^-1/2 with P = sum_c p(c) p(x|c) p(y|c)^T (p(c) as sampled)."""
    A = np.array([[.7, .1, .1, .1], [.1, .7, .1, .1], [.25, .25, .4, .1], [.25] * 4])
    Bm = np.array([[.8, .1, .05, .05], [.1, .6, .2, .1], [.1, .2, .5, .2], [.2, .2, .3, .3]])

    def draw(probs):
        counts = np.round(probs * n).astype(int)  # (classes, states)
        states = np.concatenate([np.repeat(np.arange(4), row) for row in counts])
        labels = np.repeat(np.arange(4), counts.sum(1))
        return states, labels

    xs, xl = draw(A)
    ys, yl = draw(Bm)
    pc = np.bincount(xl) / len(xl)  # the sampler visits every sketch once per epoch
    px_c = np.stack([np.bincount(xs[xl == c], minlength=4) / (xl == c).sum() for c in range(4)])
    py_c = np.stack([np.bincount(ys[yl == c], minlength=4) / (yl == c).sum() for c in range(4)])
    P = px_c.T @ np.diag(pc) @ py_c
    K = P / np.sqrt(P.sum(1)[:, None] * P.sum(0)[None, :])
    exact = np.linalg.svd(K, compute_uv=False)  # exact[0] = 1 is the constant mode
    eye = torch.eye(4)
    return TrainData(eye[xs], eye[ys], xl, yl), exact[1:]


@pytest.mark.parametrize("weights", ["uniform", "harmonic"])
def test_joint_nesting_recovers_exact_cdk_spectrum(tmp_path, weights):
    data, exact = _discrete_cdk_problem()
    # no weight decay: it shrinks the learned functions, so their norms would sit below the
    # exact singular values (the preset's decay is a regulariser for retrieval)
    cfg = _cfg(tmp_path, modes=2, hidden=32, batch_size=200, epochs=100, grad_clip=0.0,
               weight_decay=0.0, nesting_weights=weights)
    sv = train_mod.train(cfg, data, synthetic_backbone(4), tmp_path).singular_values
    np.testing.assert_allclose(sv.numpy(), exact[:2], atol=0.01)
    assert exact[0] - exact[1] > 0.1  # distinct modes, so the order is informative


def test_input_dropout_scales_the_standardised_input():
    torch.manual_seed(0)
    head = train_mod.Head(6, 16, 4, 16.0)
    head.set_feature_stats(torch.randn(50, 6) * 3 + 1)
    x, scale = torch.randn(5, 6), (torch.rand(5, 6) < 0.7).float() / 0.7
    z = head.mlp((x - head.feat_mean) / head.feat_std * scale)
    want = z * torch.clamp(16.0 / z.norm(dim=1, keepdim=True), max=1.0)
    torch.testing.assert_close(head(x, scale), want)
    torch.testing.assert_close(head(x), head(x, torch.ones(5, 6)))  # no scale: untouched


def test_input_dropout_masks_are_drawn_per_step_at_the_configured_rate(tmp_path, monkeypatch):
    seen = []
    real = train_mod.Head.forward

    def spy(self, x, input_scale=None):
        seen.append(input_scale)
        return real(self, x, input_scale)

    monkeypatch.setattr(train_mod.Head, "forward", spy)
    monkeypatch.setattr(train_mod, "CHECKPOINT_SECONDS", 0.0)  # a spectrum every epoch
    data = synthetic_data()
    train_mod.train(_cfg(tmp_path, input_dropout=0.25, epochs=2), data, synthetic_backbone(),
                    tmp_path / "drop")
    scales = [s for s in seen if s is not None]
    assert len(scales) == 2 * 2 * (len(data.sketch_labels) // 8)  # 2 heads, every step
    both = torch.stack(scales)  # (steps x 2, B, D)
    assert torch.isin(both, torch.tensor([0.0, 1 / 0.75])).all()
    assert abs((both == 0).float().mean().item() - 0.25) < 0.05
    assert not torch.equal(scales[0], scales[2])  # a new mask each step
    # the spectrum after each epoch (and its held-out check after the last, from the same
    # outputs) embeds all 24 rows of each modality without a mask
    assert all(s is None or s.shape == (8, 6) for s in seen)
    assert sum(s is None for s in seen) == 2 * 2
    seen.clear()
    train_mod.train(_cfg(tmp_path, input_dropout=0.0, epochs=1), data, synthetic_backbone(),
                    tmp_path / "nodrop")
    assert all(s is None for s in seen)


def test_input_dropout_changes_training(tmp_path):
    data = synthetic_data()
    runs = [train_mod.train(_cfg(tmp_path, input_dropout=p), data, synthetic_backbone(),
                            tmp_path / str(p)).heads["sketch"].state_dict()["mlp.0.weight"]
            for p in (0.0, 0.3)]
    assert not torch.allclose(*runs)


def test_training_fits_and_stores_the_raw_projection(tmp_path):
    from training.cdk.model.heads import fit_raw_projections

    data = synthetic_data()
    res = train_mod.train(_cfg(tmp_path, raw_dims=3, raw_weight=0.5, raw_whiten=0.75), data,
                          synthetic_backbone(), tmp_path)
    want = fit_raw_projections(data.sketch_feats, data.photo_feats, 3, 0.5, 0.75)
    plain = fit_raw_projections(data.sketch_feats, data.photo_feats, 3, 0.5, 0.0)
    assert not torch.allclose(want["sketch"].axes, plain["sketch"].axes)  # whitened
    ck = load_checkpoint(tmp_path / "checkpoint.pt")
    for m in ("sketch", "photo"):
        torch.testing.assert_close(res.raw[m].mean, want[m].mean)
        torch.testing.assert_close(ck["raw"]["mean"][m], want[m].mean)
    torch.testing.assert_close(ck["raw"]["axes"], want["sketch"].axes)
    assert ck["raw"]["weight"] == 0.5 and res.raw["photo"].dims == 3
    res0 = train_mod.train(_cfg(tmp_path / "none", raw_dims=0), data, synthetic_backbone(),
                           tmp_path / "none")
    assert res0.raw is None and load_checkpoint(tmp_path / "none" / "checkpoint.pt")["raw"] is None
    with pytest.raises(ValueError, match="raw_dims must be in"):
        train_mod.train(_cfg(tmp_path / "wide", raw_dims=7), data, synthetic_backbone(),
                        tmp_path / "wide")


def test_sorted_modes_are_the_trained_ones_in_decreasing_singular_value(tmp_path):
    # L = 6 on 4 classes: the CDK has rank 3, so modes 4-6 sit near 0 in no fixed order
    data, bb = synthetic_data(), synthetic_backbone()
    kept = train_mod.train(_cfg(tmp_path, modes=6, sort_modes=False), data, bb, tmp_path / "kept")
    done = train_mod.train(_cfg(tmp_path, modes=6), data, bb, tmp_path / "sorted")
    perm = torch.tensor(done.history[-1]["sorted_from"])
    assert sorted(perm.tolist()) == list(range(6))
    assert "sorted_from" not in kept.history[-1]
    sv = done.singular_values
    assert bool((sv[1:] <= sv[:-1]).all())
    torch.testing.assert_close(sv, kept.singular_values[perm])
    torch.testing.assert_close(done.singular_values_norm, kept.singular_values_norm[perm])
    # the same training up to the final permutation of both heads' coordinates
    for m, x in (("sketch", data.sketch_feats), ("photo", data.photo_feats)):
        with torch.no_grad():
            torch.testing.assert_close(done.heads[m](x), kept.heads[m](x)[:, perm])
    assert done.order_trained == kept.order_trained == train_mod.spectrum_order(
        kept.singular_values)
    assert done.order_heldout == kept.order_heldout
    assert done.order_heldout["top"] == 6
    # the stored checkpoint holds the sorted heads and values
    ck = load_checkpoint(tmp_path / "sorted" / "checkpoint.pt")
    torch.testing.assert_close(ck["singular_values"], sv)
    torch.testing.assert_close(ck["heads"]["photo"]["mlp.2.bias"],
                               kept.heads["photo"].mlp[2].bias.detach()[perm])
    # resuming the finished run reports the same
    again = train_mod.train(_cfg(tmp_path, modes=6), data, bb, tmp_path / "sorted")
    assert again.order_trained == done.order_trained
    assert again.history[-1]["sorted_from"] == perm.tolist()


def test_permute_modes_reorders_the_outputs():
    torch.manual_seed(0)
    head = train_mod.Head(5, 8, 4, 16.0)
    x = torch.randn(7, 5)
    with torch.no_grad():
        before = head(x)
        head.permute_modes(torch.tensor([2, 0, 3, 1]))
        torch.testing.assert_close(head(x), before[:, [2, 0, 3, 1]])
    with pytest.raises(ValueError, match="permutation"):
        head.permute_modes(torch.tensor([0, 0, 1, 2]))


def test_a_sampler_is_passed_not_patched(tmp_path):
    """What an experiment varies goes in as an argument: any object with the Sampler
    methods (here one that holds a PairSampler, not a subclass of it) draws every batch
    and gives the spectrum pass its joint moments, and training with it equals training
    with the config's own sampler when it draws the same pairs."""
    data, bb = synthetic_data(), synthetic_backbone()
    default = train_mod.train(_cfg(tmp_path), data, bb, tmp_path / "d")

    class Counting:
        def __init__(self, inner):
            self.inner, self.epochs, self.moments = inner, [], 0

        def steps_per_epoch(self, batch_size):
            return self.inner.steps_per_epoch(batch_size)

        def epoch(self, seed, epoch, batch_size):
            self.epochs.append(epoch)
            yield from self.inner.epoch(seed, epoch, batch_size)

        def joint_moment(self, *a, **k):
            self.moments += 1
            return self.inner.joint_moment(*a, **k)

        def photo_marginal(self, *a, **k):
            return self.inner.photo_marginal(*a, **k)

        def halves(self, *a, **k):
            return self.inner.halves(*a, **k)

    sampler = Counting(PairSampler(data.sketch_labels, data.photo_labels))
    assert isinstance(sampler, Sampler) and not isinstance(sampler, PairSampler)
    own = train_mod.train(_cfg(tmp_path), data, bb, tmp_path / "s", sampler=sampler)
    # one spectrum pass (the last epoch's: they are milliseconds) and the held-out halves
    assert sampler.epochs == [0, 1, 2] and sampler.moments == 1 + 2
    torch.testing.assert_close(own.singular_values, default.singular_values, rtol=0, atol=0)
    for m in ("sketch", "photo"):
        for k, v in default.heads[m].state_dict().items():
            torch.testing.assert_close(own.heads[m].state_dict()[k], v, rtol=0, atol=0)


def test_a_sampler_without_the_sampler_methods_is_refused(tmp_path):
    class Draws:
        def steps_per_epoch(self, batch_size):
            return 1

        def epoch(self, seed, epoch, batch_size):
            yield torch.arange(4), torch.arange(4)

    with pytest.raises(TypeError, match="Draws is not a training.cdk.data.Sampler .*"
                                        "joint_moment, photo_marginal, halves"):
        train_mod.train(_cfg(tmp_path), synthetic_data(), synthetic_backbone(), tmp_path,
                        sampler=Draws())


def test_time_estimate_comes_before_the_first_step_and_changes_nothing(tmp_path, monkeypatch):
    data, bb = synthetic_data(), synthetic_backbone()
    plain = train_mod.train(_cfg(tmp_path), data, bb, tmp_path / "a")
    calls, steps = [], []
    real = train_mod.Step.__call__

    def spy(self, xs, ys):
        steps.append(len(calls))
        return real(self, xs, ys)

    monkeypatch.setattr(train_mod.Step, "__call__", spy)
    timed = train_mod.train(_cfg(tmp_path), data, bb, tmp_path / "b",
                            estimate=lambda *a: calls.append(a))
    (steps_left, step_s, passes_left, spectrum_s), = calls
    # three epochs of milliseconds: one spectrum pass, the last epoch's
    assert (steps_left, passes_left) == (3 * (24 // 8), 1) and step_s > 0 and spectrum_s > 0
    assert steps[:2] == [0, 0] and set(steps[2:]) == {1}  # two probe steps, then the run's
    for m in ("sketch", "photo"):  # the probe ran on a copy: the run is the same
        for k, v in plain.heads[m].state_dict().items():
            torch.testing.assert_close(timed.heads[m].state_dict()[k], v, rtol=0, atol=0)


def test_spectrum_and_checkpoint_cadence_changes_no_weight(tmp_path, monkeypatch):
    """Epochs end with the spectrum and a checkpoint CHECKPOINT_SECONDS apart: the weights
    are those of a run that ends every epoch so; only the log and the history differ."""
    cfg = _cfg(tmp_path, epochs=4)
    saves = []
    real_save = train_mod.save_checkpoint
    monkeypatch.setattr(train_mod, "save_checkpoint",
                        lambda *a, **k: (saves.append(k["epoch"]), real_save(*a, **k)))
    few = train_mod.train(cfg, synthetic_data(), synthetic_backbone(), tmp_path / "few")
    assert saves == [4]  # milliseconds an epoch: only the last
    assert ["sigma_top" in h for h in few.history] == [False, False, False, True]
    monkeypatch.setattr(train_mod, "CHECKPOINT_SECONDS", 0.0)
    every = train_mod.train(cfg, synthetic_data(), synthetic_backbone(), tmp_path / "every")
    assert saves == [4, 1, 2, 3, 4] and all("sigma_top" in h for h in every.history)
    for m in ("sketch", "photo"):
        for k, v in every.heads[m].state_dict().items():
            torch.testing.assert_close(few.heads[m].state_dict()[k], v, rtol=0, atol=0)
    torch.testing.assert_close(few.singular_values, every.singular_values, rtol=0, atol=0)
    assert [h["loss"] for h in few.history] == [h["loss"] for h in every.history]


@pytest.mark.parametrize("epochs,epoch_s,passes", [
    (200, 0.3, 3),  # 60 s of training: at 30 s, 60 s (the last)
    (200, 0.001, 1), (5, 40.0, 5), (0, 1.0, 0), (3, 29.0, 3)])
def test_spectrum_passes_counts_the_cadence(epochs, epoch_s, passes):
    assert train_mod.spectrum_passes(epochs, epoch_s) == passes
