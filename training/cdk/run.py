"""The ``python -m training.cdk`` pipeline: data -> cached features -> training ->
evaluation on the validation and the zero-shot test classes -> checkpoint.pt, metrics.json,
plots, and the model bundle (model/: what index.build and the service read,
training.cdk.make_bundle)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from training.files import atomic_save, atomic_write_text
from training.folders import DataError

from . import distributed
from .checkpoint import HUBNESS_SAMPLE
from .config import Config, expansion, fit_warnings, hubness, input_size, smoothing, to_dict
from .data import Dataset, scan
from .estimate import estimate_run, estimate_text
from .features import extract_features
from .make_bundle import References, make_bundle
from .metrics import (
    corrected_metrics,
    cosine_scores_metrics,
    generalized_metrics,
    orthogonality_stats,
    pca_curves,
    retrieval_metrics,
    service_metrics,
    smoothed_metrics,
    spectrum_order,
    stored_gallery,
    structure_curves,
)
from .model.backbones import Backbone, build_backbone, with_flip_average
from .model.bundle import Bundle, BundleError
from .model.heads import embedding
from .model.smoothing import expand_exact
from .plots import plot_gallery, plot_spectrum, plot_structure
from .splits import split_classes
from .train import TrainData, TrainResult, train

__all__ = ["run", "load_data", "embed_features", "embed_dataset",
           "retrieval_embeddings", "Evaluation", "evaluate", "evaluate_valid", "Gallery",
           "whole_gallery", "generalized", "metrics_json"]

log = logging.getLogger(__name__)


def run(cfg: Config, say: Callable[[str], None] = log.info) -> dict:
    """Train and evaluate per ``cfg``; returns the metrics written to out/metrics.json
    (an empty dict on the ranks other than 0 of a multi-process run). Before the first
    step: a warning when the preset does not fit the data's size, OUT/config.json, and
    the run's estimated time through ``say`` (before the first image is read, then again
    before the first step)."""
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    device = distributed.init_from_env()
    out = Path(cfg.out)
    split, tr, va, te = load_data(cfg)
    cfg, photo_of = instance_pairs(cfg, tr)
    for line in fit_warnings(cfg, len(tr.sketches)):
        log.warning(line)
    if distributed.rank_and_world()[0] == 0:
        atomic_write_text(json.dumps(to_dict(cfg), indent=2), out / "config.json")
    bb = build_backbone(cfg.backbone, cfg.backbone_weights or None, cfg.photo_flip_average,
                        cfg.pooling)
    # one trunk; the sketches are mirror-averaged only with sketch_flip_average
    bbs = {"sketch": with_flip_average(bb, cfg.sketch_flip_average), "photo": bb}
    if not cfg.finetune and distributed.rank_and_world()[0] == 0:
        say(estimate_run(cfg, bbs, tr, [d for d in (va, te) if d.classes], photo_of, va,
                         device).text())
    t0 = time.perf_counter()
    # rank 0 fills the feature cache, the other ranks then read it
    tr_s, tr_p = distributed.main_first(
        lambda: (_features(cfg, "sketch", bbs["sketch"], tr.sketches, "train sketches", device),
                 _features(cfg, "photo", bb, tr.photos, "train photos", device)))
    later = _evaluation_features_first(cfg, bbs, {"valid": va, "test": te}, device)
    per_image = (time.perf_counter() - t0) / max(1, len(tr.sketches) + len(tr.photos) + (
        0 if later else sum(len(d.sketches) + len(d.photos) for d in (va, te))))
    t0 = time.perf_counter()
    res = train(cfg, TrainData(tr_s, tr_p, tr.sketch_labels, tr.photo_labels, photo_of,
                               list(tr.sketches), list(tr.photos)), bb, out, device=device,
                estimate=lambda *a: say(estimate_text(*a, later * per_image)))
    train_seconds = time.perf_counter() - t0
    if distributed.rank_and_world()[0] != 0:
        distributed.shutdown()  # waits for rank 0's evaluation
        return {}
    metrics = _evaluate_and_write(cfg, bbs, res, split, tr, va, te, tr_s, tr_p, device,
                                  train_seconds)
    distributed.shutdown()
    write_bundle(cfg, out, lambda: valid_references(cfg, bbs, res, va, device), say)
    return metrics


def write_bundle(cfg: Config, out: Path, references: Callable[[], References | None],
                 say: Callable[[str], None]) -> None:
    """The model bundle of the run's checkpoint at out/model, unless the one there already
    is (a finished run found again: its bundle, and the indexes built with it, stay valid)."""
    checkpoint = out / "checkpoint.pt"
    try:
        current = Bundle.open(out / "model")
    except (FileNotFoundError, BundleError):
        current = None
    if current is not None and current.training.get("checkpoint_sha256") == \
            hashlib.sha256(checkpoint.read_bytes()).hexdigest():
        say(f"model bundle {current.describe()} is this checkpoint's: kept")
        return
    make_bundle(checkpoint, out / "model", references=references() if cfg.int8 else None,
                threads=cfg.threads or 2, say=say, int8=cfg.int8)


def _evaluation_features_first(cfg: Config, bbs: dict, sets: dict[str, Dataset],
                               device) -> int:
    """Frozen backbones with a feature cache: the validation and test images' features
    computed now (evaluation then reads them from the cache), so that what remains after
    the first step can be estimated. Returns how many images are left for evaluation to
    embed with its backbones (fine-tuned ones, or no cache to keep them in)."""
    sets = {name: d for name, d in sets.items() if d.classes}  # split none: no test set
    count = sum(len(d.sketches) + len(d.photos) for d in sets.values())
    if cfg.finetune or not cfg.cache_dir:
        return count
    for name, d in sets.items():
        distributed.main_first(lambda d=d, name=name: [
            _features(cfg, m, bbs[m], files, f"{name} {m}s", device)
            for m, files in (("sketch", d.sketches), ("photo", d.photos))])
    return 0


def _evaluate_and_write(cfg: Config, bbs: dict, res: TrainResult, split: dict, tr: Dataset,
                        va: Dataset, te: Dataset, tr_s, tr_p, device,
                        train_seconds: float) -> dict:
    """Evaluation on the test and validation classes, metrics.json and the plots. A split
    without test classes (``none``) is evaluated on its validation classes instead, and
    says so. The generalized numbers rank the held-out sketches against every photo of
    the classes up to theirs: the validation classes' against the training and
    validation photos (no test image decides a setting), the test classes' against all."""
    out = Path(cfg.out)
    on_test = bool(te.classes)
    if not on_test:
        log.info(NO_TEST_NOTE, len(split["train"]), len(split["valid"]))
    sample = hubness_sample(cfg, bbs, res, tr, tr_s, device)
    if sample is not None:
        atomic_save({"embeddings": sample, **hubness(cfg).as_dict()},
                    out / HUBNESS_SAMPLE)
    gallery = whole_gallery(cfg, bbs, res, tr, [va, te], tr_p, device)
    valid_gallery = gallery.without(te.classes)
    ev = evaluate(cfg, bbs, res, te if on_test else va, tr_s, tr_p, device,
                  gallery if on_test else valid_gallery, sample)
    valid = evaluate_valid(cfg, bbs, res, va, device, valid_gallery, sample)
    log.info("mAP@all: valid %s, test %s (choose settings on valid)",
             "n/a (no validation classes)" if valid is None else f"{valid['map_all']:.4f}",
             f"{ev.full['map_all']:.4f}" if on_test else "n/a (no test classes)")
    if ev.smoothed is not None:
        log.info("mAP@all against the smoothed gallery: valid %s, test %s",
                 "n/a" if valid is None else f"{valid['smoothed']['map_all']:.4f}",
                 f"{ev.smoothed['map_all']:.4f}" if on_test else "n/a")
    log.info("mAP@all as the service answers (smoothed gallery, expanded queries): valid %s, "
             "test %s", "n/a" if valid is None else f"{valid['service']['map_all']:.4f}",
             f"{ev.service['map_all']:.4f}" if on_test else "n/a")
    log.info("generalized, as the service answers (held-out sketches against the whole "
             "gallery, training classes' photos included): valid %s; test %s",
             "n/a" if valid is None else _generalized_text(valid["generalized"]["service"]),
             _generalized_text(ev.generalized["service"]) if on_test else "n/a")
    if sample is not None:
        log.info("with the hubness correction (%s): zero-shot mAP@all valid %s, test %s; "
                 "generalized valid %s; test %s", hubness(cfg).as_dict(),
                 "n/a" if valid is None else f"{valid['corrected']['map_all']:.4f}",
                 f"{ev.corrected['map_all']:.4f}" if on_test else "n/a",
                 "n/a" if valid is None else _generalized_text(
                     valid["generalized"]["corrected"]),
                 _generalized_text(ev.generalized["corrected"]) if on_test else "n/a")
    metrics = metrics_json(cfg, split, te, res, ev, train_seconds, valid)
    atomic_write_text(json.dumps(metrics, indent=2), out / "metrics.json")
    write_plots(cfg, te if on_test else va, res, ev, out)
    return metrics


