"""The ONNX Runtime sketch encoder against the PyTorch one it replaces on the CPU."""

import io
import logging
import shutil
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from PIL import Image

import training.cdk.model.export as export
from index.build import build_index
from index.store import check_replaceable, load_index
from service.encoders import TorchEncoder, pick_encoder
from service.loading import load_engine
from service.settings import Settings
from training.cdk.model.checkpoint import init_checkpoint
from training.cdk.model.embedder import Embedder
from training.cdk.model.export import (
    EncoderFormatError,
    EncoderMismatchError,
    OnnxEncoder,
    encoder_path,
    export_encoder,
    load_or_export,
)

# Stated tolerance of the parity: ONNX Runtime and PyTorch both compute in float32; they
# differ by summation order only.
ATOL, RTOL = 1e-5, 1e-4


@pytest.fixture(scope="module")
def onnx_model(real_embedder) -> bytes:
    return export_encoder(real_embedder)


def sketch_batch(embedder, sketches: list[bytes]) -> torch.Tensor:
    images = [Image.open(io.BytesIO(b)) for b in sketches]
    return embedder.preprocess(images * 2, "sketch")  # (6, 3, S, S)


def test_onnx_embeddings_equal_pytorch(real_embedder, onnx_model, small_sketches):
    batch = sketch_batch(real_embedder, small_sketches)
    onnx = OnnxEncoder(onnx_model, real_embedder.checkpoint_sha256)
    assert (onnx.width, onnx.image_size) == (real_embedder.width, real_embedder.image_size)
    got = onnx(batch)
    want = TorchEncoder(real_embedder)(batch)
    assert got.dtype == np.float32 and got.shape == want.shape == (6, real_embedder.width)
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(onnx(batch[:1]), want[:1], atol=ATOL, rtol=RTOL)  # any batch


def test_concurrent_calls_agree(real_embedder, onnx_model, small_sketches):
    batch = sketch_batch(real_embedder, small_sketches)
    onnx = OnnxEncoder(onnx_model, real_embedder.checkpoint_sha256)
    want = onnx(batch)
    with ThreadPoolExecutor(4) as pool:
        for got in pool.map(lambda _: onnx(batch), range(8)):
            np.testing.assert_array_equal(got, want)


def test_another_checkpoints_encoder_is_refused(real_embedder, onnx_model):
    other = "f" * 64
    with pytest.raises(EncoderMismatchError, match="does not belong to this checkpoint") as err:
        OnnxEncoder(onnx_model, other, source="model.onnx")
    assert other in str(err.value) and "model.onnx" in str(err.value)
    with pytest.raises(EncoderMismatchError, match="modality='sketch'"):
        OnnxEncoder(onnx_model, real_embedder.checkpoint_sha256, modality="photo")


def test_garbage_file_is_refused_naming_it(tmp_path, real_embedder):
    bad = tmp_path / "sketch.onnx"
    bad.write_bytes(b"not a model")
    with pytest.raises(EncoderMismatchError, match="sketch.onnx"):
        OnnxEncoder(bad, real_embedder.checkpoint_sha256, source=str(bad))


def test_exported_once_then_read_from_the_index_folder(tmp_path, real_embedder, onnx_model,
                                                       monkeypatch):
    monkeypatch.setattr(export, "export_encoder", lambda *a, **k: onnx_model)
    first = load_or_export(real_embedder, tmp_path)
    path = encoder_path(tmp_path, real_embedder.checkpoint_sha256)
    assert path.read_bytes() == onnx_model and first.source == "exported sketch encoder (fp32)"

    def no_export(*a, **k):
        raise AssertionError("exported again although the file is there")

    monkeypatch.setattr(export, "export_encoder", no_export)
    assert load_or_export(real_embedder, tmp_path).source == str(path)


def test_unwritable_index_folder_serves_from_memory(tmp_path, real_embedder, onnx_model,
                                                    monkeypatch, caplog):
    def refuse(*a, **k):
        raise PermissionError("read-only file system")

    monkeypatch.setattr(export, "export_encoder", lambda *a, **k: onnx_model)
    monkeypatch.setattr(export, "atomic_write_bytes", refuse)
    with caplog.at_level(logging.WARNING):
        enc = load_or_export(real_embedder, tmp_path)
    assert enc.width == real_embedder.width and "using it from memory" in caplog.text
    assert not encoder_path(tmp_path, real_embedder.checkpoint_sha256).exists()


