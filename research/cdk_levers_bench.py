"""Cheap levers on frozen features, compared on the validation classes only: what the heads
see (mirror-averaged features, generalised-mean instead of average pooling, thickened sketch
strokes, the last block's pooled output beside the final features), dropout of the heads'
input features, embeddings scaled to unit length before retrieval, and the gallery
smoothing grid; whether sorting the learned modes by their estimated singular values makes
better prefixes; and a kernel that pairs each sketch now and then with a photo of a
similar class, so that its spectrum falls and the leading modes are the coarse ones.

``--folds N`` cross-validates over classes instead of using the split's validation
classes: the split's non-test classes cut in N folds (training.cdk.splits.class_folds),
each fold held out in turn while the heads train on the others. On split 2, 5 folds hold
20-21 classes each, as many as its test set: what the d = 16 share of the test classes is
compared with (10 validation classes are separated by fewer modes).

Backbone features of every image of the non-test classes are computed once (plain and
mirrored, average- and GeM-pooled, with the last block's output beside them; sketches also
with thickened strokes) and kept in OUT/features.pt; each variant then trains the cpu
preset's heads (training.cdk.train, given the variant's pair sampler) on its features and
is scored on the validation classes. No test class is embedded: this chooses, the training
command reports. ``--smoke`` shrinks the heads and the run (a check that the benchmark
works, on any small data). DIR is the sketch/photo folder (or set SKETCHY_DATA to it):

    python -m research.cdk_levers_bench --data DIR --out runs/cdk-levers-bench --seeds 0 1
    python -m research.cdk_levers_bench --data DIR --variants preset --folds 5
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import numpy as np
import torch
from PIL import ImageFilter

from research.common import (
    add_data_argument,
    data_folder,
    embed,
    folds_of,
    load_features,
    similar_class_mixing,
    train_heads,
)
from training.allocator import tune_allocator
from training.cdk.config import Config
from training.cdk.data import PairSampler
from training.cdk.metrics import retrieval_metrics, smoothed_metrics, spectrum_order
from training.cdk.model.backbones import BACKBONES, Backbone, build_backbone, global_pool
from training.cdk.model.smoothing import Smoothing, smooth
from training.cdk.run import retrieval_embeddings
from training.images import images_to_tensor, load_image

# name -> (sketch feature set, feature keys joined, training options). Options: flip (which
# modalities are mirror-averaged), dropout (the heads' input dropout; 0 where absent, as
# the preset had it when those rows were measured), unit (embeddings scaled to unit length
# before retrieval, model.embedding; off where absent), raw (raw coordinates appended after
# the modes: (dims, weight), model.fit_raw_projections on the training features; none where
# absent), mix (the similar-class pairing: (alpha, tau), SimilarClassSampler), config
# (other Config fields).
PRESET = {"flip": "photo", "dropout": 0.3, "unit": True, "raw": (256, 1.0)}
VARIANTS = {
    "preset": ("sketch", ["gem"], PRESET),
    "preset, similar-class pairing 0.3": ("sketch", ["gem"], {**PRESET, "mix": (0.3, 0.1)}),
    "preset, similar-class pairing 0.1": ("sketch", ["gem"], {**PRESET, "mix": (0.1, 0.1)}),
    "preset, input dropout 0.4": ("sketch", ["gem"], {**PRESET, "dropout": 0.4}),
    "preset, input dropout 0.5": ("sketch", ["gem"], {**PRESET, "dropout": 0.5}),
    "preset, input dropout 0.6": ("sketch", ["gem"], {**PRESET, "dropout": 0.6}),
    "preset, 128 modes": ("sketch", ["gem"], {**PRESET, "config": {"modes": 128}}),
    "preset, weight decay 1e-2": ("sketch", ["gem"], {**PRESET, "config": {"weight_decay": 1e-2}}),
    "preset, hidden 512": ("sketch", ["gem"], {**PRESET, "config": {"hidden": 512}}),
    "preset, + last block pooled": ("sketch", ["gem", "last"], PRESET),
    "plain": ("sketch", ["gap"], {}),
    "mirror-averaged": ("sketch", ["gap"], {"flip": "both"}),
    "mirror-averaged, GeM pooling": ("sketch", ["gem"], {"flip": "both"}),
    "mirror-averaged photos only": ("sketch", ["gap"], {"flip": "photo"}),
    "mirror-averaged sketches only": ("sketch", ["gap"], {"flip": "sketch"}),
    "strokes thickened (3x3 min filter)": ("thick", ["gap"], {}),
    "strokes thickened, mirror-averaged": ("thick", ["gap"], {"flip": "both"}),
    "+ last block pooled": ("sketch", ["gap", "last"], {}),
    "GeM, mirror-averaged photos only": ("sketch", ["gem"], {"flip": "photo"}),
    "GeM, input dropout 0.2": ("sketch", ["gem"], {"flip": "both", "dropout": 0.2}),
    "GeM, input dropout 0.3": ("sketch", ["gem"], {"flip": "both", "dropout": 0.3}),
    "GeM, input dropout 0.5": ("sketch", ["gem"], {"flip": "both", "dropout": 0.5}),
    "GeM, input dropout 0.2, mirror-averaged photos only": (
        "sketch", ["gem"], {"flip": "photo", "dropout": 0.2}),
    "GeM, input dropout 0.3, mirror-averaged photos only": (
        "sketch", ["gem"], {"flip": "photo", "dropout": 0.3}),
    "GeM, mirror-averaged photos only, unit embeddings": (
        "sketch", ["gem"], {"flip": "photo", "unit": True}),
    "GeM, input dropout 0.2, mirror-averaged photos only, unit embeddings": (
        "sketch", ["gem"], {"flip": "photo", "dropout": 0.2, "unit": True}),
    "GeM, input dropout 0.3, mirror-averaged photos only, unit embeddings": (
        "sketch", ["gem"], {"flip": "photo", "dropout": 0.3, "unit": True}),
    "GeM, input dropout 0.3, photos mirror-averaged, unit, raw 128": (
        "sketch", ["gem"], {"flip": "photo", "dropout": 0.3, "unit": True, "raw": (128, 1.0)}),
    "GeM, input dropout 0.3, photos mirror-averaged, unit, raw 256": (
        "sketch", ["gem"], {"flip": "photo", "dropout": 0.3, "unit": True, "raw": (256, 1.0)}),
    "GeM, input dropout 0.3, photos mirror-averaged, unit, raw 512": (
        "sketch", ["gem"], {"flip": "photo", "dropout": 0.3, "unit": True, "raw": (512, 1.0)}),
    "GeM, input dropout 0.3, photos mirror-averaged, unit, raw 256 weight 0.5": (
        "sketch", ["gem"], {"flip": "photo", "dropout": 0.3, "unit": True, "raw": (256, 0.5)}),
    "GeM, input dropout 0.3, photos mirror-averaged, unit, raw 256 weight 2": (
        "sketch", ["gem"], {"flip": "photo", "dropout": 0.3, "unit": True, "raw": (256, 2.0)}),
}


class SimilarClassSampler:
    """p(x, y) = sum_c p(c) p(x|c) sum_c' T[c, c'] p(y|c'): each sketch's photo is drawn
    from class c' ~ T[c] (class pairing is T = I), T: (C, C) rows summing to 1. A
    training.cdk.data.Sampler; the sketches' order in an epoch and the held-out halves are
    those of the class pairing (a PairSampler of the same labels)."""

    def __init__(self, sketch_labels, photo_labels, T: torch.Tensor):
        self.classes = PairSampler(sketch_labels, photo_labels)
        self.sketch_labels = self.classes.sketch_labels
        self.photo_labels = self.classes.photo_labels
        self.T = T

    def steps_per_epoch(self, batch_size: int) -> int:
        return self.classes.steps_per_epoch(batch_size)

    def epoch(self, seed, epoch, batch_size):
        """Yield (sketch idx (B,), photo idx (B,)): the class pairing's sketches, each with
        a photo of a class drawn from its row of T."""
        g = torch.Generator().manual_seed(int(seed) * 100_003 + int(epoch) + 1)
        for s, _ in self.classes.epoch(seed, epoch, batch_size):
            c = torch.multinomial(self.T[self.sketch_labels[s]].float(), 1, generator=g)[:, 0]
            yield s, self.classes.photos_of_classes(c, g)

    def joint_moment(self, f, g, sketch_idx=None, photo_idx=None):
        """E[f(X) g(Y)]: f at each sketch times the T-weighted class means of g."""
        s_idx = torch.arange(len(f)) if sketch_idx is None else torch.as_tensor(sketch_idx)
        p_idx = torch.arange(len(g)) if photo_idx is None else torch.as_tensor(photo_idx)
        g_bar, n = self.classes.class_means(g, p_idx)
        t = self.T.double() * (n > 0)[None]
        mixed = (t / t.sum(1, keepdim=True)) @ g_bar
        return (f.double() * mixed[self.sketch_labels[s_idx.long()]]).mean(0)

    def photo_marginal(self, sketch_idx=None, photo_idx=None):
        """p(y) at the given photos: a sketch of class c draws class c' with T[c, c']
        (among the classes with given photos) and then one of its photos uniformly."""
        s_idx = (torch.arange(len(self.sketch_labels)) if sketch_idx is None
                 else torch.as_tensor(sketch_idx).long())
        p_idx = (torch.arange(len(self.photo_labels)) if photo_idx is None
                 else torch.as_tensor(photo_idx).long())
        labels = self.photo_labels[p_idx]
        n = torch.bincount(labels, minlength=len(self.classes.count)).double()
        t = self.T.double() * (n > 0)[None]
        sketches = torch.bincount(self.sketch_labels[s_idx], minlength=len(n)).double()
        w = (sketches @ (t / t.sum(1, keepdim=True)))[labels] / n[labels]
        return w / w.sum()

    def halves(self, sketch_idx=None, photo_idx=None):
        """The class pairing's halves (PairSampler.halves)."""
        return self.classes.halves(sketch_idx, photo_idx)


