"""Sharded builds: shards on disk, the code kinds against brute force, the memory budget,
resume after an interruption, and the index opened memory-mapped."""

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from index.embed import Embedded
from index.errors import IndexStoreError
from index.gallery import Photo, scan_gallery
from index.kinds import KINDS, DoesNotFit, choose, get, parse_bytes
from index.kinds.codes import build_codes, default_nlist
from index.search import exact_topk, exact_topk_blocks, pad_queries
from index.sharded import build_sharded
from index.shards import (
    Shard,
    ShardPlan,
    load_vectors,
    missing_shards,
    plan_blocks,
    write_shard,
)
from index.store import current_version, load_index
from tests.fakes import FakeModel, make_gallery
from tests.index.test_kinds import sketch_like


def synthetic_plan(folder: Path, vectors: np.ndarray, shard_size: int) -> ShardPlan:
    """Shards of given vectors (no photos on disk: the plan is made by hand)."""
    shards = []
    for number, start in enumerate(range(0, len(vectors), shard_size)):
        n = min(shard_size, len(vectors) - start)
        photos = tuple(Photo(f"p{start + i}", "c", f"c/p{start + i}.jpg") for i in range(n))
        shards.append(Shard(number, start, f"{number:016x}", photos))
    plan = ShardPlan(folder, folder, vectors.shape[1], "sha", tuple(shards))
    folder.mkdir(parents=True, exist_ok=True)
    for s in shards:
        write_shard(plan, s, Embedded(list(s.photos), vectors[s.start : s.start + len(s.photos)],
                                      0, []))
    return plan


def recall(kind, index, photos, sketches, d):
    q = np.ascontiguousarray(sketches[:, :d])
    truth = np.argsort(-(q @ photos[:, :d].T), axis=1)[:, :10]  # numpy brute force
    _, found = kind.search(index, q, 10)
    return float(np.mean([len(set(t) & set(f)) / 10 for t, f in zip(truth, found, strict=True)]))


@pytest.fixture(scope="module")
def sketchlike(tmp_path_factory):
    photos, sketches = sketch_like(20_000, 200, L=32)
    plan = synthetic_plan(tmp_path_factory.mktemp("plan") / "shards", photos, 6_000)
    return photos, sketches, plan


@pytest.mark.parametrize("name,floor,extra", [
    ("ivfsq8", 0.9, {}), ("ivfsq48", 0.9, {}), ("ivfpq", 0.5, {}),
    # scanprefix: queries of 4 and 16 on its 16 leading coordinates, of 32 on the tail too
    ("scanprefix", 0.9, {"lead": 16, "scan": 16, "fine": 8})])
def test_code_kind_from_shards_against_brute_force(sketchlike, name, floor, extra,
                                                   record_property):
    photos, sketches, plan = sketchlike
    kind = get(name)
    params = {**kind.plan(len(photos), 32, nprobe=16), **extra}
    index = build_codes(kind, plan_blocks(plan)[0], 32, params, work=plan.folder)
    assert index.ntotal == len(photos)
    got = {d: recall(kind, index, photos, sketches, d) for d in (4, 16, 32)}
    record_property(f"{name}_recall", got)
    print(f"{name} recall@10 of sketch queries vs brute force: {got}")
    assert min(got.values()) >= floor, got
    # Shard by shard gives the index FAISS's own add gives (the kinds that assign or split
    # the codes themselves: their own add of all vectors at once), from the same trained
    # quantizers.
    ref = kind.train(photos, params)  # the sample of 20,000 vectors is all of them
    ref.add(photos) if name in ("ivfsq8", "ivfpq") else kind.add(ref, photos)
    for d in (16, 32):
        q = sketches[:20, :d]
        np.testing.assert_array_equal(kind.search(index, q, 10)[1], kind.search(ref, q, 10)[1])


@pytest.mark.parametrize("name", ["ivfsq8", "ivfsq48", "scanprefix"])
def test_scalar_codes_score_the_decoded_prefix_exactly(sketchlike, name):
    """Zero-padded queries score the decoded d-prefix only: the scalar quantizers code each
    coordinate (ivfsq48: each of its two components) on its own. (scanprefix: queries within
    its 16 8-bit coordinates and wider ones alike.)"""
    photos, sketches, plan = sketchlike
    kind = get(name)
    narrow = {"lead": 16, "scan": 16, "fine": 8} if name == "scanprefix" else {}
    params = {**kind.plan(20_000, 32, nprobe=256), **narrow}
    index = kind.build(plan_blocks(plan)[0], 32, params)
    decoded = kind.reconstruct(index, 0, 20_000)
    scalar = 16 if name == "scanprefix" else 32  # its tail has product codes: no max bound
    error = np.abs(decoded - photos)
    assert error[:, :scalar].max() < 0.05 * np.abs(photos).max()
    assert error.mean() < 0.01 * np.abs(photos).max()
    for d in (3, 16, 32):
        scores, rows = kind.search(index, sketches[:5, :d], 5)
        exact = np.einsum("qd,qkd->qk", sketches[:5, :d], decoded[rows][:, :, :d])
        np.testing.assert_allclose(scores, exact, rtol=1e-4, atol=1e-5)


