"""The sketch encoder the service runs: the model bundle's ONNX graph against the PyTorch
modules it replaces on the CPU, and what the service refuses (another graph, a changed file)."""

import io
import shutil
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from PIL import Image

import training.cdk.model.export as export
from index.build import build_index
from index.store import load_index
from service.encoders import TorchEncoder, pick_encoder
from service.loading import load_engine
from service.settings import Settings
from tests.bundles import untrained_bundle
from training.cdk.model.bundle import BundleError
from training.cdk.model.export import EncoderMismatchError, OnnxEncoder

# Stated tolerance of the parity: ONNX Runtime and PyTorch both compute in float32; they
# differ by summation order only.
ATOL, RTOL = 1e-5, 1e-4


def sketch_batch(model, sketches: list[bytes]) -> torch.Tensor:
    images = [Image.open(io.BytesIO(b)) for b in sketches]
    return model.preprocess(images * 2, "sketch")  # (6, 3, S, S)


def test_onnx_embeddings_equal_pytorch(real_bundle, small_sketches):
    batch = sketch_batch(real_bundle, small_sketches)
    onnx = real_bundle.encoder("sketch", "fp32")
    assert (onnx.name, onnx.precision, onnx.width) == ("onnxruntime", "fp32", real_bundle.width)
    assert onnx.image_size == real_bundle.size_of("sketch")
    got = onnx(batch)
    want = TorchEncoder(real_bundle.embedder("cpu"))(batch)
    assert got.dtype == np.float32 and got.shape == want.shape == (6, real_bundle.width)
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(onnx(batch[:1]), want[:1], atol=ATOL, rtol=RTOL)  # any batch


def test_concurrent_calls_agree(real_bundle, small_sketches):
    batch = sketch_batch(real_bundle, small_sketches)
    onnx = real_bundle.encoder("sketch")
    want = onnx(batch)
    with ThreadPoolExecutor(4) as pool:
        for got in pool.map(lambda _: onnx(batch), range(8)):
            np.testing.assert_array_equal(got, want)


def test_a_graph_that_is_not_the_one_asked_for_is_refused(real_bundle, tmp_path):
    graph = real_bundle.read("sketch.onnx")
    with pytest.raises(EncoderMismatchError, match="modality='sketch'") as err:
        OnnxEncoder(graph, modality="photo", source="sketch.onnx")
    assert "sketch.onnx" in str(err.value)
    with pytest.raises(EncoderMismatchError, match="precision='fp32'"):
        OnnxEncoder(graph, precision="int8")
    with pytest.raises(EncoderMismatchError, match="width='8'"):
        OnnxEncoder(graph, width=16)
    bad = tmp_path / "sketch.onnx"
    bad.write_bytes(b"not a model")
    with pytest.raises(EncoderMismatchError, match="sketch.onnx"):
        OnnxEncoder(bad, source=str(bad))
    older = with_metadata(graph, format="sketchsvd-encoder-3")
    with pytest.raises(EncoderMismatchError, match=f"format='sketchsvd-encoder-3'.*"
                                                   f"format='{export.FORMAT}'"):
        OnnxEncoder(older)


def test_pick_encoder(tmp_path, real_bundle):
    assert pick_encoder(Settings(index=tmp_path, encoder="torch"), real_bundle).name == "torch"
    enc = pick_encoder(Settings(index=tmp_path, device="cpu"), real_bundle)
    assert (enc.name, enc.precision) == ("onnxruntime", "fp32")  # the bundle's choice
    with pytest.raises(BundleError, match="serves no int8 sketch encoder: no int8 graph"):
        pick_encoder(Settings(index=tmp_path, device="cpu", precision="int8"), real_bundle)
    with pytest.raises(ValueError, match="precision int8 is the ONNX encoder's"):
        pick_encoder(Settings(index=tmp_path, encoder="torch", precision="int8"), real_bundle)


def copy_bundle(bundle, folder):
    shutil.copytree(bundle.path, folder)
    return folder


def test_service_refuses_a_changed_or_planted_graph(tmp_path, real_index, real_bundle):
    model = copy_bundle(real_bundle, tmp_path / "model")
    settings = Settings(index=real_index, model=model, device="cpu")
    other = untrained_bundle(tmp_path / "other", modes=8, hidden=16, image_size=64, seed=1,
                             raw_dims=0, sketch_flip_average=False)
    (model / "sketch.onnx").write_bytes(other.read("sketch.onnx"))  # a valid graph, planted
    with pytest.raises(BundleError, match="sketch.onnx is not the file model.json lists"):
        load_engine(settings)
    (model / "sketch.onnx").unlink()
    with pytest.raises(BundleError, match="cannot read sketch.onnx"):
        load_engine(settings)


@pytest.fixture(scope="module")
def sketchy_index(tmp_path_factory, sketchy_mini):
    """20 sketchy-mini classes (500 photos) indexed by an untrained bundle with a
    pretrained backbone and L=64 (more distinct scores than L=8)."""
    work = tmp_path_factory.mktemp("sketchy-onnx")
    photos = work / "photos"
    classes = sorted(p.name for p in (sketchy_mini / "photo").iterdir())[:20]
    for cls in classes:
        shutil.copytree(sketchy_mini / "photo" / cls, photos / cls)
    model = untrained_bundle(work, modes=64, hidden=64, image_size=96,
                             sketch_flip_average=False)
    build_index(model, photos, work / "index", progress=False)
    return model, work / "index", classes


