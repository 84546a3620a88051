import numpy as np
import pytest
import torch
from PIL import Image

from tests.bundles import init_checkpoint
from tests.fakes import crafted_checkpoint
from training.cdk.checkpoint import load_checkpoint
from training.cdk.make_bundle import embedder_of_checkpoint
from training.cdk.model.heads import retrieval_embedding


def from_checkpoint(path, device=None, sketch_flip_average=None):
    """The Embedder of a training checkpoint, as a bundle written from it holds it."""
    return embedder_of_checkpoint(path, device, sketch_flip_average)[0]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    # 8 modes, then 8 raw coordinates: embeddings 16 wide
    return init_checkpoint(tmp_path_factory.mktemp("ck") / "c.pt", modes=8, hidden=16,
                           image_size=64, raw_dims=8)


def _images():
    rng = np.random.default_rng(0)
    rgb = Image.fromarray(rng.integers(0, 255, (80, 60, 3), dtype=np.uint8))
    gray = Image.fromarray(rng.integers(0, 255, (50, 50), dtype=np.uint8), mode="L")
    rgba = Image.fromarray(rng.integers(0, 255, (64, 64, 4), dtype=np.uint8), mode="RGBA")
    return [rgb, gray, rgba]


def test_embed_shape_dtype_and_determinism(ckpt):
    e = from_checkpoint(ckpt, device="cpu")
    assert e.width == 16 and e.modes == 8 and e.raw_dims == 8 and e.backbone == "efficientnet-lite0"
    assert e.singular_values.shape == (8,) and bool(torch.isfinite(e.singular_values).all())
    import hashlib

    assert e.sha256 == hashlib.sha256(ckpt.read_bytes()).hexdigest()
    for modality in ("sketch", "photo"):
        z = e.embed(_images(), modality, batch_size=2)
        assert z.shape == (3, 16) and z.dtype == np.float32 and np.isfinite(z).all()
        # A fresh embedder from the same file gives the same numbers.
        z2 = from_checkpoint(ckpt, device="cpu").embed(_images(), modality)
        np.testing.assert_allclose(z, z2, rtol=1e-5, atol=1e-6)
    # Pieces compose to embed(); norm cap mu holds.
    x = e.preprocess(_images(), "photo")
    assert x.shape == (3, 3, 64, 64)
    feats = e.backbone_features(x, "photo")
    assert feats.shape == (3, 1280)
    np.testing.assert_allclose(e.head(feats, "photo").numpy(), e.embed(_images(), "photo"),
                               rtol=1e-5, atol=1e-6)
    assert np.linalg.norm(z, axis=1).max() <= e.inference.head["mu"] + 1e-4


def test_transparent_sketch_is_white(ckpt):
    e = from_checkpoint(ckpt, device="cpu")
    clear = Image.new("RGBA", (32, 32), (0, 0, 0, 0))
    white = Image.new("RGB", (32, 32), (255, 255, 255))
    torch.testing.assert_close(e.preprocess([clear], "sketch"), e.preprocess([white], "sketch"))


def test_frozen_backbone_stored_once_and_same_seed_same_heads(ckpt, tmp_path):
    obj = load_checkpoint(ckpt)
    assert obj["backbones"]["sketch"] is obj["backbones"]["photo"]
    other = init_checkpoint(tmp_path / "d.pt", modes=8, hidden=16, image_size=64)
    o2 = load_checkpoint(other)
    for k, v in obj["heads"]["sketch"].items():
        torch.testing.assert_close(v, o2["heads"]["sketch"][k])


def test_not_a_checkpoint_is_a_clear_error(tmp_path):
    bad = tmp_path / "x.pt"
    torch.save({"weights": torch.zeros(2)}, bad)
    with pytest.raises(ValueError, match="not a sketchsvd CDK checkpoint"):
        from_checkpoint(bad)
    with pytest.raises(FileNotFoundError, match=r"checkpoint '.*gone.pt' does not exist"):
        from_checkpoint(tmp_path / "gone.pt")
    junk = tmp_path / "y.pt"
    junk.write_bytes(b"junk")
    with pytest.raises(ValueError, match="y.pt"):
        from_checkpoint(junk)
    with pytest.raises(ValueError, match="modality"):
        from_checkpoint(init_checkpoint(tmp_path / "z.pt", modes=4, hidden=8)).embed(
            _images(), "drawing")



