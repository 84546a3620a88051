"""Helpers for the training tests (importable by spawned DDP worker processes)."""

import numpy as np
import torch
from torch import nn

from training.cdk.model.backbones import IMAGENET_MEAN, IMAGENET_STD, Backbone
from training.cdk.train import TrainData


def synthetic_data(seed=0, n_cls=4, per_cls=6, dim=6) -> TrainData:
    g = torch.Generator().manual_seed(seed)
    means = torch.randn(n_cls, dim, generator=g)
    labels = np.repeat(np.arange(n_cls), per_cls)
    lab = torch.as_tensor(labels)
    sk = means[lab] + 0.5 * torch.randn(len(labels), dim, generator=g)
    ph = means[lab] + 0.5 * torch.randn(len(labels), dim, generator=g)
    return TrainData(sk, ph, labels, labels.copy())


def synthetic_backbone(dim=6) -> Backbone:
    return Backbone("synthetic", nn.Identity(), dim, IMAGENET_MEAN, IMAGENET_STD)


def ddp_worker(rank: int, world: int, init_file: str, cfg, out_dir: str) -> None:
    import torch.distributed as dist

    from training.cdk.train import train

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        train(cfg, synthetic_data(), synthetic_backbone(), out_dir, device="cpu")
    finally:
        dist.destroy_process_group()
