"""The gallery's photo encoder in int8 (`index.build --precision`): the service's parity rule
measured on the photo side, the graph made only when a photo needs it, the vectors it stores
(the int8 graph's own, the same bits on every build path), and clear errors. Real
sketchy-mini photos and sketches for calibration and parity."""

import logging

import numpy as np
import pytest
import torch

import training.cdk.model.quantize as quantize_mod
from index.build import build_index, parse_args
from index.embed import photo_encoder
from index.gallery import scan_gallery
from index.sharded import build_sharded
from index.shards import plan_shards
from index.store import current_version, load_index
from tests.conftest import DATA
from training.cdk.model.embedder import Embedder
from training.cdk.model.export import OnnxEncoder, encoder_path
from training.cdk.model.quantize import QuantizationError
from training.cdk.model.smoothing import Smoothing
from training.images import load_image

pytestmark = pytest.mark.skipif(not (DATA / "sketch").is_dir(),
                                reason=f"needs sketchy-mini at {DATA}")
PLAIN = Smoothing(k=0)  # the stored vectors are the embeddings themselves


@pytest.fixture(scope="module")
def trained_on_data(real_checkpoint, tmp_path_factory):
    """The untrained test checkpoint, its config naming sketchy-mini as its training data
    (where calibration and parity read their images)."""
    ckpt = torch.load(real_checkpoint, weights_only=True)
    ckpt["config"] = {**ckpt["config"], "data": str(DATA), "split": "sketchy2"}
    path = tmp_path_factory.mktemp("on-data") / "checkpoint.pt"
    torch.save(ckpt, path)
    return path


@pytest.fixture
def lenient(monkeypatch):
    """Parity thresholds any int8 graph meets: these tests are about what the build does
    with an int8 graph (parity itself: tests/cdk/test_quantize.py, and measured on the
    trained model in docs/index.md)."""
    monkeypatch.setattr(quantize_mod, "PARITY_OVERLAP", 0.0)
    monkeypatch.setattr(quantize_mod, "PARITY_MAP_DROP", 1.0)


def preprocessed(embedder, gallery):
    root, photos = scan_gallery(gallery)
    return embedder.preprocess([load_image(root / p.path) for p in photos], "photo").numpy()


def test_int8_gallery_stores_the_int8_graphs_vectors_on_every_path(
        trained_on_data, small_gallery, tmp_path, lenient):
    embedder = Embedder.from_checkpoint(trained_on_data, device="cpu")
    common = {"feature_cache": None, "smoothing": PLAIN, "progress": False}
    a = build_index(embedder, small_gallery, tmp_path / "a", trained_on_data, batch_size=4,
                    precision="int8", threads=1, **common)
    assert a.encoder == "onnxruntime int8" and a.embedded == 15 and a.from_cache == 0
    path = encoder_path(tmp_path / "a", embedder.checkpoint_sha256, "photo", precision="int8")
    int8 = OnnxEncoder(path, embedder.checkpoint_sha256, "photo", precision="int8")
    x = preprocessed(embedder, small_gallery)
    stored = load_index(tmp_path / "a").index.reconstruct_n(0, 15)
    np.testing.assert_array_equal(stored, int8(x))  # the graph's own vectors, in one batch
    fp32 = embedder.encode(torch.from_numpy(x), "photo").numpy()
    assert not np.allclose(stored, fp32, atol=1e-4)  # really 8-bit arithmetic ...
    cos = (stored * fp32).sum(1) / np.linalg.norm(stored, axis=1) / np.linalg.norm(fp32, axis=1)
    assert cos.min() > 0.9, cos  # ... of the same embeddings

    # other batches, threads, decoding workers and the sharded path: the same bits
    b = build_index(embedder, small_gallery, tmp_path / "b", trained_on_data, batch_size=7,
                    workers=2, precision="int8", threads=2, **common)
    s = build_sharded(embedder, small_gallery, tmp_path / "s", trained_on_data, batch_size=3,
                      shard_size=4, precision="int8", threads=1, **common)
    assert b.encoder == s.encoder == "onnxruntime int8"
    for out in ("b", "s"):
        np.testing.assert_array_equal(load_index(tmp_path / out).index.reconstruct_n(0, 15),
                                      stored)
    # int8 shards are not float32 shards: a float32 rebuild of the folder embeds them again
    root, photos = scan_gallery(small_gallery)
    keys = {p: {sh.key for sh in plan_shards(tmp_path / "s" / "shards", root, photos, 8,
                                             embedder.checkpoint_sha256, 4, p).shards}
            for p in ("fp32", "int8")}
    assert not keys["fp32"] & keys["int8"]
    again = build_sharded(embedder, small_gallery, tmp_path / "s", trained_on_data,
                          shard_size=4, precision="fp32", threads=1, **common)
    assert again.embedded == 15 and again.encoder == "onnxruntime fp32"
    np.testing.assert_allclose(load_index(tmp_path / "s").index.reconstruct_n(0, 15), fp32,
                               rtol=1e-4, atol=1e-5)


