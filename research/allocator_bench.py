"""glibc's default allocator against ``training.allocator.tune_allocator`` on a backbone's
forward pass: seconds per batch, minor page faults and kernel time per batch, each setting
in its own fresh process, interleaved, same run. ``--smoke``: 2 images of 64 px, one
forward, one round (a check that it runs; such small tensors never leave the heap).

    python -m research.allocator_bench --backbone efficientnet-lite0 --batch 64 --threads 1
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import numpy as np

PROBE = """
import json, resource, sys, time, torch
from training.allocator import tune_allocator
from training.cdk.model.backbones import BACKBONES, build_backbone
name, mode = sys.argv[1], sys.argv[5]
batch, threads, reps, size = map(int, sys.argv[2:5] + sys.argv[6:7])
if mode == "tuned":
    assert tune_allocator()
torch.set_num_threads(threads)
bb = build_backbone(name)
size = size or BACKBONES[name].native_size
x = torch.randn(batch, 3, size, size)
with torch.no_grad():
    bb.module.eval()(x)
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for _ in range(reps):
        bb.module(x)
    t, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"s": t / reps, "faults": (r1.ru_minflt - r0.ru_minflt) / reps,
                  "sys_s": (r1.ru_stime - r0.ru_stime) / reps}))
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m research.allocator_bench",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backbone", default="efficientnet-lite0")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=3, help="timed forwards per process")
    p.add_argument("--rounds", type=int, default=2, help="process pairs, interleaved")
    p.add_argument("--size", type=int, default=0,
                   help="image side in pixels (0: the backbone's native size)")
    p.add_argument("--smoke", action="store_true",
                   help="batch 2 of 64 px, 1 forward, 1 round: checks it runs, measures nothing")
    a = p.parse_args(argv)
    if a.smoke:
        a.batch, a.size, a.reps, a.rounds = 2, 64, 1, 1
    res: dict[str, list[dict]] = {"default": [], "tuned": []}
    for _ in range(a.rounds):
        for mode in res:
            out = subprocess.run([sys.executable, "-c", PROBE, a.backbone, str(a.batch),
                                  str(a.threads), str(a.reps), mode, str(a.size)],
                                 capture_output=True, text=True, check=True).stdout
            res[mode].append(json.loads(out.strip().splitlines()[-1]))
    print(f"{a.backbone}, batch {a.batch}, {a.size or 'native'} px, {a.threads} thread(s), "
          f"{a.rounds} x {a.reps} forwards per setting")
    print("| allocator | s / batch | minor faults / batch | kernel s / batch |")
    print("|---|---|---|---|")
    mean = {m: {k: float(np.mean([r[k] for r in rs])) for k in rs[0]} for m, rs in res.items()}
    for m, v in mean.items():
        print(f"| {m} | {v['s']:.3f} | {v['faults']:.0f} | {v['sys_s']:.3f} |")
    print(f"speed-up: {mean['default']['s'] / mean['tuned']['s']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
