"""A PDE checkpoint rebuilds the evaluated model from its stored config alone, loads with
weights_only=True, and names a file that is not one."""

import pytest
import torch

from training.pde.checkpoint import CHECKPOINT, load_checkpoint
from training.pde.config import preset
from training.pde.problems import make_problem
from training.pde.train import train


def test_load_rebuilds_the_ema_model_from_the_stored_config(tmp_path):
    config = preset("cpu", make_problem("hydrogen"), iterations=2, batch_size=16,
                    fourier_features=4, hidden=8, threads=1, out=str(tmp_path))
    ema, _ = train(config, progress=False)
    loaded_config, model, ckpt = load_checkpoint(tmp_path / CHECKPOINT)
    assert loaded_config == config and ckpt["step"] == 2
    x = torch.randn(5, model.ndim, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(model(x), ema(x))


def test_missing_or_foreign_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="gone.pt' does not exist"):
        load_checkpoint(tmp_path / "gone.pt")
    foreign = tmp_path / "weights.pt"
    torch.save({"w": torch.zeros(2)}, foreign)
    with pytest.raises(ValueError, match="weights.pt' is not a training.pde checkpoint"):
        load_checkpoint(foreign)
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"junk")
    with pytest.raises(ValueError, match="junk.pt' is not a training.pde checkpoint"):
        load_checkpoint(junk)
