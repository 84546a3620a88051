"""Write a model bundle (training.cdk.model.bundle) from a training checkpoint.

    python -m training.cdk.make_bundle --checkpoint runs/cdk/checkpoint.pt --out runs/cdk/model

``python -m training.cdk`` runs this at the end of training; the command is for a checkpoint
written before bundles, or to write a bundle again (for example with the training data at
another path: ``--data``). Where the training data is (the checkpoint's, or ``--data``) it
exports both encoders as ONNX graphs in float32, quantizes each to int8 calibrated on
training-class images, measures the int8 graph's parity with float32 on the validation
classes (training.cdk.quantize) and times one forward of each precision on this CPU; an
encoder is served in int8 by default where the parity holds and int8 takes at most FASTER x
float32's time, and the bundle records the evidence. Without the training data the bundle
holds float32 graphs only, and says why. The photo graph of a side trained mirror-averaged
is left in float32 unless ``--int8-two-views`` asks (only ``index.build --photo-views 2``
runs it; indexing's default, the one-view graph, is quantized): it is the slowest graph to
calibrate, and a model nobody indexes in two views would pay for it on every bundle.

The folder is written beside ``--out`` and renamed into place, so a reader finds the old
bundle or the new one, never half of one.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import shutil
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from training import cli
from training.files import atomic_write_bytes, fsync_dir

from .checkpoint import HUBNESS_SAMPLE, read_checkpoint
from .config import Config, from_dict, input_size
from .data import scan
from .model.backbones import weights_fingerprint
from .model.bundle import (
    FORMAT,
    HUBNESS_FILE,
    MODEL_FILE,
    VERSION,
    WEIGHTS_FILE,
    Bundle,
    EncoderInfo,
    Inference,
    modality_of,
)
from .model.embedder import Embedder
from .model.export import INPUT, OnnxEncoder, export_encoder
from .model.heads import MODALITIES
from .splits import split_classes

__all__ = ["FASTER", "References", "bundle_from_checkpoint", "embedder_of_checkpoint",
           "inference_of", "int8_encoders", "make_bundle"]

log = logging.getLogger(__name__)

FASTER = 0.9  # int8 is served when its forward takes at most this share of float32's
TIMING_ROUNDS = 7


@dataclass(frozen=True)
class References:
    """Float32 embeddings of the validation classes, the parity's reference: ``files[m]``
    (in order), their ``labels[m]`` and ``embeddings[m]`` (N_m, width), per modality."""

    files: dict[str, list[Path]]
    labels: dict[str, np.ndarray]
    embeddings: dict[str, np.ndarray]


def inference_of(ckpt: dict, cfg: Config) -> Inference:
    """The inference block of a training checkpoint (``ckpt``, its config ``cfg``)."""
    meta, arch = ckpt["backbone"], ckpt["head_arch"]
    return Inference(
        backbone=meta["name"], feature_dim=int(arch["in_dim"]), pooling=str(meta["pooling"]),
        mean=tuple(float(v) for v in meta["mean"]), std=tuple(float(v) for v in meta["std"]),
        image_size={m: input_size(cfg, m) for m in MODALITIES},
        flip_average={"sketch": bool(meta["sketch_flip_average"]),
                      "photo": bool(meta["photo_flip_average"])},
        finetuned=bool(meta["finetuned"]), modes=int(arch["modes"]),
        raw_dims=int(cfg.raw_dims),  # the Embedder checks the weights hold them
        unit_embeddings=bool(cfg.unit_embeddings),
        head={"in_dim": int(arch["in_dim"]), "hidden": int(arch["hidden"]),
              "mu": float(arch["mu"])},
        smoothing={"k": cfg.smooth_k, "weight": cfg.smooth_weight,
                   "rounds": cfg.smooth_rounds},
        expansion={"n": cfg.expand_n, "weight": cfg.expand_weight},
        hubness={"k": cfg.hubness_k, "weight": 0.0},  # on once a sample is at hand
        singular_values=tuple(float(v) for v in ckpt["singular_values"]),
        fingerprints={},  # filled in once the backbones are built
    )


def embedder_of_checkpoint(path: str | Path, device=None,
                           sketch_flip_average: bool | None = None
                           ) -> tuple[Embedder, Config, str]:
    """(the PyTorch Embedder of a training checkpoint, its config, its sha256): for tools
    that export or measure a checkpoint's encoders before it is a bundle."""
    ckpt, sha = read_checkpoint(path)
    cfg = from_dict(ckpt["config"], str(path))
    return (Embedder(inference_of(ckpt, cfg), _weights(ckpt), sha, device, source=str(path),
                     sketch_flip_average=sketch_flip_average), cfg, sha)


