"""The training step's parameter update in one fused pass per tensor: RMSprop (as
``torch.optim.RMSprop`` with its defaults: no momentum, not centred, no weight decay) and
the exponential moving average of the parameters, compiled by ``torch.compile``
(``--fused-update true``, CPU only).

Why: at the paper architecture (4.5M parameters) the update is memory-bound. RMSprop runs
five passes over its tensors and the EMA a sixth, ~290 MB per step, 11 ms of a 56 ms step
at batch 128 on one thread here; fused, each tensor is read and written once (3.5 ms).
The state stays ``torch.optim.RMSprop``'s (``square_avg`` and ``step`` per parameter, the
learning rate from its param group, which the schedule sets), so checkpoints are the same
either way. Needs a C++ compiler the first time (inductor; seconds, cached on disk after);
without one it warns and runs the same arithmetic uncompiled.
"""

from __future__ import annotations

import logging

import torch

__all__ = ["FusedUpdate"]

log = logging.getLogger(__name__)


def _rmsprop_ema(p, g, sq, ema, lr, alpha: float, eps: float, ema_weight: float):
    # the same arithmetic as torch.optim.RMSprop's single-tensor step, then the EMA's lerp
    sq.mul_(alpha).addcmul_(g, g, value=1 - alpha)
    p.sub_(lr * (g / (sq.sqrt() + eps)))
    ema.lerp_(p, ema_weight)


class FusedUpdate:
    """optimizer.step() and the EMA ``ema_params.lerp_(params, 1 - ema_decay)`` in one
    compiled pass per parameter. ``step()`` does both. Where torch.compile fails,
    ``compile_error`` says why and the same arithmetic runs uncompiled (a warning unless
    ``warn`` is false)."""

    def __init__(self, optimizer: torch.optim.RMSprop, ema_params, ema_decay: float,
                 warn: bool = True):
        if not isinstance(optimizer, torch.optim.RMSprop) or len(optimizer.param_groups) != 1:
            raise ValueError("the fused update is for a torch.optim.RMSprop of one group")
        group = optimizer.param_groups[0]
        plain = dict(momentum=0, centered=False, weight_decay=0, maximize=False)
        if any(group.get(k, v) != v for k, v in plain.items()):
            raise ValueError(f"the fused update needs RMSprop with {plain}")
        self.optimizer, self.params = optimizer, group["params"]
        self.ema = list(ema_params)
        if len(self.ema) != len(self.params):
            raise ValueError("ema_params must match the optimizer's parameters one to one")
        self.alpha, self.eps, self.ema_weight = group["alpha"], group["eps"], 1 - ema_decay
        # a tensor, as lr changes every step (a float would be compiled in); float64, as
        # torch's RMSprop takes it, cast to the parameters' dtype by type promotion
        self._lr = torch.zeros((), dtype=torch.float64)
        self._fn = torch.compile(_rmsprop_ema, fullgraph=True)
        self.compile_error = ""  # why torch.compile failed ("" when it works)
        try:  # compile now (on two elements), so that a missing compiler shows here
            t = [torch.zeros(2) for _ in range(4)]
            self._fn(*t, self._lr, self.alpha, self.eps, self.ema_weight)
        except Exception as e:  # noqa: BLE001 (inductor's errors have no common type)
            self.compile_error = f"{type(e).__name__}: {str(e)[:200]}"
            if warn:  # (else the caller says what it does instead)
                log.warning("--fused-update: torch.compile failed (%s); the same update runs "
                            "uncompiled, in several passes", self.compile_error)
            self._fn = _rmsprop_ema

    @torch.no_grad()
    def step(self) -> None:
        self._lr.fill_(self.optimizer.param_groups[0]["lr"])
        self.optimizer._opt_called = True  # what the lr schedule checks to know it stepped
        for p, e in zip(self.params, self.ema, strict=True):
            if p.grad is None:
                continue
            state = self.optimizer.state[p]
            if not state:  # as torch.optim.RMSprop initialises it
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["square_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            self._fn(p.view(-1), p.grad.view(-1), state["square_avg"].view(-1), e.view(-1),
                     self._lr, self.alpha, self.eps, self.ema_weight)
