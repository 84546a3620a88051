"""Photo embedding as Ray Data batch inference: actors that hold the model write shards.

    python -m index.build ... --engine ray [--address ADDR] [--ray-actors N]

Each unfinished shard of the plan (`index.shards`) is one row of a Ray dataset; a pool of
actors, each opening the model bundle once (one per GPU, else one per CPU slot), maps a row
to its shard: embed its photos exactly as the local engine does (`index.embed.embed_slice`:
cached features where training left them, else the bundle's photo encoder), then write the
shard atomically. Ray Data restarts an actor whose worker died (killed, out of memory, its
node lost) and runs its shard again (Ray Data's defaults: no limit on either); a photo that
fails to decode is listed in its shard, an error raised otherwise stops the run. A rerun
embeds only the shards that are not finished.

On a cluster (`--address`), every node needs this project installed and the bundle, the
photos and the index folder at the same paths (a shared file system): actors read photos and
write shards themselves, and only shard numbers and counts travel through Ray.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
from tqdm import tqdm

from index.embed import embed_slice, photo_encoder
from index.gallery import Photo
from index.shards import Shard, ShardPlan, write_shard
from index.threads import set_threads
from training.cdk.model.bundle import Bundle

log = logging.getLogger(__name__)


class ModelLoader:
    """Opens the model bundle inside an actor (a picklable stand-in for a lambda)."""

    def __init__(self, path: str | Path):
        self.path = str(path)

    def __call__(self) -> Bundle:
        return Bundle.open(self.path)


class ShardWriter:
    """A Ray Data actor: holds one model, turns rows {"shard", "photos"} into shard files."""

    def __init__(self, load: Callable[[], Bundle], plan_fields: dict, batch_size: int,
                 threads: int, cache_dir: str | None, encoder: str, precision: str = "fp32",
                 device: str | None = None):
        set_threads(threads)
        self.model = load()
        self.fields = plan_fields
        if self.model.sha256 != plan_fields["model_sha256"]:
            raise ValueError(
                f"the model bundle opened on this worker has sha256 {self.model.sha256[:16]}"
                f"..., the driver's {plan_fields['model_sha256'][:16]}...: the nodes do not "
                "see the same bundle")
        self.encoder = photo_encoder(self.model, threads, encoder, precision, device,
                                     plan_fields["views"])
        self.batch_size, self.cache_dir = batch_size, cache_dir

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        counts, cached = [], []
        for number, start, key, rows in zip(batch["shard"], batch["start"], batch["key"],
                                            batch["photos"], strict=True):
            photos = tuple(Photo(id=r["id"], cls=r["class"], path=r["path"])
                           for r in json.loads(rows))
            shard = Shard(int(number), int(start), str(key), photos)
            plan = ShardPlan(shards=(shard,), **self.fields)
            part = embed_slice(self.model, self.encoder, plan.root, list(photos),
                               self.cache_dir, self.batch_size, views=plan.views)
            write_shard(plan, shard, part)
            counts.append(len(photos))
            cached.append(part.from_cache)
        return {"shard": batch["shard"], "count": np.asarray(counts, dtype=np.int64),
                "cached": np.asarray(cached, dtype=np.int64)}


def _start(address: str | None, num_cpus: int):
    """Connect to `address`, or start a local Ray on `num_cpus` CPUs; returns (ray, started)."""
    import ray

    if ray.is_initialized():
        return ray, False
    if address:
        ray.init(address=address, log_to_driver=True)
    else:
        # No dashboard: nothing listens beyond what the local workers need.
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=True)
    return ray, True


def embed_ray(plan: ShardPlan, shards: list[Shard], load: Callable[[], Bundle],
              out: Path, batch_size: int = 32,
              cache_dir: str | Path | None = None, encoder: str = "auto",
              address: str | None = None, actors: int = 0, num_cpus: int = 2,
              progress: bool = True, precision: str = "fp32",
              device: str | None = None) -> tuple[int, int]:
    """Embed `shards` with a pool of Ray actors; returns (photos embedded, how many of them
    came from the feature cache).

    `load` opens the model bundle in each actor; each runs the photo encoder in the plan's
    views and of the precision the driver settled (`index.sharded.build_sharded`: fp32 or
    int8). `actors` = 0: one per GPU when the cluster has GPUs, else one per CPU. A local Ray (no
    `address`, none running) gets `num_cpus` CPUs and is shut down at the end.
    """
    if not shards:
        return 0, 0
    ray, started = _start(address, num_cpus)
    try:
        gpus = int(ray.cluster_resources().get("GPU", 0))
        cpus = int(ray.cluster_resources().get("CPU", 1))
        size = max(1, min(actors or (gpus or cpus), len(shards)))
        slot = {"num_gpus": 1} if gpus else {"num_cpus": 1}
        plan.folder.mkdir(parents=True, exist_ok=True)
        fields = {"folder": plan.folder, "root": plan.root, "width": plan.width,
                  "model_sha256": plan.model_sha256, "views": plan.views}
        rows = [{"shard": s.number, "start": s.start, "key": s.key,
                 "photos": json.dumps([{"id": p.id, "class": p.cls, "path": p.path}
                                       for p in s.photos])} for s in shards]
        log.info("embedding %d shards on %d Ray actors (%s each)", len(shards), size, slot)
        ds = ray.data.from_items(rows, override_num_blocks=len(rows)).map_batches(
            ShardWriter,
            fn_constructor_kwargs={"load": load, "plan_fields": fields,
                                   "batch_size": batch_size, "threads": 1,
                                   "cache_dir": None if cache_dir is None else str(cache_dir),
                                   "encoder": encoder, "precision": precision,
                                   "device": device},
            batch_size=1,
            compute=ray.data.ActorPoolStrategy(size=size),
            **slot,
        )
        bar = tqdm(total=sum(len(s.photos) for s in shards), desc="embedding shards (ray)",
                   unit="img", disable=not progress)
        done = cached = 0
        for row in ds.iter_rows():
            done += int(row["count"])
            cached += int(row["cached"])
            bar.update(int(row["count"]))
        bar.close()
        return done, cached
    finally:
        if started:
            ray.shutdown()
