"""Retrieval quality as a user meets it: held-out sketches sent to a real service over HTTP,
zero-shot (against their own classes' photos) and generalized (against the whole gallery).

    python benchmarks/retrieval_bench.py --model runs/cdk/model --data DIR [--k 100] \
        [--photo-views 1|2]
    python benchmarks/retrieval_bench.py --smoke        # an untrained model, tiny data: a check

The held-out classes are the model's (its bundle records the class split it was trained
with): the test classes, or the validation classes of a model without test classes
(`--split none`). Two indexes are built with `python -m index.build` from the data's photos
(defaults, as a user builds them, but for `--photo-views`): of the held-out classes'
photos alone, and of every photo. For each, `python -m service` starts on a free local
port and every held-out sketch is sent to `POST /retrieve?k=K` (default dims, `--k` 100),
as the service answers by default. Printed per index: mAP over the top K (the precision at
each relevant photo found, over the class's photos), P@10, and the share of the top 10
from classes the model trained on; written to OUT/results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.service_bench import free_port, wait_healthy  # noqa: E402

DATA = os.environ.get("SKETCHY_DATA")


def held_out(model: Path) -> tuple[list[str], list[str]]:
    """(the held-out classes, the classes the model trained on) from the bundle's record."""
    classes = json.loads((model / "model.json").read_text())["training"].get("classes")
    if not classes:
        raise SystemExit(f"{model} records no class split (a bundle written without its "
                         "training data)")
    return (classes["test"] or classes["valid"]), classes["train"]


def build(model: Path, photos: Path, out: Path, views: int = 1) -> Path:
    if not (out / "CURRENT").is_file():
        subprocess.run([sys.executable, "-m", "index.build", "--model", str(model), "--photos",
                        str(photos), "--out", str(out), "--no-progress",
                        "--photo-views", str(views)], cwd=REPO, check=True,
                       stdout=subprocess.DEVNULL)
    return out


def query(index: Path, sketches: list[tuple[str, Path]], k: int) -> list[list[str]]:
    """The classes of the top k photos of each sketch, asked of a service on `index`; the
    class of a photo is read from its path (`<class>/<file>`)."""
    port = free_port()
    env = {**os.environ, "SKETCHSVD_MAX_K": str(max(k, 100))}
    proc = subprocess.Popen([sys.executable, "-m", "service", "--index", str(index), "--port",
                             str(port), "--log-level", "warning"], cwd=REPO, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc, timeout=300)
        out = []
        with httpx.Client(base_url=base, timeout=60) as client:
            for _, path in sketches:
                r = client.post("/retrieve", params={"k": k},
                                files={"file": (path.name, path.read_bytes(), "image/png")})
                r.raise_for_status()
                out.append([h["path"].split("/")[0] for h in r.json()["results"]])
        return out
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def scores(sketches: list[tuple[str, Path]], answers: list[list[str]], relevant: dict[str, int],
           trained: set[str], k: int) -> dict:
    """mAP over the top k (each relevant photo found adds the precision at its rank; divided
    by the class's photos), P@10, and the share of the top 10 from trained classes."""
    aps, p10, seen = [], [], []
    for (cls, _), got in zip(sketches, answers, strict=True):
        hits = np.array([c == cls for c in got[:k]], dtype=float)
        precision = np.cumsum(hits) / np.arange(1, len(hits) + 1)
        aps.append(float((precision * hits).sum() / min(relevant[cls], k)))
        p10.append(float(hits[:10].mean()))
        seen.append(float(np.mean([c in trained for c in got[:10]])))
    return {"map": float(np.mean(aps)), "p10": float(np.mean(p10)),
            "seen_top10": float(np.mean(seen)), "queries": len(sketches)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, help="a model bundle (training.cdk's out/model)")
    p.add_argument("--data", type=Path, default=Path(DATA) if DATA else None,
                   help="the sketch/photo folder the model was trained on (default "
                        "$SKETCHY_DATA)")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "bench" / "retrieval")
    p.add_argument("--k", type=int, default=100)
    p.add_argument("--photo-views", type=int, choices=(1, 2), default=1,
                   help="index.build --photo-views: each photo in one view (the default) or "
                        "averaged with its mirror image")
    p.add_argument("--trained", type=int, default=0, metavar="N",
                   help="also the first N sketches of each class the model trained on, "
                        "against every photo (its own training sketches: an optimistic "
                        "measure of a gallery of known classes)")
    p.add_argument("--smoke", action="store_true", help="an untrained model on generated "
                   "data, a few queries: checks that the benchmark runs")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="retrieval-bench-") as tmp:
        if args.smoke:
            args.model, args.data, args.out, args.k = smoke_setup(Path(tmp)) + (10,)
        if args.model is None or args.data is None:
            p.error("--model and --data (or $SKETCHY_DATA) are required without --smoke")
        report(args)
    return 0


def report(args) -> None:
    held, trained = held_out(args.model)
    photos = args.data / "photo"
    sketches = [(c, f) for c in held for f in sorted((args.data / "sketch" / c).iterdir())]
    relevant = {c: len(list((photos / c).iterdir())) for c in held}
    own = args.out / "held-out-photos"
    for c in held:  # copies: an index skips links that lead out of its folder
        if not (own / c).is_dir():
            shutil.copytree(photos / c, own / c)
    t0 = time.perf_counter()
    rows = {}
    for name, folder in (("zero-shot (held-out classes' photos)", own),
                         ("generalized (every photo)", photos)):
        index = build(args.model, folder, args.out / name.split()[0], args.photo_views)
        rows[name] = scores(sketches, query(index, sketches, args.k), relevant,
                            set(trained), args.k)
    if args.trained:
        own_sketches = [(c, f) for c in trained
                        for f in sorted((args.data / "sketch" / c).iterdir())[: args.trained]]
        relevant = {c: len(list((photos / c).iterdir())) for c in trained}
        rows["trained classes' sketches, every photo"] = scores(
            own_sketches, query(args.out / "generalized", own_sketches, args.k), relevant,
            set(trained), args.k)
    print(f"{len(sketches)} sketches of {len(held)} held-out classes, k={args.k}, over HTTP "
          f"({time.perf_counter() - t0:.0f} s)")
    print(f"{'gallery':<40} {'mAP@' + str(args.k):>8} {'P@10':>6} {'top-10 from trained':>20}")
    for name, r in rows.items():
        print(f"{name:<40} {r['map']:>8.3f} {r['p10']:>6.3f} {100 * r['seen_top10']:>19.0f}%")
    (args.out / "results.json").write_text(json.dumps(rows, indent=2))


def smoke_setup(tmp: Path) -> tuple[Path, Path, Path]:
    """An untrained bundle written with generated paired data (int8 off), that data."""
    from tests.bundles import untrained_bundle
    from tests.fakes import make_gallery

    data = tmp / "data"
    make_gallery(data / "photo", classes=6, per_class=3, size=32)
    make_gallery(data / "sketch", classes=6, per_class=2, size=32, seed=1)
    model = untrained_bundle(tmp / "run", data=data, split="none", modes=4, hidden=8,
                             image_size=32, raw_dims=0)
    return model.path, data, tmp / "out"


if __name__ == "__main__":
    raise SystemExit(main())
