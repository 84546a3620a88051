"""A hubness correction at search time: cross-domain similarity local scaling (CSLS).

Conneau et al. ("Word Translation Without Parallel Data", ICLR 2018) score a pair by
2 s(x, y) - r_Y(x) - r_X(y), r_X(y) the mean similarity of y to its k nearest queries and
r_Y(x) that of x to its k nearest gallery items. r_Y(x) is the same for every photo a query
ranks, so a query's ranking is that of s(x, y) - r_X(y) / 2: photos near many queries
("hubs") go down. Here the queries' sample is a fixed set of training sketches. The photos
of the classes the heads trained on lie near those sketches, and they are the photos that
crowd the answers to a sketch of a class never seen (docs/retrieval-training.md, Retrieval
in the open world), so the correction lowers them; a photo of an unseen class is near no
training sketch and keeps its score.

    s'(x, y) = s(x, y) - weight * mean of the k best s(x_j, y), x_j in the sample

The penalty is one number per stored photo, so it is one more coordinate of the stored
vector (minus the penalty) and of the query (1): a flat inner-product index ranks by s'
and a query expanded with its best photos (model.smoothing) carries the coordinate along.
It is computed on the full width; a d-prefix query (dims=d) does not read it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Hubness", "photo_penalty", "with_penalty"]


@dataclass(frozen=True)
class Hubness:
    """k nearest sample sketches per photo, and the weight of their mean score (0: off;
    CSLS's own is 0.5)."""

    k: int = 10
    weight: float = 0.5

    def __post_init__(self):
        if not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"hubness k must be an integer >= 1, got {self.k!r}")
        if not self.weight >= 0:
            raise ValueError(f"hubness weight must be >= 0, got {self.weight!r}")

    @property
    def active(self) -> bool:
        return self.weight > 0

    def as_dict(self) -> dict:
        return {"k": self.k, "weight": self.weight}


@torch.no_grad()
def photo_penalty(g: torch.Tensor, sample: torch.Tensor, cfg: Hubness,
                  chunk: int = 4096) -> torch.Tensor:
    """(N,) float32: weight x the mean of each photo's k best inner products with the
    sketches of ``sample`` (S, width), for photos g (N, width) as they are stored."""
    if len(sample) == 0:
        raise ValueError("the hubness correction needs a sample of at least one sketch")
    if sample.shape[1] != g.shape[1]:
        raise ValueError(f"sample width {sample.shape[1]} differs from the photos' "
                         f"{g.shape[1]}")
    k = min(cfg.k, len(sample))
    s = torch.as_tensor(sample).double()
    out = [(torch.as_tensor(g[i : i + chunk]).double() @ s.T).topk(k, dim=1).values.mean(1)
           for i in range(0, len(g), chunk)]
    return (cfg.weight * torch.cat(out)).float() if out else torch.zeros(0)


def with_penalty(f: torch.Tensor, g: torch.Tensor, penalty: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries f (Q, w) and photos g (N, w) with the one more coordinate that makes their
    inner product s - penalty: (Q, w + 1) with 1, (N, w + 1) with -penalty (N,)."""
    f, g = torch.as_tensor(f).float(), torch.as_tensor(g).float()
    if penalty.shape != (len(g),):
        raise ValueError(f"penalty must be one number per photo ({len(g)}), got shape "
                         f"{tuple(penalty.shape)}")
    return (torch.cat([f, torch.ones(len(f), 1)], 1),
            torch.cat([g, -penalty.float()[:, None]], 1))
