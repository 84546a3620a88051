"""Retrieval in the open world: held-out classes' sketches against the whole gallery.

For each held-out set (split 2's validation classes and the class folds of its non-test
classes; no test-class image is read) and seed, the cpu preset's heads are trained on the
other classes with training's own loop, and every variant is scored two ways, paired
against the default on the same set and seed:

- generalized: the held-out sketches against every non-test photo, the training classes'
  included (training.cdk.metrics.generalized_metrics): mAP@all, P@k and the share of the
  top k taken by training-class photos, as the service answers (the whole gallery smoothed,
  queries expanded) and plain;
- zero-shot: the same sketches against their own classes' photos (as training.cdk reports
  it): as the service answers, the learned modes alone, and the 16-mode prefix.

Variants (VARIANTS; "+" combines):

- default: the preset;
- pseudo S: the kernel also pairs pseudo-sketches of the training photos in styles S
  (training.cdk.pseudo.STYLES) with their own photo: extra sketch rows, labelled with their
  photo's class, drawn as the real sketches are (a share instance_share with their photo);
- augment: the kernel also holds augmented views of the real sketches (SKETCH_STYLES), each
  with its sketch's class and photo;
- adapt: the default heads then fine-tuned on pseudo-sketch pairs of the whole gallery's
  photos, classes unknown, with the training pairs mixed in (training.cdk.adapt): a
  transductive setting, reported as its own rows;
- csls-train / csls-gallery: a hubness correction at search time (cross-domain similarity
  local scaling, training.cdk.model.hubness): each photo's score lowered by CSLS_WEIGHT x
  its mean score against its CSLS_K nearest sketches of a fixed sample (the training
  sketches, or pseudo-sketches of the gallery's photos), stored as one more coordinate of
  the photo (the query's is 1), so a flat inner-product index serves it; "floor Q" with
  it: only the part of a photo's mean score above the Q-quantile of the training photos'
  own mean scores is a penalty (max(0, r - floor));
- modes A: the queries' learned modes scaled by A (the photos as stored);
- single-view: the gallery's photos embedded from one view each (no mirror average), the
  heads trained as the preset trains them: what indexing a gallery in one backbone pass a
  photo costs.

Beside them, "trained": the last TRAINED_QUERIES sketches of each training class (not in
the correction's sample) against the whole gallery as the service answers: what a variant
costs the classes the heads know (optimistic: the heads trained on those sketches).

    python -m research.openworld_bench --data DATA --out runs/openworld \\
        --variants default "pseudo contour" adapt csls-train --seeds 0
    python -m research.openworld_bench --out runs/openworld --report
    python -m research.openworld_bench --smoke      # seconds, on generated data
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from research.common import add_data_argument, data_folder
from training.allocator import tune_allocator
from training.cdk.adapt import Adaptation, adapt_heads
from training.cdk.config import (
    Config,
    expansion,
    input_size,
    make_config,
    nesting_weights,
    smoothing,
    to_dict,
)
from training.cdk.data import PairSampler, rank_in_class, scan
from training.cdk.features import extract_features, find_cached
from training.cdk.metrics import (
    generalized_metrics,
    retrieval_metrics,
    service_metrics,
    stored_gallery,
)
from training.cdk.model.backbones import (
    Backbone,
    build_backbone,
    weights_fingerprint,
    with_flip_average,
)
from training.cdk.model.heads import embedding
from training.cdk.model.hubness import Hubness, photo_penalty, with_penalty
from training.cdk.model.smoothing import expand_exact
from training.cdk.pseudo import (
    SKETCH_STYLES,
    STYLES,
    pseudo_sketch,
    sketch_view,
    view_features,
    view_seed,
)
from training.cdk.run import embed_features
from training.cdk.splits import class_folds, split_classes
from training.cdk.train import TrainData, train

VIEW_SEED = 0  # the views are data: the same for every training seed
CSLS_K = 10
CSLS_WEIGHT = 0.5  # CSLS's 2 cos - r_x - r_y ranks a query's photos as cos - r_y / 2
TRAINED_QUERIES = 5  # sketches a training class holds back from the correction's sample
# --smoke: small heads and a short run on generated data
SMOKE = {"modes": 8, "hidden": 16, "epochs": 2, "batch_size": 8, "k": 2, "raw_dims": 8,
         "image_size": 32}


# ------------------------------------------------------------------ data

def _features(files, bb: Backbone, size: int, cache, desc: str) -> torch.Tensor:
    """(N, D) features of ``files``: the rows any entry of the cache holds (training's own
    entries, written per split), the rest computed and cached."""
    files = list(files)
    have, feats = ([], None) if cache is None else find_cached(
        files, bb, weights_fingerprint(bb.module), size, cache)
    out = torch.zeros(len(files), bb.feature_dim)
    if have:
        out[torch.as_tensor(have)] = feats
    missing = sorted(set(range(len(files))) - set(have))
    if missing:
        out[torch.as_tensor(missing)] = extract_features([files[i] for i in missing], bb, size,
                                                         cache, desc=desc)
    return out


def load(cfg: Config, styles: list[str], sketch_styles: list[str],
         single_view: bool = False) -> dict:
    """Features of the split's non-test classes (sketches, photos), of the pseudo-sketches of
    every photo in ``styles`` and of views of every sketch in ``sketch_styles``; with
    ``single_view``, also the photos' features from one view each ("photo_single")."""
    ds = scan(cfg.data)
    split = split_classes(cfg.split, list(ds.classes))
    seen = ds.restrict(split["train"] + split["valid"])  # never a test-class image
    bb = build_backbone(cfg.backbone, cfg.backbone_weights or None, cfg.photo_flip_average,
                        cfg.pooling)
    sbb = with_flip_average(bb, cfg.sketch_flip_average)
    cache = cfg.cache_dir or None
    ss, ps = input_size(cfg, "sketch"), input_size(cfg, "photo")
    F = {"classes": list(seen.classes), "split": split,
         "sketch_labels": seen.sketch_labels, "photo_labels": seen.photo_labels,
         "photo_of": seen.instance_pairs(),
         "sketch": _features(seen.sketches, sbb, ss, cache, "sketches"),
         "photo": _features(seen.photos, bb, ps, cache, "photos"), "views": {},
         "sketch_views": {}}
    if single_view:
        F["photo_single"] = _features(seen.photos, with_flip_average(bb, False), ps, cache,
                                      "photos, one view")
    for name in styles:
        st = STYLES[name]
        F["views"][name] = view_features(
            seen.photos, lambda j, im, st=st, name=name: pseudo_sketch(
                im, st, view_seed(VIEW_SEED, f"{seen.photos[j]}|{name}"), ss),
            f"pseudo|{name}|{VIEW_SEED}|{st}", sbb, ss, cache, desc=f"pseudo {name}")
    for name in sketch_styles:
        st = SKETCH_STYLES[name]
        F["sketch_views"][name] = view_features(
            seen.sketches, lambda j, im, st=st, name=name: sketch_view(
                im, st, view_seed(VIEW_SEED, f"{seen.sketches[j]}|{name}"), ss),
            f"sketch|{name}|{VIEW_SEED}|{st}", sbb, ss, cache, desc=f"sketch views {name}")
    return F


