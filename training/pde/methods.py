"""Learning methods registered by name: (f~, T f~ / sqrt(w), params) -> (loss, eigenvalue
estimates (L,)); loss.backward() gives the method's parameter update direction."""

from __future__ import annotations

from collections.abc import Callable

import torch

from training.loss import eigenvalues, evd_loss, nesting_masks
from training.pde.baselines import NeuralEF, SpIN

__all__ = ["METHODS", "NestedLoRA", "make_method"]


class NestedLoRA:
    """NeuralSVD for a self-adjoint operator: the NestedLoRA objective of ``training.loss``
    (sequential, joint or no nesting); eigenvalues are the norms E[f~^2] = <f, f>."""

    def __init__(self, modes: int, nesting: str):
        self.vector_mask, self.matrix_mask = nesting_masks(modes, nesting)

    def __call__(self, ft: torch.Tensor, Tft: torch.Tensor, params=None):
        return evd_loss(ft, Tft, self.vector_mask, self.matrix_mask), eigenvalues(ft.detach())

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


METHODS: dict[str, Callable[..., object]] = {
    "neuralsvd-seq": lambda L, cfg: NestedLoRA(L, "sequential"),
    "neuralsvd-jnt": lambda L, cfg: NestedLoRA(L, "joint"),
    "lora": lambda L, cfg: NestedLoRA(L, "none"),
    "neuralef": lambda L, cfg: NeuralEF(L),
    "spin": lambda L, cfg: SpIN(L, decay=cfg.spin_decay),
}


def make_method(name: str, modes: int, config):
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; choose from {list(METHODS)}")
    return METHODS[name](modes, config)