def test_top10_of_sketchy_queries_identical(sketchy_index, sketchy_mini):
    model, index, classes = sketchy_index
    gallery = load_index(index, model_sha256=model.sha256)
    files = [sorted((sketchy_mini / "sketch" / c).iterdir())[i] for c in classes for i in (0, 7)]
    batch = model.preprocess([Image.open(f) for f in files], "sketch")  # (40, 3, 96, 96)
    want = TorchEncoder(model.embedder("cpu"))(batch)
    got = model.encoder("sketch")(batch)
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)
    for d in (16, 64):
        _, rows_torch = gallery.search(np.ascontiguousarray(want[:, :d]), 10)
        _, rows_onnx = gallery.search(np.ascontiguousarray(got[:, :d]), 10)
        np.testing.assert_array_equal(rows_onnx, rows_torch)


def test_single_view_queries_of_a_mirror_averaging_model(tmp_path, small_gallery,
                                                        small_sketches):
    # a model trained with --sketch-flip-average: its bundle also holds the single-view
    # sketch graph, which --no-sketch-flip-average serves: the pooled features of the trunk alone
    from training.cdk.model.backbones import global_pool

    model = untrained_bundle(tmp_path, modes=8, hidden=16, image_size=64, raw_dims=0,
                             sketch_flip_average=True)
    assert set(model.encoders) == {"sketch", "photo", "sketch-single-view",
                                   "photo-single-view"}
    assert model.encoder_name("sketch", None) == model.encoder_name("sketch", True) == "sketch"
    assert model.encoder_name("sketch", False) == "sketch-single-view"
    single = model.embedder("cpu", sketch_flip_average=False)
    both = model.embedder("cpu")
    assert not single.sketch_flip_average and single.trained_sketch_flip_average
    batch = sketch_batch(model, small_sketches)
    trunk = single.backbone_of("sketch").module.trunk
    with torch.no_grad():
        want = single.head(global_pool(trunk(batch), single.pooling), "sketch").numpy()
    np.testing.assert_allclose(TorchEncoder(single)(batch), want, atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(model.encoder("sketch-single-view")(batch), want, atol=ATOL,
                               rtol=RTOL)
    assert not np.allclose(want, TorchEncoder(both)(batch), atol=1e-3)
    np.testing.assert_allclose(model.encoder("sketch")(batch), TorchEncoder(both)(batch),
                               atol=ATOL, rtol=RTOL)
    # the service setting reaches the engine and /info
    build_index(model, small_gallery, tmp_path / "index", progress=False)
    for mirror, expected in ((False, want), (None, TorchEncoder(both)(batch))):
        engine = load_engine(Settings(index=tmp_path / "index", device="cpu",
                                      sketch_flip_average=mirror))
        assert engine.sketch_flip_average is (mirror is None)
        np.testing.assert_allclose(engine.encoder(batch), expected, atol=ATOL, rtol=RTOL)


def with_metadata(model: bytes, **changes: str | None) -> bytes:
    """`model` with metadata entries changed (None: removed)."""
    import onnx

    proto = onnx.load_from_string(model)
    props = {p.key: p.value for p in proto.metadata_props}
    props.update(changes)
    del proto.metadata_props[:]
    for key, value in props.items():
        if value is not None:
            proto.metadata_props.add(key=key, value=value)
    return proto.SerializeToString()


def test_sketches_at_their_own_size_export_and_serve_at_it(tmp_path, small_gallery,
                                                          small_sketches):
    # a model whose sketches are embedded at 48 px and photos at 64: each graph takes its
    # modality's size and equals PyTorch, and the service's engine resizes query sketches
    # to 48
    model = untrained_bundle(tmp_path, modes=8, hidden=16, image_size=64,
                             sketch_image_size=48, raw_dims=0, sketch_flip_average=False)
    e = model.embedder("cpu")
    assert (model.size_of("sketch"), model.size_of("photo"), e.image_size) == (48, 64, 64)
    batch = sketch_batch(model, small_sketches)
    assert tuple(batch.shape) == (6, 3, 48, 48)
    for modality, x in (("sketch", batch), ("photo", model.preprocess(
            [Image.open(io.BytesIO(b)) for b in small_sketches], "photo"))):
        onnx = model.encoder(modality)
        assert onnx.image_size == model.size_of(modality) == x.shape[-1]
        with torch.no_grad():
            want = e.encode(x, modality).numpy()
        np.testing.assert_allclose(onnx(x), want, atol=ATOL, rtol=RTOL)
    index = tmp_path / "index"
    build_index(model, small_gallery, index, progress=False)
    engine = load_engine(Settings(index=index, encoder="onnx", device="cpu"))
    images = [Image.open(io.BytesIO(b)) for b in small_sketches]
    got = engine.encoder(engine.model.preprocess(images, "sketch"))
    np.testing.assert_allclose(got, e.embed(images, "sketch"), atol=ATOL, rtol=RTOL)
    assert engine.decode_side == 2 * 48
    from fastapi.testclient import TestClient

    from service.main import create_app

    with TestClient(create_app(Settings(index=index, encoder="onnx"),
                               loader=lambda s: engine)) as client:
        assert client.get("/info").json()["sketch_size"] == 48
