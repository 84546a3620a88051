"""index.build / index.add reuse training's cached photo features and decode the other photos
in DataLoader workers; every faster path must give the plain path's embeddings. Training
caches mirror-averaged photo features (the cpu preset) and their first view's, so an index
reads them in either views (`--photo-views 1|2`)."""

import copy
import os
import shutil

import numpy as np
import pytest
import torch

from index import add as add_mod
from index import build as build_mod
from index.build import build_index
from index.embed import FeatureKey, TorchPhotos, cached_features, embed_photos, photo_encoder
from index.gallery import scan_gallery
from index.store import load_index
from tests.fakes import FakeModel, make_gallery
from training.cdk.features import cache_key, extract_features, find_cached
from training.cdk.make_bundle import make_bundle
from training.cdk.model.backbones import build_backbone
from training.cdk.model.smoothing import Smoothing
from training.images import load_image

SIZE = 64  # the input size of the real_bundle fixture
CLOSE = {"rtol": 1e-4, "atol": 1e-5}  # batches of other sizes: float rounding only


@pytest.fixture(scope="module")
def pretrained():
    """The frozen backbone training.cdk.run builds, whose features training caches."""
    # the cpu preset's pooling and mirror averaging
    return build_backbone("efficientnet-lite0", flip_average=True, pooling="gem")


@pytest.fixture
def gallery(tmp_path, small_gallery):
    """A private copy of the small gallery (3 classes x 5 photos): tests here change files."""
    return shutil.copytree(small_gallery, tmp_path / "photos")


def train_cache(backbone, files, cache_dir, size=SIZE, module=None):
    """Cache features of `files` as training does: one entry per file list."""
    extract_features(files, backbone, size, cache_dir, module=module, device="cpu")


def listing(gallery):
    scan = scan_gallery(gallery)
    root, photos = scan.root, scan.photos
    return root, photos, [root / p.path for p in photos]


def test_cached_photos_embed_as_the_plain_path(tmp_path, gallery, pretrained, real_bundle):
    root, photos, files = listing(gallery)
    cache = tmp_path / "cache"
    train_cache(pretrained, files[0:8:2], cache)  # two lists, as training's splits; odd
    train_cache(pretrained, files[8::2], cache)  # photos are in neither
    positions, feats = cached_features(real_bundle, root, photos, cache, views=2)
    assert positions == list(range(0, 15, 2)) and feats.shape == (8, 1280)

    two = photo_encoder(real_bundle, views=2)
    plain = embed_photos(real_bundle, root, photos, two, progress=False).vectors  # the graph's
    torch_side = TorchPhotos(real_bundle.embedder("cpu"))
    np.testing.assert_allclose(
        embed_photos(real_bundle, root, photos, torch_side, progress=False).vectors, plain,
        **CLOSE)
    reused = embed_photos(real_bundle, root, photos, two, batch_size=3, progress=False,
                          cached=(positions, feats), workers=2)
    assert reused.from_cache == 8
    np.testing.assert_allclose(reused.vectors, plain, **CLOSE)

    report = build_index(real_bundle, gallery, tmp_path / "ix", dims=6, photo_views=2,
                         progress=False, feature_cache=cache, smoothing=Smoothing(k=0))
    assert report.from_cache == 8
    ix = load_index(tmp_path / "ix")
    assert list(ix.photos) == photos  # same ids, same order
    np.testing.assert_allclose(ix.index.reconstruct_n(0, 15), plain[:, :6], **CLOSE)

    # the same photos' first view, which training cached beside the average
    ones, first = cached_features(real_bundle, root, photos, cache, views=1)
    assert ones == positions and not torch.allclose(first, feats, atol=1e-3)
    one_view = embed_photos(real_bundle, root, photos, progress=False).vectors  # the graph's
    reused = embed_photos(real_bundle, root, photos, progress=False, cached=(ones, first))
    assert reused.from_cache == 8
    np.testing.assert_allclose(reused.vectors, one_view, **CLOSE)
    assert not np.allclose(one_view, plain, atol=1e-3)


