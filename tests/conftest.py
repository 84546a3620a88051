from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data" / "sketchy-mini"


@pytest.fixture(autouse=True, scope="session")
def _few_threads():
    # The test machine is shared: keep torch and FAISS to one thread each.
    import faiss
    import torch

    torch.set_num_threads(1)
    faiss.omp_set_num_threads(1)


@pytest.fixture(scope="session")
def sketchy_mini() -> Path:
    if not (DATA / "photo").is_dir():
        pytest.skip(f"sketchy-mini data not found at {DATA}")
    return DATA
