import pytest
import torch

from training.cdk import train as train_mod
from training.cdk.config import make_config

from .ddp_worker import synthetic_backbone, synthetic_data

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_amp_training_on_cuda_matches_cpu_closely(tmp_path):
    cfg = make_config("cpu", modes=4, hidden=16, batch_size=8, epochs=3, lr=0.05, raw_dims=2,
                      out=str(tmp_path))
    gpu = train_mod.train(cfg, synthetic_data(), synthetic_backbone(), tmp_path / "gpu",
                          device="cuda")
    cpu = train_mod.train(cfg, synthetic_data(), synthetic_backbone(), tmp_path / "cpu",
                          device="cpu")
    assert bool(torch.isfinite(gpu.singular_values).all())
    # bf16/fp16 autocast of the heads: same run up to low-precision rounding
    torch.testing.assert_close(gpu.singular_values, cpu.singular_values, atol=0.05, rtol=0.1)
