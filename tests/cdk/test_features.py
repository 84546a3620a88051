"""Training's backbone features through the backbone's ONNX Runtime graph (CPU, enough
images): the same features as PyTorch's eager module, the graph exported once per weights and
kept in the cache folder (a damaged one exported again); mirror-averaged features also cache
their first view under the one-view key (what an index of photos in one view reads)."""

import numpy as np
import pytest
import torch
from PIL import Image

import training.cdk.features as features_mod
from training.cdk.features import backbone_graph, extract_features, find_cached
from training.cdk.model.backbones import build_backbone, weights_fingerprint, with_flip_average


@pytest.fixture(scope="module")
def backbone():
    return build_backbone("efficientnet-lite0", flip_average=True, pooling="gem")


def _images(folder, n):
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(n):
        Image.fromarray(rng.integers(0, 255, (40, 48, 3), dtype=np.uint8)).save(folder / f"{i}.png")
        out.append(folder / f"{i}.png")
    return out


def test_graph_features_equal_the_modules_and_the_graph_is_kept(backbone, tmp_path,
                                                                 monkeypatch):
    files = _images(tmp_path / "img", 6)
    plain = extract_features(files, backbone, 64, None, device="cpu")  # eager: few images
    monkeypatch.setattr(features_mod, "ONNX_MIN_IMAGES", 2)
    graphed = extract_features(files, backbone, 64, tmp_path / "cache", device="cpu")
    np.testing.assert_allclose(graphed.numpy(), plain.numpy(), rtol=1e-4, atol=1e-5)
    # the one-view graph runs both views (the sketches of these weights share it)
    (kept,) = (tmp_path / "cache" / "graphs").iterdir()
    assert kept.name.startswith("efficientnet-lite0-64-gem-") and "-flip-" not in kept.name
    one = with_flip_average(backbone, False)

    def no_export(*a, **k):
        raise AssertionError("exported again although the graph is kept")

    monkeypatch.setattr("training.cdk.model.export.export_module", no_export)
    again = backbone_graph(one, one.module, 64, tmp_path / "cache", 1)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        np.testing.assert_allclose(again(x.numpy()), one.module(x).numpy(), rtol=1e-4,
                                   atol=1e-5)
    kept.write_bytes(b"damaged")  # a damaged file is a cache miss: exported again
    monkeypatch.undo()
    monkeypatch.setattr(features_mod, "ONNX_MIN_IMAGES", 2)
    backbone_graph(one, one.module, 64, tmp_path / "cache", 1)
    assert kept.read_bytes() != b"damaged"


@pytest.mark.parametrize("graph", [False, True])
def test_mirror_averaged_features_cache_their_first_view(backbone, tmp_path, monkeypatch,
                                                         graph):
    if graph:
        monkeypatch.setattr(features_mod, "ONNX_MIN_IMAGES", 2)
    files = _images(tmp_path / "img", 5)
    cache = tmp_path / "cache"
    averaged = extract_features(files, backbone, 64, cache, device="cpu")
    one = with_flip_average(backbone, False)
    x = torch.cat([features_mod.images_to_tensor([features_mod.load_image(f)], 64,
                                                 backbone.mean, backbone.std) for f in files])
    with torch.no_grad():  # the references: PyTorch's modules, each image on its own
        np.testing.assert_allclose(averaged.numpy(), backbone.module(x).numpy(), rtol=1e-4,
                                   atol=1e-5)
        first = one.module(x).numpy()
    fingerprint = weights_fingerprint(backbone.module)
    rows, cached = find_cached(files, one, fingerprint, 64, cache)
    assert rows == list(range(5))
    np.testing.assert_allclose(cached.numpy(), first, rtol=1e-4, atol=1e-5)
    assert not np.allclose(first, averaged.numpy(), rtol=1e-3, atol=1e-3)
    # the one-view entry is what extract_features of the one-view backbone reads back
    def no_compute(*a, **k):
        raise AssertionError("computed again although the first view is cached")

    monkeypatch.setattr(features_mod, "_compute", no_compute)
    np.testing.assert_array_equal(extract_features(files, one, 64, cache).numpy(),
                                  cached.numpy())
    rows, mean = find_cached(files, backbone, fingerprint, 64, cache)  # and the average's
    np.testing.assert_array_equal(mean.numpy(), averaged.numpy())
