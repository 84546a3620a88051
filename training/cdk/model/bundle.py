"""The model bundle: one folder with everything that embedding needs, written once by
training (``python -m training.cdk``, or ``python -m training.cdk.make_bundle`` from a
checkpoint) where the training data is, and only read after that by ``index.build`` and the
service, which never need the training data, never export and never write into it.

    model/
      model.json         format, version, the inference block, the encoders (which graph
                         each serves, with its int8 parity evidence and timing), the
                         sha256 and size of every other file, and where it was trained
      weights.pt         backbones, heads and raw-coordinate projections (PyTorch: the
                         GPU path, and heads over cached backbone features)
      sketch.onnx        the sketch encoder (backbone + head) in float32, ONNX Runtime
      sketch.int8.onnx   ... in int8, when it could be calibrated
      photo.onnx, photo.int8.onnx
      hubness.npy        the training sketches the hubness correction scores photos against
                         (S, width) float32, when the model has the correction

The bundle's identity is the sha256 of its model.json, which names the sha256 of every
other file: an index records it, and every file is checked against model.json before
ONNX Runtime or torch reads it. There is one format version; a folder of another version is
refused with the command that rebuilds it.

This module imports nothing of the training configuration: the inference block is all that
readers see of how the model was trained.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import logging
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from PIL import Image

from training.images import images_to_tensor

from .heads import MODALITIES
from .hubness import Hubness
from .smoothing import Expansion, Smoothing

__all__ = ["FORMAT", "VERSION", "MODEL_FILE", "WEIGHTS_FILE", "HUBNESS_FILE", "PRECISIONS",
           "BundleError",
           "Inference", "EncoderInfo", "Bundle", "rebuild_command"]

log = logging.getLogger(__name__)

FORMAT = "sketchsvd-model"
VERSION = 1
MODEL_FILE = "model.json"
WEIGHTS_FILE = "weights.pt"
HUBNESS_FILE = "hubness.npy"
PRECISIONS = ("fp32", "int8")
# The encoders a bundle holds: each side as trained and, for a side trained on features
# averaged with the mirror image's, that side in one view (one backbone pass an image).
ENCODERS = ("sketch", "photo", "sketch-single-view", "photo-single-view")


class BundleError(ValueError):
    """A folder that is not a complete, unchanged model bundle of this format."""


def rebuild_command(folder: str | Path = "runs/cdk/model") -> str:
    """The command that writes a bundle again from its training checkpoint."""
    return (f"python -m training.cdk.make_bundle --checkpoint runs/cdk/checkpoint.pt "
            f"--out {folder}")


def modality_of(encoder: str) -> str:
    """The modality an encoder embeds ("photo-single-view" embeds photos)."""
    return encoder.split("-")[0]


@dataclass(frozen=True)
class Inference:
    """How images become embeddings, and the retrieval defaults that go with them.

    The backbone ``backbone`` (``feature_dim`` wide, ``pooling``) sees images resized to
    ``image_size[m]`` and normalised by ``mean``/``std``, averaged with their mirror image
    where ``flip_average[m]``; the heads (``head``: in_dim, hidden, mu) map its features to
    ``modes`` learned singular functions, scaled to unit length when ``unit_embeddings``,
    followed by ``raw_dims`` raw coordinates. ``smoothing`` is the gallery smoothing an index
    applies to its photos, ``expansion`` the query expansion of the service, ``hubness``
    the hubness correction an index stores with its photos ({k, weight}; weight 0: none);
    ``fingerprints[m]`` identify the backbones' weights (feature-cache keys)."""

    backbone: str
    feature_dim: int
    pooling: str
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    image_size: dict[str, int]
    flip_average: dict[str, bool]
    finetuned: bool
    modes: int
    raw_dims: int
    unit_embeddings: bool
    head: dict[str, float]
    smoothing: dict[str, float]
    expansion: dict[str, float]
    hubness: dict[str, float]
    singular_values: tuple[float, ...]
    fingerprints: dict[str, str]

    @property
    def width(self) -> int:
        """The embeddings' width: the learned modes, then the raw coordinates."""
        return self.modes + self.raw_dims

    def size_of(self, modality: str) -> int:
        _check_modality(modality)
        return int(self.image_size[modality])

    def gallery_smoothing(self) -> Smoothing:
        return Smoothing(**self.smoothing)

    def query_expansion(self) -> Expansion:
        return Expansion(**self.expansion)

    def hubness_correction(self) -> Hubness:
        return Hubness(**self.hubness)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict, source: str) -> Inference:
        names = {f.name for f in fields(cls)}
        if not isinstance(d, dict) or set(d) != names:
            got = set(d) if isinstance(d, dict) else set()
            raise BundleError(f"{source}: the inference block lacks {sorted(names - got)} or "
                              f"has unknown fields {sorted(got - names)}")
        return cls(**{**d, "mean": tuple(d["mean"]), "std": tuple(d["std"]),
                      "singular_values": tuple(d["singular_values"])})