def held_out_sets(F: dict, folds: int) -> list[tuple[str, list[str]]]:
    """[(name, held-out classes)]: the validation classes, then the class folds of the
    non-test classes."""
    rest = sorted(F["split"]["train"] + F["split"]["valid"])
    sets = [("valid", sorted(F["split"]["valid"]))]
    if folds:
        sets += [(f"fold{i}", f) for i, f in enumerate(class_folds(rest, folds))]
    return sets


# ------------------------------------------------------------------ training

def _identity(D: int) -> Backbone:
    return Backbone("features", torch.nn.Identity(), D, (0.0,) * 3, (1.0,) * 3)


def train_rows(cfg: Config, F: dict, train_s, train_p, extra: list[torch.Tensor],
               extra_of: list[np.ndarray], saved: Path | None = None):
    """The heads (and raw projections) trained on the training rows (boolean masks over F's
    sketches and photos), with ``extra`` sketch rows (views) each paired with the photo
    ``extra_of`` (indices into F's photos): (result, the TrainData, seconds). ``saved``: a
    file the heads and raw projections are kept in, and read from when it is there."""
    photo_rows = np.flatnonzero(train_p)
    new_photo = np.full(len(train_p), -1)
    new_photo[photo_rows] = np.arange(len(photo_rows))
    sl, pl = np.asarray(F["sketch_labels"]), np.asarray(F["photo_labels"])
    s_feats = [F["sketch"][torch.as_tensor(train_s)]]
    s_labels, s_of = [sl[train_s]], [new_photo[F["photo_of"][train_s]]]
    for x, of in zip(extra, extra_of, strict=True):
        s_feats.append(x)
        s_labels.append(pl[of])
        s_of.append(new_photo[of])
    data = TrainData(torch.cat(s_feats), F["photo"][torch.as_tensor(train_p)],
                     np.concatenate(s_labels), pl[train_p], np.concatenate(s_of))
    if (data.photo_of < 0).any():
        raise ValueError("an extra row is paired with a photo outside the training rows")
    if saved is not None and saved.is_file():
        state = torch.load(saved, weights_only=False)
        return SimpleNamespace(heads=state["heads"], raw=state["raw"]), data, state["seconds"]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        res = train(cfg, data, _identity(data.sketch_feats.shape[1]), tmp, device="cpu")
    seconds = time.perf_counter() - t0
    if saved is not None:
        saved.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"heads": res.heads, "raw": res.raw, "seconds": seconds}, saved)
    return res, data, seconds


