"""scanprefix: queries against brute force over the decoded vectors, the re-scored rows,
appending, the memory plan, and the file mapped as the service maps it."""

import faiss
import numpy as np
import pytest

from index.blocks import array_blocks
from index.kinds import DoesNotFit, choose, get, parse_bytes
from index.store import SERVE_IO_FLAGS
from tests.index.test_kinds import sketch_like

KIND = get("scanprefix")


@pytest.fixture(scope="module")
def built():
    photos, sketches = sketch_like(12_000, 40, L=48)
    params = {**KIND.plan(len(photos), 48), "lead": 16, "scan": 8, "fine": 4}
    return photos, sketches, params, KIND.build(array_blocks(photos, 5_000), 48, params)


def brute_force(decoded, q, k):
    scores = q @ decoded[:, : q.shape[1]].T
    rows = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(scores, rows, 1), rows


def test_every_query_is_the_exact_top_k_of_the_decoded_vectors_when_all_are_rescored(built):
    """Every row re-scored: queries within the 8-bit coordinates and wider ones (8-bit and
    4-bit codes) give brute force's top k over the decoded vectors."""
    photos, sketches, _, index = built
    faiss.downcast_index(index).k_factor = len(photos) / 10
    decoded = KIND.reconstruct(index, 0, len(photos))
    assert np.abs(decoded[:, :16] - photos[:, :16]).max() < 0.01 * np.abs(photos).max()
    assert np.abs(decoded - photos).max() < 0.1 * np.abs(photos).max()
    for d in (5, 16, 17, 48):
        scores, rows = KIND.search(index, sketches[:, :d], 10)
        want_scores, want_rows = brute_force(decoded, sketches[:, :d], 10)
        np.testing.assert_allclose(scores, want_scores, rtol=1e-4, atol=1e-5)
        assert np.mean(rows == want_rows) > 0.99  # ties in float32 sums may swap neighbours


def test_queries_rescore_the_rows_their_leading_coordinates_pick(built):
    """With k_factor x 10 rows the scores are still exact for the rows returned, and more
    rows re-scored find more of the exact top 10."""
    photos, sketches, params, index = built
    decoded = KIND.reconstruct(index, 0, len(photos))
    for d in (8, 48):
        _, truth = brute_force(decoded, sketches[:, :d], 10)
        found = {}
        for rerank in (10, 1000):
            faiss.downcast_index(index).k_factor = rerank / 10
            scores, rows = KIND.search(index, sketches[:, :d], 10)
            np.testing.assert_allclose(
                scores, np.einsum("qd,qkd->qk", sketches[:, :d], decoded[rows][:, :, :d]),
                rtol=1e-4, atol=1e-5)
            found[rerank] = np.mean([len(set(t) & set(r)) / 10
                                     for t, r in zip(truth, rows, strict=True)])
        assert found[10] < found[1000] and found[1000] >= 0.9, (d, found)
    faiss.downcast_index(index).k_factor = params["k_factor"]


def test_appended_rows_are_the_rows_a_build_of_all_gives(built):
    photos, sketches, params, index = built
    first = KIND.build(array_blocks(photos[:7_000], 3_000), 48, params)
    for start in (7_000, 9_500):
        KIND.add(first, photos[start : start + 2_500])
    assert first.ntotal == len(photos)
    whole = KIND.build(array_blocks(photos[:7_000]), 48, params)  # same sample: same training
    KIND.add(whole, photos[7_000:])
    for d in (8, 48):
        np.testing.assert_array_equal(KIND.search(first, sketches[:, :d], 10)[1],
                                      KIND.search(whole, sketches[:, :d], 10)[1])
    with pytest.raises(ValueError, match="appends rows in order"):
        KIND.add_codes(first, KIND.encode(first, photos[:3]), 5)


def test_the_mapped_file_answers_as_the_built_index(built, tmp_path):
    _, sketches, _, index = built
    path = tmp_path / "scan.faiss"
    faiss.write_index(index, str(path))
    mapped = faiss.read_index(str(path), SERVE_IO_FLAGS)
    for d in (8, 48):
        a, b = KIND.search(index, sketches[:, :d], 10), KIND.search(mapped, sketches[:, :d], 10)
        np.testing.assert_array_equal(a[1], b[1])
        np.testing.assert_allclose(a[0], b[0], rtol=1e-6)


