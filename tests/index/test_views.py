"""A gallery's photos in one view or averaged with their mirror image (`index.build
--photo-views`): the bundle's single-view photo graph against the trunk computed by hand,
what the sidecar records, `index.add` following it, and the errors of a model or bundle
that cannot give the views asked for."""

import json
import shutil

import numpy as np
import pytest
import torch

from index.add import append_photos
from index.build import build_index, is_current
from index.build import main as build_main
from index.embed import photo_encoder
from index.gallery import scan_gallery
from index.sharded import build_sharded
from index.store import load_index
from tests.bundles import untrained_bundle
from training.cdk.model.backbones import global_pool
from training.cdk.model.bundle import MODEL_FILE, Bundle, BundleError
from training.cdk.model.smoothing import Smoothing
from training.images import load_image

PLAIN = Smoothing(k=0)  # the stored vectors are the embeddings themselves
ATOL, RTOL = 2e-5, 1e-4


def photos_of(model, gallery) -> np.ndarray:
    scan = scan_gallery(gallery)
    return model.preprocess([load_image(scan.root / p.path) for p in scan.photos],
                            "photo").numpy()


def stored(folder) -> np.ndarray:
    ix = load_index(folder)
    return ix.index.reconstruct_n(0, ix.index.ntotal)


def test_single_view_photo_graph_is_the_trunk_alone(real_bundle, small_gallery):
    model = real_bundle  # trained (here: made) with mirror-averaged photos, as the cpu preset
    assert model.inference.flip_average == {"sketch": False, "photo": True}
    assert set(model.encoders) == {"sketch", "photo", "photo-single-view"}
    assert model.encoder_name("photo") == model.encoder_name("photo", True) == "photo"
    assert model.encoder_name("photo", False) == "photo-single-view"
    assert model.encoder_name("sketch", False) == "sketch"  # trained in one view already
    x = photos_of(model, small_gallery)
    single = model.embedder("cpu", photo_flip_average=False)
    assert not single.photo_flip_average and single.trained_photo_flip_average
    trunk = single.backbone_of("photo").module.trunk
    with torch.no_grad():
        want = single.head(global_pool(trunk(torch.from_numpy(x)), single.pooling),
                           "photo").numpy()
    np.testing.assert_allclose(model.encoder("photo-single-view")(x), want, atol=ATOL,
                               rtol=RTOL)
    np.testing.assert_allclose(photo_encoder(model, 1, "torch", views=1)(x), want, atol=ATOL,
                               rtol=RTOL)
    both = model.encoder("photo")(x)
    assert not np.allclose(want, both, atol=1e-3)  # really another embedding
    np.testing.assert_allclose(photo_encoder(model, 1, "onnx", views=2)(x), both)


def test_the_index_records_its_views_and_add_follows_them(real_bundle, small_gallery,
                                                          tmp_path):
    model = real_bundle
    x = photos_of(model, small_gallery)
    one = build_index(model, small_gallery, tmp_path / "one", smoothing=PLAIN, progress=False)
    assert one.sidecar.photo_views == 1  # the default: one backbone pass a photo
    np.testing.assert_allclose(stored(tmp_path / "one"), model.encoder("photo-single-view")(x),
                               atol=ATOL, rtol=RTOL)
    two = build_index(model, small_gallery, tmp_path / "two", smoothing=PLAIN, progress=False,
                      photo_views=2)
    assert two.sidecar.photo_views == 2
    np.testing.assert_allclose(stored(tmp_path / "two"), model.encoder("photo")(x),
                               atol=ATOL, rtol=RTOL)
    # the sharded path keys its shards by the views, and stores the same vectors
    sh = build_sharded(model, small_gallery, tmp_path / "sh", smoothing=PLAIN, progress=False,
                       shard_size=4, photo_views=2)
    assert sh.sidecar.photo_views == 2
    np.testing.assert_array_equal(stored(tmp_path / "sh"), stored(tmp_path / "two"))
    again = build_sharded(model, small_gallery, tmp_path / "sh", smoothing=PLAIN,
                          progress=False, shard_size=4, photo_views=1)
    assert again.embedded == 15  # no shard of the other views reused
    np.testing.assert_array_equal(stored(tmp_path / "sh"), stored(tmp_path / "one"))
    # --reuse keeps an index only when it holds these views
    assert is_current(tmp_path / "two", model, small_gallery, 2)
    assert not is_current(tmp_path / "two", model, small_gallery, 1)

    # an index of mirror-averaged photos embeds added photos the same way
    root = tmp_path / "grow"
    classes = sorted(p.name for p in small_gallery.iterdir())
    shutil.copytree(small_gallery / classes[0], root / classes[0])
    build_index(model, root, tmp_path / "grown", smoothing=PLAIN, progress=False,
                photo_views=2)
    for cls in classes[1:]:
        shutil.copytree(small_gallery / cls, root / cls)
    added = append_photos(model, tmp_path / "grown", root, progress=False)
    assert added.added == 10 and added.sidecar.photo_views == 2
    np.testing.assert_allclose(stored(tmp_path / "grown"), stored(tmp_path / "two"),
                               atol=ATOL, rtol=RTOL)


def test_views_a_model_or_bundle_cannot_give_are_clear_errors(tmp_path, small_gallery,
                                                              real_bundle, capsys):
    # trained on photos in one view: there is no mirror average to give
    plain = untrained_bundle(tmp_path / "plain", modes=8, hidden=16, image_size=64,
                             raw_dims=0, photo_flip_average=False)
    assert "photo-single-view" not in plain.encoders
    with pytest.raises(ValueError, match="trained on photos in one view: --photo-views 1"):
        build_index(plain, small_gallery, tmp_path / "ix", progress=False, photo_views=2)
    with pytest.raises(ValueError, match="photo views must be one of"):
        photo_encoder(real_bundle, views=3)
    # a bundle written before the single-view graph: the error names the command that
    # writes it again, and --photo-views 2 still builds from it
    old = tmp_path / "old"
    shutil.copytree(real_bundle.path, old)
    doc = json.loads((old / MODEL_FILE).read_text())
    del doc["encoders"]["photo-single-view"]
    for name in [n for n in doc["files"] if n.startswith("photo-single-view")]:
        del doc["files"][name]
        (old / name).unlink()
    (old / MODEL_FILE).write_text(json.dumps(doc))
    earlier = Bundle.open(old)
    with pytest.raises(BundleError, match="python -m training.cdk.make_bundle"):
        photo_encoder(earlier)
    assert build_main(["--model", str(old), "--photos", str(small_gallery),
                       "--out", str(tmp_path / "ix"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "has no photo-single-view encoder" in err and "make_bundle" in err
    assert not (tmp_path / "ix").exists() or not any((tmp_path / "ix").glob("v-*"))
    assert build_main(["--model", str(old), "--photos", str(small_gallery),
                       "--out", str(tmp_path / "ix"), "--no-progress",
                       "--photo-views", "2"]) == 0
    assert load_index(tmp_path / "ix").sidecar.photo_views == 2