def test_crafted_checkpoint_is_refused_without_running_code(tmp_path):
    marker = tmp_path / "ran"
    bad = crafted_checkpoint(tmp_path / "evil.pt", marker, {"format": "sketchsvd-cdk",
                                                            "version": 2})
    with pytest.raises(ValueError, match="evil.pt' is not a sketchsvd CDK checkpoint"):
        from_checkpoint(bad)
    assert not marker.exists()
    torch.load(bad, weights_only=False)  # the file is a real threat: an unsafe load runs it
    assert marker.read_text() == "ran"


def test_incomplete_checkpoint_names_the_file_and_the_missing_keys(ckpt, tmp_path):
    obj = load_checkpoint(ckpt)
    del obj["head_arch"], obj["backbone"]["image_size"]
    torch.save(obj, tmp_path / "cut.pt")
    with pytest.raises(ValueError, match=r"cut.pt' is an incomplete CDK checkpoint: it lacks "
                                         r"head_arch, backbone.image_size"):
        from_checkpoint(tmp_path / "cut.pt")
    obj = load_checkpoint(ckpt)
    del obj["heads"]["photo"]["mlp.0.weight"]
    torch.save(obj, tmp_path / "heads.pt")
    with pytest.raises(ValueError, match=r"heads.pt' photo head weights do not fit "
                                         r"(?s:.*)mlp.0.weight"):
        from_checkpoint(tmp_path / "heads.pt")


def test_hash_is_of_the_bytes_loaded_even_if_the_file_is_replaced_meanwhile(ckpt, tmp_path,
                                                                          monkeypatch):
    import hashlib
    import shutil

    import training.cdk.checkpoint as checkpoint_mod

    path = shutil.copy(ckpt, tmp_path / "c.pt")
    loaded = path.read_bytes()
    other = init_checkpoint(tmp_path / "other.pt", modes=8, hidden=16, image_size=64, seed=3)
    real_load = torch.load

    def load_then_replace(*args, **kwargs):
        obj = real_load(*args, **kwargs)
        shutil.copy(other, path)  # a new checkpoint lands right after the load
        return obj

    monkeypatch.setattr(checkpoint_mod.torch, "load", load_then_replace)
    e = from_checkpoint(path, device="cpu")
    assert e.sha256 == hashlib.sha256(loaded).hexdigest()
    assert e.sha256 != hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_mirrored_image_embeds_as_the_image(ckpt, tmp_path):
    # init_checkpoint averages backbone features over the mirror image (both modalities),
    # and the checkpoint says so
    e = from_checkpoint(ckpt, device="cpu")
    assert e.sketch_flip_average and e.photo_flip_average
    ims = _images()
    mirrored = [im.transpose(Image.Transpose.FLIP_LEFT_RIGHT) for im in ims]
    for mod in ("sketch", "photo"):
        np.testing.assert_allclose(e.embed(mirrored, mod), e.embed(ims, mod), rtol=1e-4,
                                   atol=1e-5)
    # a checkpoint without mirror averaging embeds the image alone
    plain = init_checkpoint(tmp_path / "plain.pt", modes=8, hidden=16, image_size=64,
                            raw_dims=8, photo_flip_average=False)
    e_plain = from_checkpoint(plain, device="cpu")
    assert not e_plain.sketch_flip_average and not e_plain.photo_flip_average
    assert not np.allclose(e_plain.embed(mirrored, "photo"), e_plain.embed(ims, "photo"),
                           atol=1e-3)


