"""PNG plots of a retrieval run: the structure curves, the learned spectrum and a gallery
of top-k results. Scores follow the Embedder convention (see ``metrics``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from training.files import atomic_savefig

__all__ = ["plot_structure", "plot_spectrum", "plot_gallery"]


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_structure(curves: dict[str, dict], path: str | Path, metric: str = "map_all") -> Path:
    """curves: label -> {d: metrics}; one line per label, log2 d on the x axis."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 4))
    styles = ["-o", "--s", ":^", "-.v", "-x"]
    for (label, c), st in zip(curves.items(), styles * 4, strict=False):
        ds = sorted(c)
        ax.plot(ds, [c[d][metric] for d in ds], st, label=label, ms=4)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("number of modes d")
    ax.set_ylabel({"map_all": "mAP@all", "precision_at_k": "P@K"}.get(metric, metric))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return atomic_savefig(fig, path, dpi=120)


def plot_spectrum(sv, path: str | Path, sv_norm=None, sv_trained=None) -> Path:
    """sv: (L,) estimated singular values (Rayleigh quotients) against their mode index;
    sv_norm: (L,) the norms' estimate sqrt(E f^2 E g^2), drawn beside them when given;
    sv_trained: (L,) the quotients in the order the modes were trained in, when the modes
    were sorted afterwards. The second panel zooms on the top 32 modes, where the order is
    checked."""
    plt = _plt()
    sv = np.asarray(sv)
    curves = [("Rayleigh quotient <f, K g> / (|f| |g|)", sv)]
    if sv_trained is not None:
        curves.append(("the same, in the order trained (before sorting)", np.asarray(sv_trained)))
    if sv_norm is not None:
        curves.append(("sqrt(E f^2 E g^2)", np.asarray(sv_norm)))
    top = min(32, len(sv))
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for ax, n in zip(axes, (len(sv), top), strict=True):
        for label, y in curves:
            ax.plot(np.arange(1, n + 1), y[:n], ".-", ms=3, label=label)
        ax.set_xlabel("mode l")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("estimated singular value")
    axes[0].set_ylim(bottom=0)
    axes[1].set_title(f"top {top} modes", fontsize=9)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    return atomic_savefig(fig, path, dpi=120)


def plot_gallery(f, g, q_labels, g_labels, q_files, g_files, path, n_queries=6, topk=8,
                 seed=0) -> Path:
    """Grid image: each row a query sketch and its top-k photos by full inner product,
    framed green if relevant (same class) and red otherwise."""
    from training.images import load_image

    plt = _plt()
    rng = np.random.default_rng(seed)
    q_labels, g_labels = np.asarray(q_labels), np.asarray(g_labels)
    qs = rng.choice(len(f), size=min(n_queries, len(f)), replace=False)
    scores = torch.as_tensor(f[qs]).double() @ torch.as_tensor(g).double().T
    top = torch.sort(-scores, dim=1, stable=True).indices[:, :topk].numpy()
    fig, axes = plt.subplots(len(qs), topk + 1, figsize=(1.3 * (topk + 1), 1.4 * len(qs)),
                             squeeze=False)
    for r, q in enumerate(qs):
        axes[r, 0].imshow(load_image(q_files[q]).resize((96, 96)))
        axes[r, 0].set_title("query", fontsize=7)
        for c, j in enumerate(top[r], start=1):
            ax = axes[r, c]
            ax.imshow(load_image(g_files[j]).resize((96, 96)))
            ok = g_labels[j] == q_labels[q]
            for s in ax.spines.values():
                s.set_edgecolor("limegreen" if ok else "red")
                s.set_linewidth(3)
    for ax in axes.flat:
        ax.set_xticks([])
        ax.set_yticks([])
    fig.tight_layout()
    return atomic_savefig(fig, path, dpi=100)