def test_pick_encoder(tmp_path, real_embedder, onnx_model, monkeypatch, caplog):
    assert pick_encoder(Settings(index=tmp_path, encoder="torch"), real_embedder).name == "torch"
    monkeypatch.setattr(export, "export_encoder", lambda *a, **k: onnx_model)
    assert pick_encoder(Settings(index=tmp_path), real_embedder).name == "onnxruntime"

    def broken(*a, **k):
        raise RuntimeError("exporter failed")

    monkeypatch.setattr(export, "export_encoder", broken)
    empty = tmp_path / "other"
    with caplog.at_level(logging.WARNING):
        assert pick_encoder(Settings(index=empty), real_embedder).name == "torch"
    assert "exporter failed" in caplog.text
    with pytest.raises(RuntimeError, match="exporter failed"):
        pick_encoder(Settings(index=empty, encoder="onnx"), real_embedder)


def test_service_refuses_a_planted_encoder(tmp_path, real_index, real_checkpoint, onnx_model):
    index = tmp_path / "index"
    shutil.copytree(real_index, index)
    sha = Embedder.from_checkpoint(real_checkpoint, device="cpu").checkpoint_sha256
    other = init_checkpoint(tmp_path / "other.pt", modes=8, hidden=16, image_size=64, seed=1,
                            raw_dims=0)
    planted = export_encoder(Embedder.from_checkpoint(other, device="cpu"))
    encoder_path(index, sha).parent.mkdir(parents=True, exist_ok=True)
    encoder_path(index, sha).write_bytes(planted)  # another checkpoint's graph, this name
    with pytest.raises(EncoderMismatchError, match=sha):
        load_engine(Settings(index=index, checkpoint=real_checkpoint))


@pytest.fixture(scope="module")
def sketchy_index(tmp_path_factory, sketchy_mini):
    """20 sketchy-mini classes (500 photos) indexed by an untrained checkpoint with a
    pretrained backbone and L=64 (more distinct scores than L=8)."""
    work = tmp_path_factory.mktemp("sketchy-onnx")
    photos = work / "photos"
    classes = sorted(p.name for p in (sketchy_mini / "photo").iterdir())[:20]
    for cls in classes:
        shutil.copytree(sketchy_mini / "photo" / cls, photos / cls)
    ckpt = init_checkpoint(work / "checkpoint.pt", modes=64, hidden=64, image_size=96)
    embedder = Embedder.from_checkpoint(ckpt, device="cpu")
    build_index(embedder, photos, work / "index", ckpt, progress=False)
    return embedder, work / "index", classes


def test_top10_of_sketchy_queries_identical(sketchy_index, sketchy_mini):
    embedder, index, classes = sketchy_index
    gallery = load_index(index, checkpoint_sha256=embedder.checkpoint_sha256)
    files = [sorted((sketchy_mini / "sketch" / c).iterdir())[i] for c in classes for i in (0, 7)]
    batch = embedder.preprocess([Image.open(f) for f in files], "sketch")  # (40, 3, 96, 96)
    onnx = OnnxEncoder(export_encoder(embedder), embedder.checkpoint_sha256)
    want, got = TorchEncoder(embedder)(batch), onnx(batch)
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)
    for d in (16, 64):
        _, rows_torch = gallery.search(np.ascontiguousarray(want[:, :d]), 10)
        _, rows_onnx = gallery.search(np.ascontiguousarray(got[:, :d]), 10)
        np.testing.assert_array_equal(rows_onnx, rows_torch)


def test_index_folder_with_an_encoder_stays_replaceable(tmp_path, real_index, real_embedder,
                                                         onnx_model, monkeypatch):
    index = tmp_path / "index"
    shutil.copytree(real_index, index)
    monkeypatch.setattr(export, "export_encoder", lambda *a, **k: onnx_model)
    load_or_export(real_embedder, index)
    check_replaceable(index)  # encoders/ is part of an index folder, not a stranger
    (index / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="notes.txt"):
        check_replaceable(index)