def test_a_checkpoint_of_other_code_is_refused_with_the_fix(ckpt, tmp_path):
    old = load_checkpoint(ckpt)
    old["version"] = 1
    torch.save(old, tmp_path / "old.pt")
    with pytest.raises(ValueError, match=r"old.pt' has checkpoint version 1.*retrain it"):
        from_checkpoint(tmp_path / "old.pt")
    same = load_checkpoint(ckpt)
    del same["config"]["modes"]  # the right version with a config of other code
    torch.save(same, tmp_path / "odd.pt")
    with pytest.raises(ValueError, match=r"odd.pt lacks the config fields \['modes'\].*retrain"):
        from_checkpoint(tmp_path / "odd.pt")


def test_photos_mirror_averaged_sketches_alone(tmp_path):
    # the cpu preset averages photos over the mirror image and embeds sketches alone (one
    # backbone pass a query); both modalities share one trunk in the checkpoint
    path = init_checkpoint(tmp_path / "c.pt", modes=8, hidden=16, image_size=64,
                           sketch_flip_average=False)
    meta = load_checkpoint(path)["backbone"]
    assert meta["photo_flip_average"] and not meta["sketch_flip_average"]
    e = from_checkpoint(path, device="cpu")
    assert e.photo_flip_average and not e.sketch_flip_average
    assert not e.trained_sketch_flip_average
    ims = _images()
    mirrored = [im.transpose(Image.Transpose.FLIP_LEFT_RIGHT) for im in ims]
    np.testing.assert_allclose(e.embed(mirrored, "photo"), e.embed(ims, "photo"), rtol=1e-4,
                               atol=1e-5)
    assert not np.allclose(e.embed(mirrored, "sketch"), e.embed(ims, "sketch"), atol=1e-3)
    sketch_bb, photo_bb = e.modules("sketch")[0], e.modules("photo")[0]
    assert sketch_bb.trunk is photo_bb.trunk  # one set of weights
    # the sketch backbone is the photo one's trunk pooled without the mirror image
    x = e.preprocess(ims, "sketch")
    with torch.no_grad():
        both = photo_bb.pool(photo_bb.trunk(torch.cat([x, x.flip(3)])))
    torch.testing.assert_close(e.backbone_features(x, "sketch"), both[: len(ims)])
    torch.testing.assert_close(e.backbone_features(x, "photo"),
                               0.5 * (both[: len(ims)] + both[len(ims):]))
    # a checkpoint that mirror-averages its sketches queries them so, unless told not to
    path = init_checkpoint(tmp_path / "both.pt", modes=8, hidden=16, image_size=64)
    assert from_checkpoint(path, device="cpu").sketch_flip_average
    single = from_checkpoint(path, device="cpu", sketch_flip_average=False)
    assert not single.sketch_flip_average and single.trained_sketch_flip_average


def test_the_checkpoint_says_how_the_backbone_pools(ckpt, tmp_path):
    # the cpu preset pools the trunk's maps by generalised mean, and the embedder follows the
    # checkpoint; one with average pooling (the same seeded heads) pools by the mean
    from training.cdk.model.backbones import global_pool

    e = from_checkpoint(ckpt, device="cpu")
    assert e.pooling == "gem" and load_checkpoint(ckpt)["backbone"]["pooling"] == "gem"
    avg = init_checkpoint(tmp_path / "avg.pt", modes=8, hidden=16, image_size=64, raw_dims=8,
                          pooling="avg")
    e_avg = from_checkpoint(avg, device="cpu")
    assert e_avg.pooling == "avg"
    ims = _images()
    x = e.preprocess(ims, "photo")
    with torch.no_grad():
        for emb, pooling in ((e, "gem"), (e_avg, "avg")):
            bb, head = emb.modules("photo")
            maps = torch.cat([bb.trunk(x), bb.trunk(x.flip(3))])  # mirror averaging, as trained
            feats = global_pool(maps, pooling).unflatten(0, (2, -1)).mean(0)
            want = torch.cat([retrieval_embedding(head(feats), emb.unit_embeddings),
                              emb.raw_projection("photo")(feats)], 1)
            np.testing.assert_allclose(emb.embed(ims, "photo"), want.numpy(),
                                       rtol=1e-4, atol=1e-5)


