"""The int8 encoders a model bundle holds (training.cdk.quantize, training.cdk.make_bundle):
the quantized graph against the float32 graph it came from, its parity measured on validation
classes and recorded in the bundle and the graph, and the precision rule (int8 served only
where parity holds and it is faster, by a measurement recorded when the bundle is written).
Real sketchy-mini sketches and photos for calibration and parity."""

import numpy as np
import onnx
import pytest

import training.cdk.make_bundle as make_bundle_mod
import training.cdk.quantize as quantize_mod
from tests.conftest import DATA
from tests.service.test_encoder import with_metadata
from training.cdk.make_bundle import make_bundle
from training.cdk.model.bundle import BundleError
from training.cdk.model.export import INPUT, OnnxEncoder
from training.cdk.quantize import Parity, ParityCheck, images_of

pytestmark = pytest.mark.skipif(not (DATA / "sketch").is_dir(),
                                reason=f"needs sketchy-mini at {DATA}")


def test_int8_graph_is_quantized_and_close_to_float32(int8_bundle):
    int8, fp32 = int8_bundle.encoder("sketch", "int8"), int8_bundle.encoder("sketch", "fp32")
    ops = {n.op_type for n in onnx.load_from_string(int8.data).graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops
    assert int8.precision == "int8" and int8.meta["precision"] == "int8"
    files = sorted((DATA / "sketch").glob("*/*.png"))[::97][:16]
    x = next(quantize_mod.preprocessed(int8_bundle.preprocess, files, "sketch"))
    a, b = fp32(x), int8(x)
    cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    assert cos.min() > 0.95, cos  # 8-bit arithmetic: near, not equal
    assert not np.allclose(a, b, atol=1e-6)


def test_parity_is_measured_on_validation_classes_and_recorded(int8_bundle):
    model = int8_bundle
    int8, fp32 = model.encoder("sketch", "int8"), model.encoder("sketch", "fp32")
    parity = Parity.from_metadata(int8.meta)
    recorded = model.encoders["sketch"].parity
    assert (recorded["map_fp32"], recorded["overlap"], recorded["queries"]) == pytest.approx(
        (parity.map_fp32, parity.overlap, parity.queries), abs=1e-6)
    _, valid = quantize_mod.calibration_sets(DATA, "sketchy2")
    assert parity.queries == len(valid.sketches) == 250  # 10 validation classes, none test
    ours = np.concatenate([fp32(b) for b in quantize_mod.preprocessed(
        model.preprocess, valid.sketches, "sketch")])
    theirs = np.concatenate([model.embedder("cpu").embed(im, "photo")
                             for im in images_of(valid.photos)])
    check = ParityCheck("sketch", valid.sketches, ours, theirs, valid.sketch_labels,
                        valid.photo_labels, model.preprocess)
    again = check(int8)
    assert again.map_fp32 == pytest.approx(parity.map_fp32, abs=1e-4)
    assert again.map_int8 == pytest.approx(parity.map_int8, abs=1e-4)
    assert again.overlap == pytest.approx(parity.overlap, abs=0.01)
    assert check(int8) == again  # the float32 side is reused, and the int8 one recomputed
    same = check(fp32)
    assert same.overlap == 1.0 and same.map_int8 == pytest.approx(same.map_fp32)
    assert Parity(0.5, 0.48, 0.95, 10).holds() is False  # mAP drops by more than 0.01
    assert Parity(0.5, 0.495, 0.85, 10).holds() is False  # top-10 overlap below 0.9
    assert Parity(0.5, 0.495, 0.9, 10).holds() is True


def test_no_training_data_writes_float32_only_and_says_why(real_bundle):
    for name in ("sketch", "photo"):
        info = real_bundle.encoders[name]
        assert info.graphs == {"fp32": f"{name}.onnx", "int8": None}
        assert info.precision == "fp32" and "not a folder" in info.why
    with pytest.raises(BundleError, match="serves no int8 sketch encoder: no int8 graph: "
                                          "calibrating int8 needs the training data"):
        real_bundle.encoder("sketch", "int8")


def _conv_weights_quantized(data: bytes) -> list[bool]:
    """For each convolution of a QDQ graph, in graph order: whether its weight comes through
    a DequantizeLinear node (quantized) rather than straight from a float initializer."""
    graph = onnx.load_from_string(data).graph
    dequantized = {o for n in graph.node if n.op_type == "DequantizeLinear" for o in n.output}
    return [n.input[1] in dequantized for n in graph.node if n.op_type == "Conv"]


def test_leading_convolutions_stay_float32(real_bundle):
    fp32 = real_bundle.read("sketch.onnx")
    files = sorted((DATA / "sketch").glob("*/*.png"))[::211][:8]
    batches = list(quantize_mod.preprocessed(real_bundle.preprocess, files, "sketch"))
    full = _conv_weights_quantized(quantize_mod.quantize_graph(fp32, iter(batches), INPUT))
    front = _conv_weights_quantized(quantize_mod.quantize_graph(fp32, iter(batches), INPUT,
                                                                float_front=5))
    assert all(full) and len(full) == len(front) > 5
    assert front == [False] * 5 + [True] * (len(front) - 5)
    with pytest.raises(ValueError, match="convolutions"):
        quantize_mod.quantize_graph(fp32, iter(batches), INPUT, float_front=len(full) + 1)


def test_float_front_is_raised_until_parity_holds_and_timing_decides(tmp_path, monkeypatch):
    """The sketch graph is tried with FLOAT_FRONT's leading convolutions in float32, in turn;
    the first whose parity holds is kept and its K recorded (the last one when none holds,
    kept with its evidence and not served). int8 is served where it also takes at most
    FASTER x float32's time, by the timing recorded in the bundle."""
    from tests.bundles import init_checkpoint

    checkpoint = init_checkpoint(tmp_path / "checkpoint.pt", modes=8, hidden=16, image_size=64,
                                 raw_dims=0, sketch_flip_average=False)
    fronts = []
    real_quantize = quantize_mod.quantize_graph

    def recording(fp32, calibration, input_name, float_front=0):
        fronts.append(float_front)
        return real_quantize(fp32, calibration, input_name, float_front)

    made = []  # the float32 sides of the parity checks made

    def parity_at(holding):  # a parity that holds only for the graph with `holding` float convs
        class Check:
            def __init__(self, modality, *args):
                made.append(modality)

            def __call__(self, int8):
                ok = int8.meta["float_front"] == str(holding)
                return Parity(0.5, 0.5, 0.95 if ok else 0.5, 10)
        return Check

    monkeypatch.setattr(quantize_mod, "quantize_graph", recording)
    monkeypatch.setattr(quantize_mod, "FLOAT_FRONT", {"sketch": (2, 6, 9), "photo": (0,)})
    monkeypatch.setattr(quantize_mod, "ParityCheck", parity_at(6))
    monkeypatch.setattr(make_bundle_mod, "_timing", lambda a, b, size: {"fp32": 10.0,
                                                                        "int8": 8.0})
    a = make_bundle(checkpoint, tmp_path / "a", data=DATA, threads=1)
    # float32's side once an encoder: the photos' single-view graph, which indexes by
    # default; their mirror-averaged graph (--photo-views 2) stays float32 unless asked
    assert fronts == [2, 6, 0] and made == ["sketch", "photo"]
    two = a.encoders["photo"]
    assert two.graphs["int8"] is None and two.precision == "fp32"
    assert "--int8-two-views" in two.why and "photo.int8.onnx" not in a.files
    with pytest.raises(BundleError, match="--photo-views 2"):
        a.encoder("photo", "int8")
    assert a.encoders["photo-single-view"].graphs["int8"] == "photo-single-view.int8.onnx"
    graph = OnnxEncoder(a.read("sketch.int8.onnx"), precision="int8")
    assert graph.meta["float_front"] == "6"
    assert _conv_weights_quantized(graph.data)[:7] == [False] * 6 + [True]
    info = a.encoders["sketch"]
    assert info.precision == "int8" and info.timing_ms == {"fp32": 10.0, "int8": 8.0,
                                                            "threads": 1}
    assert info.parity["holds"] and "8.0 ms against float32's 10.0 ms" in info.why

    fronts.clear()
    monkeypatch.setattr(quantize_mod, "ParityCheck", parity_at(-1))  # never holds
    b = make_bundle(checkpoint, tmp_path / "b", data=DATA, threads=1)
    assert fronts == [2, 6, 9, 0]
    info = b.encoders["sketch"]
    assert info.precision == "fp32" and info.graphs["int8"] == "sketch.int8.onnx"
    assert not info.parity["holds"] and "fails the parity rule" in info.why
    kept = OnnxEncoder(b.read("sketch.int8.onnx"), precision="int8")
    assert kept.meta["float_front"] == "9" and float(kept.meta["parity_overlap"]) == 0.5
    with pytest.raises(BundleError, match="fails the parity rule"):
        b.encoder("sketch", "int8")

    monkeypatch.setattr(quantize_mod, "ParityCheck", parity_at(0))  # the photo graph holds
    monkeypatch.setattr(make_bundle_mod, "_timing", lambda a, b, size: {"fp32": 10.0,
                                                                        "int8": 9.5})
    fronts.clear()
    c = make_bundle(checkpoint, tmp_path / "c", data=DATA, threads=1, int8_two_views=True)
    assert fronts == [2, 6, 9, 0, 0]  # the mirror-averaged photo graph too
    assert c.encoders["photo"].parity["holds"] and c.encoders["photo"].precision == "fp32"
    assert "(served when <= 0.9 x)" in c.encoders["photo"].why
    assert c.encoder("photo", "int8").precision == "int8"  # holds parity: may be asked for


def test_a_changed_metadata_graph_is_not_the_bundles(int8_bundle, tmp_path):
    """A graph in the bundle's folder is the one model.json lists, byte for byte."""
    import shutil

    from training.cdk.model.bundle import Bundle

    folder = shutil.copytree(int8_bundle.path, tmp_path / "model")
    graph = (folder / "sketch.int8.onnx").read_bytes()
    (folder / "sketch.int8.onnx").write_bytes(with_metadata(graph, parity_overlap="1.0"))
    with pytest.raises(BundleError, match="sketch.int8.onnx is not the file model.json lists"):
        Bundle.open(folder).encoder("sketch", "int8")
