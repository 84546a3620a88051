"""The experiments (research/): every script imports, parses its command line and runs in
its --smoke mode on tiny generated data; their samplers and kernels against references
written out pair by pair, and their training against training.cdk.train itself. Marked
``research`` (``pytest -m "not research"`` leaves them out); tests/run.sh runs them."""

import importlib
import json
import pkgutil

import pytest

import research
from tests.tiny_data import tiny_paired
from training.cdk.data import Sampler

pytestmark = pytest.mark.research

# the scripts; research.common is what they share
NAMES = sorted(m.name for m in pkgutil.iter_modules(research.__path__) if m.name != "common")


def test_every_research_script_is_found():
    assert set(NAMES) == {"allocator_bench", "cdk_finetune_bench", "cdk_kernel_bench",
                          "cdk_levers_bench", "cdk_step_bench", "openworld_bench"}


@pytest.mark.parametrize("name", NAMES)
def test_research_script_imports_and_shows_help(name, capsys):
    module = importlib.import_module(f"research.{name}")
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--help"])
    assert exit_info.value.code == 0
    assert "--smoke" in capsys.readouterr().out


def test_every_research_script_runs_in_its_smoke_mode_here():
    """Each script's smoke mode has a test below: test_<name>_smoke..."""
    tested = {n for n in NAMES if any(t.startswith(f"test_{n}_smoke") for t in globals())}
    assert tested == set(NAMES)


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    return tiny_paired(tmp_path_factory.mktemp("tiny"))


def test_allocator_bench_smoke(capsys):
    from research import allocator_bench

    assert allocator_bench.main(["--smoke"]) == 0
    out = capsys.readouterr().out
    assert "| default |" in out and "| tuned |" in out and "speed-up" in out


def test_the_data_folder_comes_from_the_flag_or_sketchy_data(monkeypatch, capsys):
    """--data wins, SKETCHY_DATA stands in for it, and with neither a run that reads
    images stops naming both, before any work."""
    import argparse

    from research.common import DATA_ENV, add_data_argument, data_folder

    def parse(argv):
        parser = argparse.ArgumentParser()
        add_data_argument(parser)
        return data_folder(parser, parser.parse_args(argv))

    monkeypatch.setenv(DATA_ENV, "from-env")
    assert parse([]) == "from-env" and parse(["--data", "given"]) == "given"
    monkeypatch.delenv(DATA_ENV)
    with pytest.raises(SystemExit) as exit_info:
        parse([])
    assert exit_info.value.code == 2
    assert "--data DIR" in capsys.readouterr().err
    from research import cdk_step_bench

    with pytest.raises(SystemExit):
        cdk_step_bench.main(["--smoke"])
    assert f"{DATA_ENV}=DIR" in capsys.readouterr().err


def test_similar_class_pairing_draws_and_moments_follow_its_matrix():
    """The levers study's similar-class kernel: T is symmetric, doubly stochastic with
    1 - alpha on the diagonal; the sampler (a training.cdk.data.Sampler) draws the partner
    class from T (counted over many epochs) and joint_moment is E[f(X) g(Y)] written out
    pair by pair."""
    import numpy as np
    import torch

    from research.cdk_levers_bench import SimilarClassSampler
    from research.common import similar_class_mixing

    gen = torch.Generator().manual_seed(0)
    labels = torch.arange(40) % 4
    T = similar_class_mixing(torch.randn(40, 6, generator=gen), labels, 0.3, 0.2)
    torch.testing.assert_close(T.sum(0), torch.ones(4, dtype=T.dtype))
    torch.testing.assert_close(T.sum(1), torch.ones(4, dtype=T.dtype))
    torch.testing.assert_close(T, T.T)
    torch.testing.assert_close(T.diagonal(), torch.full((4,), 0.7, dtype=T.dtype))

    sketch_labels, photo_labels = np.arange(20) % 4, np.arange(12) % 4
    sampler = SimilarClassSampler(sketch_labels, photo_labels, T)
    assert isinstance(sampler, Sampler)
    counts = torch.zeros(4, 4)
    for epoch in range(400):
        for s, p in sampler.epoch(0, epoch, 10):
            counts.index_put_((torch.as_tensor(sketch_labels)[s],
                               torch.as_tensor(photo_labels)[p]), torch.ones(len(s)),
                              accumulate=True)
    freq = counts / counts.sum(1, keepdim=True)  # 2,000 draws per class
    assert (freq - T.float()).abs().max() < 0.04
    f, g = torch.randn(20, 3, generator=gen), torch.randn(12, 3, generator=gen)
    want = torch.zeros(3, dtype=torch.float64)
    for i in range(20):
        for j in range(12):
            c, d = sketch_labels[i], photo_labels[j]
            want += f[i].double() * g[j].double() * T[c, d] / (photo_labels == d).sum()
    torch.testing.assert_close(sampler.joint_moment(f, g), want / 20)
    marginal = torch.tensor([sum(float(T[c, photo_labels[j]]) for c in sketch_labels) / 20 / 3
                             for j in range(12)], dtype=torch.float64)  # 3 photos a class
    torch.testing.assert_close(sampler.photo_marginal(), marginal)
    # among photos 0 (class 0), 1 and 5 (class 1): the draw of class 0 or 1 renormalised
    to0 = sum(float(T[c, 0] / (T[c, 0] + T[c, 1])) for c in range(4)) / 4  # 5 sketches each
    torch.testing.assert_close(sampler.photo_marginal(None, torch.tensor([0, 1, 5])),
                               torch.tensor([to0, (1 - to0) / 2, (1 - to0) / 2],
                                            dtype=torch.float64))