def test_unit_embeddings_scale_the_heads_outputs_to_length_one(ckpt, tmp_path):
    # the cpu preset's checkpoints embed on the unit sphere; the heads' raw outputs (the
    # learned functions) are what modules() returns; a checkpoint without unit embeddings
    # (the paper preset) embeds the raw outputs
    e = from_checkpoint(ckpt, device="cpu")
    assert e.unit_embeddings and load_checkpoint(ckpt)["config"]["unit_embeddings"] is True
    plain = load_checkpoint(ckpt)
    plain["config"].update(unit_embeddings=False, raw_dims=0)
    plain["raw"] = None
    torch.save(plain, tmp_path / "plain.pt")
    e_raw = from_checkpoint(tmp_path / "plain.pt", device="cpu")
    assert not e_raw.unit_embeddings and e_raw.raw_dims == 0 and e_raw.width == e_raw.modes == 8
    ims = _images()
    for modality in ("sketch", "photo"):
        raw = e_raw.embed(ims, modality)
        z = e.embed(ims, modality)[:, : e.modes]
        np.testing.assert_allclose(np.linalg.norm(z, axis=1), 1.0, rtol=1e-5)
        assert np.abs(np.linalg.norm(raw, axis=1) - 1).max() > 1e-2  # the raw ones are not
        np.testing.assert_allclose(z, raw / np.linalg.norm(raw, axis=1, keepdims=True),
                                   rtol=1e-5, atol=1e-6)
        with torch.no_grad():
            feats = e.backbone_features(e.preprocess(ims, modality), modality)
            np.testing.assert_allclose(e.modules(modality)[1](feats).numpy(), raw,
                                       rtol=1e-5, atol=1e-6)


def test_retrieval_embedding_keeps_zero_rows_and_directions():
    z = torch.tensor([[3.0, 4.0], [0.0, 0.0], [-1e-3, 0.0]])
    u = retrieval_embedding(z, True)
    torch.testing.assert_close(u, torch.tensor([[0.6, 0.8], [0.0, 0.0], [-1.0, 0.0]]))
    assert retrieval_embedding(z, False) is z


