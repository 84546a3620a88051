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
    coordinates, so its embeddings are the 8 modes)."""
    from tests.bundles import init_checkpoint

    return init_checkpoint(tmp_path_factory.mktemp("ckpt") / "checkpoint.pt", modes=8, hidden=16,
                           image_size=64, raw_dims=0)


@pytest.fixture(scope="session")
def real_bundle(tmp_path_factory):
    """The model bundle of an untrained checkpoint like ``real_checkpoint`` (float32 graphs;
    its sketches embedded alone, photos mirror-averaged as the cpu preset does)."""
    from tests.bundles import untrained_bundle

    return untrained_bundle(tmp_path_factory.mktemp("bundle"), modes=8, hidden=16,
                            image_size=64, raw_dims=0, sketch_flip_average=False)


@pytest.fixture(scope="session")
def hybrid_bundle(tmp_path_factory):
    """As ``real_bundle``, with 8 raw coordinates after the 8 modes (16 wide)."""
    from tests.bundles import untrained_bundle

    return untrained_bundle(tmp_path_factory.mktemp("hybrid"), modes=8, hidden=16,
                            image_size=64, raw_dims=8, sketch_flip_average=False)


@pytest.fixture(scope="session")
def int8_bundle(tmp_path_factory):
    """An untrained bundle written with sketchy-mini as its training data (split 2), so it
    holds int8 graphs calibrated and measured as training writes them. Parity thresholds
    any int8 graph meets: the tests that use it are about what index and service do with
    an int8 graph (parity itself: tests/cdk/test_quantize.py)."""
    import training.cdk.quantize as quantize_mod
    from tests.bundles import untrained_bundle

    if not (DATA / "photo").is_dir():
        pytest.skip(f"sketchy-mini data not found at {DATA}")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(quantize_mod, "PARITY_OVERLAP", 0.0)
        mp.setattr(quantize_mod, "PARITY_MAP_DROP", 1.0)
        return untrained_bundle(tmp_path_factory.mktemp("int8"), data=DATA, modes=8,
                                hidden=16, image_size=64, raw_dims=0,
                                sketch_flip_average=False)


@pytest.fixture(scope="session")
def real_embedder(real_bundle):
    return real_bundle.embedder("cpu")


@pytest.fixture(scope="session")
def real_index(tmp_path_factory, real_bundle, small_gallery) -> Path:
    from index.build import build_index

    out = tmp_path_factory.mktemp("real") / "index"
    build_index(real_bundle, small_gallery, out, progress=False)
    return out