def test_single_view_queries_of_a_mirror_averaging_checkpoint(real_checkpoint, real_embedder,
                                                             real_index, small_sketches,
                                                             tmp_path):
    # the real checkpoint averages every image with its mirror image (the cpu preset);
    # --no-mirror-queries embeds sketches alone: the pooled features of the trunk alone
    from training.cdk.model.backbones import global_pool

    assert real_embedder.sketch_flip_average and real_embedder.trained_sketch_flip_average
    single = Embedder.from_checkpoint(real_checkpoint, device="cpu", sketch_flip_average=False)
    assert not single.sketch_flip_average and single.trained_sketch_flip_average
    batch = sketch_batch(single, small_sketches)
    trunk = single.backbone_of("sketch").module.trunk
    with torch.no_grad():
        want = single.head(global_pool(trunk(batch), single.pooling), "sketch").numpy()
    got = TorchEncoder(single)(batch)
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)
    assert not np.allclose(got, TorchEncoder(real_embedder)(batch), atol=1e-3)
    # its ONNX graph: own file, same numbers, and not taken for the mirror-averaging one
    index = tmp_path / "index"
    shutil.copytree(real_index, index)
    shutil.rmtree(index / "encoders", ignore_errors=True)  # other tests may have exported
    onnx = load_or_export(single, index)
    path = encoder_path(index, single.checkpoint_sha256, single_view=True)
    assert path.is_file() and not encoder_path(index, single.checkpoint_sha256).exists()
    np.testing.assert_allclose(onnx(batch), want, atol=ATOL, rtol=RTOL)
    with pytest.raises(EncoderMismatchError, match="flip_average"):
        OnnxEncoder(path, single.checkpoint_sha256, flip_average=True)
    # the service setting reaches the engine and /info
    engine = load_engine(Settings(index=index, checkpoint=real_checkpoint,
                                  mirror_queries=False, encoder="torch"))
    assert not engine.embedder.sketch_flip_average


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


def test_a_graph_of_another_format_is_refused_then_exported_again(tmp_path, real_embedder,
                                                                 onnx_model, monkeypatch):
    sha = real_embedder.checkpoint_sha256
    older = with_metadata(onnx_model, format="sketchsvd-encoder-1", flip_average=None)
    with pytest.raises(EncoderFormatError, match="of format 'sketchsvd-encoder-1'; this code "
                                                 f"reads '{export.FORMAT}'"):
        OnnxEncoder(older, sha, source="old.onnx")
    path = encoder_path(tmp_path, sha)
    path.parent.mkdir(parents=True)
    path.write_bytes(older)
    monkeypatch.setattr(export, "export_encoder", lambda *a, **k: onnx_model)
    assert load_or_export(real_embedder, tmp_path).source == "exported sketch encoder (fp32)"
    assert path.read_bytes() == onnx_model  # replaced by the graph of this code
    with pytest.raises(EncoderMismatchError, match="flip_average=None"):  # no key: no default
        OnnxEncoder(with_metadata(onnx_model, flip_average=None), sha, flip_average=True)


def test_sketches_at_their_own_size_export_and_serve_at_it(tmp_path, small_gallery,
                                                          small_sketches):
    # a checkpoint whose sketches are embedded at 48 px and photos at 64: each exported
    # graph takes its modality's size and equals PyTorch, and the service's engine resizes
    # query sketches to 48
    path = init_checkpoint(tmp_path / "c.pt", modes=8, hidden=16, image_size=64,
                           sketch_image_size=48, raw_dims=0)
    e = Embedder.from_checkpoint(path, device="cpu")
    assert (e.size_of("sketch"), e.size_of("photo"), e.image_size) == (48, 64, 64)
    batch = sketch_batch(e, small_sketches)
    assert tuple(batch.shape) == (6, 3, 48, 48)
    for modality, x in (("sketch", batch), ("photo", e.preprocess(
            [Image.open(io.BytesIO(b)) for b in small_sketches], "photo"))):
        onnx = OnnxEncoder(export_encoder(e, modality), e.checkpoint_sha256, modality)
        assert onnx.image_size == e.size_of(modality) == x.shape[-1]
        with torch.no_grad():
            want = e.encode(x, modality).numpy()
        np.testing.assert_allclose(onnx(x), want, atol=ATOL, rtol=RTOL)
    index = tmp_path / "index"
    build_index(e, small_gallery, index, path, progress=False)
    engine = load_engine(Settings(index=index, checkpoint=path, encoder="onnx"))
    images = [Image.open(io.BytesIO(b)) for b in small_sketches]
    got = engine.encoder(engine.embedder.preprocess(images, "sketch"))
    np.testing.assert_allclose(got, e.embed(images, "sketch"), atol=ATOL, rtol=RTOL)
    assert engine.decode_side == 2 * 48
    from fastapi.testclient import TestClient

    from service.main import create_app

    with TestClient(create_app(Settings(index=index, checkpoint=path, encoder="onnx"),
                               loader=lambda s: engine)) as client:
        assert client.get("/info").json()["sketch_size"] == 48