def _generalized_text(m: dict) -> str:
    return (f"mAP@all {m['map_all']:.4f}, P@{m['k']} {m['precision_at_k']:.4f}, "
            f"{100 * m['seen_at_k']:.0f}% of the top {m['k']} from training classes")


def hubness_sample(cfg: Config, bbs: dict, res: TrainResult, tr: Dataset, tr_s: torch.Tensor,
                   device) -> torch.Tensor | None:
    """(S, width) the embeddings of at most cfg.hubness_sample training sketches, evenly
    spread over them (classes are contiguous, so every class is in it), as retrieval embeds
    sketches; None when the correction is off."""
    if not hubness(cfg).active:
        return None
    pick = np.unique(np.linspace(0, len(tr_s) - 1, min(cfg.hubness_sample, len(tr_s)))
                     .round().astype(np.int64))
    tuned = (res.backbones or {}).get("sketch")
    x = tr_s if tuned is None else _features(cfg, "sketch", bbs["sketch"], tr.sketches,
                                             "train sketches", device, tuned)
    x = x[torch.as_tensor(pick)]
    dev = next(res.heads["sketch"].parameters()).device
    raw = (res.raw or {}).get("sketch")
    with torch.no_grad():
        return embedding(embed_features(res.heads["sketch"], x, dev), x.float().cpu(),
                         cfg.unit_embeddings, None if raw is None else raw.cpu())


