"""The Ray engine (local Ray on 2 CPUs): a Ray build stores the vectors a local (in-memory)
and a sharded build store, gallery smoothing included, although a worker killed mid-shard is
replaced and its shard redone; a rerun embeds only the shards that are missing."""

import functools
import os

import numpy as np
import pytest
import torch

ray = pytest.importorskip("ray", reason="needs ray[data] (pip install -e '.[ray]'; in .[dev])")

from index.build import build_index  # noqa: E402
from index.gallery import scan_gallery  # noqa: E402
from index.sharded import build_sharded  # noqa: E402
from index.shards import load_vectors, plan_shards  # noqa: E402
from index.store import load_index  # noqa: E402
from training.cdk.model.bundle import Bundle  # noqa: E402
from training.cdk.model.smoothing import Smoothing, smooth  # noqa: E402
from training.images import load_image  # noqa: E402


class CrashOnce:
    """Opens the model bundle in a Ray actor; the first photo any actor decodes kills its
    worker process (os._exit), once per `marker` file."""

    def __init__(self, path, marker):
        self.path, self.marker = str(path), str(marker)

    def __call__(self):
        model = Bundle.open(self.path)
        crashing = functools.partial(crash_once, model.transform(), self.marker)
        model.transform = lambda modality="photo": crashing  # actors decode in their own process
        return model


def crash_once(transform, marker, images):
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return transform(images)
    os._exit(1)


@pytest.fixture(scope="module")
def local_ray():
    import sys

    # The workers unpickle CrashOnce: send this module by value (tests/ is not installed).
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_local_sharded_and_ray_builds_store_the_same_smoothed_vectors(
        local_ray, tmp_path, real_bundle, real_embedder, small_gallery):
    smoothing = Smoothing(k=3, weight=4.0, rounds=2)
    # photos mirror-averaged (not the default): the actors are given the driver's views
    common = {"batch_size": 4, "shard_size": 4, "progress": False, "smoothing": smoothing,
              "photo_views": 2}
    local = build_index(real_bundle, small_gallery, tmp_path / "local", workers=2, **common)
    sharded = build_sharded(real_bundle, small_gallery, tmp_path / "sharded", **common)
    out, marker = tmp_path / "ray", tmp_path / "crashed"
    ray_built = build_sharded(real_bundle, small_gallery, out, engine="ray",
                              load=CrashOnce(real_bundle.path, marker), **common)
    assert marker.exists()  # a worker died mid-shard, and Ray ran that shard again
    assert ray_built.embedded == sharded.embedded == 15 and ray_built.shards == 4
    assert local.sidecar.smoothing == ray_built.sidecar.smoothing == smoothing.as_dict()
    vectors = {name: load_index(tmp_path / name).index.reconstruct_n(0, 15)
               for name in ("local", "sharded", "ray")}
    np.testing.assert_array_equal(vectors["sharded"], vectors["local"])  # the same bits
    np.testing.assert_array_equal(vectors["ray"], vectors["local"])
    # ... which are the plain embeddings smoothed by training's rule
    scan = scan_gallery(small_gallery)
    root, photos = scan.root, scan.photos
    plain = real_embedder.embed([load_image(root / p.path) for p in photos], "photo")  # (15, 8)
    want = smooth(torch.from_numpy(plain), smoothing).numpy()
    np.testing.assert_allclose(vectors["ray"], want, rtol=1e-4, atol=1e-5)
    ix = load_index(out, model_sha256=real_embedder.sha256)
    assert [p.id for p in ix.photos] == [p.id for p in photos]

    # A rerun embeds only the shards that are not finished (here: one removed by hand).
    plan = plan_shards(out / "shards", root, photos, 8, real_embedder.sha256, 4, "fp32", 2)
    np.testing.assert_allclose(load_vectors(plan), plain, rtol=1e-4, atol=1e-5)  # unsmoothed
    plan.npy(plan.shards[2]).unlink()
    again = build_sharded(real_bundle, small_gallery, out, engine="ray",
                          **common)
    assert again.embedded == len(plan.shards[2].photos) == 4
    np.testing.assert_array_equal(load_index(out).index.reconstruct_n(0, 15), vectors["local"])
