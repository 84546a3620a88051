"""The parts of fine-tuning a backbone that the frozen path does not need: where a backbone
splits into a frozen trunk and trainable stages, the BatchNorm policy, the images of each
step (decoded and augmented by a seeded DataLoader), and the trunk-activation cache.

The stages are the backbone's own (``model.backbones.BackboneSpec.stages``: the blocks of
an EfficientNet-Lite, whose final 1x1 conv trains with them; the five conv stages of
VGG16). ``trainable_stages = K`` trains the last K; 0 trains the whole backbone.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from training.images import ImageError, images_to_tensor, load_image

from .features import cache_key, cached_tensor
from .model.backbones import Backbone, spec_of

__all__ = ["Split", "set_train_mode", "validate_images", "StepImages", "step_loader",
           "trunk_cache"]


class Split:
    """``module`` (a backbones.PooledFeatures of backbone ``name``) as
    tail(trunk(x)) == module(x), with the last ``K`` of the backbone's stages (and its
    head) in the tail (K = 0: the trunk is the identity and the whole backbone trains)."""

    def __init__(self, module: nn.Module, name: str, K: int):
        spec = spec_of(name)
        if not 0 <= K <= spec.stage_count:
            raise ValueError(f"trainable_stages must be in 0..{spec.stage_count} for {name}, "
                             f"got {K}")
        self.module, self.name, self.K = module, name, K
        stages = spec.stages(module.trunk)
        first = len(stages.blocks) - K
        # the modules that stay fixed: they hold the trunk's own layers
        self.frozen = [] if K == 0 else [stages.stem, *stages.blocks[:first]]
        self._tail = [*stages.blocks[first:], stages.head]

    def freeze(self) -> None:
        """The trunk's parameters stop receiving gradients."""
        for m in self.frozen:
            m.requires_grad_(False)

    def trunk(self, x: torch.Tensor) -> torch.Tensor:
        """(N, 3, H, W) images -> the input of the trainable stages."""
        for m in self.frozen:
            x = m(x)
        return x

    def tail(self, x: torch.Tensor) -> torch.Tensor:
        """The trunk's output -> (N, D) pooled features."""
        if self.K == 0:
            return self.module(x)
        for m in self._tail:
            x = m(x)
        return self.module.pool(x)


def set_train_mode(module: nn.Module, split: Split) -> None:
    """Training mode for the trainable stages only; every BatchNorm layer stays in eval
    mode with the pretrained running statistics (its affine weights still train)."""
    module.train()
    for m in split.frozen:
        m.eval()
    for m in module.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.eval()


def validate_images(files, desc: str = "checking images") -> None:
    """Decode every file once; ImageError names the first unreadable or truncated one."""
    for f in tqdm(files, desc=desc, unit="img", leave=False):
        try:
            load_image(f)
        except ImageError as err:
            raise ImageError(f"training image {str(f)!r} cannot be used: {err}") from err


def _item_seed(seed: int, epoch: int, modality: int, index: int) -> int:
    key = f"{seed}|{epoch}|{modality}|{index}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "little") & ((1 << 63) - 1)


def _transforms(size: int, mean, std):
    from torchvision.transforms import v2

    tail = [v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std)]
    sketch = v2.Compose([
        v2.RandomResizedCrop(size, scale=(0.8, 1.0), antialias=True),
        v2.RandomHorizontalFlip(),
        v2.RandomAffine(degrees=10, translate=(0.05, 0.05), fill=255),  # white paper
        *tail])
    photo = v2.Compose([
        v2.RandomResizedCrop(size, scale=(0.8, 1.0), antialias=True),
        v2.RandomHorizontalFlip(),
        v2.ColorJitter(brightness=0.2, contrast=0.2, saturation=0.2, hue=0.02),
        *tail])
    return sketch, photo


class StepImages(Dataset):
    """Item (modality 0 sketch / 1 photo, index, epoch) -> (3, size, size) normalised image.
    Augmented views are seeded by (seed, epoch, modality, index) alone, so they do not
    depend on the worker count or on where a run was resumed."""

    def __init__(self, sketch_files, photo_files, size: int, mean, std, augment: bool,
                 seed: int):
        self.files = (list(sketch_files), list(photo_files))
        self.size, self.mean, self.std = size, tuple(mean), tuple(std)
        self.augment, self.seed = augment, seed
        self._tf = _transforms(size, mean, std) if augment else None

    def __len__(self) -> int:
        return len(self.files[0]) + len(self.files[1])

    def __getitem__(self, key) -> torch.Tensor:
        mod, idx, epoch = key
        im = load_image(self.files[mod][idx])
        if not self.augment:
            return images_to_tensor([im], self.size, self.mean, self.std)[0]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(_item_seed(self.seed, epoch, mod, idx))
            return self._tf[mod](im)


CHUNK = 256  # images per DataLoader item: bounds the memory in flight at any batch size


def step_loader(images: StepImages, batches, epoch: int, workers: int):
    """One epoch of steps: each yields (2B, 3, H, W), the B sketches then the B photos of
    ``batches`` (pairs of index tensors). The loader's items are chunks of at most CHUNK
    images, so a batch of 4096 pairs never sits whole in one worker's memory."""
    keys, sizes = [], []
    for s, p in batches:
        step = [(0, int(i), epoch) for i in s] + [(1, int(j), epoch) for j in p]
        chunks = [step[i : i + CHUNK] for i in range(0, len(step), CHUNK)]
        keys += chunks
        sizes.append(len(chunks))
    # its own generator: the loader's base seed must not consume the global RNG (which
    # drives drop-connect in the trainable stages)
    loader = iter(DataLoader(images, batch_sampler=keys, num_workers=workers,
                             generator=torch.Generator().manual_seed(epoch)))
    for n in sizes:
        yield torch.cat([next(loader) for _ in range(n)])


@torch.no_grad()
def _trunk_outputs(split: Split, files, size: int, mean, std, device, batch_size: int,
                   desc: str) -> torch.Tensor:
    out = []
    was = [m.training for m in split.frozen]
    for m in split.frozen:
        m.eval()
    for i in tqdm(range(0, len(files), batch_size), desc=desc, unit="batch", leave=False):
        x = images_to_tensor([load_image(Path(f)) for f in files[i : i + batch_size]],
                             size, mean, std).to(device)
        out.append(split.trunk(x).float().cpu())
    for m, w in zip(split.frozen, was, strict=True):
        m.train(w)
    return torch.cat(out)


def trunk_cache(split: Split, files, backbone: Backbone, size: int, device,
                cache_dir: str | Path | None = None, batch_size: int = 64,
                desc: str = "trunk cache") -> torch.Tensor:
    """The trunk's output (N, C, h, w) for every file (no augmentation, eval mode), on the
    CPU: computed once, each step then runs only the trainable stages. With ``cache_dir``
    it is also kept on disk, keyed like the feature cache (backbone, weights, size, files)
    plus the stage split, so later runs with the same trunk skip the pass."""
    files = [Path(f) for f in files]
    key, path = "", None
    if cache_dir is not None:
        key = cache_key(files, backbone, split.module, size) + f"|trunk-{split.K}"
        digest = hashlib.sha256(key.encode()).hexdigest()[:24]
        path = Path(cache_dir) / f"{backbone.name}-{size}-trunk{split.K}-{digest}.pt"
    return cached_tensor(path, key, files, (len(files),), 4, lambda: _trunk_outputs(
        split, files, size, backbone.mean, backbone.std, device, batch_size, desc),
        what="trunk activations")
