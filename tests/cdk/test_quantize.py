"""The int8 encoder (training.cdk.model.quantize, export.load_or_export): the quantized graph
against the float32 graph it came from, its parity measured on validation classes and kept in
its metadata, the cache, and the precision rule (int8 refused when parity fails; auto falls
back to float32). Real sketchy-mini sketches for calibration and parity."""

import logging

import numpy as np
import onnx
import pytest

import training.cdk.model.quantize as quantize_mod
from tests.conftest import DATA
from tests.service.test_encoder import with_metadata
from training.cdk.model.embedder import Embedder
from training.cdk.model.export import INPUT, OnnxEncoder, encoder_path, load_or_export
from training.cdk.model.quantize import Parity, QuantizationError

pytestmark = pytest.mark.skipif(not (DATA / "sketch").is_dir(),
                                reason=f"needs sketchy-mini at {DATA}")


@pytest.fixture(scope="module")
def int8_setup(real_checkpoint, tmp_path_factory):
    """The float32 and int8 graphs of an untrained checkpoint (whose int8 parity may fail:
    the graph is cached either way)."""
    embedder = Embedder.from_checkpoint(real_checkpoint, device="cpu")
    index = tmp_path_factory.mktemp("int8") / "index"
    try:
        load_or_export(embedder, index, precision="int8", data=DATA)
    except QuantizationError as err:
        assert "parity" in str(err)
    path = encoder_path(index, embedder.checkpoint_sha256, "sketch", precision="int8")
    int8 = OnnxEncoder(path, embedder.checkpoint_sha256, precision="int8")
    fp32 = load_or_export(embedder, index, precision="fp32")
    return embedder, index, fp32, int8


