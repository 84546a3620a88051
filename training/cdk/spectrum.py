"""The learned spectrum during training: the CDK's Rayleigh quotients of the learned pairs
on the training set (the estimate the modes are ordered by), the norms' estimate beside
them, the held-out check of their order, and the final sort of the modes."""

from __future__ import annotations

import torch

from ..loss import cdk_singular_values, singular_values
from .metrics import heldout_order
from .model.heads import MODALITIES

__all__ = ["spectrum", "sort_modes"]


def _quotients(out: list[torch.Tensor], idx: dict, sampler) -> torch.Tensor:
    joint = sampler.joint_moment(out[0], out[1], idx["sketch"], idx["photo"])
    weights = sampler.photo_marginal(idx["sketch"], idx["photo"])
    return cdk_singular_values(out[0], out[1], joint, weights).float()


@torch.no_grad()
def spectrum(model, sampler, inputs, seed: int, heldout: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor, dict | None]:
    """(sigma, sigma_norm, held), sigma and sigma_norm (modes,) on the training rows that
    ``inputs.outputs`` embeds: sigma the CDK's Rayleigh quotients
    (training.loss.cdk_singular_values, with the joint moment of ``sampler``'s p(x, y)),
    sigma_norm = sqrt(E f_l(X)^2 E g_l(Y)^2); the photos' moments are taken under the
    kernel's photo marginal (``sampler.photo_marginal``: the photos as the batches draw
    them), which is not uniform over the photos under instance pairing (a photo with more
    sketches is drawn more often) nor under class pairing with classes of unequal
    sketch-to-photo ratios. With ``heldout``, held is
    metrics.heldout_order of the quotients read on two halves of the same rows
    (PairSampler.halves): is the modes' order a property of the functions, or of the sample
    that estimated it? Else None. Leaves the model in eval mode."""
    out, idx = inputs.outputs(model, seed, sampler)
    held = None
    if heldout:
        halves = []
        for s_pos, p_pos in sampler.halves(idx["sketch"], idx["photo"]):
            rows = {m: (pos if idx[m] is None else idx[m][pos])
                    for m, pos in (("sketch", s_pos), ("photo", p_pos))}
            halves.append(_quotients([out[0][s_pos], out[1][p_pos]], rows, sampler))
        held = heldout_order(*halves)
    weights = sampler.photo_marginal(idx["sketch"], idx["photo"])
    return (_quotients(out, idx, sampler), singular_values(out[0], out[1], weights).float(),
            held)


def sort_modes(model, sv: torch.Tensor, sv_norm: torch.Tensor | None):
    """Both heads' coordinates reordered by decreasing Rayleigh quotient (stable, so an
    ordered run is unchanged): coordinate l is then the mode with the l-th largest
    estimated singular value. Returns sv and sv_norm in the new order, and the
    permutation (coordinate l was mode perm[l])."""
    perm = torch.argsort(sv, descending=True, stable=True)
    for m in MODALITIES:
        model.heads[m].permute_modes(perm)
    return sv[perm], None if sv_norm is None else sv_norm[perm], perm