def test_budget_plans_the_8_bit_width():
    n, dims = 10_000_000, 512
    plan = KIND.plan(n, dims, parse_bytes("3G"))
    assert plan == {"scan": 32, "fine": 16, "lead": 64, "k_factor": 300}
    assert KIND.memory(n, dims, plan) <= 3 * 2**30 < KIND.memory(n, dims, {**plan, "lead": 80})
    # per photo: 16 bytes of fast-scan codes, 32 of float16, 48 of 8-bit codes, 224 of
    # product codes; codebooks, ranges and the tail's rotation
    fixed = 16 * 32 * 4 + 2 * 512 * 4 + 256 * 448 * 4 + 448 * 448 * 4
    assert KIND.memory(n, dims, plan) == n * (16 + 32 + 48 + 224) + fixed
    kind, params = choose(n, dims, parse_bytes("3G"))
    assert (kind.name, params) == ("scanprefix", plan)
    assert KIND.plan(20_000, 24)["lead"] == 22  # the tail keeps two coordinates
    assert KIND.plan(20_000, 25)["lead"] == 23  # and an even number of them
    assert KIND.plan(20_000, 61, parse_bytes("1G"))["lead"] == 49  # 16 x 3 + 1: odd dims
    with pytest.raises(DoesNotFit, match="scanprefix over 10000000 vectors of 512 dims needs"):
        KIND.plan(n, dims, parse_bytes("2G"))
    with pytest.raises(ValueError, match="needs dims >= 4"):
        KIND.plan(20_000, 3)
    with pytest.raises(ValueError, match="needs at least 9984 vectors"):
        KIND.plan(5_000, 32)
    with pytest.raises(ValueError, match="got scan 30, fine 16, lead 17, dims 32"):
        KIND.train(np.zeros((100, 32), np.float32), {**KIND.plan(20_000, 32), "lead": 17})


def test_the_mixed_kind_fills_its_cells_evenly():
    """ivfsq48's photos go to their nearest centre (k-means in Euclidean distance): list
    sizes stay near N / nlist, where clustering by inner product crowded a few cells."""
    photos, _ = sketch_like(20_000, 1, L=32)
    mixed = get("ivfsq48")
    index = mixed.build(array_blocks(photos), 32, {**mixed.plan(len(photos), 32), "coarse": 8})
    ivf = faiss.extract_index_ivf(index)  # a view into `index`, which must stay alive
    sizes = np.array([ivf.invlists.list_size(i) for i in range(ivf.nlist)], dtype=float)
    assert sizes.sum() == len(photos)
    assert (sizes**2).sum() * ivf.nlist / sizes.sum() ** 2 < 1.5


def test_built_loaded_served_and_appended_through_the_index_commands(tmp_path):
    """scanprefix through the sharded build, the memory-mapped loader the service uses,
    and index.add: answers are brute force's top k over the stored (decoded) vectors."""
    from index.add import append_photos
    from index.sharded import build_sharded
    from index.store import load_index
    from tests.fakes import FakeModel, make_gallery

    gallery = make_gallery(tmp_path / "photos", classes=20, per_class=500, size=8)
    build_sharded(FakeModel(L=16), gallery, tmp_path / "ix", kind="scanprefix",
                  shard_size=4_000, progress=False)
    make_gallery(gallery, classes=2, per_class=5, seed=1)
    report = append_photos(FakeModel(L=16), tmp_path / "ix", gallery, progress=False)
    ix = load_index(tmp_path / "ix")
    assert report.added == 10 and len(ix) == ix.index.ntotal == 10_010
    assert ix.sidecar.kind == "scanprefix" and set(ix.sidecar.recall["by_dims"]) == {"16"}
    stored = ix.kind.reconstruct(ix.index, 0, len(ix))
    queries = np.random.default_rng(0).normal(size=(8, 16)).astype(np.float32)
    for d in (4, 16):  # k = every row: the whole ranking, appended rows included
        scores, rows = ix.search(queries[:, :d], k=len(ix))
        want, _ = brute_force(stored, queries[:, :d], len(ix))
        np.testing.assert_allclose(scores, want, rtol=1e-4, atol=1e-5)
        assert all(set(r) == set(range(len(ix))) for r in rows)