def test_levers_folds_hold_out_each_non_test_class_once():
    from research.common import folds_of
    from training.cdk.splits import SKETCHY2_TEST

    classes = sorted([f"c{i:03d}" for i in range(104)] + list(SKETCHY2_TEST))
    folds = folds_of(classes, "sketchy2", 5)
    held = [c for _, parts in folds for c in parts["valid"]]
    assert sorted(held) == [f"c{i:03d}" for i in range(104)]  # each once, no test class
    for _, parts in folds:
        assert len(parts["valid"]) in (20, 21) and len(parts["train"]) == 104 - len(parts["valid"])
        assert not set(parts["train"]) & set(parts["valid"])
    (name, parts), = folds_of(classes, "sketchy2", 0)
    assert name == "valid" and len(parts["valid"]) == 10


def _kernel_labels(classes=3):
    """classes x 2 photos x 2 sketches each: sketch i was drawn from photo i // 2."""
    import numpy as np

    photo_labels = np.repeat(np.arange(classes), 2)
    photo_of = np.repeat(np.arange(2 * classes), 2)
    return photo_labels[photo_of], photo_labels, photo_of


def test_kernel_spectra_are_the_analytic_ones():
    """Class kernel: C - 1 singular values 1, the rest 0. Instance kernel (every photo with
    two sketches): all 1. Their mixture (1 - a) class + a instance is U ((1 - a) Pi + a I)
    with U's columns orthonormal and Pi the projection on the class indicators: C - 1
    values 1, then a."""
    import torch

    from research.cdk_kernel_bench import (
        KernelSampler,
        class_conditional,
        conditional,
        effective_rank,
        instance_conditional,
    )

    sl, pl, photo_of = _kernel_labels()
    one = torch.ones(2, dtype=torch.float64)
    got = KernelSampler(class_conditional(sl, pl)).spectrum()
    torch.testing.assert_close(got, torch.cat([one, torch.zeros(3, dtype=torch.float64)]))
    got = KernelSampler(instance_conditional(photo_of, 6)).spectrum()
    torch.testing.assert_close(got, torch.ones(5, dtype=torch.float64))
    data = {"sketch_labels": sl, "photo_labels": pl, "photo_of": photo_of}
    got = KernelSampler(conditional({"instance": 0.3}, data)).spectrum()
    torch.testing.assert_close(got, torch.cat([one, torch.full((3,), 0.3, dtype=torch.float64)]))
    assert abs(effective_rank([1.0, 1.0, 0.0, -0.2]) - 2.0) < 1e-12
    assert abs(effective_rank([1.0, 1.0, 2.3e-162]) - 2.0) < 1e-12  # its share underflows to 0
    assert 2.0 < effective_rank(got) < 5.0