def test_the_mixed_kind_codes_its_leading_coordinates_with_8_bits(sketchlike):
    photos, _, plan = sketchlike
    kind = get("ivfsq48")
    errors = {}
    for lead in (0, 8):
        params = {**kind.plan(20_000, 32), "lead": lead}
        index = kind.build(plan_blocks(plan)[0], 32, params)
        errors[lead] = np.abs(kind.reconstruct(index, 0, 20_000) - photos).max(0)  # (32,)
        assert index.sa_code_size() == (32 + lead) // 2 + 1  # + 1 byte for the cell number
    # 4 more bits: the rounding error of the first 8 coordinates falls 16-fold (>= 8 here),
    # the others are coded as before
    assert (errors[8][:8] * 8 < errors[0][:8]).all()
    np.testing.assert_array_equal(errors[8][8:], errors[0][8:])


def test_exact_topk_blocks_equals_one_block():
    rng = np.random.default_rng(0)
    x, q = rng.normal(size=(1000, 8)).astype(np.float32), rng.normal(size=(7, 8)).astype(
        np.float32)
    s1, i1 = exact_topk(x, q, 10)
    s2, i2 = exact_topk_blocks(((o, x[o : o + 300]) for o in range(0, 1000, 300)), q, 10)
    np.testing.assert_array_equal(i1, i2)
    np.testing.assert_allclose(s1, s2, rtol=1e-6)


def test_budget_picks_kind_and_code_size():
    assert parse_bytes("3G") == 3 * 2**30 and parse_bytes("512M") == 2**29
    assert parse_bytes("1.5K") == 1536 and parse_bytes("100") == 100
    with pytest.raises(ValueError, match="'3 parsecs'"):
        parse_bytes("3 parsecs")
    n, d = 10_000_000, 256
    assert default_nlist(n) == 4096 and default_nlist(1_000_000) == 1024
    assert default_nlist(100) == 1

    def auto(count, dims, budget):
        return choose(count, dims, parse_bytes(budget) if budget else None)[0].name

    assert auto(50_000, d, None) == "flat" and auto(200_000, d, None) == "ivf"
    assert auto(n, d, "16G") == "ivf"  # 10.3 GB of float32 + ids
    assert auto(n, d, "3G") == "ivfsq8"  # 2.64 GB
    assert auto(n, d, "1G") == "opq"
    sq8 = get("ivfsq8")
    assert sq8.memory(n, d, sq8.plan(n, d)) == n * (256 + 8) + 4096 * 256 * 4 + 2 * 256 * 4
    # today's width: 8-bit codes of all 512 would take 5.2 GB; scanprefix fits (its plan:
    # tests/index/test_prefix.py), and the mixed kind codes as many leading coordinates with
    # 8 bits as the budget allows, the others with 4
    assert auto(n, 512, "3G") == "scanprefix"
    kind = get("ivfsq48")
    params = kind.plan(n, 512, parse_bytes("3G"))
    assert params["lead"] == 114
    assert kind.memory(n, 512, params) <= 3 * 2**30 < kind.memory(n, 512, {**params, "lead": 116})
    pq = get("ivfpq").plan(n, d, parse_bytes("1G"))
    assert pq["m"] == 64 and get("ivfpq").memory(n, d, pq) <= 2**30 < get("ivfpq").memory(
        n, d, {**pq, "m": 128})
    assert get("opq").plan(n, d)["m"] == 128  # at most dims/2 sub-vectors
    with pytest.raises(DoesNotFit, match="ivfsq8 over 10000000 vectors of 256 dims needs"):
        sq8.plan(n, d, parse_bytes("2G"))
    with pytest.raises(ValueError, match="needs at least 9984 vectors"):
        get("ivfpq").plan(500, d)
    with pytest.raises(DoesNotFit, match="too small for any index kind over 10000000 vectors"):
        choose(n, 512, parse_bytes("10M"))


def test_interrupted_encoding_resumes_at_the_first_shard_not_encoded(tmp_path):
    photos, _ = sketch_like(12_000, 1, L=16)
    plan = synthetic_plan(tmp_path / "shards", photos, 3_000)
    kind = get("ivfsq8")
    params = kind.plan(12_000, 16)

    def stop_after_two(block):
        if block.start == 3_000:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build_codes(kind, plan_blocks(plan)[0], 16, params, plan.folder, on_block=stop_after_two)
    written = {p.name: p.stat().st_mtime_ns for p in plan.folder.glob("codes-*")}
    assert len(written) == 2 and len(list(plan.folder.glob("trained-*"))) == 1
    resumed = build_codes(kind, plan_blocks(plan)[0], 16, params, plan.folder)
    assert {p.name: p.stat().st_mtime_ns for p in plan.folder.glob("codes-*")
            if p.name in written} == written  # not encoded again
    again = synthetic_plan(tmp_path / "again", photos, 3_000)
    whole = build_codes(kind, plan_blocks(again)[0], 16, params, again.folder)
    q = pad_queries(photos[:50, :8], 16)
    for a, b in zip(resumed.search(q, 10), whole.search(q, 10), strict=True):
        np.testing.assert_array_equal(a, b)