def _weights(ckpt: dict) -> dict:
    """What weights.pt holds: the backbones (one storage when shared), heads, raw axes."""
    return {"backbones": ckpt["backbones"], "heads": ckpt["heads"], "raw": ckpt["raw"]}


def _timing(fp32: OnnxEncoder, int8: OnnxEncoder, size: int) -> dict[str, float]:
    """Milliseconds of one single-image forward of each graph on one thread (medians of
    interleaved runs, after two that allocate)."""
    x = np.random.default_rng(0).standard_normal((1, 3, size, size), dtype=np.float32)
    times: dict[str, list[float]] = {"fp32": [], "int8": []}
    for i in range(TIMING_ROUNDS + 2):
        for name, enc in (("fp32", fp32), ("int8", int8)):
            t0 = time.perf_counter()
            enc(x)
            if i >= 2:
                times[name].append(time.perf_counter() - t0)
    return {name: round(1000 * float(np.median(t)), 3) for name, t in times.items()}


class _Writer:
    """The encoders of one bundle: float32 graphs, then int8 where the data allows."""

    def __init__(self, embedders: dict[str, Embedder], threads: int):
        self.embedders, self.threads = embedders, threads
        self.files: dict[str, bytes] = {}
        self.info: dict[str, EncoderInfo] = {}
        self.fp32: dict[str, OnnxEncoder] = {}

    def export(self, say) -> None:
        for name, emb in self.embedders.items():
            t0 = time.perf_counter()
            data = export_encoder(emb, modality_of(name))
            self.files[f"{name}.onnx"] = data
            self.fp32[name] = OnnxEncoder(data, modality_of(name), self.threads,
                                          source=f"{name} float32 graph")
            say(f"exported the {name} encoder ({len(data) / 1e6:.1f} MB) in "
                f"{time.perf_counter() - t0:.1f} s")

    def float_only(self, why: str, names=None) -> None:
        for name in self.embedders if names is None else names:
            self.info[name] = EncoderInfo({"fp32": f"{name}.onnx", "int8": None}, "fp32", why)

    def quantize(self, name: str, train, refs: References, say) -> None:
        """The int8 graph of encoder ``name``: calibrated on ``train`` (training classes),
        its parity measured against ``refs``, timed against float32."""
        import onnx

        from .quantize import (
            FLOAT_FRONT,
            ParityCheck,
            calibration_files,
            preprocessed,
            quantize_graph,
            with_metadata,
        )

        t0 = time.perf_counter()
        modality = modality_of(name)
        other = "photo" if modality == "sketch" else "sketch"
        emb, fp32 = self.embedders[name], self.fp32[name]
        files = calibration_files(train, modality)
        ours = (refs.embeddings[modality] if name == modality else  # single view: its own
                np.concatenate([fp32(b) for b in preprocessed(emb.preprocess,
                                                              refs.files[modality], modality)]))
        check = ParityCheck(modality, refs.files[modality], ours, refs.embeddings[other],
                            refs.labels[modality], refs.labels[other], emb.preprocess)
        for front in FLOAT_FRONT[modality]:  # until the parity holds; the last one is kept
            graph = quantize_graph(self.files[f"{name}.onnx"],
                                   preprocessed(emb.preprocess, files, modality), INPUT, front)
            proto = onnx.load_from_string(graph)
            meta = {**{p.key: p.value for p in proto.metadata_props}, **fp32.meta,
                    "precision": "int8", "calibration_images": str(len(files)),
                    "float_front": str(front)}
            int8 = OnnxEncoder(with_metadata(proto, meta), modality, self.threads,
                               precision="int8", source=f"{name} int8 graph")
            parity = check(int8)
            say(f"int8 {name} encoder, its first {front} convolutions in float32: {parity}: "
                + ("holds" if parity.holds() else "fails"))
            if parity.holds():
                break
        self.files[f"{name}.int8.onnx"] = with_metadata(proto, {**meta, **parity.metadata()})
        graphs = {"fp32": f"{name}.onnx", "int8": f"{name}.int8.onnx"}
        if not parity.holds():
            self.info[name] = EncoderInfo(graphs, "fp32", f"the int8 graph fails the parity "
                                          f"rule ({parity})", parity.as_dict())
            return
        one = [OnnxEncoder(self.files[g], modality, 1, precision=p)
               for p, g in graphs.items()]
        ms = _timing(*one, emb.size_of(modality))
        faster = ms["int8"] <= FASTER * ms["fp32"]
        why = (f"int8 holds parity and takes {ms['int8']:.1f} ms against float32's "
               f"{ms['fp32']:.1f} ms a forward on one thread of the CPU the bundle was "
               f"written on (served when <= {FASTER} x)")
        self.info[name] = EncoderInfo(graphs, "int8" if faster else "fp32", why,
                                      parity.as_dict(), {**ms, "threads": 1})
        say(f"{name} encoder: {why}: serving {self.info[name].precision} "
            f"({time.perf_counter() - t0:.0f} s)")


