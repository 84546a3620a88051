"""The ``python -m training.cdk`` pipeline: data -> cached features -> training ->
evaluation on the zero-shot test classes -> checkpoint.pt, metrics.json and plots."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from training.files import atomic_write_text

from .backbones import build_backbone
from .config import Config, to_dict
from .data import scan
from .features import extract_features
from .metrics import (
    cosine_scores_metrics,
    orthogonality_stats,
    pca_curves,
    retrieval_metrics,
    structure_curves,
)
from .plots import plot_gallery, plot_spectrum, plot_structure
from .splits import split_classes
from .train import TrainData, train

__all__ = ["run", "embed_features"]

log = logging.getLogger(__name__)


def _init_distributed() -> torch.device | None:
    """Join the torchrun process group when launched with WORLD_SIZE > 1."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return None
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl")
        return torch.device("cuda", local)
    dist.init_process_group("gloo")
    return torch.device("cpu")


@torch.no_grad()
def embed_features(head, feats: torch.Tensor, device) -> torch.Tensor:
    """(N, D) features -> (N, L) embeddings with ``head`` in chunks, on the CPU."""
    head.eval()
    return torch.cat([head(feats[i : i + 8192].to(device)).float().cpu()
                      for i in range(0, len(feats), 8192)])


def _train_orthogonality_stats(res, tr_s, tr_p, device) -> dict:
    """Orthogonality of the learned functions on the training classes (frozen backbones
    only; the fine-tuned ones would need the training images again)."""
    if res.backbones is not None:
        return {}
    return {"sketch": orthogonality_stats(embed_features(res.heads["sketch"], tr_s, device)),
            "photo": orthogonality_stats(embed_features(res.heads["photo"], tr_p, device))}


def run(cfg: Config) -> dict:
    """Train and evaluate per ``cfg``; returns the metrics written to out/metrics.json."""
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    device = _init_distributed()
    rank = dist.get_rank() if dist.is_initialized() else 0
    out = Path(cfg.out)
    ds = scan(cfg.data)
    split = split_classes(cfg.split, list(ds.classes))
    tr, te = ds.restrict(split["train"]), ds.restrict(split["test"])
    log.info("split %s: %d train classes (%d sketches, %d photos), %d test classes "
             "(%d sketches, %d photos)", cfg.split, len(tr.classes), len(tr.sketches),
             len(tr.photos), len(te.classes), len(te.sketches), len(te.photos))
    bb = build_backbone(cfg.backbone, cfg.backbone_weights or None)

    def feats(files, desc, module=None):
        return extract_features(files, bb, cfg.image_size, cfg.cache_dir, module=module,
                                device=device, desc=desc)

    # Rank 0 fills the cache first; the other ranks then read it.
    for turn in ([0, 1] if dist.is_initialized() else [0]):
        if (rank == 0) == (turn == 0):
            tr_s, tr_p = feats(tr.sketches, "train sketches"), feats(tr.photos, "train photos")
        if dist.is_initialized():
            dist.barrier()
    data = TrainData(tr_s, tr_p, tr.sketch_labels, tr.photo_labels,
                     tr.instance_pairs() if cfg.pairing == "instance" else None,
                     list(tr.sketches), list(tr.photos))
    t0 = time.perf_counter()
    res = train(cfg, data, bb, out, device=device)
    train_seconds = time.perf_counter() - t0
    if rank != 0:
        dist.barrier()  # wait for rank 0's evaluation
        dist.destroy_process_group()
        return {}

    dev = next(res.heads["sketch"].parameters()).device
    bbs = res.backbones or {}
    te_s = feats(te.sketches, "test sketches", bbs.get("sketch"))
    te_p = feats(te.photos, "test photos", bbs.get("photo"))
    f = embed_features(res.heads["sketch"], te_s, dev)  # (Qs, L)
    g = embed_features(res.heads["photo"], te_p, dev)  # (Np, L)
    full = retrieval_metrics(f, g, te.sketch_labels, te.photo_labels, cfg.k)
    curves = structure_curves(f, g, te.sketch_labels, te.photo_labels, cfg.k)
    if res.backbones is not None:  # the baseline is the pretrained backbone, not the tuned one
        te_s0, te_p0 = feats(te.sketches, "test sketches"), feats(te.photos, "test photos")
    else:
        te_s0, te_p0 = te_s, te_p
    raw = cosine_scores_metrics(te_s0, te_p0, te.sketch_labels, te.photo_labels, cfg.k)
    raw_pca = pca_curves(tr_s, tr_p, te_s0, te_p0, te.sketch_labels, te.photo_labels, cfg.k,
                         list(curves["most"]))
    metrics = {
        **full,
        "map_by_dims": {str(d): m["map_all"] for d, m in curves["most"].items()},
        "precision_by_dims": {str(d): m["precision_at_k"] for d, m in curves["most"].items()},
        "map_by_dims_least": {str(d): m["map_all"] for d, m in curves["least"].items()},
        "precision_by_dims_least": {str(d): m["precision_at_k"]
                                    for d, m in curves["least"].items()},
        "singular_values": res.singular_values.tolist(),
        "orthogonality_test": {"sketch": orthogonality_stats(f), "photo": orthogonality_stats(g)},
        "orthogonality_train": _train_orthogonality_stats(res, tr_s, tr_p, dev),
        "raw_backbone_cosine": raw,
        # the same raw features cut to their top-d principal axes (fit on training classes)
        "raw_backbone_pca_map_by_dims": {str(d): m["map_all"]
                                         for d, m in raw_pca["cosine"].items()},
        "raw_backbone_pca_inner_map_by_dims": {str(d): m["map_all"]
                                               for d, m in raw_pca["inner"].items()},
        "method": cfg.method, "backbone": cfg.backbone, "preset": cfg.preset,
        "seed": cfg.seed,
        "split": {"name": cfg.split, "train_classes": len(split["train"]),
                  "valid_classes": len(split["valid"]), "test_classes": split["test"]},
        "test_counts": {"sketches": len(te.sketches), "photos": len(te.photos)},
        "train_seconds": train_seconds,
        "history": res.history,
        "config": to_dict(cfg),
    }
    atomic_write_text(json.dumps(metrics, indent=2), out / "metrics.json")
    plot_structure({f"{cfg.method} (d most significant)": curves["most"],
                    f"{cfg.method} (d least significant)": curves["least"],
                    "raw features, top-d principal axes, cosine": raw_pca["cosine"],
                    "raw features, top-d principal axes, inner product": raw_pca["inner"],
                    "raw features, all dims, cosine": {d: raw for d in curves["most"]}},
                   out / "structure.png")
    plot_spectrum(res.singular_values, out / "spectrum.png")
    plot_gallery(f.numpy(), g.numpy(), te.sketch_labels, te.photo_labels, te.sketches,
                 te.photos, out / "gallery.png", cfg.gallery_queries, cfg.gallery_topk,
                 cfg.seed)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return metrics