# ------------------------------------------------------------------ scoring

def _embed(cfg: Config, heads: dict, raw: dict | None, m: str, x: torch.Tensor) -> torch.Tensor:
    z = embed_features(heads[m], x, torch.device("cpu"))
    return embedding(z, x, cfg.unit_embeddings, None if raw is None else raw[m])


def _penalty(g: torch.Tensor, sample: torch.Tensor, hub: Hubness, floor: float | None
             ) -> torch.Tensor:
    """model.hubness.photo_penalty, or with a ``floor``: weight x max(0, r - floor), r the
    photos' mean score against their K best sample sketches."""
    if floor is None:
        return photo_penalty(g, sample, hub)
    return hub.weight * (photo_penalty(g, sample, Hubness(hub.k, 1.0)) - floor).clamp_min(0)


def score(cfg: Config, f: torch.Tensor, g: torch.Tensor, F: dict, rows: dict,
          csls: torch.Tensor | None = None, csls_weight: float = CSLS_WEIGHT,
          csls_k: int = CSLS_K, floor: float | None = None) -> dict:
    """The table's numbers of sketches f (held-out) against photos g (every non-test photo),
    rows: {"held_p": bool mask over g of the held-out photos, "seen": of training photos,
    "q_labels"}; csls: a sketch sample to correct the scores by (model.hubness with
    csls_k, csls_weight; with ``floor``, only the part of a photo's mean score above it), or
    None."""
    ql, gl = rows["q_labels"], np.asarray(F["photo_labels"])
    sm, ex, k, L = smoothing(cfg), expansion(cfg), cfg.k, cfg.modes
    held = torch.as_tensor(rows["held_p"])
    out = {}
    for mask in (None, held):  # generalized, then zero-shot
        gg = g if mask is None else g[mask]
        labels = gl if mask is None else gl[rows["held_p"]]
        gallery = stored_gallery(gg, sm)
        fq = f
        if csls is not None:  # the stored photos carry the penalty; the plain ones their own
            hub = Hubness(csls_k, csls_weight)
            fq, gallery = with_penalty(f, gallery, _penalty(gallery, csls, hub, floor))
            gg = with_penalty(f, gg, _penalty(gg, csls, hub, floor))[1]
        if mask is None:
            m = generalized_metrics(fq, gg, ql, labels, rows["seen"], k, sm, ex,
                                    learned=L, gallery=gallery)
            if "trained_f" in rows:  # sketches of trained classes against the same gallery
                tq = rows["trained_f"]
                tq = tq if csls is None else torch.cat([tq, torch.ones(len(tq), 1)], 1)
                t = retrieval_metrics(expand_exact(tq, gallery, ex), gallery,
                                      rows["trained_labels"], labels, k)
                out.update(trained_map=t["map_all"], trained_p=t["precision_at_k"])
            out.update(gen_map=m["service"]["map_all"], gen_p=m["service"]["precision_at_k"],
                       gen_seen=m["service"]["seen_at_k"], gen_plain_map=m["map_all"],
                       gen_plain_seen=m["seen_at_k"], gen_modes_map=m["learned"]["map_all"],
                       gen_d16_map=m["service"]["map_by_dims"].get("16"))
        else:
            m = service_metrics(fq, gg, ql, labels, k, sm, ex, gallery)
            learned = retrieval_metrics(fq[:, :L], gg[:, :L], ql, labels, k)
            out.update(zs_map=m["map_all"], zs_p=m["precision_at_k"],
                       zs_modes_map=learned["map_all"], zs_modes_p=learned["precision_at_k"],
                       zs_d16_map=m["map_by_dims"].get("16"))
    return out


