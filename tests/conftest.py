import os
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# SKETCHY_MINI: where the data is when the checkout is not beside shared/ (as tests/cdk read it)
DATA = Path(os.environ.get("SKETCHY_MINI", REPO.parent / "shared" / "data" / "sketchy-mini"))
SMALL_CLASSES = ("airplane", "cat", "tree")


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


@pytest.fixture(scope="session")
def small_gallery(tmp_path_factory) -> Path:
    """3 classes x 5 photos: copies from sketchy-mini when it is there (not links: the index
    refuses photos that lead outside the gallery), else generated images."""
    root = tmp_path_factory.mktemp("gallery") / "photos"
    if not (DATA / "photo").is_dir():
        from tests.fakes import make_gallery

        return make_gallery(root, classes=3, per_class=5, size=64)
    for cls in SMALL_CLASSES:
        (root / cls).mkdir(parents=True)
        for f in sorted((DATA / "photo" / cls).iterdir())[:5]:
            shutil.copyfile(f, root / cls / f.name)
    return root


@pytest.fixture(scope="session")
def small_sketches(small_gallery) -> list[bytes]:
    """PNG bytes of a few query sketches (real ones when sketchy-mini is there)."""
    if (DATA / "sketch").is_dir():
        return [sorted((DATA / "sketch" / c).iterdir())[0].read_bytes() for c in SMALL_CLASSES]
    from tests.service.conftest import sketch_png

    return [sketch_png(seed=s) for s in range(3)]


@pytest.fixture(scope="session")
def real_checkpoint(tmp_path_factory) -> Path:
    """An untrained but complete training.cdk checkpoint (small head and input size; no raw
    coordinates, so its embeddings are the 8 modes; ``hybrid_checkpoint`` has them)."""
    from training.cdk.model.checkpoint import init_checkpoint

    return init_checkpoint(tmp_path_factory.mktemp("ckpt") / "checkpoint.pt", modes=8, hidden=16,
                           image_size=64, raw_dims=0)


@pytest.fixture(scope="session")
def hybrid_checkpoint(tmp_path_factory) -> Path:
    """As ``real_checkpoint``, with 8 raw coordinates after the 8 modes (L = 16 wide)."""
    from training.cdk.model.checkpoint import init_checkpoint

    return init_checkpoint(tmp_path_factory.mktemp("ckpt") / "hybrid.pt", modes=8, hidden=16,
                           image_size=64, raw_dims=8)


@pytest.fixture(scope="session")
def real_embedder(real_checkpoint):
    from training.cdk.model.embedder import Embedder

    return Embedder.from_checkpoint(real_checkpoint, device="cpu")


@pytest.fixture(scope="session")
def real_index(tmp_path_factory, real_embedder, real_checkpoint, small_gallery) -> Path:
    from index.build import build_index

    out = tmp_path_factory.mktemp("real") / "index"
    build_index(real_embedder, small_gallery, out, real_checkpoint, progress=False)
    return out
