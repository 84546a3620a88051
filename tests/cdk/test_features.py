"""Training's backbone features through the backbone's ONNX Runtime graph (CPU, enough
images): the same features as PyTorch's eager module, the graph exported once per weights and
kept in the cache folder (a damaged one exported again)."""

import numpy as np
import pytest
import torch
from PIL import Image

import training.cdk.features as features_mod
from training.cdk.features import backbone_graph, extract_features
from training.cdk.model.backbones import build_backbone


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
    (kept,) = (tmp_path / "cache" / "graphs").iterdir()
    assert kept.name.startswith("efficientnet-lite0-64-gem-flip-")

    def no_export(*a, **k):
        raise AssertionError("exported again although the graph is kept")

    monkeypatch.setattr("training.cdk.model.export.export_module", no_export)
    again = backbone_graph(backbone, backbone.module, 64, tmp_path / "cache", 1)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        np.testing.assert_allclose(again(x.numpy()), backbone.module(x).numpy(), rtol=1e-4,
                                   atol=1e-5)
    kept.write_bytes(b"damaged")  # a damaged file is a cache miss: exported again
    monkeypatch.undo()
    monkeypatch.setattr(features_mod, "ONNX_MIN_IMAGES", 2)
    backbone_graph(backbone, backbone.module, 64, tmp_path / "cache", 1)
    assert kept.read_bytes() != b"damaged"