class StopAfter(FakeModel):
    """Raises once `limit` photos have been embedded (an interrupted build)."""

    def __init__(self, limit):
        super().__init__(L=8)
        self.limit, self.seen = limit, 0

    def encode(self, batch, modality):
        self.seen += len(batch)
        if self.seen > self.limit:
            raise KeyboardInterrupt
        return super().encode(batch, modality)


def test_sharded_build_resumes_and_never_shows_a_partial_index(tmp_path):
    gallery = make_gallery(tmp_path / "photos", classes=3, per_class=5)
    out = tmp_path / "ix"
    with pytest.raises(KeyboardInterrupt):
        build_sharded(StopAfter(8), gallery, out, kind="ivfsq8", batch_size=4,
                      shard_size=4, progress=False)
    with pytest.raises(IndexStoreError):
        load_index(out)  # two shards on disk, no index
    plan_files = sorted(p.name for p in (out / "shards").glob("shard-*.json"))
    assert len(plan_files) == 2
    report = build_sharded(FakeModel(L=8), gallery, out, kind="ivfsq8",
                           batch_size=4, shard_size=4, progress=False)
    assert report.embedded == 15 - 8 and report.shards == 4
    again = build_sharded(FakeModel(L=8), gallery, out, kind="ivfsq8",
                          batch_size=4, shard_size=4, progress=False)
    assert again.embedded == 0
    # The shards hold what the local engine computes, photo by photo, with the same ids.
    scan = scan_gallery(gallery)
    root, photos = scan.root, scan.photos
    reference = FakeModel(L=8).embed([Image.open(root / p.path) for p in photos], "photo")
    from index.shards import plan_shards

    plan = plan_shards(out / "shards", root, photos, 8, FakeModel(L=8).sha256, 4)
    assert not missing_shards(plan)
    np.testing.assert_allclose(load_vectors(plan), reference, rtol=1e-6, atol=1e-6)
    ix = load_index(out)
    assert [p.id for p in ix.photos] == [p.id for p in photos] and ix.sidecar.kind == "ivfsq8"
    assert ix.sidecar.params["nlist"] == 1
    assert set(ix.sidecar.recall["by_dims"]) == {"8"} and ix.sidecar.recall["k"] == 10
    assert sorted(p.name for p in (out / "shards").iterdir()) == sorted(  # work files went
        f"{s.stem}{ext}" for s in plan.shards for ext in (".npy", ".json"))


def test_index_is_memory_mapped(tmp_path):
    from index.build import build_index

    gallery = make_gallery(tmp_path / "photos", classes=2, per_class=3)
    build_index(FakeModel(L=8), gallery, tmp_path / "ix", progress=False)
    ix = load_index(tmp_path / "ix")
    path = str(current_version(tmp_path / "ix") / "index.faiss")
    maps = Path("/proc/self/maps")
    if maps.exists():
        assert path in maps.read_text()  # the vectors are mapped from the file, not copied
    assert len(ix) == 6


def test_code_kinds_are_build_choices():
    from index.build import parse_args

    for kind in [k for k in KINDS if get(k).streams]:
        cfg = parse_args(["--model", "m", "--photos", "p", "--out", "o", "--kind", kind,
                          "--max-index-memory", "3G", "--engine", "ray", "--shard-size", "7"])
        assert (cfg.kind, cfg.max_index_memory, cfg.engine, cfg.shard_size) == (
            kind, "3G", "ray", 7)


@pytest.mark.parametrize("kind", ["ivfsq8", "ivfsq48"])
def test_append_to_a_code_index(tmp_path, kind):
    """index.add works on a code index: the new photos are encoded by its trained
    quantizers and the old codes stay as they were. (Values outside the ranges the scalar
    quantizer was trained on are clipped: docs/index.md says to rebuild instead.)"""
    from index.add import append_photos

    gallery = make_gallery(tmp_path / "photos", classes=3, per_class=5)
    build_sharded(FakeModel(L=8), gallery, tmp_path / "ix", kind=kind,
                  shard_size=4, progress=False)
    queries = np.random.default_rng(0).normal(size=(4, 8)).astype(np.float32)
    before = load_index(tmp_path / "ix").search(queries, k=15)
    make_gallery(gallery, classes=2, per_class=3, seed=1)
    report = append_photos(FakeModel(L=8), tmp_path / "ix", gallery, progress=False)
    ix = load_index(tmp_path / "ix")
    assert report.added == 6 and len(ix) == ix.index.ntotal == 21
    assert ix.sidecar.kind == kind
    photos = scan_gallery(gallery).photos
    assert {p.id for p in ix.photos} == {p.id for p in photos}
    scores, rows = ix.search(queries, k=21)
    for q in range(4):
        old = {r: sc for r, sc in zip(rows[q], scores[q], strict=True) if r < 15}
        assert old == dict(zip(before[1][q], before[0][q], strict=True))
