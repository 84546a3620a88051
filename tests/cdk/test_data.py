import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from training.cdk.data import DataError, PairSampler, scan
from training.cdk.features import extract_features
from training.cdk.model.backbones import build_backbone
from training.cdk.splits import SKETCHY2_TEST, class_folds, split_classes, validation_classes
from training.images import ImageError


def _png(path: Path, value: int = 0, mode="RGB"):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, (8, 8), value if mode == "L" else (value, value, value)).save(path)


def make_paired(root: Path, classes=("a", "b", "c"), photos=3, sketches_per_photo=2):
    for c in classes:
        for i in range(photos):
            _png(root / "photo" / c / f"{c}{i}.jpg", 10 * i)
            for n in range(1, sketches_per_photo + 1):
                _png(root / "sketch" / c / f"{c}{i}-{n}.png", 20 * n, mode="L")
    return root


def test_scan_paired_and_instance_pairs(tmp_path):
    ds = scan(make_paired(tmp_path))
    assert ds.classes == ("a", "b", "c")
    assert len(ds.photos) == 9 and len(ds.sketches) == 18
    pairs = ds.instance_pairs()
    for s, j in zip(ds.sketches, pairs, strict=True):
        assert ds.photos[j].stem == s.stem.rsplit("-", 1)[0]
        assert ds.photos[j].parent.name == s.parent.name
    sub = ds.restrict(["c", "a"])
    assert sub.classes == ("a", "c") and set(sub.sketch_labels.tolist()) == {0, 1}
    assert all(p.parent.name == sub.classes[lab]
               for p, lab in zip(sub.photos, sub.photo_labels, strict=True))


def test_official_sketchy_extended_layout(tmp_path):
    for c in ("cat", "dog"):
        _png(tmp_path / "sketch/tx_000000000000" / c / f"{c}1-1.png")
        _png(tmp_path / "photo/tx_000000000000" / c / f"{c}1.jpg")
        _png(tmp_path / "extended_photo" / c / f"ext_{c}.jpg")
    ds = scan(tmp_path)
    assert ds.classes == ("cat", "dog") and len(ds.photos) == 4 and len(ds.sketches) == 2
    assert any("extended_photo" in str(p) for p in ds.photos)


def test_bad_data_errors_name_the_file(tmp_path):
    root = make_paired(tmp_path / "one_modality")
    (root / "photo" / "zebra").mkdir()
    _png(root / "photo" / "zebra" / "z.jpg")
    with pytest.raises(DataError, match="zebra"):
        scan(root)

    root = make_paired(tmp_path / "empty")
    (root / "sketch" / "d").mkdir()
    _png(root / "photo" / "d" / "d0.jpg")
    with pytest.raises(DataError, match=r"empty class.*sketch.*d"):
        scan(root)

    root = make_paired(tmp_path / "stray")
    (root / "photo" / "a" / "notes.txt").write_text("x")
    with pytest.raises(DataError, match="notes.txt"):
        scan(root)

    root = make_paired(tmp_path / "corrupt")
    bad = root / "photo" / "b" / "b1.jpg"
    bad.write_bytes(b"not a jpeg")
    ds = scan(root)
    bb = build_backbone("efficientnet-lite0")
    with pytest.raises(ImageError, match="b1.jpg"):
        extract_features(ds.photos, bb, 32, None)

    root = make_paired(tmp_path / "orphan")
    _png(root / "sketch" / "a" / "nophoto-1.png")
    with pytest.raises(DataError, match="nophoto-1.png"):
        scan(root).instance_pairs()


def test_feature_cache_reused_and_keyed_by_files(tmp_path):
    ds = scan(make_paired(tmp_path / "d", classes=("a",), photos=2, sketches_per_photo=1))
    bb = build_backbone("efficientnet-lite0")
    cache = tmp_path / "cache"
    a = extract_features(ds.photos, bb, 32, cache)
    assert a.shape == (2, 1280) and len(list(cache.iterdir())) == 1
    b = extract_features(ds.photos, bb, 32, cache)
    torch.testing.assert_close(a, b)
    extract_features(ds.photos[:1], bb, 32, cache)  # another file list: another entry
    assert len(list(cache.iterdir())) == 2