@torch.no_grad()
def _features(files, backbone: Backbone, size: int, transform, desc: str) -> dict:
    """{"gap", "gem", "last", "flip_gap", "flip_gem", "flip_last"}: (N, D) average- and
    GeM-pooled final features and the last block's average-pooled output, of each image and
    of its mirror image."""
    stages = BACKBONES[backbone.name].stages(backbone.module.trunk)
    out: dict[str, list] = {}
    t0 = time.perf_counter()
    for i in range(0, len(files), 64):
        x = images_to_tensor([transform(load_image(f)) for f in files[i : i + 64]], size,
                             backbone.mean, backbone.std)
        for prefix, view in (("", x), ("flip_", x.flip(3))):
            h = stages.stem(view)
            for block in stages.blocks:
                h = block(h)
            final = stages.head(h)  # the trunk's maps, with the last block's output beside
            out.setdefault(prefix + "gap", []).append(global_pool(final, "avg"))
            out.setdefault(prefix + "gem", []).append(global_pool(final, "gem"))
            out.setdefault(prefix + "last", []).append(h.mean((2, 3)))
    print(f"  {desc}: {len(files)} images in {time.perf_counter() - t0:.0f}s", flush=True)
    return {k: torch.cat(v) for k, v in out.items()}


def _thicken(im):
    return im.convert("L").filter(ImageFilter.MinFilter(3)).convert("RGB")


