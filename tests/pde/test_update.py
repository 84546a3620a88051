"""The fused RMSprop + EMA update against torch.optim.RMSprop and the EMA's lerp it
replaces, over steps of a changing learning rate, and in training."""

import pytest
import torch
from torch._dynamo.utils import counters

from training.pde.config import preset
from training.pde.problems import make_problem
from training.pde.train import train
from training.pde.update import FusedUpdate

SHAPES = [(3, 40, 8), (3, 1, 8), (3, 8, 1), (5,)]


def _pair(seed=0):
    gen = torch.Generator().manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(*s, generator=gen)) for s in SHAPES]
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    return ps, qs


def test_fused_update_equals_rmsprop_and_the_ema():
    ps, qs = _pair()
    ref_opt, opt = torch.optim.RMSprop(ps, lr=3e-3), torch.optim.RMSprop(qs, lr=3e-3)
    ref_sched = torch.optim.lr_scheduler.CosineAnnealingLR(ref_opt, 8)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, 8)
    ref_ema, ema = [p.detach().clone() for p in ps], [q.detach().clone() for q in qs]
    fused = FusedUpdate(opt, ema, ema_decay=0.9)
    graphs = counters["stats"]["unique_graphs"]
    gen = torch.Generator().manual_seed(1)
    for _ in range(6):
        for p, q in zip(ps, qs, strict=True):
            g = torch.randn(p.shape, generator=gen)
            p.grad, q.grad = g.clone(), g.clone()
        ref_opt.step()
        with torch.no_grad():
            for e, p in zip(ref_ema, ps, strict=True):
                e.lerp_(p, 0.1)
        fused.step()
        ref_sched.step()
        sched.step()  # no warning that the optimizer did not step: it did, fused
    for p, q, e, f in zip(ps, qs, ref_ema, ema, strict=True):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(f, e, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(opt.state[q]["square_avg"], ref_opt.state[p]["square_avg"])
        assert opt.state[q]["step"] == ref_opt.state[p]["step"] == 6
    # one graph for every size and learning rate (a flat view, lr a tensor), not one per step
    assert counters["stats"]["unique_graphs"] - graphs <= 2
    # the state is torch's: a plain RMSprop takes it over
    torch.optim.RMSprop(qs, lr=1e-3).load_state_dict(opt.state_dict())


def test_fused_update_refuses_what_it_does_not_compute():
    ps, _ = _pair()
    ema = [p.detach().clone() for p in ps]
    for opt in (torch.optim.RMSprop(ps, lr=1e-3, momentum=0.9),
                torch.optim.RMSprop(ps, lr=1e-3, centered=True),
                torch.optim.Adam(ps, lr=1e-3)):
        with pytest.raises(ValueError, match="RMSprop"):
            FusedUpdate(opt, ema, 0.99)
    with pytest.raises(ValueError, match="one to one"):
        FusedUpdate(torch.optim.RMSprop(ps, lr=1e-3), ema[:-1], 0.99)


def test_training_with_the_fused_update_matches_the_plain_one(tmp_path):
    def run(fused):
        config = preset("cpu", make_problem("hydrogen"), iterations=5, batch_size=16,
                        fourier_features=4, hidden=8, threads=1, checkpoint_every=5,
                        device="cpu", fused_update=fused, out=str(tmp_path / str(fused)))
        return train(config, progress=False)[0]

    # Rounding differences of ~1 ulp per step; RMSprop's normalisation g / sqrt(E g^2)
    # amplifies them where a gradient is ~0, so compare each tensor as a whole.
    plain, fused = run("false"), run("true")
    for a, b in zip(plain.parameters(), fused.parameters(), strict=True):
        assert (b - a).norm() <= 1e-4 * a.norm()


def test_without_a_compiler_the_update_runs_uncompiled(monkeypatch, caplog):
    def broken(fn, **kw):
        def fail(*a, **k):
            raise RuntimeError("no C++ compiler")
        return fail

    monkeypatch.setattr(torch, "compile", broken)
    ps, qs = _pair(2)
    ref_opt, opt = torch.optim.RMSprop(ps, lr=1e-3), torch.optim.RMSprop(qs, lr=1e-3)
    ref_ema, ema = [p.detach().clone() for p in ps], [q.detach().clone() for q in qs]
    fused = FusedUpdate(opt, ema, ema_decay=0.99)
    assert "torch.compile failed (RuntimeError: no C++ compiler)" in caplog.text
    for p, q in zip(ps, qs, strict=True):
        p.grad = torch.ones_like(p)
        q.grad = torch.ones_like(q)
    ref_opt.step()
    with torch.no_grad():
        for e, p in zip(ref_ema, ps, strict=True):
            e.lerp_(p, 0.01)
    fused.step()
    for p, q, e, f in zip(ps, qs, ref_ema, ema, strict=True):
        torch.testing.assert_close(q, p)
        torch.testing.assert_close(f, e)
