"""Where a training step's inputs come from, and the model they go through.

``PairModel`` maps (sketch inputs, photo inputs) to (f, g). The inputs are the cached
frozen backbone features (``FeatureInputs``), or, when fine-tuning, the images
(``ImageInputs``: decoded and augmented by a seeded DataLoader, run through the frozen
trunk, or read from its activation cache). Both give ``steps(batches, epoch)`` for the
training loop and ``outputs(model, seed, sampler)`` for the spectrum pass.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader

from .finetune import Split, StepImages, step_loader, trunk_cache
from .finetune import set_train_mode as set_backbone_train_mode
from .model.backbones import Backbone
from .model.heads import MODALITIES, Head

__all__ = ["PairModel", "set_train_mode", "FeatureInputs", "ImageInputs", "head_outputs"]

SUBSET = 1024  # images per modality of the spectrum pass while the backbones train


class PairModel(nn.Module):
    """(sketch inputs, photo inputs) -> (f (B, modes), g (B, modes)). Inputs are backbone
    features, or, when backbones are given, the input of their trainable stages (images
    when the whole backbone trains; cached or no-grad trunk activations otherwise)."""

    def __init__(self, heads: dict[str, Head], backbones: dict[str, nn.Module] | None,
                 splits: dict[str, Split] | None = None):
        super().__init__()
        self.heads = nn.ModuleDict(heads)
        self.backbones = nn.ModuleDict(backbones) if backbones else None
        self.splits = splits

    def encode(self, x: torch.Tensor, modality: str,
               input_scale: torch.Tensor | None = None) -> torch.Tensor:
        if self.backbones is not None:
            x = self.splits[modality].tail(x)
        return self.heads[modality](x, input_scale)

    def forward(self, xs: torch.Tensor, ys: torch.Tensor, scales=(None, None)):
        """scales: the heads' input dropout factors (sketch, photo), each (B, D) or None."""
        return self.encode(xs, "sketch", scales[0]), self.encode(ys, "photo", scales[1])


def set_train_mode(model: PairModel) -> None:
    """Training mode, except the backbones' frozen trunks and BatchNorm layers."""
    model.train()
    if model.backbones is not None:
        for m in MODALITIES:
            set_backbone_train_mode(model.backbones[m], model.splits[m])


@torch.no_grad()
def head_outputs(head: Head, x: torch.Tensor) -> torch.Tensor:
    """(N, D) features -> (N, modes) float32 head outputs on the CPU, in chunks."""
    return torch.cat([head(x[i : i + 8192]).float() for i in range(0, len(x), 8192)]).cpu()


class FeatureInputs:
    """The frozen path: a batch is the cached features (N, D) per modality at its rows."""

    def __init__(self, feats: dict[str, torch.Tensor], model: PairModel):
        self.feats, self.device = feats, feats["sketch"].device

    def steps(self, batches, epoch: int):
        """(sketch features, photo features) of each (sketch idx, photo idx) batch."""
        for s, p in batches:
            s, p = s.to(self.device), p.to(self.device)
            yield self.feats["sketch"][s], self.feats["photo"][p]

    def outputs(self, model: PairModel, seed: int, sampler):
        """([(S, modes), (P, modes)] on every training image, {modality: None} (all rows))."""
        model.eval()
        return ([head_outputs(model.heads[m], self.feats[m]) for m in MODALITIES],
                {m: None for m in MODALITIES})


class ImageInputs:
    """The fine-tuning path: the images of each step, decoded by a DataLoader (``workers``
    processes) and augmented when asked; with a frozen trunk (K > 0) they run through it
    without gradients, or, unaugmented, come from the trunk cache (computed once, also
    kept in ``cache_dir``; ``cache`` False skips it, for a run that will take no step)."""

    def __init__(self, files: dict[str, list], backbone: Backbone, model: PairModel,
                 image_size: int, augment: bool, seed: int, workers: int,
                 cache_dir: str | None, device, cache: bool = True):
        self.files, self.splits, self.device, self.workers = files, model.splits, device, workers
        self.K = self.splits["sketch"].K
        self.images = StepImages(files["sketch"], files["photo"], image_size, backbone.mean,
                                 backbone.std, augment, seed)
        self.plain = StepImages(files["sketch"], files["photo"], image_size, backbone.mean,
                                backbone.std, False, seed)
        self.cache = None
        if cache and self.K > 0 and not augment:
            # the trunks of both modalities hold the same frozen weights: one cache each
            self.cache = {m: trunk_cache(self.splits[m], self.files[m], backbone, image_size,
                                         device, cache_dir, desc=f"trunk cache ({m}s)")
                          for m in MODALITIES}

    def steps(self, batches, epoch: int):
        """(sketch inputs, photo inputs) of each (sketch idx, photo idx) batch."""
        if self.cache is not None:
            for s, p in batches:
                yield (self.cache["sketch"][s].to(self.device),
                       self.cache["photo"][p].to(self.device))
            return
        loader = step_loader(self.images, batches, epoch, self.workers)
        for (s, _), x in zip(batches, loader, strict=True):
            x = x.to(self.device)
            xs, ys = x[: len(s)], x[len(s) :]
            if self.K > 0:
                with torch.no_grad(), self._autocast():
                    xs, ys = self.splits["sketch"].trunk(xs), self.splits["photo"].trunk(ys)
            yield xs, ys

    def _autocast(self):
        return torch.autocast(self.device.type, enabled=self.device.type == "cuda")

    @torch.no_grad()
    def features(self, modality: str, idx=None) -> torch.Tensor:
        """(n, D) pooled features of the training images ``idx`` (default all) with the
        current backbone in eval mode, without augmentation (what evaluation sees)."""
        files = self.files[modality]
        idx = list(range(len(files))) if idx is None else list(idx)
        split, out = self.splits[modality], []
        chunks = [idx[i : i + 64] for i in range(0, len(idx), 64)]
        images = None
        if self.cache is None:
            # decoded by the loader's workers, unaugmented: the same tensors as decoding here
            mod = MODALITIES.index(modality)
            images = iter(DataLoader(self.plain, num_workers=self.workers,
                                     batch_sampler=[[(mod, j, 0) for j in c] for c in chunks]))
        for chunk in chunks:
            with self._autocast():
                if images is None:
                    x = self.cache[modality][chunk].to(self.device)
                else:
                    x = split.trunk(next(images).to(self.device))
                out.append(split.tail(x).float())
        return torch.cat(out)

    def outputs(self, model: PairModel, seed: int, sampler):
        """The heads' outputs on a seeded subset of at most SUBSET sketches and SUBSET
        photos (their own photos under instance pairing, and with them under a share of
        instance pairs), to bound the cost, and the rows
        they are at ({modality: indices})."""
        model.eval()
        idx = {}
        for m in MODALITIES:
            g = torch.Generator().manual_seed(seed)
            idx[m] = torch.randperm(len(self.files[m]), generator=g)[:SUBSET]
        share = getattr(sampler, "instance_share", 0.0)
        if share == 1.0:
            idx["photo"] = torch.unique(sampler.photo_of[idx["sketch"]])
        elif share > 0:  # the class draws' photos and the sketches' own
            idx["photo"] = torch.unique(torch.cat([idx["photo"],
                                                   sampler.photo_of[idx["sketch"]]]))
        return ([head_outputs(model.heads[m], self.features(m, idx[m].tolist()))
                 for m in MODALITIES], idx)