def lever_features(data: str, split: str, out: Path, backbone: str) -> dict:
    """research.common.load_features of the split's non-test classes, per modality {view:
    (N, D)}: _features' views of every image, and for sketches the same of their thickened
    strokes ("thick_" views); kept in OUT/features.pt. Adds "size", the input size."""
    bb = build_backbone(backbone)
    size = BACKBONES[backbone].native_size

    def extract(files, modality):
        feats = _features(files, bb, size, lambda im: im,
                          "sketches" if modality == "sketch" else "photos")
        if modality == "sketch":
            thick = _features(files, bb, size, _thicken, "sketches, strokes thickened")
            feats.update({"thick_" + k: v for k, v in thick.items()})
        return feats

    out.mkdir(parents=True, exist_ok=True)
    F = load_features(data, split, extract, cache=out / "features.pt",
                      tag=f"levers {backbone} {size}")
    return {**F, "size": size}


def _pick(F: dict, mod: str, keys: list[str], flip: bool, prefix: str = "") -> torch.Tensor:
    """(N, D * len(keys)) the views ``keys`` (with ``prefix``) of modality ``mod`` side by
    side, each averaged with its mirror image's when ``flip``."""
    parts = []
    for k in keys:
        x = F[mod][prefix + k]
        parts.append(0.5 * (x + F[mod][prefix + "flip_" + k]) if flip else x)
    return torch.cat(parts, 1)