def test_kernel_conditionals_and_their_limits():
    """Rows are distributions; the soft instance kernel is the instance kernel as tau -> 0
    and the class kernel as tau -> inf; the semantic kernel moves a class's photo draw to
    the other classes by T: symmetric, doubly stochastic, 1 - b on the diagonal."""
    import torch

    from research.cdk_kernel_bench import (
        class_conditional,
        conditional,
        instance_conditional,
        soft_instance_conditional,
    )

    sl, pl, photo_of = _kernel_labels()
    feats = torch.randn(6, 5, generator=torch.Generator().manual_seed(0))
    sharp = soft_instance_conditional(photo_of, sl, pl, feats, 1e-4)
    torch.testing.assert_close(sharp, instance_conditional(photo_of, 6))
    flat = soft_instance_conditional(photo_of, sl, pl, feats, 1e9)
    torch.testing.assert_close(flat, class_conditional(sl, pl))
    sl, pl, photo_of = _kernel_labels(4)  # with 3 classes W's off-diagonal is forced
    data = {"sketch_labels": sl, "photo_labels": pl, "photo_of": photo_of,
            "photo": torch.randn(8, 5, generator=torch.Generator().manual_seed(0))}
    emb = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    cond = conditional({"semantic": (0.3, 0.2), "instance": 0.5}, data, emb)
    torch.testing.assert_close(cond.sum(1), torch.ones(16, dtype=torch.float64))
    # the class part: P(photo class c' | sketch class c) = 0.5 T[c, c'] (+ 0.5 when c' = c)
    by_class = torch.stack([cond[:, torch.as_tensor(pl == c)].sum(1) for c in range(4)], 1)
    T = torch.stack([by_class[torch.as_tensor(sl == c)].mean(0) for c in range(4)])
    T = (T - 0.5 * torch.eye(4, dtype=T.dtype)) / 0.5
    torch.testing.assert_close(T, T.T)
    torch.testing.assert_close(T.sum(0), torch.ones(4, dtype=T.dtype))
    torch.testing.assert_close(T.diagonal(), torch.full((4,), 0.7, dtype=T.dtype))
    off = T[~torch.eye(4, dtype=torch.bool)]
    assert float(off.min()) > 0 and float(off.max() - off.min()) > 0.01  # the names decide