# ------------------------------------------------------------------ one held-out set

VARIANTS = ("default", "pseudo contour", "pseudo detail", "pseudo canny",
            "pseudo contour detail", "augment", "adapt", "csls-train", "csls-gallery",
            "adapt + csls-train", "adapt + csls-gallery", "pseudo contour + adapt")


def parse_variant(name: str) -> dict:
    """{"pseudo": [styles], "augment": bool, "adapt": bool, "csls": None | "train" |
    "gallery", "csls_weight", "csls_k", "modes": the queries' mode scale, "floor": None | a
    quantile, "single_view": bool} of a variant name ("+" between parts; "csls-train W K":
    weight W and K neighbours instead of CSLS_WEIGHT and CSLS_K; "modes A"; "floor Q";
    "single-view")."""
    spec = {"pseudo": [], "augment": False, "adapt": False, "csls": None,
            "csls_weight": CSLS_WEIGHT, "csls_k": CSLS_K, "modes": 1.0, "floor": None,
            "single_view": False}
    for part in (p.strip() for p in name.split("+")):
        words = part.split()
        if part == "default":
            continue
        if words[0] == "pseudo" and len(words) > 1 and all(w in STYLES for w in words[1:]):
            spec["pseudo"] = words[1:]
        elif part in ("augment", "adapt"):
            spec[part] = True
        elif part == "single-view":
            spec["single_view"] = True
        elif words[0] == "modes" and len(words) == 2:
            spec["modes"] = float(words[1])
        elif words[0] == "floor" and len(words) == 2:
            spec["floor"] = float(words[1])
        elif words[0] in ("csls-train", "csls-gallery") and len(words) in (1, 3):
            spec["csls"] = words[0].split("-")[1]
            if len(words) == 3:
                spec["csls_weight"], spec["csls_k"] = float(words[1]), int(words[2])
        else:
            raise ValueError(f"unknown variant part {part!r} in {name!r}")
    return spec


