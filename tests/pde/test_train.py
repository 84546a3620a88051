"""Checkpoints resume a run exactly where it stopped; settings must match to resume."""

import math

import pytest
import torch

import training.pde.train as train_module
from tests.fakes import crafted_checkpoint
from training.pde.checkpoint import load_checkpoint
from training.pde.config import Config, preset
from training.pde.problems import make_problem
from training.pde.train import make_schedule, train


def _config(out, **kw):
    values = dict(iterations=4, batch_size=16, fourier_features=4, hidden=8, threads=1,
                  checkpoint_every=2, out=str(out), method="spin")
    return preset("cpu", make_problem("hydrogen"), **{**values, **kw})


_GUESS = {"step_seconds": {}, "train_seconds": 0.0, "eval_seconds": 0.0, "eval_points": 0}


class _Interrupt(Exception):
    pass


def _interrupted_after_step_3(monkeypatch, config):
    """Train ``config`` and stop it after step 3 (its last checkpoint is from step 2)."""
    real_tqdm = train_module.tqdm

    class StopAtThree(real_tqdm):
        steps = 0

        def update(self, n=1):
            super().update(n)
            StopAtThree.steps += n
            if StopAtThree.steps == 3:
                raise _Interrupt

    monkeypatch.setattr(train_module, "tqdm", StopAtThree)
    with pytest.raises(_Interrupt):
        train(config, progress=False)
    monkeypatch.setattr(train_module, "tqdm", real_tqdm)


def test_resume_after_an_interruption_reproduces_the_uninterrupted_run(tmp_path, monkeypatch):
    full, _ = train(_config(tmp_path / "full"), progress=False)

    _interrupted_after_step_3(monkeypatch, _config(tmp_path / "cut"))
    config, _, ckpt = load_checkpoint(tmp_path / "cut" / "checkpoint.pt")
    assert ckpt["step"] == 2 and config.method == "spin"

    resumed, info = train(_config(tmp_path / "cut", resume=True), progress=False)
    assert info["steps"] == 4
    for a, b in zip(full.state_dict().values(), resumed.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b)


def test_resume_with_different_settings_is_an_error(tmp_path):
    train(_config(tmp_path, iterations=2, lr=1e-3), progress=False)
    with pytest.raises(ValueError, match=r"lr: 0.001 -> 0.002"):
        train(_config(tmp_path, iterations=2, lr=2e-3, resume=True), progress=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_trains_on_cuda_when_present(tmp_path, precision):
    model, info = train(_config(tmp_path, iterations=2, method="neuralsvd-seq",
                                stencil_precision=precision), progress=False)
    assert info["device"].startswith("cuda")
    assert next(model.parameters()).device.type == "cpu"  # returned for evaluation


def test_crafted_checkpoint_is_refused_without_running_code(tmp_path):
    marker = tmp_path / "ran"
    bad = crafted_checkpoint(tmp_path / "checkpoint.pt", marker)
    with pytest.raises(ValueError, match="checkpoint.pt' is not a training.pde checkpoint"):
        load_checkpoint(bad)
    with pytest.raises(ValueError, match="is not a training.pde checkpoint"):
        train(_config(tmp_path, resume=True), progress=False)
    assert not marker.exists()


@pytest.mark.parametrize("floor", [0.0, 0.2])
def test_cosine_schedule_ends_at_the_floor(floor):
    w = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.RMSprop([w], lr=2e-3)
    sched = make_schedule(opt, 10, floor)
    for t in range(1, 11):
        opt.step()
        sched.step()
        ref = 2e-3 * (floor + (1 - floor) * (1 + math.cos(math.pi * t / 10)) / 2)
        assert opt.param_groups[0]["lr"] == pytest.approx(ref, rel=1e-9, abs=1e-15)
    assert opt.param_groups[0]["lr"] == pytest.approx(2e-3 * floor, abs=1e-15)
    with pytest.raises(ValueError, match="lr_floor must be in \\[0, 1\\), got 1.0"):
        Config(lr_floor=1.0)


def test_the_last_steps_draw_the_final_batch_size_and_resume_exactly(tmp_path, monkeypatch):
    from training.pde.config import batch_size_at

    cfg = _config(tmp_path / "full", final_batch_size=40, final_steps=2)
    assert [batch_size_at(cfg, t) for t in range(4)] == [16, 16, 40, 40]
    assert [batch_size_at(_config(tmp_path), t) for t in range(4)] == [16] * 4
    drawn = []
    real_step = train_module.Trainer.step

    def spy(self, batch_size, *args, **kwargs):
        drawn.append(batch_size)
        return real_step(self, batch_size, *args, **kwargs)

    # the batches of the run itself (not those of the trial steps that time it)
    monkeypatch.setattr(train_module, "estimate_seconds", lambda *a, **k: _GUESS)
    monkeypatch.setattr(train_module.Trainer, "step", spy)
    full, _ = train(cfg, progress=False)
    assert drawn == [16, 16, 40, 40]

    # stopped after step 3, a large batch
    _interrupted_after_step_3(monkeypatch, _config(tmp_path / "cut", final_batch_size=40,
                                                   final_steps=2))
    drawn.clear()
    resumed, _ = train(_config(tmp_path / "cut", final_batch_size=40, final_steps=2,
                               resume=True), progress=False)
    assert drawn == [40, 40]  # steps 3 and 4 again, with the final batch size
    for a, b in zip(full.state_dict().values(), resumed.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b)
    # the final batch is part of what was trained: changing it is not a resume
    with pytest.raises(ValueError, match="final_batch_size: 40 -> 64"):
        train(_config(tmp_path / "cut", final_batch_size=64, final_steps=2, resume=True),
              progress=False)


@pytest.mark.parametrize("kw", [{"final_steps": 5}, {"final_batch_size": 64},
                                {"final_steps": -1, "final_batch_size": 64},
                                {"final_steps": 5, "final_batch_size": 1}])
def test_bad_final_batch_settings_are_errors(kw):
    with pytest.raises(ValueError, match="final_"):
        Config(**kw)