NO_TEST_NOTE = ("split none: no test classes are held out; every class but the validation "
                "classes trained (%d classes), so the model has seen the classes of a gallery "
                "it serves. There are no test (zero-shot) numbers: metrics.json's top-level "
                "numbers and the plots are those of the %d validation classes")


def load_data(cfg: Config) -> tuple[dict, Dataset, Dataset, Dataset]:
    """(class split, training, validation and test classes) of ``cfg.data``; the
    validation Dataset has no classes when the split holds none out."""
    ds = scan(cfg.data)
    split = split_classes(cfg.split, list(ds.classes))
    tr, va, te = (ds.restrict(split[name]) for name in ("train", "valid", "test"))
    log.info("split %s: %d train classes (%d sketches, %d photos), %d valid classes "
             "(%d sketches, %d photos), %d test classes (%d sketches, %d photos)", cfg.split,
             len(tr.classes), len(tr.sketches), len(tr.photos), len(va.classes),
             len(va.sketches), len(va.photos), len(te.classes), len(te.sketches),
             len(te.photos))
    return split, tr, va, te


def _features(cfg: Config, modality: str, bb: Backbone, files, desc: str, device,
              module=None) -> torch.Tensor:
    """(N, D) backbone features of ``modality``'s ``files`` (at its image size) through the
    on-disk cache; ``module``: a fine-tuned backbone instead of the pretrained one."""
    return extract_features(files, bb, input_size(cfg, modality), cfg.cache_dir,
                            module=module, device=device, desc=desc)


def instance_pairs(cfg: Config, tr: Dataset) -> tuple[Config, np.ndarray | None]:
    """(cfg, the photo each training sketch was drawn from, or None where the kernel has no
    instance pairs). Under class pairing, data whose sketches do not name their photo
    train the class kernel alone (instance_share 0 in the config the run saves), with a
    warning; instance pairing needs them (DataError)."""
    if cfg.pairing == "class" and cfg.instance_share == 0:
        return cfg, None
    try:
        return cfg, tr.instance_pairs()
    except DataError as err:
        if cfg.pairing == "instance":
            raise
        log.warning("instance_share %g needs each sketch to name its photo (<photo>-<n>): "
                    "%s; training the class kernel alone (instance_share 0)",
                    cfg.instance_share, err)
        return dataclasses.replace(cfg, instance_share=0.0), None


