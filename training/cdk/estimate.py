"""The run's time: estimated before the first image is read (the backbone and a training
step timed on random inputs of the run's shapes, on this machine, scaled by what the run will
do: the images whose features are not cached yet, the steps, the model bundle's int8
calibration and parity), then again before the first step (`estimate_text`).

Frozen backbones only: a fine-tuning run's cost is its steps through the backbones, which
train() measures before its first step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from training.images import images_to_tensor

from .config import Config, input_size
from .data import Dataset
from .features import ONNX_MIN_IMAGES, backbone_graph, cache_entry, one_view
from .make_bundle import int8_encoders
from .model.backbones import Backbone
from .model.bundle import modality_of
from .quantize import CALIBRATION_IMAGES
from .train import TrainData, measure_training

__all__ = ["EXPORT_SECONDS", "Estimate", "duration", "estimate_run", "estimate_text"]

SAMPLE = 8  # images of a timed forward
# One encoder graph exported by torch.onnx (EfficientNet-Lite1 with its head, 2 cores); the
# bundle exports one an encoder. Used when no backbone graph was exported while estimating.
EXPORT_SECONDS = 10.0


@dataclass(frozen=True)
class Estimate:
    images: dict[str, int]  # images whose features are still to compute, per modality
    per_second: dict[str, float]  # their rate here, decoding's resizing included
    steps: int
    step_s: float
    passes: int  # spectrum passes (training.cdk.train.CHECKPOINT_SECONDS apart)
    spectrum_s: float
    bundle_s: float

    @property
    def features_s(self) -> float:
        return sum(n / self.per_second[m] for m, n in self.images.items() if n)

    @property
    def train_s(self) -> float:
        return self.steps * self.step_s + self.passes * self.spectrum_s

    def text(self) -> str:
        plural = {"sketch": "sketches", "photo": "photos"}
        rates = ", ".join(f"{plural[m]} {self.per_second[m]:.0f}/s"
                          for m, n in self.images.items() if n)
        total = self.features_s + self.train_s + self.bundle_s
        return (f"estimated time: {duration(total)}, measured on this machine before the "
                f"first image (features of {sum(self.images.values())} images "
                f"{duration(self.features_s)}{f' at {rates}' if rates else ''}; training "
                f"{duration(self.train_s)}: {self.steps} steps x {self.step_s:.3f} s and "
                f"{self.passes} spectrum passes x {self.spectrum_s:.3f} s; the model bundle "
                f"about {duration(self.bundle_s)}; evaluation not included)")


def estimate_text(steps: int, step_s: float, passes: int, spectrum_s: float,
                  features_s: float) -> str:
    """The run's time after its features, before its first step: training from a step and
    a spectrum pass measured on this machine, and the evaluation images still to embed at
    the rate the features took (none left on the frozen path with a cache; evaluation's
    own arithmetic is small beside them)."""
    train_s = steps * step_s + passes * spectrum_s
    return (f"estimated time from here: {duration(train_s + features_s)} (training "
            f"{duration(train_s)}: {steps} steps x {step_s:.3f} s and {passes} spectrum "
            f"passes x {spectrum_s:.3f} s, measured here; evaluation features "
            f"{duration(features_s)})")


def duration(seconds: float) -> str:
    minutes, s = divmod(round(seconds), 60)
    return f"{minutes} min {s} s" if minutes else f"{s} s"


def _pending(cfg: Config, bbs: dict[str, Backbone], sets: list[Dataset]
             ) -> dict[str, list[int]]:
    """Per modality, the sizes of the file lists run() embeds whose features the cache
    does not hold."""
    out: dict[str, list[int]] = {"sketch": [], "photo": []}
    for d in sets:
        for m, files in (("sketch", d.sketches), ("photo", d.photos)):
            if not files:
                continue
            _, path = cache_entry(files, bbs[m], bbs[m].module, input_size(cfg, m),
                                  cfg.cache_dir or None)
            if path is None or not path.is_file():
                out[m].append(len(files))
    return out


def _rate(cfg: Config, bb: Backbone, modality: str, sizes: list[int]) -> tuple[float, float]:
    """(images a second through `bb` as extract_features runs them, including resizing a
    decoded image; seconds spent exporting a backbone graph now). A mirror-averaging
    module is timed as extract_features runs it: its one-view network, twice an image."""
    size = input_size(cfg, modality)
    one = one_view(bb.module)
    net, views = (bb.module, 1) if one is None else (one, 2)
    export_s = 0.0
    if sizes and max(sizes) >= ONNX_MIN_IMAGES:
        t0 = time.perf_counter()
        graph = backbone_graph(bb, net, size, cfg.cache_dir or None, torch.get_num_threads())
        export_s = time.perf_counter() - t0

        def forward(x):
            return graph(x.numpy())
    else:
        module = net.eval()

        def forward(x):
            with torch.no_grad():
                return module(x)
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 255, (256, 256, 3), dtype=np.uint8))
              for _ in range(SAMPLE)]
    times = []
    for _ in range(2):  # the first allocates
        t0 = time.perf_counter()
        forward(images_to_tensor(images, size, bb.mean, bb.std))
        times.append(time.perf_counter() - t0)
    return SAMPLE / (views * times[-1]), export_s


def estimate_run(cfg: Config, bbs: dict[str, Backbone], train: Dataset, others: list[Dataset],
                 photo_of: np.ndarray | None, valid: Dataset, device) -> Estimate:
    """The estimate of a frozen-backbone run of ``cfg`` on the training set ``train`` (and
    the validation and test sets ``others`` it evaluates), before any image is read."""
    pending = _pending(cfg, bbs, [train, *others])
    per_second, exported = {}, []
    for m in ("sketch", "photo"):
        per_second[m], export_s = _rate(cfg, bbs[m], m, pending[m])
        exported += [export_s] if export_s else []
    D = bbs["photo"].feature_dim
    g = torch.Generator().manual_seed(0)
    data = TrainData(torch.randn(len(train.sketches), D, generator=g),
                     torch.randn(len(train.photos), D, generator=g), train.sketch_labels,
                     train.photo_labels, photo_of)
    steps, step_s, passes, spectrum_s = measure_training(cfg, data, bbs["photo"], device)
    # the encoders: each side as trained, and in one view (half the work) where averaged
    single = [m for m in ("sketch", "photo") if bbs[m].flip_average]
    encoders = ["sketch", "photo", *(f"{m}-single-view" for m in single)]
    export = len(encoders) * (max(exported) if exported else EXPORT_SECONDS)
    quantize = 0.0
    if cfg.int8 and valid.classes:  # calibration, then parity on the validation classes
        n = {"sketch": len(valid.sketches), "photo": len(valid.photos)}
        for name in int8_encoders(encoders):  # a mirror-averaged graph: two passes an image
            m = modality_of(name)
            one_pass = per_second[m] * (2 if m in single else 1)  # images/s in one view
            quantize += (CALIBRATION_IMAGES + n[m]) * (2 if name in single else 1) / one_pass
    return Estimate({m: sum(v) for m, v in pending.items()}, per_second, steps, step_s,
                    passes, spectrum_s, export + quantize)