def _references(writer: _Writer, valid) -> References:
    """The validation classes embedded by the float32 graphs (when training gave none)."""
    from .quantize import preprocessed

    files = {"sketch": list(valid.sketches), "photo": list(valid.photos)}
    emb = {m: np.concatenate([writer.fp32[m](b) for b in preprocessed(
        writer.embedders[m].preprocess, files[m], m)]) for m in MODALITIES}
    return References(files, {"sketch": valid.sketch_labels, "photo": valid.photo_labels},
                      emb)


def _hubness_sample(checkpoint: Path, cfg: Config, width: int) -> dict | None:
    """What training wrote beside the checkpoint for the hubness correction ({embeddings
    (S, width) float32, k, weight}), or None: the correction off, or no sample there (a
    checkpoint written before it; said)."""
    if not cfg.hubness_weight:
        return None
    path = checkpoint.parent / HUBNESS_SAMPLE
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
        emb = np.asarray(obj["embeddings"], dtype=np.float32)
        if emb.ndim != 2 or emb.shape[1] != width or not np.isfinite(emb).all():
            raise ValueError(f"it holds {emb.shape} values, not (S, {width}) finite ones")
        return {"embeddings": emb, "k": int(obj["k"]), "weight": float(obj["weight"])}
    except (OSError, KeyError, ValueError, RuntimeError) as err:
        log.warning("the bundle has no hubness correction: %s: %s", path, err)
        return None


def _provenance(cfg: Config, ckpt_sha: str, data: str | Path | None, trained: bool) -> dict:
    """Where the model came from (a record: readers of the bundle embed without it)."""
    out = {"checkpoint_sha256": ckpt_sha, "preset": cfg.preset, "method": cfg.method,
           "seed": cfg.seed, "split": cfg.split, "trained": trained,
           "data": str(Path(data or cfg.data).absolute()) if (data or cfg.data) else "",
           "feature_cache": str(Path(cfg.cache_dir).absolute()) if cfg.cache_dir else "",
           "classes": None}
    try:
        classes = list(scan(data or cfg.data).classes)
        out["classes"] = split_classes(cfg.split, classes)
    except Exception as err:  # noqa: BLE001 - a record only; say why it is missing
        log.info("the bundle records no class split: %s", err)
    return out


TWO_VIEWS_FLOAT = ("float32 only: indexes in two views (index.build --photo-views 2) run "
                   "this graph, the default's one-view graph is quantized; python -m "
                   "training.cdk.make_bundle --checkpoint CHECKPOINT --int8-two-views "
                   "quantizes it too")


def int8_encoders(names, two_views: bool = False) -> list[str]:
    """Which of a bundle's encoders ``names`` are made in int8 too: all, but the photo
    graph of a side trained mirror-averaged only when ``two_views`` (indexing's default is
    its one-view graph)."""
    return [n for n in names
            if two_views or not (n == "photo" and "photo-single-view" in names)]