def test_auto_makes_no_graph_when_every_photo_is_cached(trained_on_data, small_gallery,
                                                        tmp_path, monkeypatch):
    embedder = Embedder.from_checkpoint(trained_on_data, device="cpu")

    def no_graph(*args, **kwargs):
        raise AssertionError("no photo needed the encoder")

    monkeypatch.setattr("training.cdk.model.export.load_or_export", no_graph)
    root, photos = scan_gallery(small_gallery)
    feats = embedder.backbone_of("photo").module(
        torch.from_numpy(preprocessed(embedder, small_gallery))).detach()
    monkeypatch.setattr("index.embed.cached_features",
                        lambda e, r, p, c: (list(range(len(p))), feats[: len(p)]))
    report = build_index(embedder, small_gallery, tmp_path / "a", trained_on_data,
                         feature_cache="unused", smoothing=PLAIN, progress=False)
    assert report.from_cache == 15 and report.encoder == ""
    assert not (tmp_path / "a" / "encoders").exists()


def test_int8_that_cannot_be_made_stops_the_build_and_auto_falls_back(
        real_checkpoint, small_gallery, tmp_path, caplog, monkeypatch):
    monkeypatch.setattr("index.embed._ONNX", {})  # this process's graphs: made again here
    embedder = Embedder.from_checkpoint(real_checkpoint, device="cpu")  # no training data
    build_index(embedder, small_gallery, tmp_path / "ix", real_checkpoint, precision="fp32",
                smoothing=PLAIN, progress=False)
    version = current_version(tmp_path / "ix")
    before = load_index(tmp_path / "ix").index.reconstruct_n(0, 15)
    with pytest.raises(QuantizationError, match="training data"):
        build_index(embedder, small_gallery, tmp_path / "ix", real_checkpoint,
                    precision="int8", smoothing=PLAIN, progress=False)
    assert current_version(tmp_path / "ix") == version  # nothing lost: the one before
    with caplog.at_level(logging.WARNING):
        auto = build_index(embedder, small_gallery, tmp_path / "ix", real_checkpoint,
                           smoothing=PLAIN, progress=False)
    assert auto.encoder == "onnxruntime fp32" and "float32" in caplog.text
    np.testing.assert_array_equal(load_index(tmp_path / "ix").index.reconstruct_n(0, 15),
                                  before)


def test_precision_flag_and_its_errors(real_embedder, tmp_path):
    assert parse_args(["--checkpoint", "c", "--photos", "p", "--out", "o"]).precision == "auto"
    with pytest.raises(SystemExit):
        parse_args(["--checkpoint", "c", "--photos", "p", "--out", "o", "--precision", "int4"])
    with pytest.raises(ValueError, match="PyTorch encoder runs in float32"):
        photo_encoder(real_embedder, tmp_path, 1, "torch", "int8")
    with pytest.raises(ValueError, match="unknown precision"):
        photo_encoder(real_embedder, tmp_path, 1, "onnx", "fp16")