def test_stale_and_foreign_entries_are_never_used(tmp_path, gallery, pretrained, real_bundle):
    root, photos, files = listing(gallery)
    cache = tmp_path / "cache"
    two = photo_encoder(real_bundle, views=2)
    old = embed_photos(real_bundle, root, photos, two, progress=False).vectors
    extra = tmp_path / "extra.jpg"
    shutil.copyfile(files[0], extra)
    for part in (files[0:4], files[4:8], files[8:11], [*files[11:], extra]):
        train_cache(pretrained, part, cache)
    other = copy.deepcopy(pretrained.module)  # other weights (a fine-tuned run's, say)
    with torch.no_grad():
        next(other.parameters()).mul_(0.5)
    train_cache(pretrained, files[11:], cache, module=other)
    train_cache(pretrained, files[11:], cache, size=32)  # another input size

    shutil.copyfile(files[14], files[1])  # new content (and mtime) under an old name
    st = files[6].stat()  # same bytes, another mtime
    os.utime(files[6], ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    extra.unlink()  # a file of the last list is gone
    positions, feats = cached_features(real_bundle, root, photos, cache, views=2)
    assert positions == [8, 9, 10]  # only the list whose files are all unchanged

    plain = embed_photos(real_bundle, root, photos, two, progress=False).vectors
    reused = embed_photos(real_bundle, root, photos, two, progress=False,
                          cached=(positions, feats)).vectors
    np.testing.assert_allclose(reused, plain, **CLOSE)
    np.testing.assert_allclose(plain[1], plain[14], **CLOSE)  # the new content, not the old
    assert not np.allclose(plain[1], old[1], rtol=1e-3, atol=1e-3)


@pytest.fixture(scope="module")
def tuned_bundle(tmp_path_factory, real_checkpoint):
    """real_checkpoint with its photo backbone changed and marked fine-tuned, as a bundle."""
    ckpt = torch.load(real_checkpoint, map_location="cpu", weights_only=True)
    photo = {k: v.clone() for k, v in ckpt["backbones"]["sketch"].items()}
    stem = next(k for k, v in photo.items() if v.ndim == 4)  # the first convolution
    photo[stem] = photo[stem] * 0.5
    ckpt["backbones"]["photo"] = photo
    ckpt["backbone"]["finetuned"] = True
    ckpt["config"] = {**ckpt["config"], "finetune": True, "raw_dims": 0,
                      "photo_flip_average": False, "sketch_flip_average": False}
    ckpt["backbone"]["photo_flip_average"] = ckpt["backbone"]["sketch_flip_average"] = False
    folder = tmp_path_factory.mktemp("tuned")
    torch.save(ckpt, folder / "checkpoint.pt")
    return make_bundle(folder / "checkpoint.pt", folder / "model", threads=1)


def test_fine_tuned_model_embeds_every_photo_with_its_backbone(tmp_path, gallery, pretrained,
                                                               tuned_bundle):
    assert tuned_bundle.inference.finetuned
    tuned = tuned_bundle.embedder("cpu")
    root, photos, files = listing(gallery)
    cache = tmp_path / "cache"
    train_cache(pretrained, files, cache)  # the pretrained backbone's features
    # An entry under the tuned weights' own key (training's evaluation of a fine-tuned run
    # writes one) holding wrong values: the fine-tuned rule, not the key, must skip it.
    bb = tuned.backbone_of("photo")
    train_cache(bb, files, cache, module=bb.module)
    entry = cache / f"{bb.name}-{SIZE}-{cache_key(files, bb, bb.module, SIZE)[:24]}.pt"
    planted = torch.load(entry, weights_only=True)
    torch.save({**planted, "features": torch.ones_like(planted["features"])}, entry)
    key = FeatureKey(bb.name, bb.mean, bb.std, bb.flip_average, bb.pooling, bb.feature_dim)
    assert find_cached(files, key, tuned_bundle.inference.fingerprints["photo"], SIZE,
                       cache)[0] == list(range(15))
    assert cached_features(tuned_bundle, root, photos, cache)[0] == []

    report = build_index(tuned_bundle, gallery, tmp_path / "ix", progress=False,
                         feature_cache=cache, workers=2, smoothing=Smoothing(k=0))
    assert report.from_cache == 0
    expected = tuned.embed([load_image(f) for f in files], "photo")  # (15, 8)
    np.testing.assert_allclose(load_index(tmp_path / "ix").index.reconstruct_n(0, 15),
                               expected, **CLOSE)
    pretrained_feats = extract_features(files, pretrained, SIZE, None, device="cpu")
    wrong = tuned.head(pretrained_feats, "photo").numpy()  # what reusing them would give
    assert not np.allclose(wrong, expected, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("workers", [1, 2])
def test_workers_embed_as_the_main_process(small_gallery, real_bundle, workers):
    scan = scan_gallery(small_gallery)
    main = embed_photos(real_bundle, scan.root, scan.photos, batch_size=4, progress=False)
    many = embed_photos(real_bundle, scan.root, scan.photos, batch_size=4, progress=False,
                        workers=workers)
    np.testing.assert_array_equal(many.vectors, main.vectors)


@pytest.mark.parametrize("workers", [0, 2])
def test_unreadable_photo_is_named_from_a_worker(tmp_path, workers):
    make_gallery(tmp_path, classes=1, per_class=6)
    (tmp_path / "class0" / "c0_0_004.jpg").write_bytes(b"not a jpeg")
    scan = scan_gallery(tmp_path)
    part = embed_photos(FakeModel(L=4), scan.root, scan.photos, batch_size=2, progress=False,
                        workers=workers)
    assert len(part.photos) == 5 and [p.id for p, _ in part.failed] == ["c0_0_004"]
    assert "c0_0_004.jpg" in part.failed[0][1]


def test_commands_read_the_models_cache_unless_told_not_to(tmp_path, gallery, pretrained,
                                                           real_checkpoint, monkeypatch,
                                                           capsys):
    monkeypatch.chdir(tmp_path)  # the checkpoint's cache_dir is relative, as training's
    make_bundle(real_checkpoint, "model", threads=1)  # records ./.cache/cdk-features
    root, photos, files = listing(gallery)
    train_cache(pretrained, files, ".cache/cdk-features")
    # photos in one view (the default) read the first view training cached
    common = ["--model", "model", "--no-progress", "--threads", "1", "--smooth-k", "0"]
    assert build_mod.main([*common, "--photos", str(gallery), "--out", "one"]) == 0
    assert "backbone features of 15 of 15 embedded photos" in capsys.readouterr().out
    assert build_mod.main([*common, "--photos", str(gallery), "--out", "one-plain",
                           "--feature-cache", "none"]) == 0
    np.testing.assert_allclose(load_index("one").index.reconstruct_n(0, 15),
                               load_index("one-plain").index.reconstruct_n(0, 15), **CLOSE)
    # plain embeddings: an index grown by index.add equals one built at once only unsmoothed
    common += ["--photo-views", "2"]
    assert build_mod.main([*common, "--photos", str(gallery), "--out", "ix"]) == 0
    assert "backbone features of 15 of 15 embedded photos from the feature cache " \
        f"{tmp_path / '.cache/cdk-features'}" in capsys.readouterr().out
    assert build_mod.main([*common, "--photos", str(gallery), "--out", "plain",
                           "--feature-cache", "none", "--workers", "0"]) == 0
    assert "feature cache: not used" in capsys.readouterr().out
    np.testing.assert_allclose(load_index("ix").index.reconstruct_n(0, 15),
                               load_index("plain").index.reconstruct_n(0, 15), **CLOSE)

    # index.add: an index of one class, then the other classes' photos from the cache
    small = tmp_path / "small"
    shutil.copytree(root / photos[0].cls, small / photos[0].cls)
    assert build_mod.main([*common, "--photos", str(small), "--out", "grown",
                           "--feature-cache", "none"]) == 0
    for cls in sorted({p.cls for p in photos} - {photos[0].cls}):
        shutil.copytree(root / cls, small / cls)
    train_cache(pretrained, listing(small)[2], "cache2")
    assert add_mod.main(["--index", "grown", "--photos", str(small), "--no-progress",
                         "--threads", "1", "--feature-cache", "cache2"]) == 0
    assert "added 10 photos (10 from the feature cache)" in capsys.readouterr().out
    np.testing.assert_allclose(load_index("grown").index.reconstruct_n(0, 15),
                               load_index("plain").index.reconstruct_n(0, 15), **CLOSE)