def run_variant(F: dict, name: str, seed: int, parts: dict, smoke: bool = False) -> dict:
    """Train variant ``name`` on the classes parts["train"], score it on parts["valid"]
    (``smoke``: SMOKE's small heads and run)."""
    sketch_set, keys, opt = VARIANTS[name]
    flip, unit = opt.get("flip", "none"), opt.get("unit", False)
    S = _pick(F, "sketch", keys, flip in ("both", "sketch"),
              "thick_" if sketch_set == "thick" else "")
    P = _pick(F, "photo", keys, flip in ("both", "photo"))
    sl, pl = F["sketch_labels"], F["photo_labels"]
    index = {c: i for i, c in enumerate(F["classes"])}

    def rows(which):
        ids = [index[c] for c in parts[which]]
        return np.isin(sl, ids), np.isin(pl, ids)

    (ts, tp), (vs, vp) = rows("train"), rows("valid")
    relabel = {c: i for i, c in enumerate(np.unique(sl[ts]))}
    train_labels = (np.array([relabel[c] for c in sl[ts]]),
                    np.array([relabel[c] for c in pl[tp]]))
    raw_dims, raw_weight = opt.get("raw", (0, 1.0))
    cfg = dataclasses.replace(Config(image_size=F["size"]), seed=seed, out="",
                              input_dropout=opt.get("dropout", 0.0), unit_embeddings=unit,
                              raw_dims=raw_dims, raw_weight=raw_weight,
                              sort_modes=False,  # the training order, compared with sorted below
                              # smoke's small heads win over a variant's own
                              **{**opt.get("config", {}), **(SMOKE if smoke else {})})
    res, seconds = train_heads(cfg, S[ts], P[tp], _sampler(opt, *train_labels, P[tp]))
    # as training's evaluation and the Embedder embed: unit length, then raw coordinates
    f, g = retrieval_embeddings(cfg, res, embed(res.heads["sketch"], S[vs]),
                                embed(res.heads["photo"], P[vp]), S[vs], P[vp])
    labels = (sl[vs], pl[vp])
    learned = retrieval_metrics(f[:, : cfg.modes], g[:, : cfg.modes], *labels, cfg.k)
    full = retrieval_metrics(f, g, *labels, cfg.k)
    dims = [d for d in (1, 2, 4, 8, 16, 32, 64) if d <= cfg.modes]
    by_d = {d: retrieval_metrics(f[:, :d], g[:, :d], *labels, cfg.k)["map_all"] for d in dims}
    order = torch.argsort(-res.singular_values, stable=True)  # modes sorted by sigma
    sorted_d = {d: retrieval_metrics(f[:, order[:d]], g[:, order[:d]], *labels,
                                     cfg.k)["map_all"] for d in dims}
    d16 = str(min(16, cfg.modes))
    sm = smoothed_metrics(f, g, *labels, cfg.k, Smoothing())  # as index.build stores it
    # the modes sorted by sigma (the preset's --sort-modes), raw coordinates after them
    perm = torch.cat([order, torch.arange(cfg.modes, f.shape[1])])
    sm_sorted = smoothed_metrics(f[:, perm], g[:, perm], *labels, cfg.k, Smoothing())
    L = str(cfg.modes)
    return {"variant": name, "seed": seed, "valid_classes": len(parts["valid"]), "k": cfg.k,
            "d16": d16,  # the d of the "d16" numbers: 16, or all modes when fewer
            "valid_map": full["map_all"],
            "learned_valid_map": learned["map_all"],
            "learned_valid_p10": learned["precision_at_k"],
            "valid_p10": full["precision_at_k"], "d16_share": by_d[int(d16)] / full["map_all"],
            "max_swap_top32": spectrum_order(res.singular_values)["max_swap"],
            "max_swap_top32_norm": spectrum_order(res.singular_values_norm)["max_swap"],
            "smoothed_d16_share": sm["map_by_dims"][d16] / sm["map_all"],
            "smoothed_valid_map": sm["map_all"], "smoothed_valid_p10": sm["precision_at_k"],
            # the target's measure: d = 16 against all L modes, both against the smoothed
            # gallery (what dims=16 and dims=L queries of the default index score)
            "modes_d16_share": sm["map_by_dims"][d16] / sm["map_by_dims"][L],
            "modes_d16_share_sorted": sm_sorted["map_by_dims"][d16] / sm_sorted["map_by_dims"][L],
            "smoothed_map_by_dims_sorted": sm_sorted["map_by_dims"],
            "map_by_dims": by_d, "map_by_dims_sorted_by_sigma": sorted_d,
            "train_seconds": seconds, "embeddings": (f, g, labels)}