@dataclass(frozen=True)
class EncoderInfo:
    """One encoder of a bundle: its graph file per precision (int8: None when none could be
    made), the precision served by default and why, the int8 graph's parity with float32
    on validation classes (training.cdk.quantize.Parity's fields) and the forward times
    measured when the bundle was written."""

    graphs: dict[str, str | None]
    precision: str
    why: str
    parity: dict | None = None
    timing_ms: dict[str, float] | None = None


def _check_modality(modality: str) -> None:
    if modality not in MODALITIES:
        raise ValueError(f"modality must be one of {MODALITIES}, got {modality!r}")


class Bundle:
    """A model bundle opened for reading: ``inference``, ``encoders``, ``training`` (where
    it was trained: data, split, classes, feature cache), ``sha256`` (its identity).

    It embeds the way index and service need: ``preprocess`` images, ``encoder(name)`` (an
    ONNX Runtime graph), ``embedder()`` (the PyTorch modules, built on first use)."""

    def __init__(self, path: Path, doc: dict, sha256: str):
        self.path, self.sha256 = path, sha256
        source = str(path)
        self.inference = Inference.from_dict(doc.get("inference"), source)
        self.encoders = {name: EncoderInfo(**info) for name, info in doc["encoders"].items()}
        self.files: dict[str, dict] = dict(doc["files"])
        self.training: dict = dict(doc.get("training") or {})
        self.created: str = str(doc.get("created", ""))
        inf = self.inference
        self._mean, self._std = inf.mean, inf.std
        self._embedders: dict = {}

    # -- opening ---------------------------------------------------------------------------

    @classmethod
    def open(cls, path: str | Path) -> Bundle:
        """The bundle at ``path`` (a folder with model.json); BundleError when it is not a
        complete bundle of this format (FileNotFoundError when there is nothing there)."""
        path = Path(path)
        doc_path = path / MODEL_FILE
        if not doc_path.is_file():
            if path.is_file():
                raise BundleError(
                    f"{str(path)!r} is a file, not a model bundle folder; a training "
                    f"checkpoint becomes a bundle with {rebuild_command()}")
            raise FileNotFoundError(f"no model bundle at {str(path)!r} (no {MODEL_FILE}); "
                                    "train one with python -m training.cdk")
        data = doc_path.read_bytes()
        try:
            doc = json.loads(data)
        except json.JSONDecodeError as err:
            raise BundleError(f"{str(doc_path)!r} is not valid JSON: {err}") from err
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise BundleError(f"{str(doc_path)!r} is not a sketchsvd model bundle")
        if doc.get("version") != VERSION:
            raise BundleError(
                f"{str(path)!r} is a model bundle of version {doc.get('version')!r}; this code "
                f"reads version {VERSION}. Write it again: {rebuild_command(path)}")
        missing = [k for k in ("inference", "encoders", "files") if k not in doc]
        if missing:
            raise BundleError(f"{str(doc_path)!r} lacks {missing}; write it again: "
                              f"{rebuild_command(path)}")
        try:
            return cls(path, doc, hashlib.sha256(data).hexdigest())
        except TypeError as err:  # an encoder entry with other fields
            raise BundleError(f"{str(doc_path)!r}: {err}; write it again: "
                              f"{rebuild_command(path)}") from err

    def read(self, name: str) -> bytes:
        """The bytes of the bundle's file ``name``, checked against the size and sha256
        model.json lists for it (BundleError names a changed or missing file)."""
        entry = self.files.get(name)
        if entry is None:
            raise BundleError(f"model bundle {str(self.path)!r} lists no file {name!r}")
        path = self.path / name
        try:
            data = path.read_bytes()
        except OSError as err:
            raise BundleError(f"model bundle {str(self.path)!r}: cannot read {name}: {err}; "
                              f"write it again: {rebuild_command(self.path)}") from err
        if len(data) != entry["bytes"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise BundleError(f"model bundle {str(self.path)!r}: {name} is not the file "
                              f"{MODEL_FILE} lists (changed since the bundle was written); "
                              f"write it again: {rebuild_command(self.path)}")
        return data

    # -- what the embeddings are -----------------------------------------------------------

    @property
    def backbone(self) -> str:
        return self.inference.backbone

    @property
    def width(self) -> int:
        return self.inference.width

    @property
    def modes(self) -> int:
        return self.inference.modes

    @property
    def raw_dims(self) -> int:
        return self.inference.raw_dims

    @property
    def singular_values(self) -> torch.Tensor:
        return torch.tensor(self.inference.singular_values, dtype=torch.float32)

    def size_of(self, modality: str) -> int:
        """The side ``modality``'s images are resized to (H = W) before the backbone."""
        return self.inference.size_of(modality)

    def preprocess(self, images: list[Image.Image], modality: str) -> torch.Tensor:
        """PIL images (any mode; transparent pixels -> white) -> (N, 3, S, S) float32 on
        the CPU, S = ``size_of(modality)``."""
        return images_to_tensor(images, self.size_of(modality), self._mean, self._std)

    def transform(self, modality: str = "photo"):
        """``preprocess`` of ``modality`` as a picklable function (DataLoader workers)."""
        return functools.partial(images_to_tensor, size=self.size_of(modality),
                                 mean=self._mean, std=self._std)

    # -- running it ------------------------------------------------------------------------

    def encoder_name(self, modality: str, mirror: bool | None = None) -> str:
        """The encoder that embeds ``modality``: for a side the model averages with its
        mirror image, ``mirror`` False picks the single-view graph (a BundleError where a
        bundle written before it has none; the message names the command that adds it)."""
        _check_modality(modality)
        if mirror is False and self.inference.flip_average[modality]:
            name = f"{modality}-single-view"
            if name not in self.encoders:
                raise BundleError(
                    f"model bundle {str(self.path)!r} has no {name} encoder (written by "
                    f"earlier code); write it again: {rebuild_command(self.path)}")
            return name
        return modality

    def precision_of(self, name: str, precision: str = "auto") -> str:
        """The precision encoder ``name`` runs in when ``precision`` is asked for: auto is
        the bundle's choice; int8 is a BundleError where the bundle has no int8 graph that
        holds parity (the message says why)."""
        info = self._info(name)
        if precision == "auto":
            return info.precision
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be auto or one of {PRECISIONS}, got "
                             f"{precision!r}")
        if precision == "int8" and (info.graphs.get("int8") is None or info.parity is None
                                    or not info.parity.get("holds")):
            raise BundleError(f"model bundle {str(self.path)!r} serves no int8 {name} "
                              f"encoder: {info.why}")
        return precision

    def encoder(self, name: str, precision: str = "auto", threads: int = 1):
        """Encoder ``name`` (ENCODERS) as an ONNX Runtime session on the CPU, in the
        precision ``precision_of`` gives: (N, 3, S, S) float32 -> (N, width) float32."""
        from .export import OnnxEncoder  # local: onnxruntime only where a graph runs

        chosen = self.precision_of(name, precision)
        file = self._info(name).graphs[chosen]
        return OnnxEncoder(self.read(file), modality=modality_of(name), threads=threads,
                           precision=chosen, width=self.width,
                           source=f"{self.path / file}")

    def weights(self) -> dict:
        """The PyTorch state of the bundle (weights.pt), checked; tensors only."""
        data = self.read(WEIGHTS_FILE)
        try:
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001 - re-raised with the file named
            raise BundleError(f"{str(self.path / WEIGHTS_FILE)!r} is unreadable: {err}") \
                from err

    def hubness_sample(self) -> torch.Tensor:
        """(S, width) float32: the training sketches' embeddings the hubness correction
        scores photos against (model.hubness; an empty (0, width) when the model has none)."""
        import numpy as np

        if HUBNESS_FILE not in self.files:
            return torch.zeros(0, self.width)
        sample = np.load(io.BytesIO(self.read(HUBNESS_FILE)), allow_pickle=False)
        if sample.ndim != 2 or sample.shape[1] != self.width:
            raise BundleError(f"{str(self.path / HUBNESS_FILE)!r} holds {sample.shape}, not "
                              f"(S, {self.width})")
        return torch.from_numpy(np.asarray(sample, dtype=np.float32))

    def embedder(self, device=None, sketch_flip_average: bool | None = None,
                 photo_flip_average: bool | None = None):
        """The PyTorch Embedder of this bundle on ``device`` (built once per arguments;
        the flip averages as in Embedder: None, as trained)."""
        from .embedder import Embedder

        key = (str(device), sketch_flip_average, photo_flip_average)
        if key not in self._embedders:
            self._embedders[key] = Embedder(self.inference, self.weights(), self.sha256,
                                            device, source=str(self.path),
                                            sketch_flip_average=sketch_flip_average,
                                            photo_flip_average=photo_flip_average)
        return self._embedders[key]

    def _info(self, name: str) -> EncoderInfo:
        if name not in self.encoders:
            raise BundleError(f"model bundle {str(self.path)!r} has no {name!r} encoder "
                              f"(it has {sorted(self.encoders)})")
        return self.encoders[name]

    def describe(self) -> str:
        """One line: where, what, which precisions."""
        parts = ", ".join(f"{n} {e.precision}" for n, e in self.encoders.items())
        return (f"{self.path} ({self.backbone}, {self.modes} modes + {self.raw_dims} raw, "
                f"{parts})")
