"""End to end: ``python -m training.cdk`` on a tiny symlinked subset of sketchy-mini."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from training.cdk.__main__ import main
from training.cdk.checkpoint import load_checkpoint
from training.cdk.data import scan
from training.cdk.metrics import retrieval_metrics
from training.cdk.model.bundle import Bundle
from training.cdk.model.smoothing import Expansion, Smoothing, expand_exact, smooth
from training.images import load_image

CLASSES = ("airplane", "ant", "apple", "bat", "cow", "door", "pear")
TEST = ("bat", "cow")
# The split rule holds out 2 of the 5 non-test classes (lowest sha256 of the name).
VALID = ("airplane", "door")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, request):
    mini = request.getfixturevalue("sketchy_mini_module")
    root = tmp_path_factory.mktemp("tiny")
    for c in CLASSES:
        photos = sorted((mini / "photo" / c).iterdir())[:3]
        for p in photos:
            (root / "photo" / c).mkdir(parents=True, exist_ok=True)
            (root / "photo" / c / p.name).symlink_to(p)
            s = sorted((mini / "sketch" / c).glob(p.stem + "-*"))[0]
            (root / "sketch" / c).mkdir(parents=True, exist_ok=True)
            (root / "sketch" / c / s.name).symlink_to(s)
    split = root / "split.txt"
    split.write_text("\n".join(TEST) + "\n")
    return root, split


@pytest.fixture(scope="module")
def sketchy_mini_module():
    from .conftest import SKETCHY_MINI

    if not (SKETCHY_MINI / "photo").is_dir():
        pytest.skip(f"sketchy-mini not found at {SKETCHY_MINI} (set SKETCHY_MINI to its path)")
    return SKETCHY_MINI


def _args(root, split, out, cache, *extra):
    return ["--data", str(root), "--split", str(split), "--out", str(out),
            "--cache-dir", str(cache), "--image-size", "32", "--modes", "4", "--hidden", "16",
            "--batch-size", "6", "--epochs", "2", "--gallery-queries", "2",
            "--gallery-topk", "3", "--k", "2", "--int8", "false", *extra]


def test_cli_end_to_end_and_embedder_reproduces_metrics(tiny, tmp_path, capsys):
    root, split = tiny
    out = tmp_path / "run"
    assert main(_args(root, split, out, tmp_path / "cache", "--method", "neuralsvd-jnt",
                      "--int8", "true")) == 0
    printed = capsys.readouterr().out
    assert "mAP@all" in printed
    # before the first step: the preset and why, and the run's estimated time
    lines = printed.splitlines()
    assert lines[0].startswith("preset cpu (no --preset given): the default")
    assert lines[1].startswith("estimated time: ") and "before the first image" in lines[1]
    assert "steps x" in lines[1] and "the model bundle about" in lines[1]
    assert lines[2].startswith("estimated time from here: ") and "steps x" in lines[2]
    assert json.loads((out / "config.json").read_text())["modes"] == 4
    m = json.loads((out / "metrics.json").read_text())
    for key in ("map_all", "precision_at_k", "k", "map_by_dims", "singular_values"):
        assert key in m
    assert m["k"] == 2 and sorted(m["map_by_dims"], key=int) == ["1", "2", "4"]
    # the preset appends raw coordinates after the 4 modes: map_all scores all of them,
    # the d-curves the modes' prefixes, and "learned" the 4 modes alone
    assert len(m["singular_values"]) == 4 and m["map_by_dims"]["4"] == m["learned"]["map_all"]
    assert m["config"]["raw_dims"] == 256 and m["map_all"] != m["learned"]["map_all"]
    assert len(m["singular_values_norm"]) == 4
    for key, sv in (("spectrum_order", "singular_values"),
                    ("spectrum_order_norm", "singular_values_norm")):
        rise = np.diff(m[sv]).clip(min=0)
        assert m[key]["max_swap"] == pytest.approx(rise.max())
    # the preset sorts the modes after training: sorted values, the trained order beside them
    assert m["config"]["sort_modes"] and m["spectrum_order"]["max_swap"] == 0
    perm = m["history"][-1]["sorted_from"]
    trained = np.empty(4)
    trained[perm] = m["singular_values"]
    assert m["spectrum_order_trained"]["max_swap"] == pytest.approx(
        np.diff(trained).clip(min=0).max())
    assert set(m["spectrum_order_heldout"]) == {"top", "max_swap", "rising_pairs"}
    for key in ("raw_backbone_pca_map_by_dims", "raw_backbone_pca_inner_map_by_dims"):
        assert sorted(m[key], key=int) == ["1", "2", "4"]
    for png in ("structure.png", "spectrum.png", "gallery.png"):
        assert (out / png).stat().st_size > 1000
    assert m["split"]["train_classes"] == 3 and m["split"]["valid_classes"] == 2
    assert m["evaluated_on"] == "test" and m["note"] is None
    assert m["test_counts"] == {"sketches": 6, "photos": 6}
    v = m["valid"]
    assert v["classes"] == list(VALID) and v["counts"] == {"sketches": 6, "photos": 6}
    assert sorted(v["map_by_dims"], key=int) == sorted(v["precision_by_dims"], key=int) == [
        "1", "2", "4"]
    assert v["map_by_dims"]["4"] == v["learned"]["map_all"]
    nums = [v["map_all"], v["precision_at_k"], *v["map_by_dims"].values(),
            *v["precision_by_dims"].values()]
    assert all(np.isfinite(x) and 0 <= x <= 1 for x in nums)

    # The model bundle alone reproduces the reported numbers, through its PyTorch modules
    # and its float32 graphs; its int8 graphs were calibrated on the training classes and
    # measured on the validation classes.
    ck = load_checkpoint(out / "checkpoint.pt")
    assert ck["epoch"] == 2 and ck["train_state"] is None and ck["trained"]
    # the preset's photos are mirror-averaged, its sketches (the queries) are not
    assert ck["backbone"]["photo_flip_average"] and not ck["backbone"]["sketch_flip_average"]
    model = Bundle.open(out / "model")
    assert "model bundle" in printed and str(out / "model") in printed
    # the photos' single-view graph (indexing's default); none for the sketches: not averaged
    assert set(model.encoders) == {"sketch", "photo", "photo-single-view"}
    for name in ("sketch", "photo-single-view"):  # what a default index and a query run
        info = model.encoders[name]
        assert info.graphs["int8"] == f"{name}.int8.onnx" and info.parity["queries"] == 6
    # the mirror-averaged photo graph (--photo-views 2 only) stays float32
    assert model.encoders["photo"].graphs == {"fp32": "photo.onnx", "int8": None}
    assert model.training["classes"]["valid"] == list(VALID)
    e = model.embedder("cpu")
    assert e.photo_flip_average and not e.sketch_flip_average
    # the training sketches the hubness correction scores photos against: all 3 of them
    hub = torch.load(out / "hubness_sample.pt", weights_only=True)
    train_sketches = scan(root).restrict([c for c in CLASSES if c not in TEST + VALID])
    torch.testing.assert_close(hub["embeddings"], torch.as_tensor(e.embed(
        [load_image(p) for p in train_sketches.sketches], "sketch")), rtol=1e-4, atol=1e-5)
    # ... which the bundle carries, with the correction's k and weight, for index.build
    assert model.inference.hubness == {"k": hub["k"], "weight": hub["weight"]} == {
        "k": 10, "weight": 0.5}
    torch.testing.assert_close(model.hubness_sample(), hub["embeddings"])
    for classes, want in ((TEST, m), (VALID, v)):  # test numbers top level, valid in "valid"
        te = scan(root).restrict(list(classes))
        f = e.embed([load_image(p) for p in te.sketches], "sketch")
        g = e.embed([load_image(p) for p in te.photos], "photo")
        assert f.shape[1] == e.width == 4 + 256 and e.modes == 4
        for d in (2, 4):
            r = retrieval_metrics(f[:, :d], g[:, :d], te.sketch_labels, te.photo_labels, 2)
            assert r["map_all"] == pytest.approx(want["map_by_dims"][str(d)], abs=1e-6)
        r = retrieval_metrics(f, g, te.sketch_labels, te.photo_labels, 2)
        assert r["map_all"] == pytest.approx(want["map_all"], abs=1e-6)
        for modality, x, files in (("sketch", f, te.sketches), ("photo", g, te.photos)):
            graph = model.encoder(modality, "fp32")
            y = graph(model.preprocess([load_image(p) for p in files], modality))
            np.testing.assert_allclose(y, x, rtol=1e-3, atol=1e-4)  # summation order
        assert r["precision_at_k"] == pytest.approx(want["precision_at_k"], abs=1e-6)
        # what the service answers: the smoothed gallery, each query expanded with its best
        # photos (the preset's 5, of 6 here)
        assert want["service"]["expansion"] == {"n": 5, "weight": 0.5}
        gs = smooth(torch.as_tensor(g), Smoothing())
        fq = expand_exact(torch.as_tensor(f), gs, Expansion())
        r = retrieval_metrics(fq, gs, te.sketch_labels, te.photo_labels, 2)
        assert r["map_all"] == pytest.approx(want["service"]["map_all"], abs=1e-6)
        # generalized: the same sketches against every photo of the training classes and of
        # theirs (the validation classes' without the test photos), as the service answers
        whole = scan(root).restrict([c for c in CLASSES if c not in TEST or classes == TEST])
        ga = e.embed([load_image(p) for p in whole.photos], "photo")
        seen = ~np.isin(np.array(whole.classes)[whole.photo_labels], TEST + VALID)
        q = np.array([whole.classes.index(te.classes[i]) for i in te.sketch_labels])
        gas = smooth(torch.as_tensor(ga), Smoothing())
        fa = expand_exact(torch.as_tensor(f), gas, Expansion())
        r = retrieval_metrics(fa, gas, q, whole.photo_labels, 2, seen=seen)
        gen = want["generalized"]
        assert (gen["gallery"], gen["seen_photos"]) == (len(whole.photos), 9)
        for key in ("map_all", "precision_at_k", "seen_at_k"):
            assert r[key] == pytest.approx(gen["service"][key], abs=1e-6)
        r = retrieval_metrics(f, ga, q, whole.photo_labels, 2, seen=seen)
        assert r["map_all"] == pytest.approx(gen["map_all"], abs=1e-6)
        # the hubness correction: each stored photo less its score against the training
        # sketches written beside the model, one more coordinate of photos and queries
        for gallery, lab, block, see in ((gs, te.photo_labels, want["corrected"], None),
                                         (gas, whole.photo_labels, gen["corrected"], seen)):
            pen = hub["weight"] * (gallery @ hub["embeddings"].T).topk(
                min(hub["k"], len(hub["embeddings"])), dim=1).values.mean(1)
            fq = torch.cat([torch.as_tensor(f), torch.ones(len(f), 1)], 1)
            gq = torch.cat([gallery, -pen[:, None]], 1)
            r = retrieval_metrics(expand_exact(fq, gq, Expansion()), gq,
                                  te.sketch_labels if see is None else q, lab, 2, seen=see)
            assert r["map_all"] == pytest.approx(block["map_all"], abs=1e-6)
            if see is not None:
                assert r["seen_at_k"] == pytest.approx(block["seen_at_k"], abs=1e-6)
    np.testing.assert_allclose(e.singular_values.numpy(), m["singular_values"], rtol=1e-6)

    # Running again finds the finished run: no retraining, same numbers, the same bundle
    # (indexes built with it stay valid).
    main(_args(root, split, out, tmp_path / "cache", "--method", "neuralsvd-jnt"))
    assert json.loads((out / "metrics.json").read_text())["map_all"] == m["map_all"]
    assert Bundle.open(out / "model").sha256 == model.sha256


def test_cli_seeded_determinism_and_lora(tiny, tmp_path):
    root, split = tiny
    runs = []
    for name in ("a", "b"):
        main(_args(root, split, tmp_path / name, tmp_path / "cache", "--method", "lora",
                   "--seed", "5"))
        runs.append(load_checkpoint(tmp_path / name / "checkpoint.pt")["heads"]["photo"])
    for k, v in runs[0].items():
        assert torch.equal(v, runs[1][k])


def test_cli_finetune_trains_separate_backbones(tiny, tmp_path):
    root, split = tiny
    out = tmp_path / "ft"
    main(_args(root, split, out, tmp_path / "cache", "--finetune", "true",
               "--photo-flip-average", "false", "--raw-dims", "0", "--epochs", "1",
               "--backbone-lr", "0.01"))
    ck = load_checkpoint(out / "checkpoint.pt")
    assert ck["backbone"]["finetuned"]
    sk, ph = ck["backbones"]["sketch"], ck["backbones"]["photo"]
    changed = [k for k in sk if sk[k].is_floating_point() and not torch.equal(sk[k], ph[k])]
    assert changed, "fine-tuning left both backbones identical"
    assert Bundle.open(out / "model").embedder().embed(
        [load_image(next(Path(root, "sketch", "bat").iterdir()))], "sketch").shape == (1, 4)
    assert json.loads((out / "metrics.json").read_text())["learned"] is None  # no raw dims
    # validation embeds through the fine-tuned backbones as the test evaluation does
    assert np.isfinite(json.loads((out / "metrics.json").read_text())["valid"]["map_all"])


def test_cli_instance_pairing(tiny, tmp_path):
    root, split = tiny
    out = tmp_path / "inst"
    main(_args(root, split, out, tmp_path / "cache", "--pairing", "instance"))
    m = json.loads((out / "metrics.json").read_text())
    assert m["config"]["pairing"] == "instance" and 0 <= m["map_all"] <= 1
    assert 0 <= m["valid"]["map_all"] <= 1


def test_cli_without_validation_classes_writes_valid_null(tiny, tmp_path):
    root, _ = tiny
    split = tmp_path / "split.txt"  # 4 non-test classes: too few to hold any out
    split.write_text("bat\ncow\ndoor\n")
    out = tmp_path / "noval"
    main(_args(root, split, out, tmp_path / "cache", "--epochs", "1"))
    m = json.loads((out / "metrics.json").read_text())
    assert m["valid"] is None and m["split"]["valid_classes"] == 0
    assert m["split"]["train_classes"] == 4 and 0 <= m["map_all"] <= 1


def test_cli_paper_preset_says_it_does_not_fit_and_writes_its_config(tiny, tmp_path, capsys):
    # the paper's batch of 4096 on the tiny set's 9 training sketches: one step an epoch
    import torchvision

    torch.manual_seed(0)
    trunk = torchvision.models.vgg.make_layers(torchvision.models.vgg.cfgs["D"])
    weights = tmp_path / "vgg16.pth"
    torch.save({f"features.{k}": v for k, v in trunk.state_dict().items()}, weights)
    root, split = tiny
    out = tmp_path / "paper"
    main(["--data", str(root), "--split", str(split), "--out", str(out), "--cache-dir",
          str(tmp_path / "cache"), "--preset", "paper", "--backbone-weights", str(weights),
          "--image-size", "32", "--modes", "8", "--hidden", "16"])
    printed = capsys.readouterr()
    assert printed.out.startswith("preset paper (chosen): the paper's setting")
    [warning] = [line for line in printed.err.splitlines() if "WARNING" in line]
    assert "preset paper (batch 4096, 10 epochs) does not fit these data" in warning
    assert "10 in all" in warning
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["preset"], cfg["smooth_k"], cfg["batch_size"], cfg["backbone"]) == (
        "paper", 0, 4096, "vgg16")
    m = json.loads((out / "metrics.json").read_text())
    assert m["smoothed"] is None and m["config"] == cfg
    # no smoothing and no expansion: the service's numbers are the plain embedding's
    assert m["service"]["smoothing"] == {} and m["service"]["expansion"] == {}
    assert m["service"]["map_all"] == pytest.approx(m["map_all"])


def _generated(root: Path, classes: int = 6, per_class: int = 3) -> Path:
    """Generated paired images: dark strokes on white (sketches) and colour fields
    (photos), per_class of each per class, sketch i drawn from photo i."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for c in range(classes):
        for mod in ("sketch", "photo"):
            (root / mod / f"k{c}").mkdir(parents=True)
        for i in range(per_class):
            sketch = np.full((40, 40, 3), 255, np.uint8)
            r = int(rng.integers(4, 30))
            sketch[r : r + 3, 4 + c : 36] = 0
            photo = (rng.random((40, 40, 3)) * 60).astype(np.uint8)
            photo[..., c % 3] += 40 * (1 + c // 3)
            Image.fromarray(sketch).save(root / "sketch" / f"k{c}" / f"p{i}-1.png")
            Image.fromarray(photo).save(root / "photo" / f"k{c}" / f"p{i}.png")
    return root


def test_cli_split_none_trains_on_every_class_but_validation_and_says_so(tmp_path, capsys):
    """--split none: no test class; the validation classes are the usual rule's, every
    other class trains; the top-level numbers are the validation classes' and the run says
    so (printed and in metrics.json), with no test counts."""
    from training.cdk.splits import validation_classes

    root = _generated(tmp_path / "data")
    out = tmp_path / "run"
    assert main(_args(root, "none", out, tmp_path / "cache", "--epochs", "1")) == 0
    printed = capsys.readouterr().out
    m = json.loads((out / "metrics.json").read_text())
    classes = [f"k{c}" for c in range(6)]
    valid = validation_classes(classes)
    assert m["split"] == {"name": "none", "train_classes": 4, "valid_classes": 2,
                          "test_classes": []}
    assert m["evaluated_on"] == "valid" and m["test_counts"] is None
    assert "no test classes" in m["note"] and m["note"] in printed
    assert "on none valid classes" in printed
    assert m["valid"]["classes"] == valid
    # the top level scores the validation classes: the same queries as "valid"
    for key in ("map_all", "precision_at_k"):
        assert m[key] == pytest.approx(m["valid"][key], abs=1e-9)
    assert m["map_by_dims"] == m["valid"]["map_by_dims"]
    assert (out / "gallery.png").stat().st_size > 1000
    assert load_checkpoint(out / "checkpoint.pt")["config"]["split"] == "none"



def test_cli_sketches_at_their_own_size_and_the_embedder_agrees(tiny, tmp_path):
    # sketches embedded at 24 px, photos at 32: training, evaluation and the checkpoint's
    # Embedder all take each modality at its size (the metrics are reproduced from the file)
    root, split = tiny
    out = tmp_path / "run"
    main(_args(root, split, out, tmp_path / "cache", "--sketch-image-size", "24",
               "--epochs", "1"))
    m = json.loads((out / "metrics.json").read_text())
    assert (m["config"]["image_size"], m["config"]["sketch_image_size"]) == (32, 24)
    ck = load_checkpoint(out / "checkpoint.pt")
    assert (ck["backbone"]["image_size"], ck["backbone"]["sketch_image_size"]) == (32, 24)
    e = Bundle.open(out / "model").embedder("cpu")
    va = scan(root).restrict(list(VALID))
    sketches = [load_image(p) for p in va.sketches]
    f = e.embed(sketches, "sketch")
    g = e.embed([load_image(p) for p in va.photos], "photo")
    r = retrieval_metrics(f, g, va.sketch_labels, va.photo_labels, 2)
    assert r["map_all"] == pytest.approx(m["valid"]["map_all"], abs=1e-6)
    # the sketches at the photos' size embed otherwise: the size is what was used
    e.sketch_image_size = 32
    assert not np.allclose(e.embed(sketches, "sketch"), f, atol=1e-3)
    # unset, the sketches take the photos' size (and so read older checkpoints)
    main(_args(root, split, tmp_path / "same", tmp_path / "cache", "--epochs", "1"))
    assert json.loads((tmp_path / "same" / "config.json").read_text())["sketch_image_size"] == 32
