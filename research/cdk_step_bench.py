"""Seconds per fine-tuning step and per epoch, side by side in one run, on the training
classes of a split (never its test classes).

Compares, for efficientnet-lite0 with the last K blocks trainable: the trunk cache (no
augmentation; each step runs only the trainable stages on cached activations) against
running the frozen trunk under no_grad at every step (without and with augmentation), at
two batch sizes, and the DataLoader's worker count on the augmented path. The cache's
one-off cost is measured on a subset and scaled to the training set; a cache of V
augmented views per image would cost V times that and then step at the cached speed.
``--smoke``: small heads and images, one batch size and K, one step per row (a check that
it runs). DIR is the sketch/photo folder (or set SKETCHY_DATA to it):

    nice -n 10 python -m research.cdk_step_bench --data DIR
"""

from __future__ import annotations

import argparse
import time

import torch

from research.common import add_data_argument, data_folder
from training.allocator import tune_allocator
from training.cdk.config import NESTING_OF, make_config, nesting_weights
from training.cdk.data import PairSampler, scan
from training.cdk.inputs import ImageInputs, set_train_mode
from training.cdk.model.backbones import build_backbone
from training.cdk.splits import split_classes
from training.cdk.train import InputDropout, Step, TrainData, build_model
from training.loss import nesting_masks

CPU = torch.device("cpu")


def _setup(cfg, bb, tr, n_cache, cache=True):
    """(model, step, inputs, cache seconds per image, data) for cfg: training's own model,
    step and inputs; the cache (if any) over the first n_cache images; cache=False: the
    trunk runs at every step."""
    cached = cache and cfg.trainable_stages > 0 and not cfg.augment
    n = max(n_cache, cfg.batch_size) if cached else len(tr.sketches)  # a full batch
    stats = torch.randn(8, bb.feature_dim, generator=torch.Generator().manual_seed(0))
    data = TrainData(stats, stats,  # the heads' standardisation only: timing needs no more
                     tr.sketch_labels[:n], tr.photo_labels[:n], None, list(tr.sketches[:n]),
                     list(tr.photos[:n]))
    torch.manual_seed(0)
    model = build_model(data, bb, cfg.hidden, cfg.modes, cfg.mu, True, cfg.trainable_stages)
    params = [p for p in model.parameters() if p.requires_grad]
    masks = nesting_masks(cfg.modes, NESTING_OF[cfg.method], nesting_weights(cfg),
                          constant_mode=True)
    step = Step(model, params, masks, torch.optim.SGD(params, lr=1e-3, momentum=0.9), None,
                cfg.grad_clip, InputDropout(0.0, bb.feature_dim, cfg.batch_size, slice(None),
                                            CPU), CPU)
    t0 = time.perf_counter()
    inputs = ImageInputs({"sketch": data.sketch_files, "photo": data.photo_files}, bb, model,
                         cfg.image_size, cfg.augment, cfg.seed, cfg.workers, None, CPU,
                         cache=cached)
    build = (time.perf_counter() - t0) / n  # seconds per image (both modalities)
    return model, step, inputs, build, data


def _time_steps(cfg, model, step, inputs, data, steps, warmup):
    sampler = PairSampler(data.sketch_labels, data.photo_labels)
    batches = []
    for e in range(100):
        batches += list(sampler.epoch(0, e, cfg.batch_size))
        if len(batches) >= steps + warmup:
            break
    set_train_mode(model)
    times, t = [], time.perf_counter()
    for xs, ys in inputs.steps(batches[: steps + warmup], 0):
        step(xs, ys)
        now = time.perf_counter()
        times.append(now - t)
        t = now
    return sum(times[warmup:]) / steps  # warm-up steps (worker start) are left out


def main(argv: list[str] | None = None) -> int:
    tune_allocator()
    ap = argparse.ArgumentParser(prog="python -m research.cdk_step_bench",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_argument(ap)
    ap.add_argument("--split", default="sketchy2")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per row")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps before them")
    ap.add_argument("--cache-images", type=int, default=256,
                    help="images per modality the trunk cache is timed on")
    ap.add_argument("--batches", default="128,256")
    ap.add_argument("--stages", default="1,2,3", help="K at the first batch size")
    ap.add_argument("--stages-other", default="1,2,3", help="K at the other batch sizes")
    ap.add_argument("--smoke", action="store_true",
                    help="small heads and images, batch 4, K = 1, one step per row and 4 "
                         "cached images: checks the benchmark, measures nothing")
    args = ap.parse_args(argv)
    overrides = {}
    if args.smoke:
        overrides = {"modes": 4, "hidden": 16, "image_size": 32}
        args.batches, args.stages, args.stages_other = "4", "1", "1"
        args.steps, args.warmup, args.cache_images = 1, 0, 4

    ds = scan(data_folder(ap, args))
    tr = ds.restrict(split_classes(args.split, list(ds.classes))["train"])
    n = len(tr.sketches)
    bb = build_backbone("efficientnet-lite0")
    print(f"{args.split} training classes: {len(tr.classes)}, {n} sketches, "
          f"{len(tr.photos)} photos; threads {torch.get_num_threads()}")
    print(f"{'batch':>5} {'K':>2} {'path':<22} {'workers':>7} {'s/step':>7} "
          f"{'steps/ep':>8} {'s/epoch':>8} {'cache s (once)':>14}")
    for i, B in enumerate(int(b) for b in args.batches.split(",")):
        for K in [int(k) for k in (args.stages if i == 0 else args.stages_other).split(",")]:
            for path, augment, cached, workers in (("trunk cache", False, True, 0),
                                                   ("trunk no_grad", False, False, 0),
                                                   ("trunk no_grad + aug", True, False, 0)):
                cfg = make_config("cpu", finetune=True, photo_flip_average=False, raw_dims=0,
                                  trainable_stages=K, augment=augment, batch_size=B,
                                  workers=workers, **overrides)
                model, step, inputs, build, data = _setup(cfg, bb, tr, args.cache_images,
                                                          cached)
                s = _time_steps(cfg, model, step, inputs, data, args.steps, args.warmup)
                spe = max(1, n // B)
                once = build * n if cached else 0.0
                print(f"{B:>5} {K:>2} {path:<22} {workers:>7} {s:>7.2f} {spe:>8} "
                      f"{s * spe:>8.1f} {once:>14.1f}", flush=True)
    B, K = int(args.batches.split(",")[0]), 2
    for workers in (1, 2):  # workers 0: the row above
        cfg = make_config("cpu", finetune=True, photo_flip_average=False, raw_dims=0,
                          trainable_stages=K, augment=True, batch_size=B, workers=workers,
                          **overrides)
        model, step, inputs, _, data = _setup(cfg, bb, tr, args.cache_images)
        s = _time_steps(cfg, model, step, inputs, data, args.steps, args.warmup)
        spe = max(1, n // B)
        print(f"{B:>5} {K:>2} {'trunk no_grad + aug':<22} {workers:>7} {s:>7.2f} {spe:>8} "
              f"{s * spe:>8.1f} {0.0:>14.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