def test_raw_coordinates_follow_the_modes(ckpt, tmp_path):
    # embed = [unit(head(x)), sqrt(w) unit((x - mean_m) @ axes)], as stored; d-prefixes up to
    # the modes are the learned embedding alone
    e = from_checkpoint(ckpt, device="cpu")
    stored = load_checkpoint(ckpt)["raw"]
    ims = _images()
    for modality in ("sketch", "photo"):
        feats = e.backbone_features(e.preprocess(ims, modality), modality).double()
        c = (feats - stored["mean"][modality].double()) @ stored["axes"].double()
        want = stored["weight"] ** 0.5 * c / c.norm(dim=1, keepdim=True)
        z = e.embed(ims, modality)
        np.testing.assert_allclose(z[:, 8:], want.numpy(), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(np.linalg.norm(z[:, :8], axis=1), 1.0, rtol=1e-5)
    # a config asking for raw coordinates without the projection is refused, naming the file
    broken = load_checkpoint(ckpt)
    broken["raw"] = None
    torch.save(broken, tmp_path / "broken.pt")
    with pytest.raises(ValueError, match="broken.pt.*raw coordinates"):
        from_checkpoint(tmp_path / "broken.pt", device="cpu")


def test_fit_raw_projections_against_numpy_pca():
    from training.cdk.model.heads import fit_raw_projections

    rng = np.random.default_rng(0)
    s = rng.normal(size=(40, 6)) @ rng.normal(size=(6, 6)) + 3.0
    p = rng.normal(size=(30, 6)) @ rng.normal(size=(6, 6)) - 1.0
    proj = fit_raw_projections(torch.tensor(s), torch.tensor(p), 3, 2.0)
    np.testing.assert_allclose(proj["sketch"].mean.numpy(), s.mean(0), rtol=1e-5)
    np.testing.assert_allclose(proj["photo"].mean.numpy(), p.mean(0), rtol=1e-5, atol=1e-6)
    # the reference: principal axes of the per-modality centred rows, by numpy's SVD
    X = np.concatenate([s - s.mean(0), p - p.mean(0)])
    _, _, vt = np.linalg.svd(X, full_matrices=False)
    ref = vt[:3].T  # (6, 3); axes agree up to sign, so compare the projectors
    axes = proj["sketch"].axes.double().numpy()
    np.testing.assert_allclose(axes @ axes.T, ref @ ref.T, atol=1e-5)
    assert proj["photo"].axes is not None and torch.equal(proj["photo"].axes, proj["sketch"].axes)
    out = proj["photo"](torch.tensor(p[:5]).float())
    np.testing.assert_allclose(out.norm(dim=1).numpy(), 2.0 ** 0.5, rtol=1e-5)
    with pytest.raises(ValueError, match="raw_dims must be in"):
        fit_raw_projections(torch.tensor(s), torch.tensor(p), 7, 1.0)


@pytest.mark.parametrize("whiten", [0.5, 1.0])
def test_fit_raw_projections_whitening_against_numpy(whiten):
    """Each coordinate divided by its standard deviation**whiten: the reference is numpy's
    SVD of the centred rows (standard deviation s_k / sqrt(n)); full whitening gives
    coordinates of unit variance over the training rows."""
    from training.cdk.model.heads import fit_raw_projections

    rng = np.random.default_rng(1)
    s = rng.normal(size=(50, 6)) @ rng.normal(size=(6, 6)) + 2.0
    p = rng.normal(size=(40, 6)) @ rng.normal(size=(6, 6))
    proj = fit_raw_projections(torch.tensor(s), torch.tensor(p), 4, 1.0, whiten)
    X = np.concatenate([s - s.mean(0), p - p.mean(0)])
    _, sv, vt = np.linalg.svd(X, full_matrices=False)
    ref = (X @ vt[:4].T) / (sv[:4] / np.sqrt(len(X))) ** whiten  # (90, 4)
    got = np.concatenate([(torch.tensor(x) - proj[m].mean.double()).numpy()
                          @ proj[m].axes.double().numpy()
                          for m, x in (("sketch", s), ("photo", p))])
    np.testing.assert_allclose(np.abs(got), np.abs(ref), rtol=1e-4, atol=1e-5)  # up to sign
    if whiten == 1.0:
        np.testing.assert_allclose((got**2).mean(0), 1.0, rtol=1e-4)
    with pytest.raises(ValueError, match="raw_whiten must be in"):
        fit_raw_projections(torch.tensor(s), torch.tensor(p), 3, 1.0, 1.5)


def test_fit_raw_projections_whitening_keeps_null_axes_null():
    """Rank-deficient features: an axis of zero variance is not blown up into noise."""
    from training.cdk.model.heads import fit_raw_projections

    rng = np.random.default_rng(2)
    basis = rng.normal(size=(2, 5))
    s, p = rng.normal(size=(20, 2)) @ basis, rng.normal(size=(20, 2)) @ basis
    proj = fit_raw_projections(torch.tensor(s), torch.tensor(p), 4, 1.0, 1.0)
    z = (torch.tensor(s) - proj["sketch"].mean.double()) @ proj["sketch"].axes.double()
    assert z[:, :2].abs().max() > 0.5 and z[:, 2:].abs().max() < 1e-3


def test_fit_raw_projections_falls_back_to_svd_when_eigh_fails(monkeypatch):
    """LAPACK's eigh may not converge on a low-rank moment matrix; the SVD gives the same
    principal axes (compared as projectors with eigh's own, taken before it is broken)."""
    from training.cdk.model.heads import fit_raw_projections

    rng = np.random.default_rng(1)
    s, p = torch.tensor(rng.normal(size=(5, 12))), torch.tensor(rng.normal(size=(4, 12)))
    want = fit_raw_projections(s, p, 4, 1.0)["sketch"].axes.double()

    def broken(_):
        raise torch.linalg.LinAlgError("linalg.eigh: the algorithm failed to converge")

    monkeypatch.setattr(torch.linalg, "eigh", broken)
    got = fit_raw_projections(s, p, 4, 1.0)["sketch"].axes.double()
    torch.testing.assert_close(got @ got.T, want @ want.T, atol=1e-8, rtol=0)
