import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[2]
SKETCHY_MINI = Path(os.environ.get("SKETCHY_MINI", REPO.parent / "shared/data/sketchy-mini"))


@pytest.fixture
def sketchy_mini() -> Path:
    if not (SKETCHY_MINI / "photo").is_dir():
        pytest.skip(f"sketchy-mini not found at {SKETCHY_MINI} (set SKETCHY_MINI to its path)")
    return SKETCHY_MINI
