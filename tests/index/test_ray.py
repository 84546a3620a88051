"""The Ray engine (local Ray on 2 CPUs): its shards equal the local path's embeddings, a
worker killed mid-shard is replaced and its shard redone, and a rerun embeds only the shards
that are missing."""

import os

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="needs ray[data] (pip install -e '.[ray]'; in .[dev])")

from index.gallery import scan_gallery  # noqa: E402
from index.sharded import build_sharded  # noqa: E402
from index.shards import load_vectors, plan_shards  # noqa: E402
from index.store import load_index  # noqa: E402
from training.cdk.model.embedder import Embedder  # noqa: E402
from training.images import load_image  # noqa: E402


class CrashOnce:
    """Builds the embedder in a Ray actor; the first photo batch any actor encodes kills its
    worker process (os._exit), once per `marker` file."""

    def __init__(self, checkpoint, marker):
        self.checkpoint, self.marker = str(checkpoint), str(marker)

    def __call__(self):
        embedder = Embedder.from_checkpoint(self.checkpoint, device="cpu")
        encode, marker = embedder.encode, self.marker

        def crash_once(batch, modality):
            try:
                os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                return encode(batch, modality)
            os._exit(1)

        embedder.encode = crash_once
        return embedder


@pytest.fixture(scope="module")
def local_ray():
    import sys

    # The workers unpickle CrashOnce: send this module by value (tests/ is not installed).
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_ray_shards_equal_the_local_path_after_a_worker_dies(
        local_ray, tmp_path, real_checkpoint, real_embedder, small_gallery):
    out, marker = tmp_path / "ix", tmp_path / "crashed"
    report = build_sharded(real_embedder, small_gallery, out, real_checkpoint, batch_size=4,
                           engine="ray", shard_size=4, progress=False,
                           load=CrashOnce(real_checkpoint, marker))
    assert marker.exists()  # a worker died mid-shard, and Ray ran that shard again
    assert report.embedded == 15 and report.shards == 4 and report.sidecar.kind == "flat"
    root, photos = scan_gallery(small_gallery)
    local = real_embedder.embed([load_image(root / p.path) for p in photos], "photo")  # (15, 8)
    plan = plan_shards(out / "shards", root, photos, 8, real_embedder.checkpoint_sha256, 4)
    np.testing.assert_allclose(load_vectors(plan), local, rtol=1e-4, atol=1e-5)
    ix = load_index(out, checkpoint_sha256=real_embedder.checkpoint_sha256)
    assert [p.id for p in ix.photos] == [p.id for p in photos]
    np.testing.assert_allclose(ix.index.reconstruct_n(0, 15), local, rtol=1e-4, atol=1e-5)

    # A rerun embeds only the shards that are not finished (here: one removed by hand).
    plan.npy(plan.shards[2]).unlink()
    again = build_sharded(real_embedder, small_gallery, out, real_checkpoint, batch_size=4,
                          engine="ray", shard_size=4, progress=False)
    assert again.embedded == len(plan.shards[2].photos) == 4
    np.testing.assert_allclose(load_vectors(plan), local, rtol=1e-4, atol=1e-5)
