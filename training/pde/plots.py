"""PNG figures: learned vs analytic eigenfunctions (aligned), the orthogonality matrix,
and the relative eigenvalue error per mode for one or several methods."""

from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from training.files import atomic_savefig  # noqa: E402

__all__ = ["eigenfunctions", "plot_gram", "errors_per_mode", "radial_profiles", "slices"]


def eigenfunctions(learned, truth, half_width: float, path, title: str = "") -> None:
    """learned, truth: (n, n, k) on [-h, h]^2; rows alternate learned / truth, 8 modes a row."""
    learned, truth = np.asarray(learned), np.asarray(truth)
    k = truth.shape[-1]
    per_row = min(k, 8)
    blocks = math.ceil(k / per_row)
    fig, axes = plt.subplots(
        2 * blocks, per_row, figsize=(1.6 * per_row, 3.4 * blocks), squeeze=False
    )
    ext = [-half_width, half_width, -half_width, half_width]
    for ax in axes.flat:
        ax.axis("off")
    for i in range(k):
        b, c = divmod(i, per_row)
        vmax = np.abs(truth[..., i]).max() or 1.0
        for r, (img, label) in enumerate([(learned, "learned"), (truth, "truth")]):
            ax = axes[2 * b + r, c]
            ax.imshow(img[..., i], extent=ext, origin="lower", cmap="RdBu_r",
                      vmin=-vmax, vmax=vmax)
            ax.set_title(f"{label} {i}", fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    atomic_savefig(fig, path, dpi=110)


def plot_gram(gram, path, title: str = "") -> None:
    """gram: (L, L) inner products of the normalised learned functions."""
    fig, ax = plt.subplots(figsize=(4, 3.4))
    im = ax.imshow(np.asarray(gram), cmap="RdBu_r", vmin=-1, vmax=1)
    fig.colorbar(im, ax=ax)
    ax.set_title(title or "<psi_i, psi_j>", fontsize=9)
    fig.tight_layout()
    atomic_savefig(fig, path, dpi=110)


def errors_per_mode(errors: dict, path, title: str = "") -> None:
    """errors: method -> relative eigenvalue errors per mode (in learned order)."""
    fig, ax = plt.subplots(figsize=(7, 3))
    n = len(errors)
    for j, (name, err) in enumerate(errors.items()):
        err = np.maximum(np.asarray(err, dtype=float), 1e-12)
        x = np.arange(len(err)) + (j - (n - 1) / 2) * 0.8 / max(n, 1)
        ax.bar(x, err, width=0.8 / max(n, 1), label=name)
    ax.set_yscale("log")
    ax.set_xlabel("mode")
    ax.set_ylabel("relative error of eigenvalue")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    atomic_savefig(fig, path, dpi=110)


def radial_profiles(r, learned, truth, panels: dict, names, path, title: str = "") -> None:
    """r: (R,); learned, truth: (R, K) radial parts; panels: panel title -> the columns it
    shows (one line each, learned dashed over the analytic solid line); names: per column."""
    r, learned, truth = (np.asarray(v) for v in (r, learned, truth))
    cols = min(len(panels), 3)
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 2.7 * rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    for ax, (name, ks) in zip(axes.flat, panels.items(), strict=False):
        for i, k in enumerate(ks):
            color = f"C{i}"
            ax.plot(r, r * truth[:, k], color=color, lw=2.2, alpha=0.45,
                    label="analytic" if i == 0 else None)
            ax.plot(r, r * learned[:, k], color=color, lw=1.0, ls="--", label=names[k])
        ax.axhline(0, color="k", lw=0.5)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("r", fontsize=8)
        ax.legend(fontsize=6)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    atomic_savefig(fig, path, dpi=110)


def slices(learned: list, truth: list, half_widths: list, titles: list, path,
           title: str = "") -> None:
    """Images of planar slices, learned above truth, one column per function; each (n, n)
    on [-h, h]^2 with its own half-width h."""
    k = len(truth)
    fig, axes = plt.subplots(2, k, figsize=(1.5 * k, 3.4), squeeze=False)
    for c in range(k):
        vmax = float(np.abs(np.asarray(truth[c])).max()) or 1.0
        ext = [-half_widths[c], half_widths[c], -half_widths[c], half_widths[c]]
        for row, img in enumerate((learned[c], truth[c])):
            ax = axes[row, c]
            ax.imshow(np.asarray(img), extent=ext, origin="lower", cmap="RdBu_r",
                      vmin=-vmax, vmax=vmax)
            ax.set_xticks([])
            ax.set_yticks([])
        axes[0, c].set_title(titles[c], fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    atomic_savefig(fig, path, dpi=110)