@torch.no_grad()
def embed_features(head, feats: torch.Tensor, device) -> torch.Tensor:
    """(N, D) features -> (N, modes) head outputs with ``head`` in chunks, on the CPU."""
    head.eval()
    return torch.cat([head(feats[i : i + 8192].to(device)).float().cpu()
                      for i in range(0, len(feats), 8192)])


@dataclass
class Evaluation:
    """What the test classes say about a trained model, and the raw-feature baselines."""

    f: torch.Tensor  # (Qs, width) test sketch embeddings, as retrieval uses them
    g: torch.Tensor  # (Np, width) test photo embeddings, as retrieval uses them
    gallery: torch.Tensor  # g as index.build stores it (smoothed when the config smooths)
    full: dict  # retrieval metrics with the whole embedding
    curves: dict  # {"most", "least"}: d -> metrics (structure_curves)
    raw: dict  # cosine retrieval on the pretrained backbone's features
    raw_pca: dict  # {"cosine", "inner"}: d -> metrics on their top-d principal axes
    orthogonality_test: dict
    orthogonality_train: dict
    smoothed: dict | None = None  # against the smoothed gallery (None: smoothing off)
    service: dict | None = None  # as the service answers: smoothed gallery, expanded queries
    learned: dict | None = None  # the learned modes alone, when raw coordinates follow them
    # the same queries against the whole gallery, training classes' photos included
    # (metrics.generalized_metrics); None when no gallery was given
    generalized: dict | None = None
    # as ``service`` with the hubness correction (metrics.corrected_metrics); None when off
    corrected: dict | None = None