def make_bundle(checkpoint: str | Path, out: str | Path, data: str | Path | None = None,
                references: References | None = None, threads: int = 2,
                say=log.info, int8: bool = True, int8_two_views: bool = False) -> Bundle:
    """Write the bundle of ``checkpoint`` at ``out`` (replacing one there) and open it.
    ``data``: the training data (default: the folder the checkpoint was trained on), for
    int8 calibration and parity; ``references``: float32 embeddings of its validation
    classes when the caller has them (training does), else the float32 graphs embed them;
    ``int8`` False: float32 graphs only; ``int8_two_views``: the mirror-averaged photo graph
    (next to its one-view graph) in int8 too."""
    from .quantize import QuantizationError, calibration_sets

    t0 = time.perf_counter()
    ckpt, ckpt_sha = read_checkpoint(checkpoint)
    cfg = from_dict(ckpt["config"], str(checkpoint))
    inference = inference_of(ckpt, cfg)
    weights = _weights(ckpt)
    base = Embedder(inference, weights, "", device="cpu", source=str(checkpoint))
    inference = Inference(**{**asdict(inference), "fingerprints": {
        m: weights_fingerprint(base.backbone_of(m).module) for m in MODALITIES}})
    embedders = {"sketch": base, "photo": base}
    for m in MODALITIES:  # a side trained on mirror-averaged features, in one view too
        if inference.flip_average[m]:
            embedders[f"{m}-single-view"] = Embedder(inference, weights, "", device="cpu",
                                                     **{f"{m}_flip_average": False})
    writer = _Writer(embedders, threads)
    writer.export(say)
    try:
        if not int8:
            raise QuantizationError("not asked for (--int8 false)")
        train, valid = calibration_sets(data or cfg.data, cfg.split)
        refs = references or _references(writer, valid)
        quantized = int8_encoders(list(embedders), int8_two_views)
        for name in quantized:
            writer.quantize(name, train, refs, say)
        writer.float_only(TWO_VIEWS_FLOAT, [n for n in embedders if n not in quantized])
    except QuantizationError as err:
        log.warning("the bundle serves float32 only: %s", err)
        writer.float_only(f"no int8 graph: {err}")
    buf = io.BytesIO()
    torch.save(weights, buf)
    writer.files[WEIGHTS_FILE] = buf.getvalue()
    sample = _hubness_sample(Path(checkpoint), cfg, inference.width)
    if sample is not None:
        buf = io.BytesIO()
        np.save(buf, sample["embeddings"], allow_pickle=False)
        writer.files[HUBNESS_FILE] = buf.getvalue()
        inference = Inference(**{**asdict(inference), "hubness": {
            "k": int(sample["k"]), "weight": float(sample["weight"])}})
    doc = {
        "format": FORMAT, "version": VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "inference": inference.to_dict(),
        "encoders": {n: asdict(i) for n, i in writer.info.items()},
        "files": {n: {"sha256": hashlib.sha256(b).hexdigest(), "bytes": len(b)}
                  for n, b in sorted(writer.files.items())},
        "training": _provenance(cfg, ckpt_sha, data, bool(ckpt["trained"])),
    }
    path = _write_folder(Path(out), {**writer.files,
                                     MODEL_FILE: json.dumps(doc, indent=2).encode() + b"\n"})
    bundle = Bundle.open(path)
    say(f"model bundle {bundle.describe()} written in {time.perf_counter() - t0:.0f} s")
    return bundle


def _write_folder(out: Path, files: dict[str, bytes]) -> Path:
    """``files`` as the folder ``out``: staged beside it, then renamed over it (the old one
    is removed after). Only a bundle (or an empty folder) is replaced."""
    out = out.absolute()
    if out.exists() and any(out.iterdir()) and not (out / MODEL_FILE).is_file():
        raise FileExistsError(f"{str(out)!r} exists and is not a model bundle; choose another "
                              "--out")
    stage = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex}"
    stage.mkdir(parents=True)
    try:
        for name, data in files.items():
            if name != MODEL_FILE:
                atomic_write_bytes(data, stage / name)
        atomic_write_bytes(files[MODEL_FILE], stage / MODEL_FILE)  # last: it names the rest
        old = None
        if out.exists():
            old = out.parent / f".{out.name}.old-{uuid.uuid4().hex}"
            out.rename(old)
        stage.rename(out)
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return out


@dataclass(frozen=True)
class BundleConfig:
    checkpoint: str = ""  # a training.cdk checkpoint.pt
    out: str = ""  # the bundle folder to write (default: model/ beside the checkpoint)
    data: str = ""  # the training data (int8 calibration); "": the checkpoint's
    threads: int = 2  # ONNX Runtime threads while calibrating and measuring parity
    int8: bool = True  # int8 encoders too (they need the training data); false: float32
    int8_two_views: bool = False  # the mirror-averaged photo graph in int8 too (--photo-views 2)


def bundle_from_checkpoint(cfg: BundleConfig, say=print) -> Bundle:
    out = cfg.out or str(Path(cfg.checkpoint).parent / "model")
    return make_bundle(cfg.checkpoint, out, cfg.data or None, threads=cfg.threads, say=say,
                       int8=cfg.int8, int8_two_views=cfg.int8_two_views)


def main(argv: list[str] | None = None) -> int:
    return cli.main(_main, argv)


def _main(argv: list[str]) -> int:
    parser = cli.build_parser(BundleConfig, prog="python -m training.cdk.make_bundle",
                              description=__doc__, required=("checkpoint",))
    cfg = cli.parse(parser, BundleConfig, argv)
    torch.set_num_threads(cfg.threads)
    bundle = bundle_from_checkpoint(cfg, say=lambda line: print(line, flush=True))
    print(f"index a photo folder with it: python -m index.build --model {bundle.path} "
          "--photos DIR --out runs/index")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
