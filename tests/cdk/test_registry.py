"""Adding a backbone is one ``register`` call: a tiny CNN registered here trains on frozen
features through the command line, fine-tunes with a stage split, checkpoints, and the
Embedder rebuilds and embeds with it, with no other code naming it."""

import json

import numpy as np
import pytest
import torch
from torch import nn

from training.cdk import train as train_mod
from training.cdk.__main__ import main
from training.cdk.config import make_config
from training.cdk.data import scan
from training.cdk.features import extract_features
from training.cdk.finetune import Split
from training.cdk.make_bundle import embedder_of_checkpoint
from training.cdk.metrics import retrieval_metrics
from training.cdk.model.backbones import (
    BACKBONES,
    BackboneSpec,
    build_backbone,
    load_state_dict_file,
    register,
    stages_at_pools,
)
from training.cdk.run import embed_features
from training.cdk.train import TrainData
from training.images import load_image

from .test_finetune import _write_dataset


def _tiny_trunk() -> nn.Module:  # (N, 3, 16, 16) -> (N, 8, 4, 4)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(4, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))


def _tiny_load(trunk: nn.Module, weights: str | None) -> None:
    if weights is None:  # its "packaged" weights: a fixed seeded initialisation
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(123)
            trunk.load_state_dict(_tiny_trunk().state_dict())
    else:
        trunk.load_state_dict(load_state_dict_file(weights))


@pytest.fixture
def tiny_cnn():
    spec = register(BackboneSpec("tiny-cnn", native_size=16, feature_dim=8, trunk=_tiny_trunk,
                                 load=_tiny_load, stages=stages_at_pools, stage_count=2))
    yield spec
    del BACKBONES[spec.name]


def test_a_registered_backbone_is_complete(tiny_cnn, tmp_path, capsys):
    with pytest.raises(ValueError, match="already registered"):
        register(tiny_cnn)
    cfg = make_config(backbone="tiny-cnn")
    assert cfg.image_size == 16  # its native size
    with pytest.raises(ValueError, match="trainable_stages must be <= 2 for tiny-cnn"):
        make_config(backbone="tiny-cnn", finetune=True, photo_flip_average=False, raw_dims=0,
                    trainable_stages=3)
    # frozen features, end to end through the command line: 1 training class, 2 test ones
    root = _write_dataset(tmp_path / "d", n=6, classes=("apple", "boat", "door"))
    split = tmp_path / "split.txt"
    split.write_text("boat\ndoor\n")
    out = tmp_path / "run"
    assert main(["--data", str(root), "--split", str(split), "--out", str(out),
                 "--cache-dir", str(tmp_path / "cache"), "--backbone", "tiny-cnn",
                 "--modes", "4", "--hidden", "16", "--raw-dims", "4", "--batch-size", "6",
                 "--epochs", "3", "--k", "2", "--gallery-queries", "2",
                 "--gallery-topk", "2"]) == 0
    assert "preset cpu" in capsys.readouterr().out
    m = json.loads((out / "metrics.json").read_text())
    assert len(m["history"]) == 3 and m["backbone"] == "tiny-cnn"
    e = embedder_of_checkpoint(out / "checkpoint.pt", "cpu")[0]
    assert (e.backbone, e.image_size, e.modes, e.width) == ("tiny-cnn", 16, 4, 8)
    test = scan(root).restrict(["boat", "door"])
    f = e.embed([load_image(p) for p in test.sketches], "sketch")
    g = e.embed([load_image(p) for p in test.photos], "photo")
    assert f.shape == g.shape == (12, 8)
    r = retrieval_metrics(f, g, test.sketch_labels, test.photo_labels, 2)
    assert r["map_all"] == pytest.approx(m["map_all"], abs=1e-6)
    assert r["precision_at_k"] == pytest.approx(m["precision_at_k"], abs=1e-6)


def test_a_registered_backbone_fine_tunes_by_its_stages(tiny_cnn, tmp_path):
    bb = build_backbone("tiny-cnn")
    x = torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        for K in (0, 1, 2):
            s = Split(bb.module, "tiny-cnn", K)
            torch.testing.assert_close(s.tail(s.trunk(x)), bb.module(x))
    ds = scan(_write_dataset(tmp_path / "d", n=4))
    feats = [extract_features(f, bb, 16, None, device="cpu") for f in (ds.sketches, ds.photos)]
    data = TrainData(feats[0], feats[1], ds.sketch_labels, ds.photo_labels, None,
                     list(ds.sketches), list(ds.photos))
    cfg = make_config(backbone="tiny-cnn", modes=4, hidden=16, batch_size=4, epochs=2,
                      finetune=True, trainable_stages=1, backbone_lr=0.05,
                      photo_flip_average=False, raw_dims=0, instance_share=0.0,
                      out=str(tmp_path / "o"),
                      cache_dir=str(tmp_path / "cache"))
    res = train_mod.train(cfg, data, bb, cfg.out, device="cpu")
    before = bb.module.state_dict()
    for m in ("sketch", "photo"):
        after = res.backbones[m].state_dict()
        assert torch.equal(after["trunk.0.weight"], before["trunk.0.weight"])  # frozen stage
        assert not torch.equal(after["trunk.3.weight"], before["trunk.3.weight"])  # trained
    e = embedder_of_checkpoint(tmp_path / "o" / "checkpoint.pt", "cpu")[0]
    assert e.finetuned
    for mod, files in (("sketch", ds.sketches), ("photo", ds.photos)):
        want = embed_features(res.heads[mod], extract_features(
            files, bb, 16, None, module=res.backbones[mod]), "cpu")
        want = want / want.norm(dim=1, keepdim=True)  # the preset's unit embeddings
        np.testing.assert_allclose(e.embed([load_image(f) for f in files], mod), want.numpy(),
                                   rtol=1e-4, atol=1e-5)