# --smoke: small heads and a short run, to check the benchmark on small data
SMOKE = {"modes": 8, "hidden": 16, "epochs": 2, "batch_size": 8, "k": 2}


def _sampler(opt: dict, sketch_labels, photo_labels, photo_feats):
    """The variant's pair sampler on the training rows: class pairing, or the
    similar-class one ("mix", by the classes' mean photo features)."""
    if "mix" not in opt:
        return PairSampler(sketch_labels, photo_labels)
    T = similar_class_mixing(photo_feats, photo_labels, *opt["mix"])
    return SimilarClassSampler(sketch_labels, photo_labels, T)


def smoothing_grid(f, g, labels, k: int) -> list[dict]:
    rows = []
    for rounds in (1, 2, 3):
        for nb in (5, 10, 15):
            for w in (1.0, 2.0, 4.0, 8.0):
                m = retrieval_metrics(f, smooth(g, Smoothing(nb, w, rounds)), *labels, k)
                rows.append({"rounds": rounds, "k": nb, "weight": w, "map": m["map_all"]})
    return rows


def _table(results: list[dict], variants: list[str]) -> None:
    """The mean of each variant's runs; where the preset ran on the same folds and seeds,
    the mean paired difference from it (each fold and seed against its own preset run)."""
    base = {(r["fold"], r["seed"]): r for r in results if r["variant"] == "preset"}
    print("\n| variant | runs | valid mAP | valid P@10 | d=16 share | max swap top-32 "
          "(Rayleigh / norms) | smoothed valid mAP | smoothed P@10 | modes' d=16 share, "
          "smoothed (sorted; min) | paired vs preset: smoothed mAP, d = 16 |\n"
          "|---|---|---|---|---|---|---|---|---|---|")
    for name in variants:
        rs = [r for r in results if r["variant"] == name]
        if not rs:
            continue
        mean = {k: float(np.mean([r[k] for r in rs])) for k in
                ("valid_map", "valid_p10", "d16_share", "max_swap_top32", "max_swap_top32_norm",
                 "smoothed_valid_map", "smoothed_valid_p10", "modes_d16_share_sorted")}
        low = min(r["modes_d16_share_sorted"] for r in rs)
        pairs = [(r, base[r["fold"], r["seed"]]) for r in rs if (r["fold"], r["seed"]) in base]
        paired = "-"
        if pairs and name != "preset":
            dm = np.mean([a["smoothed_valid_map"] - b["smoothed_valid_map"] for a, b in pairs])
            d16 = np.mean([a["smoothed_map_by_dims_sorted"][a["d16"]]
                           - b["smoothed_map_by_dims_sorted"][b["d16"]] for a, b in pairs])
            paired = f"{dm:+.3f}, {d16:+.3f} ({len(pairs)})"
        print(f"| {name} | {len(rs)} | {mean['valid_map']:.3f} | "
              f"{mean['valid_p10']:.3f} | {mean['d16_share']:.2f} | "
              f"{mean['max_swap_top32']:.3f} / {mean['max_swap_top32_norm']:.3f} | "
              f"{mean['smoothed_valid_map']:.3f} | {mean['smoothed_valid_p10']:.3f} | "
              f"{mean['modes_d16_share_sorted']:.3f}; {low:.3f} | {paired} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m research.cdk_levers_bench",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_argument(ap)
    ap.add_argument("--split", default="sketchy2")
    ap.add_argument("--backbone", default="efficientnet-lite1")
    ap.add_argument("--out", default="runs/cdk-levers-bench")
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--seeds", nargs="*", type=int, default=[0])
    ap.add_argument("--folds", type=int, default=0,
                    help="cross-validate over N class folds of the non-test classes "
                         "(0: the split's validation classes)")
    ap.add_argument("--fold-ids", nargs="*", type=int, default=None,
                    help="which folds to hold out (default: all)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--smoke", action="store_true",
                    help="small heads and a 2-epoch run: checks the benchmark, measures nothing")
    ap.add_argument("--report", action="store_true",
                    help="print the table of OUT/results.jsonl's runs (those with a fold) "
                         "and exit")
    args = ap.parse_args(argv)
    if args.fold_ids and any(not 0 <= i < args.folds for i in args.fold_ids):
        ap.error(f"--fold-ids must lie in 0..{args.folds - 1}")
    tune_allocator()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    if args.report:
        runs = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
        runs = [r for r in runs if "fold" in r]
        _table(runs, list(dict.fromkeys(r["variant"] for r in runs)))
        return 0
    F = lever_features(data_folder(ap, args), args.split, out, args.backbone)
    folds = folds_of(F["all_classes"], args.split, args.folds, args.fold_ids)
    results = []
    for name in args.variants:
        for fold, parts in folds:
            for seed in args.seeds:
                r = run_variant(F, name, seed, parts, args.smoke)
                emb = r.pop("embeddings")
                r["fold"] = fold
                results.append(r)
                with open(out / "results.jsonl", "a") as fh:
                    fh.write(json.dumps(r) + "\n")
                print(f"{name:<40} {fold} seed {seed}: valid mAP {r['valid_map']:.3f} P@10 "
                      f"{r['valid_p10']:.3f} d16 {r['d16_share']:.2f} swap "
                      f"{r['max_swap_top32']:.3f} (norms {r['max_swap_top32_norm']:.3f}) "
                      f"smoothed {r['smoothed_valid_map']:.3f} modes' d16 "
                      f"{r['modes_d16_share']:.3f} (sorted {r['modes_d16_share_sorted']:.3f}) "
                      f"({r['train_seconds']:.0f}s)", flush=True)
                if name == "mirror-averaged" and seed == args.seeds[0] and fold == "valid":
                    grid = smoothing_grid(*emb, r["k"])
                    (out / "smoothing_grid.json").write_text(json.dumps(grid, indent=1))
                    print("smoothing grid (valid mAP; rows: rounds, k; columns: weight 1 2 4 8)")
                    for rounds in (1, 2, 3):
                        for nb in (5, 10, 15):
                            cells = [g["map"] for g in grid
                                     if (g["rounds"], g["k"]) == (rounds, nb)]
                            print(f"  {rounds} {nb:>2}: " + " ".join(f"{c:.3f}" for c in cells))
    _table(results, args.variants)
    print("\nmAP at d leading modes, training order vs sorted by estimated sigma (valid):")
    for r in results:
        pairs = " ".join(f"{d}:{r['map_by_dims'][d]:.3f}/{r['map_by_dims_sorted_by_sigma'][d]:.3f}"
                         for d in r["map_by_dims"])
        print(f"  {r['variant']} {r['fold']} seed {r['seed']}: {pairs}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
