"""The gallery's photo encoder in int8 (`index.build --precision`): the bundle's int8 graph,
calibrated when the bundle was written, stores the same bits on every build path; a bundle
without one is a clear error for int8 and float32 for auto. Real sketchy-mini photos and
sketches for calibration and parity."""

import numpy as np
import pytest
import torch

from index.build import build_index, parse_args
from index.embed import photo_encoder
from index.gallery import scan_gallery
from index.sharded import build_sharded
from index.shards import plan_shards
from index.store import current_version, load_index
from tests.conftest import DATA
from training.cdk.model.bundle import BundleError
from training.cdk.model.smoothing import Smoothing
from training.images import load_image

pytestmark = pytest.mark.skipif(not (DATA / "sketch").is_dir(),
                                reason=f"needs sketchy-mini at {DATA}")
PLAIN = Smoothing(k=0)  # the stored vectors are the embeddings themselves


def preprocessed(model, gallery):
    scan = scan_gallery(gallery)
    return model.preprocess([load_image(scan.root / p.path) for p in scan.photos],
                            "photo").numpy()


def test_int8_gallery_stores_the_bundles_int8_vectors_on_every_path(int8_bundle, small_gallery,
                                                                    tmp_path):
    model = int8_bundle
    photo = model.encoder_name("photo", False)  # the default: one view a photo
    assert model.encoders[photo].graphs["int8"] == "photo-single-view.int8.onnx"
    common = {"feature_cache": None, "smoothing": PLAIN, "progress": False}
    a = build_index(model, small_gallery, tmp_path / "a", batch_size=4, precision="int8",
                    threads=1, **common)
    assert a.encoder == "onnxruntime int8" and a.embedded == 15 and a.from_cache == 0
    x = preprocessed(model, small_gallery)
    stored = load_index(tmp_path / "a").index.reconstruct_n(0, 15)
    np.testing.assert_array_equal(stored, model.encoder(photo, "int8")(x))  # one batch
    fp32 = model.embedder("cpu", photo_flip_average=False).encode(torch.from_numpy(x),
                                                                 "photo").numpy()
    assert not np.allclose(stored, fp32, atol=1e-4)  # really 8-bit arithmetic ...
    cos = (stored * fp32).sum(1) / np.linalg.norm(stored, axis=1) / np.linalg.norm(fp32, axis=1)
    # ... of the same embeddings (8 untrained modes, one view: no mirror average to smooth
    # the rounding; random directions would score about 0 +- 0.35)
    assert cos.mean() > 0.95 and cos.min() > 0.8, cos

    # other batches, threads, decoding workers and the sharded path: the same bits
    b = build_index(model, small_gallery, tmp_path / "b", batch_size=7, workers=2,
                    precision="int8", threads=2, **common)
    s = build_sharded(model, small_gallery, tmp_path / "s", batch_size=3, shard_size=4,
                      precision="int8", threads=1, **common)
    assert b.encoder == s.encoder == "onnxruntime int8"
    for out in ("b", "s"):
        np.testing.assert_array_equal(load_index(tmp_path / out).index.reconstruct_n(0, 15),
                                      stored)
    # int8 shards are not float32 shards: a float32 rebuild of the folder embeds them again
    scan = scan_gallery(small_gallery)
    keys = {p: {sh.key for sh in plan_shards(tmp_path / "s" / "shards", scan.root,
                                             scan.photos, 8, model.sha256, 4, p).shards}
            for p in ("fp32", "int8")}
    assert not keys["fp32"] & keys["int8"]
    again = build_sharded(model, small_gallery, tmp_path / "s", shard_size=4, precision="fp32",
                          threads=1, **common)
    assert again.embedded == 15 and again.encoder == "onnxruntime fp32"
    np.testing.assert_allclose(load_index(tmp_path / "s").index.reconstruct_n(0, 15), fp32,
                               rtol=1e-4, atol=1e-5)


def test_auto_serves_the_bundles_choice(int8_bundle, small_gallery, tmp_path):
    chosen = int8_bundle.encoders["photo-single-view"].precision
    report = build_index(int8_bundle, small_gallery, tmp_path / "ix", smoothing=PLAIN,
                         progress=False)
    assert report.encoder == f"onnxruntime {chosen}"


def test_int8_of_a_bundle_without_one_stops_the_build_and_auto_serves_float32(
        real_bundle, small_gallery, tmp_path):
    assert real_bundle.encoders["photo"].graphs["int8"] is None  # written without data
    build_index(real_bundle, small_gallery, tmp_path / "ix", precision="fp32", smoothing=PLAIN,
                progress=False)
    version = current_version(tmp_path / "ix")
    before = load_index(tmp_path / "ix").index.reconstruct_n(0, 15)
    with pytest.raises(BundleError, match="serves no int8 photo-single-view encoder: no int8 "
                                          "graph: "
                                          "calibrating int8 needs the training data"):
        build_index(real_bundle, small_gallery, tmp_path / "ix", precision="int8",
                    smoothing=PLAIN, progress=False)
    assert current_version(tmp_path / "ix") == version  # nothing lost: the one before
    auto = build_index(real_bundle, small_gallery, tmp_path / "ix", smoothing=PLAIN,
                       progress=False)
    assert auto.encoder == "onnxruntime fp32"
    np.testing.assert_array_equal(load_index(tmp_path / "ix").index.reconstruct_n(0, 15),
                                  before)


def test_precision_flag_and_its_errors(real_bundle):
    assert parse_args(["--model", "m", "--photos", "p", "--out", "o"]).precision == "auto"
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", "--photos", "p", "--out", "o", "--precision", "int4"])
    with pytest.raises(ValueError, match="PyTorch encoder runs in float32"):
        photo_encoder(real_bundle, 1, "torch", "int8")
    with pytest.raises(ValueError, match="unknown precision"):
        photo_encoder(real_bundle, 1, "onnx", "fp16")