@pytest.mark.parametrize("damage", ["truncated", "empty", "nan", "garbage", "wrong rows"])
def test_damaged_feature_cache_is_recomputed_with_a_warning(tmp_path, caplog, damage):
    ds = scan(make_paired(tmp_path / "d", classes=("a",), photos=2, sketches_per_photo=1))
    bb = build_backbone("efficientnet-lite0")
    cache = tmp_path / "cache"
    right = extract_features(ds.photos, bb, 32, cache)  # (2, 1280)
    [entry] = cache.iterdir()
    data = entry.read_bytes()
    if damage == "truncated":
        entry.write_bytes(data[: len(data) // 2])
    elif damage == "empty":
        entry.write_bytes(b"")
    elif damage == "garbage":
        entry.write_bytes(b"\x00" * 100)
    else:
        obj = torch.load(entry, weights_only=True)
        if damage == "nan":
            obj["features"][1, 7] = float("nan")
        else:
            obj["features"] = obj["features"][:1]
        torch.save(obj, entry)
    with caplog.at_level("WARNING", logger="training.cdk.features"):
        again = extract_features(ds.photos, bb, 32, cache)
    torch.testing.assert_close(again, right)
    assert any(r.levelname == "WARNING" and "recomputing: feature cache" in r.getMessage()
               and str(entry) in r.getMessage() for r in caplog.records)
    caplog.clear()
    torch.testing.assert_close(extract_features(ds.photos, bb, 32, cache), right)  # rewritten
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


def test_class_sampler_pair_distribution():
    # 3 classes with unequal sizes: 2/3/5 sketches, 1/2/4 photos.
    sl = np.array([0] * 2 + [1] * 3 + [2] * 5)
    pl = np.array([2, 0, 1, 2, 1, 2, 2])
    s = PairSampler(sl, pl, "class")
    counts = np.zeros((len(sl), len(pl)))
    epochs = 3000
    for e in range(epochs):
        batches = list(s.epoch(seed=0, epoch=e, batch_size=5))
        assert len(batches) == 2
        seen = torch.cat([b[0] for b in batches])
        assert sorted(seen.tolist()) == list(range(10))  # every sketch once per epoch
        for si, pi in batches:
            np.add.at(counts, (si.numpy(), pi.numpy()), 1)
    # p(x, y) = E_c[p(x|c) p(y|c)] with p(c) = #sketches(c) / #sketches.
    same = sl[:, None] == pl[None, :]
    n_photo = np.bincount(pl)[sl][:, None]
    expected = np.where(same, epochs / n_photo, 0.0)
    assert counts[~same].sum() == 0
    rel_err = np.abs(counts[same] - expected[same]) / expected[same]
    assert rel_err.max() < 0.1, rel_err.max()


def test_sampler_deterministic_and_instance_mode():
    sl, pl = np.array([0, 0, 1, 1]), np.array([0, 1, 1])
    a = [tuple(t.tolist() for t in b) for b in PairSampler(sl, pl).epoch(7, 3, 2)]
    b = [tuple(t.tolist() for t in b) for b in PairSampler(sl, pl).epoch(7, 3, 2)]
    c = [tuple(t.tolist() for t in b) for b in PairSampler(sl, pl).epoch(7, 4, 2)]
    assert a == b and a != c
    inst = PairSampler(sl, pl, "instance", photo_of=[0, 0, 1, 2])
    for si, pi in inst.epoch(0, 0, 4):
        assert pi.tolist() == [[0, 0, 1, 2][i] for i in si.tolist()]
    with pytest.raises(DataError, match=r"\[1\]"):
        PairSampler(np.array([0, 1]), np.array([0, 0]))


def test_splits(tmp_path):
    classes = [f"c{i:03d}" for i in range(125)]
    s1 = split_classes("sketchy1", classes)
    assert (len(s1["train"]), len(s1["valid"]), len(s1["test"])) == (100, 12, 13)
    assert not (set(s1["train"]) & set(s1["valid"])) and not (set(s1["test"]) & set(s1["train"]))
    state = np.random.get_state()[1].copy()
    assert split_classes("sketchy1", classes[::-1]) == s1  # sorted first; global RNG kept
    np.testing.assert_array_equal(np.random.get_state()[1], state)
    with pytest.raises(ValueError, match="bat"):
        split_classes("sketchy2", classes)
    f = tmp_path / "test.txt"
    f.write_text("# my split\nc001\nc002  # trailing comment\n")
    s = split_classes(str(f), classes)
    assert s["test"] == ["c001", "c002"] and (len(s["train"]), len(s["valid"])) == (111, 12)
    with pytest.raises(ValueError, match="nosuchsplit"):
        split_classes("nosuchsplit", classes)


def test_split_none_holds_out_no_test_class_and_the_usual_validation_classes():
    classes = [f"c{i:03d}" for i in range(125)]
    s = split_classes("none", classes[::-1])
    assert s["test"] == [] and s["valid"] == validation_classes(classes)
    assert len(s["valid"]) == 13 and sorted(s["train"] + s["valid"]) == classes
    assert not set(s["train"]) & set(s["valid"])
    with pytest.raises(ValueError, match="4 classes give none"):
        split_classes("none", classes[:4])


# sketchy1's classes as the SEM-PCYC rule drew them before validation_classes existed.
SKETCHY1_C_VALID = ["c009", "c044", "c046", "c047", "c058", "c067", "c070", "c081", "c087",
                    "c088", "c102", "c114"]
SKETCHY1_C_TEST = ["c012", "c021", "c036", "c039", "c064", "c065", "c083", "c103", "c109",
                   "c110", "c112", "c117", "c120"]


def _check_partition(s: dict, classes: list[str]) -> None:
    tr, va, te = (set(s[k]) for k in ("train", "valid", "test"))
    assert not (tr & va) and not (tr & te) and not (va & te)
    assert tr | va | te == set(classes)
    assert all(s[k] == sorted(s[k]) for k in s)


def test_validation_rule_matches_brute_force_hash_rank():
    names = [f"class {i}" for i in range(37)] + ["évier", "a"]
    digest = {c: hashlib.sha256(c.encode("utf-8")).hexdigest() for c in names}
    n = len(names)  # 39: round(3.9) = 4
    want = sorted(c for c in names if sum(digest[o] < digest[c] for o in names) < 4)
    assert validation_classes(names) == want
    assert validation_classes(names[::-1]) == want  # order of the list does not matter
    state = np.random.get_state()
    try:  # nor the global RNG
        for seed in (1, 2):
            np.random.seed(seed)
            assert validation_classes(names) == want
    finally:
        np.random.set_state(state)
    # round(n / 10) with halves up (not Python's banker's round: 25 -> 3), and never a single
    # class (retrieval within one class is trivial): 5 -> 2, 14 -> 2
    for k, nv in ((0, 0), (1, 0), (4, 0), (5, 2), (14, 2), (15, 2), (25, 3), (104, 10), (n, 4)):
        assert len(validation_classes([f"x{i}" for i in range(k)])) == nv


def test_class_folds_partition_by_hash_rank():
    names = [f"class {i}" for i in range(104)]
    digest = {c: hashlib.sha256(c.encode("utf-8")).hexdigest() for c in names}
    rank = {c: sum(digest[o] < digest[c] for o in names) for c in names}  # brute force
    folds = class_folds(names, 5)
    assert [len(f) for f in folds] == [21, 21, 21, 21, 20]
    for i, fold in enumerate(folds):
        assert fold == sorted(c for c in names if rank[c] % 5 == i)
    assert class_folds(names[::-1], 5) == folds  # the names decide, not their order
    # the same hash order as validation_classes: the class it ranks first opens fold 0
    assert min(validation_classes(names), key=digest.get) in class_folds(names, 10)[0]
    for bad in (1, 105):
        with pytest.raises(ValueError, match="folds"):
            class_folds(names, bad)
    with pytest.raises(ValueError, match="twice"):
        class_folds(["a", "a", "b"], 2)


def test_file_and_sketchy2_splits_carve_validation_from_training(tmp_path):
    others = [f"c{i:03d}" for i in range(104)]
    classes = sorted(others + list(SKETCHY2_TEST))
    s2 = split_classes("sketchy2", classes)
    _check_partition(s2, classes)
    assert (len(s2["train"]), len(s2["valid"]), len(s2["test"])) == (94, 10, 21)
    assert s2["valid"] == validation_classes(others) and not set(s2["valid"]) & set(SKETCHY2_TEST)
    assert split_classes("sketchy2", classes[::-1]) == s2  # deterministic, order-free

    # The same training list beside other test classes gives the same validation classes.
    train_list = [f"t{i:02d}" for i in range(30)]
    picks = []
    for tests in (["u1", "u2"], ["v1", "v2", "v3", "v4", "v5"]):
        f = tmp_path / f"{len(tests)}.txt"
        f.write_text("\n".join(tests) + "\n")
        s = split_classes(str(f), train_list + tests)
        _check_partition(s, train_list + tests)
        assert s["test"] == tests and len(s["valid"]) == 3 and len(s["train"]) == 27
        picks.append(s["valid"])
    assert picks[0] == picks[1] == validation_classes(train_list)

    # Too few training classes to hold any out: valid stays empty, training keeps them all.
    f = tmp_path / "tiny.txt"
    f.write_text("a\n")
    assert split_classes(str(f), ["a", "b", "c", "d", "e"]) == {
        "train": ["b", "c", "d", "e"], "valid": [], "test": ["a"]}


def test_sketchy1_split_unchanged():
    classes = [f"c{i:03d}" for i in range(125)]
    s1 = split_classes("sketchy1", classes)
    _check_partition(s1, classes)
    assert s1["valid"] == SKETCHY1_C_VALID and s1["test"] == SKETCHY1_C_TEST


def test_sketchy2_on_sketchy_mini(sketchy_mini):
    ds = scan(sketchy_mini)
    assert len(ds.classes) == 125
    s = split_classes("sketchy2", list(ds.classes))
    _check_partition(s, list(ds.classes))
    assert s["test"] == sorted(SKETCHY2_TEST) and len(s["train"]) == 94
    assert s["valid"] == ["airplane", "alarm_clock", "axe", "hat", "hedgehog", "owl", "penguin",
                          "table", "violin", "volcano"]  # the names README lists
    assert split_classes("sketchy1", list(ds.classes))["valid"] == [
        "bear", "geyser", "guitar", "hamburger", "jack-o-lantern", "mushroom", "pear", "racket",
        "saw", "saxophone", "spoon", "trumpet"]


def test_instance_pairing_on_sketchy_minis_real_pairs(sketchy_mini):
    """Split 2's training classes of sketchy-mini: some photos have no sketch, so the
    photos some sketch was drawn from stop short of the last photo. The joint moment and
    the held-out halves must take every photo, against a brute-force mean over the pairs."""
    ds = scan(sketchy_mini)
    tr = ds.restrict(split_classes("sketchy2", list(ds.classes))["train"])
    photo_of = tr.instance_pairs()
    assert int(photo_of.max()) + 1 < len(tr.photos)  # the case that once failed
    for s, j in zip(tr.sketches, photo_of, strict=True):
        assert tr.photos[j].stem == s.stem.rsplit("-", 1)[0]
    sampler = PairSampler(tr.sketch_labels, tr.photo_labels, "instance", photo_of)
    g = torch.Generator().manual_seed(0)
    f = torch.randn(len(tr.sketches), 3, generator=g)
    gp = torch.randn(len(tr.photos), 3, generator=g)
    want = (f.double() * gp.double()[torch.as_tensor(photo_of)]).mean(0)
    torch.testing.assert_close(sampler.joint_moment(f, gp), want)
    # a subset of photos that includes the last one: only the sketches of those photos count
    photos = torch.arange(len(tr.photos) - 300, len(tr.photos))
    keep = np.isin(photo_of, photos.numpy())
    rows = {int(p): i for i, p in enumerate(photos)}
    sub = gp[photos]
    want = torch.stack([f[i].double() * sub[rows[int(photo_of[i])]].double()
                        for i in np.flatnonzero(keep)]).mean(0)
    torch.testing.assert_close(sampler.joint_moment(f, sub, None, photos), want)
    halves = sampler.halves()
    assert sum(len(s) for s, _ in halves) == len(tr.sketches)  # every sketch has its photo
    for s_pos, p_pos in halves:  # each half keeps its pairs
        assert set(photo_of[s_pos.numpy()].tolist()) <= set(p_pos.tolist())
    for s, p in sampler.epoch(0, 0, 512):
        assert torch.equal(p, torch.as_tensor(photo_of)[s])


def test_mixed_pairs_on_sketchy_minis_real_pairs(sketchy_mini):
    """The default kernel, half class pairs and half each sketch with its own photo, on
    split 2's training classes: joint moment and photo marginal against the dense
    (sketches x photos) p(x, y) written out from the labels and file names."""
    ds = scan(sketchy_mini)
    tr = ds.restrict(split_classes("sketchy2", list(ds.classes))["train"])
    photo_of = tr.instance_pairs()
    sampler = PairSampler(tr.sketch_labels, tr.photo_labels, "class", photo_of,
                          instance_share=0.5)
    sl, pl = torch.as_tensor(tr.sketch_labels), torch.as_tensor(tr.photo_labels)
    same = (sl[:, None] == pl[None]).double()
    joint = 0.5 * same / same.sum(1, keepdim=True)
    joint[torch.arange(len(sl)), torch.as_tensor(photo_of)] += 0.5
    joint /= len(sl)
    g = torch.Generator().manual_seed(0)
    f = torch.randn(len(sl), 4, generator=g, dtype=torch.float64)
    gp = torch.randn(len(pl), 4, generator=g, dtype=torch.float64)
    torch.testing.assert_close(sampler.joint_moment(f, gp), torch.einsum("il,ij,jl->l", f,
                                                                          joint, gp))
    torch.testing.assert_close(sampler.photo_marginal(), joint.sum(0))


def test_data_without_instance_pairs_trains_the_class_kernel(tmp_path, caplog):
    """Sketches that do not name their photo: the default share of instance pairs falls
    back to 0 with a warning (the saved config says 0); --pairing instance is an error."""
    import dataclasses
    import logging

    from training.cdk.config import make_config
    from training.cdk.run import instance_pairs

    for c in ("a", "b"):
        for m, name in (("photo", "p1.jpg"), ("sketch", "drawn-1.png")):
            (tmp_path / m / c).mkdir(parents=True, exist_ok=True)
            Image.new("RGB", (8, 8), "white").save(tmp_path / m / c / name)
    tr = scan(tmp_path)
    cfg = make_config(data=str(tmp_path))
    assert cfg.instance_share == 0.5
    with caplog.at_level(logging.WARNING):
        got, photo_of = instance_pairs(cfg, tr)
    assert photo_of is None and got.instance_share == 0.0
    assert "class kernel alone" in caplog.text
    with pytest.raises(DataError, match="no photo"):
        instance_pairs(dataclasses.replace(cfg, pairing="instance"), tr)