def test_neighbour_kernel_is_brute_force_nearest_photos():
    """Each sketch's row is uniform over the k photos nearest its own photo by centred
    cosine, found here by sorting every pair; k = 1 is the instance kernel."""
    import torch

    from research.cdk_kernel_bench import (
        class_conditional,
        conditional,
        instance_conditional,
        neighbour_conditional,
    )

    sl, pl, photo_of = _kernel_labels(4)
    feats = torch.randn(8, 5, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(neighbour_conditional(photo_of, feats, 1),
                               instance_conditional(photo_of, 8))
    q = neighbour_conditional(photo_of, feats, 3)
    z = feats.double() - feats.double().mean(0)
    for i, own in enumerate(photo_of):
        cos = [float(z[own] @ z[j] / (z[own].norm() * z[j].norm())) for j in range(8)]
        near = sorted(range(8), key=lambda j: (j != own, -cos[j]))[:3]
        expect = torch.zeros(8, dtype=torch.float64)
        expect[near] = 1 / 3
        torch.testing.assert_close(q[i], expect)
    assert len({int(pl[j]) for j in q.nonzero()[:, 1]}) > 1  # it crosses classes
    data = {"sketch_labels": sl, "photo_labels": pl, "photo_of": photo_of, "photo": feats}
    mixed = conditional({"instance": 0.3, "neighbour": (0.2, 3)}, data)
    torch.testing.assert_close(mixed, 0.5 * class_conditional(sl, pl)
                               + 0.3 * instance_conditional(photo_of, 8) + 0.2 * q)
    with pytest.raises(ValueError, match="at most 1"):
        conditional({"instance": 0.9, "neighbour": (0.2, 3)}, data)
    with pytest.raises(ValueError, match="k must be"):
        neighbour_conditional(photo_of, feats, 9)


def test_fewer_images_keeps_the_first_n_of_training_classes_and_every_pair():
    """Training classes keep their first n sketches and photos and the photos those
    sketches were drawn from; held-out classes keep every row; each kept sketch still
    points at its own photo's features."""
    import numpy as np
    import torch

    from research.cdk_kernel_bench import fewer_images

    # classes 0 and 1 train, 2 held out; 4 photos a class; sketch rows drawn from photos
    photo_labels = np.repeat([0, 1, 2], 4)
    photo_of = np.array([3, 0, 1, 1, 4, 7, 8, 9, 10])
    F = {"classes": ["a", "b", "c"], "sketch_labels": photo_labels[photo_of],
         "photo_labels": photo_labels, "photo_of": photo_of,
         "photo": torch.arange(12.0)[:, None], "sketch": torch.arange(9.0)[:, None] + 100}
    G = fewer_images(F, {"train": ["a", "b"], "valid": ["c"]}, 2)
    # class a: sketches 0, 1 (of photos 3, 0); photos 0, 1 and 3. Class b: sketches 4, 5
    # (photos 4, 7); photos 4, 5 and 7. Class c: everything.
    assert G["sketch"].flatten().tolist() == [100, 101, 104, 105, 106, 107, 108]
    assert G["photo"].flatten().tolist() == [0, 1, 3, 4, 5, 7, 8, 9, 10, 11]
    own = G["photo"][torch.as_tensor(G["photo_of"])].flatten().tolist()
    assert own == [3, 0, 4, 7, 8, 9, 10]  # the same photos as before
    assert list(G["photo_labels"]) == [0, 0, 0, 1, 1, 1, 2, 2, 2, 2]
    assert list(G["sketch_labels"]) == [0, 0, 1, 1, 2, 2, 2]
    with pytest.raises(ValueError, match="at least 1"):
        fewer_images(F, {"train": ["a"], "valid": ["c"]}, 0)


def test_kernel_sampler_draws_from_its_matrix_and_its_quotients_are_the_cdk_ones():
    """Pairs counted over many epochs follow cond; the quotients equal the definition
    written out over all (sketch, photo) pairs, and for the class kernel (uniform
    marginals) training's own estimate (cdk_singular_values with the PairSampler's joint
    moment)."""
    import torch

    from research.cdk_kernel_bench import KernelSampler, conditional
    from training.cdk.data import PairSampler
    from training.loss import cdk_singular_values

    sl, pl, photo_of = _kernel_labels()
    feats = torch.randn(6, 5, generator=torch.Generator().manual_seed(0))
    data = {"sketch_labels": sl, "photo_labels": pl, "photo_of": photo_of, "photo": feats}
    cond = conditional({"soft": (0.5, 0.5)}, data)
    sampler = KernelSampler(cond)
    counts = torch.zeros(12, 6, dtype=torch.float64)
    for epoch in range(1500):
        for s, p in sampler.epoch(0, epoch, 4):
            counts.index_put_((s, p), torch.ones(len(s), dtype=torch.float64), accumulate=True)
    assert (counts / counts.sum(1, keepdim=True) - cond).abs().max() < 0.05  # 1,500 each

    gen = torch.Generator().manual_seed(2)
    f, g = torch.randn(12, 3, generator=gen), torch.randn(6, 3, generator=gen)
    joint = torch.zeros(3, dtype=torch.float64)
    py = torch.zeros(6, dtype=torch.float64)
    for i in range(12):
        for j in range(6):
            joint += cond[i, j] / 12 * f[i].double() * g[j].double()
            py[j] += cond[i, j] / 12
    fd, gd = f.double(), g.double()
    want = (joint - fd.mean(0) * (py @ gd)) / ((fd**2).mean(0) * (py @ gd**2)).sqrt()
    torch.testing.assert_close(sampler.quotients(f, g), want)
    cls = conditional({}, data)
    moment = PairSampler(sl, pl).joint_moment(f, g)
    torch.testing.assert_close(KernelSampler(cls).quotients(f, g),
                               cdk_singular_values(f, g, moment).double())


def test_kernel_bench_training_is_the_training_loop(tmp_path):
    """The study trains through training.cdk.train (research.common.train_heads): with
    training's pair sampler its heads are those of train() on the same data (same seeds,
    dropout masks, optimiser and schedule); with a kernel sampler, the spectrum it reports
    is the kernel's quotients written out over all rows, at the heads it returns."""
    import numpy as np
    import torch
    from torch import nn

    import training.cdk.train as train_mod
    from research.cdk_kernel_bench import KernelSampler, conditional
    from research.common import embed, train_heads
    from training.cdk.config import make_config
    from training.cdk.data import PairSampler
    from training.cdk.model.backbones import Backbone

    gen = torch.Generator().manual_seed(0)
    labels = np.repeat(np.arange(4), 6)
    means = torch.randn(4, 6, generator=gen)
    sk = means[labels] + 0.5 * torch.randn(24, 6, generator=gen)
    ph = means[labels] + 0.5 * torch.randn(24, 6, generator=gen)
    cfg = make_config("cpu", modes=4, hidden=16, batch_size=8, epochs=3, raw_dims=0,
                      sort_modes=False, instance_share=0.0, out=str(tmp_path))
    backbone = Backbone("synthetic", nn.Identity(), 6, (0.0,) * 3, (1.0,) * 3)
    want = train_mod.train(cfg, train_mod.TrainData(sk, ph, labels, labels.copy()), backbone,
                           tmp_path, device="cpu").heads
    got, seconds = train_heads(cfg, sk, ph, PairSampler(labels, labels))
    assert seconds > 0
    for m in ("sketch", "photo"):
        for (name, a), b in zip(want[m].state_dict().items(), got.heads[m].state_dict().values(),
                                strict=True):
            torch.testing.assert_close(a, b, msg=f"{m} {name}")

    # sketches 2k, 2k + 1 drawn from photo 2k: under instance 0.5 odd photos come only by
    # the class draw, so the photo marginal is 3/2 and 1/2 of uniform, and the spectrum
    # pass weighs the photos by it
    data = {"sketch_labels": labels, "photo_labels": labels, "photo_of": np.arange(24) // 2 * 2}
    for parts in ({}, {"instance": 0.5}):
        sampler = KernelSampler(conditional(parts, data))
        assert isinstance(sampler, Sampler)
        res, _ = train_heads(cfg, sk, ph, sampler)
        f, g = embed(res.heads["sketch"], sk), embed(res.heads["photo"], ph)
        torch.testing.assert_close(res.singular_values.double(), sampler.quotients(f, g),
                                   atol=1e-5, rtol=1e-5)
        w = sampler.photo_marginal()
        norm = ((f.double() ** 2).mean(0) * (w @ g.double() ** 2)).sqrt()
        torch.testing.assert_close(res.singular_values_norm.double(), norm, atol=1e-5, rtol=1e-5)


def test_cdk_kernel_bench_smoke_runs_end_to_end(tmp_path, capsys):
    """--smoke on generated paired images (7 classes, one held out as the test class):
    features, three kernels on the validation classes and 2 class folds, results and
    report; no test-class row, and the instance kernel's spectrum is wider than the class
    one's; the grids over the saved heads, and fewer training images."""
    import json

    import torch
    from PIL import Image

    from research.cdk_kernel_bench import main

    root = tmp_path / "data"
    for c in range(7):
        for i in range(6):
            (root / "photo" / f"c{c}").mkdir(parents=True, exist_ok=True)
            (root / "sketch" / f"c{c}").mkdir(parents=True, exist_ok=True)
            colour = (40 * c, 30 * i, 255 - 35 * c)
            Image.new("RGB", (40, 40), colour).save(root / "photo" / f"c{c}" / f"p{c}_{i}.jpg")
            if i < 3:
                for n in (1, 2):
                    im = Image.new("RGB", (40, 40), "white")
                    im.paste((0, 0, 0), (5 * c, 4 * i, 5 * c + 10 + n, 30))
                    im.save(root / "sketch" / f"c{c}" / f"p{c}_{i}-{n}.png")
    split = tmp_path / "test-classes.txt"
    split.write_text("c6\n")
    out = tmp_path / "out"
    args = ["--smoke", "--data", str(root), "--split", str(split), "--out", str(out),
            "--cache-dir", str(tmp_path / "cache"), "--kernels", "class", "instance 0.5",
            "soft 0.5, tau 0.1"]
    assert main(args) == 0
    rows = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert sorted({r["set"] for r in rows}) == ["fold0", "fold1", "valid"] and len(rows) == 9
    for r in rows:
        assert 0 < r["service_map"] <= 1 and 0 < r["learned_map"] <= 1
        assert len(r["sigma"]) == 4 and r["sigma"] == sorted(r["sigma"], reverse=True)
        assert min(r["sigma_norm"]) >= 0
        heads = torch.load(out / "heads" / f"{r['kernel']}-{r['set']}-0.pt")
        assert heads["photo"]["mlp.2.weight"].shape == (4, 8)
    ranks = {r["kernel"]: r["kernel_effective_rank"] for r in rows if r["set"] == "valid"}
    assert ranks["class"] < ranks["instance 0.5"]  # rank 3 against 3 + 11 values a
    assert main([*args, "--spectra", "--folds", "0"]) == 0
    spectra = [json.loads(x) for x in (out / "spectra.jsonl").read_text().splitlines()]
    # 4 training classes, 12 photos with sketches: ranks C - 1 and 12 - 1; the soft rows
    # are spread over the photos of a class, between the two
    assert [(s["kernel"], s["set"], s["rank"]) for s in spectra[:2]] == [
        ("class", "valid", 3), ("instance 0.5", "valid", 11)]
    assert 3 < spectra[2]["rank"] <= 11
    assert main(args) == 0  # every run is done already: nothing is added
    assert len((out / "results.jsonl").read_text().splitlines()) == 9
    capsys.readouterr()
    assert main(["--out", str(out), "--report"]) == 0
    table = capsys.readouterr().out
    assert "| instance 0.5 | folds mean | 2 |" in table and "| class | valid | 1 |" in table
    # the query expansion grid over the saved heads: without expansion it gives back each
    # run's own service numbers (embeddings rebuilt from the saved heads alone)
    assert main([*args, "--kernels", "class", "--expansion-grid"]) == 0
    grid = [json.loads(x) for x in (out / "expansion.jsonl").read_text().splitlines()]
    own = {r["set"]: r for r in rows if r["kernel"] == "class"}
    none = [g for g in grid if g["n"] == 0]
    assert sorted(g["set"] for g in none) == ["fold0", "fold1", "valid"]
    for g in none:
        assert g["service_map"] == pytest.approx(own[g["set"]]["service_map"], abs=1e-6)
        assert g["d16_share"] == pytest.approx(own[g["set"]]["d16_share"], abs=1e-6)
    assert len(grid) == 3 * 21 and all(0 < g["service_map"] <= 1 for g in grid)
    assert "| class | 5 | 0.5 |" in capsys.readouterr().out
    # the raw-coordinate grid: at the preset's whitening and weight it gives back the
    # expansion grid's numbers at the preset's expansion
    assert main([*args, "--kernels", "class", "--raw-grid"]) == 0
    raw = [json.loads(x) for x in (out / "raw.jsonl").read_text().splitlines()]
    assert len(raw) == 3 * 16
    at_preset = {g["set"]: g for g in grid if (g["n"], g["weight"]) == (5, 0.5)}
    for r in raw:
        if (r["whiten"], r["weight"]) == (0.5, 2.0):
            assert r["service_map"] == pytest.approx(at_preset[r["set"]]["service_map"],
                                                     abs=1e-6)
    assert "| class | 0.5 | 2.0 |" in capsys.readouterr().out
    # fewer training images: a row of its own, in the report under its own name; refused
    # with the grids (they rebuild the saved heads' training rows) before any work
    for bad in (["--per-class", "2", "--raw-grid"], ["--per-class", "0"]):
        with pytest.raises(SystemExit):
            main([*args, *bad])
    assert "--per-class" in capsys.readouterr().err
    assert main([*args, "--kernels", "class", "--sets", "valid", "--per-class", "2"]) == 0
    last = json.loads((out / "results.jsonl").read_text().splitlines()[-1])
    assert (last["kernel"], last["set"], last["per_class"]) == ("class", "valid", 2)
    assert (out / "heads" / "class-valid-0-per-class-2.pt").is_file()
    capsys.readouterr()
    assert main(["--out", str(out), "--report"]) == 0
    assert "| class, 2 per class | valid | 1 |" in capsys.readouterr().out


def test_cdk_finetune_bench_smoke(tiny_data, tmp_path):
    from research import cdk_finetune_bench

    root, split = tiny_data
    assert cdk_finetune_bench.main(["--smoke", "--data", str(root), "--split", str(split),
                                    "--out", str(tmp_path), "--variants", "frozen-lite0",
                                    "finetune-lite0"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [r["variant"] for r in rows] == ["frozen-lite0", "finetune-lite0"]
    assert [r["config"]["finetune"] for r in rows] == [False, True]
    assert {r["config"]["backbone"] for r in rows} == {"efficientnet-lite0"}


def test_cdk_step_bench_smoke(tiny_data, capsys):
    from research import cdk_step_bench

    root, split = tiny_data
    assert cdk_step_bench.main(["--smoke", "--data", str(root), "--split", str(split)]) == 0
    out = capsys.readouterr().out
    assert out.count("trunk cache") == 1 and out.count("trunk no_grad + aug") == 3


def test_cdk_levers_bench_smoke(tiny_data, tmp_path, capsys):
    from research import cdk_levers_bench

    root, split = tiny_data
    variants = ["preset", "preset, similar-class pairing 0.3", "preset, input dropout 0.6"]
    assert cdk_levers_bench.main(["--smoke", "--data", str(root), "--split", str(split),
                                  "--out", str(tmp_path), "--threads", "1",
                                  "--variants", *variants]) == 0
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [r["variant"] for r in rows] == variants
    # the variants passed their own sampler or dropout: different training, same data
    # (the learned spectrum differs; the full embedding's mAP on this tiny set is mostly the
    # raw coordinates', which no variant changes)
    assert len({r["max_swap_top32"] for r in rows}) == 3
    assert len({r["max_swap_top32_norm"] for r in rows}) == 3


def test_openworld_bench_smoke(tmp_path, capsys):
    from research import openworld_bench

    variants = ["default", "pseudo contour", "augment", "adapt + csls-gallery", "csls-train",
                "modes 0.5 + csls-train + floor 0.05", "single-view + csls-train"]
    assert openworld_bench.main(["--smoke", "--out", str(tmp_path), "--threads", "1",
                                 "--variants", *variants]) == 0
    rows = [json.loads(x) for x in (tmp_path / "results.jsonl").read_text().splitlines()]
    # every variant on both class folds and the validation classes, each with both measures
    assert sorted({(r["variant"], r["set"]) for r in rows}) == sorted(
        (v, s) for v in variants for s in ("valid", "fold0", "fold1"))
    for r in rows:
        for key in ("gen_map", "gen_p", "gen_seen", "zs_map", "zs_modes_map"):
            assert 0 <= r[key] <= 1, (key, r)
    by = {(r["variant"], r["set"]): r for r in rows}
    # the search-time correction changes the scores, not the heads: the modes alone agree
    assert by["csls-train", "fold0"]["zs_modes_map"] == by["default", "fold0"]["zs_modes_map"]
    # scaling a query's modes changes no ranking by the modes alone
    assert by["modes 0.5 + csls-train + floor 0.05", "fold0"]["zs_modes_map"] == pytest.approx(
        by["default", "fold0"]["zs_modes_map"])
    assert "| default | folds | 2 |" in capsys.readouterr().out


def test_openworld_floor_penalty_is_the_correction_above_the_floor():
    """A floor under every photo's mean score shifts every penalty by weight x floor (no
    ranking changes); a floor above them all leaves no penalty."""
    import torch

    from research.openworld_bench import _penalty
    from training.cdk.model.hubness import Hubness, photo_penalty

    g, sample = torch.randn(40, 6, generator=torch.Generator().manual_seed(0)), \
        torch.randn(30, 6, generator=torch.Generator().manual_seed(1))
    hub = Hubness(5, 0.7)
    plain = photo_penalty(g, sample, hub)
    r = plain / hub.weight
    low, high = float(r.min()) - 1.0, float(r.max()) + 1.0
    assert torch.allclose(_penalty(g, sample, hub, None), plain)
    assert torch.allclose(_penalty(g, sample, hub, low), plain - hub.weight * low, atol=1e-5)
    assert torch.equal(_penalty(g, sample, hub, high), torch.zeros(40))