def embed_dataset(cfg: Config, bbs: dict[str, Backbone], res: TrainResult, ds: Dataset,
                  name: str, device
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(f (Qs, modes), g (Np, modes), x_s (Qs, D), x_p (Np, D)): the trained heads' outputs on
    ``ds`` (the learned functions, before ``retrieval_embedding``) and the backbone features
    they were computed from (the fine-tuned backbones' when there are any, else the
    pretrained ones of ``bbs``, per modality); ``name`` labels the progress."""
    dev = next(res.heads["sketch"].parameters()).device
    tuned = res.backbones or {}
    x_s = _features(cfg, "sketch", bbs["sketch"], ds.sketches, f"{name} sketches", device,
                    tuned.get("sketch"))
    x_p = _features(cfg, "photo", bbs["photo"], ds.photos, f"{name} photos", device,
                    tuned.get("photo"))
    return (embed_features(res.heads["sketch"], x_s, dev),
            embed_features(res.heads["photo"], x_p, dev), x_s, x_p)


def retrieval_embeddings(cfg: Config, res: TrainResult, fn: torch.Tensor, gn: torch.Tensor,
                         x_s: torch.Tensor, x_p: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """What retrieval scores (as the Embedder embeds): the heads' outputs fn, gn (N, L)
    through ``model.embedding`` (unit length, then the raw coordinates of the backbone features
    x_s, x_p when the run has them): (N, modes + raw_dims) each."""
    raw = res.raw or {}
    with torch.no_grad():
        return tuple(embedding(z, x.float().cpu(), cfg.unit_embeddings,
                               raw[m].cpu() if m in raw else None)
                     for m, z, x in (("sketch", fn, x_s), ("photo", gn, x_p)))


def evaluate(cfg: Config, bbs: dict[str, Backbone], res: TrainResult, te: Dataset,
             tr_s: torch.Tensor, tr_p: torch.Tensor, device,
             whole: Gallery | None = None, sample: torch.Tensor | None = None) -> Evaluation:
    """Embed the test classes with the trained heads (and backbones, if fine-tuned) and
    score them; bbs: the pretrained backbone per modality; tr_s, tr_p: (N, D) training
    features, the PCA baseline's fit; ``whole``: the whole gallery the generalized
    numbers rank the test sketches against (none: not scored); ``sample``: the hubness
    correction's sketches (hubness_sample; None: off)."""
    dev = next(res.heads["sketch"].parameters()).device
    fn, gn, te_s, te_p = embed_dataset(cfg, bbs, res, te, "test", device)
    f, g = retrieval_embeddings(cfg, res, fn, gn, te_s, te_p)
    labels = (te.sketch_labels, te.photo_labels)
    L = cfg.modes  # the curves are those of the learned modes' prefixes
    curves = structure_curves(f[:, :L], g[:, :L], *labels, cfg.k)
    if res.backbones is not None:  # the baseline is the pretrained backbone, not the tuned one
        te_s = _features(cfg, "sketch", bbs["sketch"], te.sketches, "test sketches", device)
        te_p = _features(cfg, "photo", bbs["photo"], te.photos, "test photos", device)
    gallery = stored_gallery(g, smoothing(cfg))  # smoothed once for both blocks below
    return Evaluation(
        f=f, g=g, gallery=gallery,
        full=retrieval_metrics(f, g, *labels, cfg.k),
        curves=curves,
        raw=cosine_scores_metrics(te_s, te_p, *labels, cfg.k),
        raw_pca=pca_curves(tr_s, tr_p, te_s, te_p, *labels, cfg.k, list(curves["most"])),
        orthogonality_test={"sketch": orthogonality_stats(fn), "photo": orthogonality_stats(gn)},
        orthogonality_train=_train_orthogonality(res, tr_s, tr_p, dev),
        smoothed=smoothed_metrics(f, g, *labels, cfg.k, smoothing(cfg), gallery),
        service=service_metrics(f, g, *labels, cfg.k, smoothing(cfg), expansion(cfg), gallery),
        learned=(retrieval_metrics(f[:, :L], g[:, :L], *labels, cfg.k)
                 if res.raw is not None else None),
        generalized=None if whole is None else generalized(cfg, whole, f, te, sample),
        corrected=None if sample is None else corrected_metrics(
            f, g, *labels, cfg.k, smoothing(cfg), expansion(cfg), hubness(cfg), sample,
            gallery),
    )


def evaluate_valid(cfg: Config, bbs: dict[str, Backbone], res: TrainResult, va: Dataset,
                   device, whole: Gallery | None = None,
                   sample: torch.Tensor | None = None) -> dict | None:
    """metrics.json's "valid" block: retrieval metrics of the trained embeddings on the
    validation classes, in full and by the d most significant modes (no baselines: they do
    not depend on the trained model), against the ``whole`` gallery (generalized; null
    without one), and with the hubness correction of ``sample`` ("corrected"; null
    without). None when the split has no validation classes."""
    if not va.classes:
        return None
    fn, gn, x_s, x_p = embed_dataset(cfg, bbs, res, va, "valid", device)
    f, g = retrieval_embeddings(cfg, res, fn, gn, x_s, x_p)
    labels = (va.sketch_labels, va.photo_labels)
    L = cfg.modes
    most = structure_curves(f[:, :L], g[:, :L], *labels, cfg.k)["most"]
    gallery = stored_gallery(g, smoothing(cfg))
    return {
        **retrieval_metrics(f, g, *labels, cfg.k),
        "learned": (retrieval_metrics(f[:, :L], g[:, :L], *labels, cfg.k)
                    if res.raw is not None else None),
        "map_by_dims": _by_dims(most, "map_all"),
        "precision_by_dims": _by_dims(most, "precision_at_k"),
        "smoothed": smoothed_metrics(f, g, *labels, cfg.k, smoothing(cfg), gallery),
        "service": service_metrics(f, g, *labels, cfg.k, smoothing(cfg), expansion(cfg),
                                   gallery),
        "corrected": None if sample is None else corrected_metrics(
            f, g, *labels, cfg.k, smoothing(cfg), expansion(cfg), hubness(cfg), sample,
            gallery),
        "generalized": None if whole is None else generalized(cfg, whole, f, va, sample),
        "classes": list(va.classes),
        "counts": {"sketches": len(va.sketches), "photos": len(va.photos)},
    }


def valid_references(cfg: Config, bbs: dict[str, Backbone], res: TrainResult, va: Dataset,
                     device) -> References | None:
    """The validation classes embedded as evaluation embeds them (float32, PyTorch): the
    int8 parity's reference when the bundle is written (None: no validation classes)."""
    if not va.classes:
        return None
    fn, gn, x_s, x_p = embed_dataset(cfg, bbs, res, va, "valid", device)
    f, g = retrieval_embeddings(cfg, res, fn, gn, x_s, x_p)
    return References({"sketch": list(va.sketches), "photo": list(va.photos)},
                      {"sketch": va.sketch_labels, "photo": va.photo_labels},
                      {"sketch": f.numpy(), "photo": g.numpy()})


@dataclass(frozen=True)
class Gallery:
    """Photos of every split as a served index holds them, embedded as retrieval uses them
    (the plain embeddings; generalized_metrics smooths them as index.build would)."""

    g: torch.Tensor  # (N, width)
    classes: tuple[str, ...]  # (N,) each photo's class
    seen: np.ndarray  # (N,) bool: photos of the classes the heads trained on

    def without(self, classes) -> Gallery:
        """The gallery without the photos of ``classes``."""
        keep = np.array([c not in set(classes) for c in self.classes], dtype=bool)
        return Gallery(self.g[torch.as_tensor(keep)],
                       tuple(c for c, k in zip(self.classes, keep, strict=True) if k),
                       self.seen[keep])


def whole_gallery(cfg: Config, bbs: dict[str, Backbone], res: TrainResult, tr: Dataset,
                  others: list[Dataset], tr_p: torch.Tensor, device) -> Gallery:
    """The photos of the training classes ``tr`` (their features ``tr_p`` (N, D), the
    pretrained backbone's) and of each of ``others`` (held-out classes), embedded by the
    trained model as ``retrieval_embeddings`` embeds them."""
    tuned = (res.backbones or {}).get("photo")
    raw = (res.raw or {}).get("photo")
    dev = next(res.heads["photo"].parameters()).device
    gs, classes, seen = [], [], []
    for ds, name in [(tr, "train"), *((d, "held-out") for d in others)]:
        if not ds.classes:
            continue
        x = tr_p if ds is tr and tuned is None else _features(
            cfg, "photo", bbs["photo"], ds.photos, f"{name} photos", device, tuned)
        with torch.no_grad():
            gs.append(embedding(embed_features(res.heads["photo"], x, dev), x.float().cpu(),
                                cfg.unit_embeddings, None if raw is None else raw.cpu()))
        classes += [ds.classes[i] for i in ds.photo_labels]
        seen += [ds is tr] * len(ds.photos)
    return Gallery(torch.cat(gs), tuple(classes), np.array(seen, dtype=bool))


def generalized(cfg: Config, gallery: Gallery, f: torch.Tensor, ds: Dataset,
                sample: torch.Tensor | None = None) -> dict:
    """metrics.generalized_metrics of the sketches of ``ds`` embedded as f (Q, width)
    against ``gallery``, smoothed and expanded as the config says (and corrected by the
    hubness ``sample``, when given)."""
    index = {c: i for i, c in enumerate(dict.fromkeys(gallery.classes))}
    missing = sorted(set(ds.classes) - set(index))
    if missing:
        raise ValueError(f"the gallery holds no photo of the classes {missing[:5]}")
    q_labels = np.array([index[ds.classes[i]] for i in ds.sketch_labels], dtype=np.int64)
    g_labels = np.array([index[c] for c in gallery.classes], dtype=np.int64)
    return generalized_metrics(f, gallery.g, q_labels, g_labels, gallery.seen, cfg.k,
                               smoothing(cfg), expansion(cfg), learned=cfg.modes,
                               hubness=hubness(cfg) if sample is not None else None,
                               sample=sample)


def _train_orthogonality(res: TrainResult, tr_s, tr_p, device) -> dict:
    """Orthogonality of the learned functions on the training classes (frozen backbones
    only; the fine-tuned ones would need the training images again)."""
    if res.backbones is not None:
        return {}
    return {"sketch": orthogonality_stats(embed_features(res.heads["sketch"], tr_s, device)),
            "photo": orthogonality_stats(embed_features(res.heads["photo"], tr_p, device))}


def _by_dims(curve: dict, metric: str) -> dict[str, float]:
    return {str(d): m[metric] for d, m in curve.items()}


def metrics_json(cfg: Config, split: dict, te: Dataset, res: TrainResult, ev: Evaluation,
                 train_seconds: float, valid: dict | None) -> dict:
    """The contents of metrics.json (benchmarks and tests read these keys): the top-level
    retrieval numbers are the test classes' (``ev``), or the validation classes' where the
    split holds out no test classes ("evaluated_on" says which); ``valid``
    (evaluate_valid) is those of the validation classes, the ones to choose settings by
    (null when there are none)."""
    return {
        **ev.full,
        "map_by_dims": _by_dims(ev.curves["most"], "map_all"),
        "precision_by_dims": _by_dims(ev.curves["most"], "precision_at_k"),
        "map_by_dims_least": _by_dims(ev.curves["least"], "map_all"),
        "precision_by_dims_least": _by_dims(ev.curves["least"], "precision_at_k"),
        # the learned modes alone (map_all etc. above include the raw coordinates; the
        # *_by_dims curves are the learned modes' d-prefixes); null without raw coordinates
        "learned": ev.learned,
        # the same embeddings against the smoothed gallery that index.build stores
        "smoothed": ev.smoothed,
        # what /retrieve returns: that gallery, each query expanded with its best photos
        # (model.smoothing.Expansion) on the prefix it scores with
        "service": ev.service,
        # the same sketches against the whole gallery, the training classes' photos
        # included (generalized zero-shot retrieval; metrics.generalized_metrics)
        "generalized": ev.generalized,
        # "service" with the hubness correction (model.hubness; null when off)
        "corrected": ev.corrected,
        # the CDK's Rayleigh quotients at the learned pairs (the estimate modes are ordered
        # by), and sqrt(E f^2 E g^2), first-order in the pairs' error, beside them
        "singular_values": res.singular_values.tolist(),
        "spectrum_order": spectrum_order(res.singular_values),
        # the order the modes were trained in (before --sort-modes reordered them), and
        # the sorted order checked on held-out halves of the training rows
        "spectrum_order_trained": res.order_trained,
        "spectrum_order_heldout": res.order_heldout,
        "singular_values_norm": (None if res.singular_values_norm is None
                                 else res.singular_values_norm.tolist()),
        "spectrum_order_norm": (None if res.singular_values_norm is None
                                else spectrum_order(res.singular_values_norm)),
        "orthogonality_test": ev.orthogonality_test,
        "orthogonality_train": ev.orthogonality_train,
        "raw_backbone_cosine": ev.raw,
        # the same raw features cut to their top-d principal axes (fit on training classes)
        "raw_backbone_pca_map_by_dims": _by_dims(ev.raw_pca["cosine"], "map_all"),
        "raw_backbone_pca_inner_map_by_dims": _by_dims(ev.raw_pca["inner"], "map_all"),
        "method": cfg.method, "backbone": cfg.backbone, "preset": cfg.preset,
        "seed": cfg.seed,
        "split": {"name": cfg.split, "train_classes": len(split["train"]),
                  "valid_classes": len(split["valid"]), "test_classes": split["test"]},
        # which classes the top-level numbers are of: "test", or "valid" for a split that
        # holds out no test classes (none; its note says so)
        "evaluated_on": "test" if te.classes else "valid",
        "note": None if te.classes else NO_TEST_NOTE % (len(split["train"]),
                                                        len(split["valid"])),
        "test_counts": ({"sketches": len(te.sketches), "photos": len(te.photos)}
                        if te.classes else None),
        "valid": valid,
        "train_seconds": train_seconds,
        "history": res.history,
        "config": to_dict(cfg),
    }


def write_plots(cfg: Config, te: Dataset, res: TrainResult, ev: Evaluation, out: Path) -> None:
    """structure.png, spectrum.png and gallery.png in ``out``."""
    most = ev.curves["most"]
    plot_structure({f"{cfg.method} (d most significant)": most,
                    f"{cfg.method} (d least significant)": ev.curves["least"],
                    "raw features, top-d principal axes, cosine": ev.raw_pca["cosine"],
                    "raw features, top-d principal axes, inner product": ev.raw_pca["inner"],
                    "raw features, all dims, cosine": {d: ev.raw for d in most}},
                   out / "structure.png")
    trained = None
    perm = res.history[-1].get("sorted_from") if res.history else None
    if perm is not None:  # coordinate l was mode perm[l]: put each value back in its place
        trained = torch.empty_like(res.singular_values)
        trained[torch.as_tensor(perm)] = res.singular_values
    plot_spectrum(res.singular_values, out / "spectrum.png", res.singular_values_norm, trained)
    # the photos as the service returns them: the stored gallery, each query expanded with
    # its best photos when the config expands
    queries = expand_exact(ev.f, ev.gallery, expansion(cfg))
    plot_gallery(queries.numpy(), ev.gallery.numpy(), te.sketch_labels, te.photo_labels,
                 te.sketches, te.photos, out / "gallery.png", cfg.gallery_queries,
                 cfg.gallery_topk, cfg.seed)