def test_int8_graph_is_quantized_and_close_to_float32(int8_setup):
    embedder, index, fp32, int8 = int8_setup
    ops = {n.op_type for n in onnx.load_from_string(int8.data).graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops
    assert int8.precision == "int8" and int8.meta["precision"] == "int8"
    files = sorted((DATA / "sketch").glob("*/*.png"))[::97][:16]
    x = next(quantize_mod.preprocessed(embedder, files, "sketch"))
    a, b = fp32(x), int8(x)
    cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    assert cos.min() > 0.95, cos  # 8-bit arithmetic: near, not equal
    assert not np.allclose(a, b, atol=1e-6)


def test_parity_is_measured_on_validation_classes_and_stored(int8_setup):
    embedder, index, fp32, int8 = int8_setup
    parity = Parity.from_metadata(int8.meta)
    _, valid = quantize_mod.calibration_sets(embedder.config, DATA)
    assert parity.queries == len(valid.sketches)
    again = quantize_mod.measure_parity(embedder, valid, "sketch", fp32, int8)
    assert again.map_fp32 == pytest.approx(parity.map_fp32, abs=1e-6)
    assert again.overlap == pytest.approx(parity.overlap, abs=1e-6)
    check = quantize_mod.ParityCheck(embedder, valid, "sketch", fp32)
    assert check(int8) == check(int8) == again  # reused: what a fresh measurement gives
    same = check(fp32)
    assert same.overlap == 1.0 and same.map_int8 == same.map_fp32 == again.map_fp32
    assert parity.holds() == (parity.map_fp32 - parity.map_int8 <= quantize_mod.PARITY_MAP_DROP
                              and parity.overlap >= quantize_mod.PARITY_OVERLAP)
    assert Parity(0.5, 0.48, 0.95, 10).holds() is False  # mAP drops by more than 0.01
    assert Parity(0.5, 0.495, 0.85, 10).holds() is False  # top-10 overlap below 0.9


def test_cached_int8_graph_is_reused_and_failing_parity_is_refused(int8_setup, monkeypatch,
                                                                   caplog):
    embedder, index, fp32, int8 = int8_setup
    path = encoder_path(index, embedder.checkpoint_sha256, "sketch", precision="int8")
    assert path.is_file()

    def no_quantizing(*args, **kwargs):
        raise AssertionError("the cached int8 graph should have been read")

    monkeypatch.setattr(quantize_mod, "quantize_graph", no_quantizing)
    if Parity.from_metadata(int8.meta).holds():
        again = load_or_export(embedder, index, precision="int8", data=DATA)
        assert again.data == int8.data
    # a graph whose parity fails is kept but never served
    path.write_bytes(with_metadata(int8.data, parity_overlap="0.5"))
    with pytest.raises(QuantizationError, match="parity"):
        load_or_export(embedder, index, precision="int8", data=DATA)
    with caplog.at_level(logging.WARNING):
        chosen = load_or_export(embedder, index, precision="auto", data=DATA)
    assert chosen.precision == "fp32" and "float32" in caplog.text


def test_no_training_data_is_a_clear_error(real_checkpoint, tmp_path):
    embedder = Embedder.from_checkpoint(real_checkpoint, device="cpu")
    with pytest.raises(QuantizationError, match="not a folder"):
        load_or_export(embedder, tmp_path / "index", precision="int8", data=tmp_path / "none")
    assert load_or_export(embedder, tmp_path / "index", precision="auto",
                          data=tmp_path / "none").precision == "fp32"
    assert INPUT  # the graphs' input name, shared by export and quantize


def _conv_weights_quantized(data: bytes) -> list[bool]:
    """For each convolution of a QDQ graph, in graph order: whether its weight comes through
    a DequantizeLinear node (quantized) rather than straight from a float initializer."""
    graph = onnx.load_from_string(data).graph
    dequantized = {o for n in graph.node if n.op_type == "DequantizeLinear" for o in n.output}
    return [n.input[1] in dequantized for n in graph.node if n.op_type == "Conv"]


def test_leading_convolutions_stay_float32(int8_setup):
    embedder, index, fp32, int8 = int8_setup
    files = sorted((DATA / "sketch").glob("*/*.png"))[::211][:8]
    batches = list(quantize_mod.preprocessed(embedder, files, "sketch"))
    full = _conv_weights_quantized(quantize_mod.quantize_graph(fp32.data, iter(batches), INPUT))
    front = _conv_weights_quantized(quantize_mod.quantize_graph(fp32.data, iter(batches), INPUT,
                                                                float_front=5))
    assert all(full) and len(full) == len(front) > 5
    assert front == [False] * 5 + [True] * (len(front) - 5)
    with pytest.raises(ValueError, match="convolutions"):
        quantize_mod.quantize_graph(fp32.data, iter(batches), INPUT, float_front=len(full) + 1)


def test_float_front_is_raised_until_parity_holds(real_checkpoint, tmp_path, monkeypatch):
    """The sketch graph is tried with FLOAT_FRONT's leading convolutions in float32, in turn;
    the first whose parity holds is kept and its K recorded (the last one when none holds)."""
    embedder = Embedder.from_checkpoint(real_checkpoint, device="cpu")
    fronts = []
    real_quantize = quantize_mod.quantize_graph

    def recording(fp32, calibration, input_name, float_front=0):
        fronts.append(float_front)
        return real_quantize(fp32, calibration, input_name, float_front)

    made = []  # the float32 sides of the parity checks made

    def parity_at(holding):  # a parity that holds only for the graph with `holding` float convs
        class Check:
            def __init__(self, embedder, valid, modality, fp32):
                made.append(modality)

            def __call__(self, int8):
                ok = int8.meta["float_front"] == str(holding)
                return Parity(0.5, 0.5, 0.95 if ok else 0.5, 10)
        return Check

    monkeypatch.setattr(quantize_mod, "quantize_graph", recording)
    monkeypatch.setattr(quantize_mod, "FLOAT_FRONT", {"sketch": (2, 6, 9), "photo": (0,)})
    monkeypatch.setattr(quantize_mod, "ParityCheck", parity_at(6))
    enc = load_or_export(embedder, tmp_path / "a", precision="int8", data=DATA)
    assert fronts == [2, 6] and enc.meta["float_front"] == "6"
    assert _conv_weights_quantized(enc.data)[:7] == [False] * 6 + [True]
    fronts.clear()
    made.clear()
    monkeypatch.setattr(quantize_mod, "ParityCheck", parity_at(-1))  # never holds
    with pytest.raises(QuantizationError, match="parity"):
        load_or_export(embedder, tmp_path / "b", precision="int8", data=DATA)
    assert fronts == [2, 6, 9] and made == ["sketch"]  # float32's side made once for all K
    path = encoder_path(tmp_path / "b", embedder.checkpoint_sha256, "sketch", precision="int8")
    kept = OnnxEncoder(path, embedder.checkpoint_sha256, precision="int8")
    assert kept.meta["float_front"] == "9" and float(kept.meta["parity_overlap"]) == 0.5