def run_set(cfg: Config, F: dict, held: list[str], variants: list[str], adapt_cfg: Adaptation,
            adapt_style: str, done: set, set_name: str, out: Path,
            heads_dir: Path) -> list[dict]:
    """Every variant not in ``done`` on one held-out set and cfg.seed; the trained heads of
    each kernel are trained once and shared by the variants that use them."""
    index = {c: i for i, c in enumerate(F["classes"])}
    held_ids = [index[c] for c in held]
    sl, pl = np.asarray(F["sketch_labels"]), np.asarray(F["photo_labels"])
    train_s, train_p = ~np.isin(sl, held_ids), ~np.isin(pl, held_ids)
    # the last TRAINED_QUERIES sketches of each training class: queries of classes the heads
    # trained on (trained on them too, so an optimistic measure of what a correction costs
    # them), never in the hubness correction's sample, which holds the other sketches
    rank = rank_in_class(torch.as_tensor(sl)).numpy()
    count = np.bincount(sl)[sl]
    trained_q = train_s & (rank >= count - np.minimum(TRAINED_QUERIES, count // 2))
    rows = {"held_p": ~train_p, "seen": train_p, "q_labels": sl[~train_s],
            "trained_labels": sl[trained_q]}
    trained: dict[tuple, tuple] = {}
    results = []
    for name in variants:
        if (name, set_name, cfg.seed) in done:
            continue
        spec = parse_variant(name)
        kernel = (tuple(spec["pseudo"]), spec["augment"])
        if kernel not in trained:
            extra, extra_of = [], []
            for st in spec["pseudo"]:  # views of the training photos only
                extra.append(F["views"][st][torch.as_tensor(train_p)])
                extra_of.append(np.flatnonzero(train_p))
            if spec["augment"]:
                for st in F["sketch_views"]:
                    extra.append(F["sketch_views"][st][torch.as_tensor(train_s)])
                    extra_of.append(F["photo_of"][train_s])
            # the heads of this kernel, set and config (the seed is in it)
            tag = hashlib.sha256(json.dumps([kernel, set_name, to_dict(cfg)]).encode())
            saved = heads_dir / f"{set_name}-{cfg.seed}-{tag.hexdigest()[:16]}.pt"
            trained[kernel] = train_rows(cfg, F, train_s, train_p, extra, extra_of, saved)
        res, data, seconds = trained[kernel]
        heads = res.heads
        t0 = time.perf_counter()
        if spec["adapt"]:  # pseudo-sketches of every gallery photo, classes unknown
            sampler = PairSampler(data.sketch_labels, data.photo_labels, cfg.pairing,
                                  data.photo_of, cfg.instance_share)
            heads = adapt_heads(heads, (data.sketch_feats, data.photo_feats), sampler,
                                F["views"][adapt_style], F["photo"],
                                torch.arange(len(F["photo"])),
                                dataclasses.replace(adapt_cfg, seed=cfg.seed),
                                nesting_weights(cfg))
        f = _embed(cfg, heads, res.raw, "sketch", F["sketch"][torch.as_tensor(~train_s)])
        g = _embed(cfg, heads, res.raw, "photo",
                   F["photo_single" if spec["single_view"] else "photo"])
        rows["trained_f"] = _embed(cfg, heads, res.raw, "sketch",
                                   F["sketch"][torch.as_tensor(trained_q)])
        if spec["modes"] != 1.0:  # the queries' learned modes scaled, the photos as stored
            for q in (f, rows["trained_f"]):
                q[:, :cfg.modes] *= spec["modes"]
        sample = None
        if spec["csls"] == "train":
            sample = _embed(cfg, heads, res.raw, "sketch",
                            F["sketch"][torch.as_tensor(train_s & ~trained_q)])
        elif spec["csls"] == "gallery":
            sample = _embed(cfg, heads, res.raw, "sketch", F["views"][adapt_style])
        floor = None
        if spec["floor"] is not None and sample is not None:  # a quantile of the training
            # photos' own mean scores (plain, as embedded), as training would compute it
            r_train = photo_penalty(g[torch.as_tensor(train_p)], sample,
                                    Hubness(spec["csls_k"], 1.0))
            floor = float(torch.quantile(r_train.double(), spec["floor"]))
        r = {"variant": name, "set": set_name, "seed": cfg.seed, "held_out": len(held),
             **score(cfg, f, g, F, rows, sample, spec["csls_weight"], spec["csls_k"], floor),
             "train_seconds": seconds,
             "extra_seconds": time.perf_counter() - t0, "load": os.getloadavg()[0]}
        results.append(r)
        with open(out / "results.jsonl", "a") as fh:
            fh.write(json.dumps(r) + "\n")
        print(f"{name:<28} {set_name:<6} seed {cfg.seed}: generalized {r['gen_map']:.3f} / "
              f"P {r['gen_p']:.3f} / seen {r['gen_seen']:.2f}; zero-shot {r['zs_map']:.3f} / "
              f"{r['zs_p']:.3f}, modes {r['zs_modes_map']:.3f}, d16 {r['zs_d16_map']:.3f} "
              f"({seconds:.0f}+{r['extra_seconds']:.0f} s)", flush=True)
    return results


# ------------------------------------------------------------------ report

COLUMNS = (("gen_map", "gen. mAP"), ("gen_p", "gen. P@k"), ("gen_seen", "seen top-k"),
           ("gen_plain_map", "gen. plain mAP"), ("trained_map", "trained mAP"),
           ("zs_map", "zero-shot mAP"),
           ("zs_p", "zero-shot P@k"), ("zs_modes_map", "modes mAP"),
           ("zs_d16_map", "d=16 mAP"))


def report(rows: list[dict]) -> str:
    """Markdown: per variant, the folds' mean and the validation classes, and the folds'
    mean paired difference from the default (generalized and zero-shot mAP as the service
    answers) with how many runs it is ahead."""
    base = {(r["set"], r["seed"]): r for r in rows if r["variant"] == "default"}
    lines = ["| variant | held out | runs | " + " | ".join(c for _, c in COLUMNS)
             + " | paired gen. mAP (ahead) | paired zero-shot mAP |",
             "|---" * (len(COLUMNS) + 5) + "|"]
    for name in dict.fromkeys(r["variant"] for r in rows):
        for label, pick in (("folds", lambda r: r["set"] != "valid"),
                            ("valid", lambda r: r["set"] == "valid")):
            rs = [r for r in rows if r["variant"] == name and pick(r)]
            if not rs:
                continue
            cells = " | ".join("-" if any(r.get(k) is None for r in rs)
                               else f"{np.mean([r[k] for r in rs]):.3f}" for k, _ in COLUMNS)
            pairs = [(r, base[r["set"], r["seed"]]) for r in rs if (r["set"], r["seed"]) in base]
            gen = [a["gen_map"] - b["gen_map"] for a, b in pairs]
            zs = [a["zs_map"] - b["zs_map"] for a, b in pairs]
            paired = (f"{np.mean(gen):+.3f} ({sum(x > 0 for x in gen)}/{len(gen)}) | "
                      f"{np.mean(zs):+.3f}") if pairs and name != "default" else "- | -"
            lines.append(f"| {name} | {label} | {len(rs)} | {cells} | {paired} |")
    return "\n".join(lines)


# ------------------------------------------------------------------ main

def _smoke_data(root: Path) -> tuple[Path, Path]:
    """6 classes of 4 generated sketch/photo pairs (dark strokes on white; shapes on colour
    fields) and a split file naming 1 test class."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(0)
    for c in range(6):
        for mod in ("sketch", "photo"):
            (root / mod / f"class{c}").mkdir(parents=True)
        for i in range(4):
            box = [*map(int, rng.integers(4, 14, 2)), *map(int, rng.integers(26, 36, 2))]
            photo = Image.new("RGB", (40, 40), tuple(int(v) for v in rng.integers(0, 120, 3)))
            ImageDraw.Draw(photo).ellipse(box, fill=(200, 40 * c, 255 - 40 * c))
            sketch = Image.new("RGB", (40, 40), "white")
            ImageDraw.Draw(sketch).ellipse(box, outline="black", width=2)
            photo.save(root / "photo" / f"class{c}" / f"p{c}{i}.png")
            sketch.save(root / "sketch" / f"class{c}" / f"p{c}{i}-1.png")
    (root / "split.txt").write_text("class5\n")
    return root, root / "split.txt"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m research.openworld_bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_argument(ap)
    ap.add_argument("--split", default="sketchy2")
    ap.add_argument("--out", default="runs/openworld")
    ap.add_argument("--variants", nargs="*", default=["default"])
    ap.add_argument("--seeds", nargs="*", type=int, default=[0])
    ap.add_argument("--folds", type=int, default=5, help="class folds of the non-test classes")
    ap.add_argument("--sets", nargs="*", default=None,
                    help="held-out sets: valid, fold0, fold1, ... (default: all)")
    ap.add_argument("--cache-dir", default=Config.cache_dir)
    ap.add_argument("--override", nargs="*", default=[], metavar="FIELD=VALUE",
                    help="cpu preset fields to change (JSON values)")
    ap.add_argument("--adapt", nargs="*", default=[], metavar="FIELD=VALUE",
                    help="training.cdk.adapt.Adaptation fields to change (JSON values)")
    ap.add_argument("--adapt-style", default="detail", choices=sorted(STYLES),
                    help="the pseudo-sketch style of the gallery's views (adapt, csls-gallery)")
    ap.add_argument("--heads", default=None,
                    help="where trained heads are kept and reused (default: OUT/heads)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--report", action="store_true", help="print OUT/results.jsonl's table")
    ap.add_argument("--smoke", action="store_true",
                    help="generated data, small heads, a short run: checks the script")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.report:
        print(report([json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]))
        return 0
    for v in args.variants:
        parse_variant(v)  # a bad name fails before any feature is computed
    tune_allocator()
    torch.set_num_threads(args.threads)
    over = {k: json.loads(v) for k, _, v in (o.partition("=") for o in args.override)}
    adapt_over = {k: json.loads(v) for k, _, v in (o.partition("=") for o in args.adapt)}
    tmp = None
    if args.smoke:
        tmp = tempfile.TemporaryDirectory()
        args.data, args.split = map(str, _smoke_data(Path(tmp.name) / "data"))
        args.cache_dir = str(Path(tmp.name) / "cache")
        args.folds, over, adapt_over = 2, {**SMOKE, **over}, {"steps": 3, "batch_size": 8,
                                                              **adapt_over}
    elif not args.data:
        data_folder(ap, args)  # exits naming how to give it
    try:
        cfg = make_config(data=args.data, split=args.split, cache_dir=args.cache_dir, **over)
        adapt_cfg = Adaptation(**adapt_over)
        specs = [parse_variant(v) for v in args.variants]
        styles = sorted({s for sp in specs for s in sp["pseudo"]}
                        | ({args.adapt_style} if any(sp["adapt"] or sp["csls"] == "gallery"
                                                     for sp in specs) else set()))
        sketch_styles = sorted(SKETCH_STYLES) if any(sp["augment"] for sp in specs) else []
        F = load(cfg, styles, sketch_styles, any(sp["single_view"] for sp in specs))
        out.mkdir(parents=True, exist_ok=True)
        results = out / "results.jsonl"
        done = set()
        if results.is_file():
            done = {(r["variant"], r["set"], r["seed"])
                    for r in map(json.loads, results.read_text().splitlines())}
        rows = []
        for set_name, held in held_out_sets(F, args.folds):
            if args.sets is not None and set_name not in args.sets:
                continue
            for seed in args.seeds:
                rows += run_set(dataclasses.replace(cfg, seed=seed), F, held, args.variants,
                                adapt_cfg, args.adapt_style, done, set_name, out,
                                Path(args.heads or out / "heads"))
        print(report([json.loads(x) for x in results.read_text().splitlines()]))
    finally:
        if tmp is not None:
            tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
