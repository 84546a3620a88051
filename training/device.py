"""Device choice shared by every entry point: CUDA when present, else CPU."""

from __future__ import annotations

import torch


def pick_device(name: str | torch.device | None = None) -> torch.device:
    """``None``, ``""`` or ``"auto"``: CUDA if available, else CPU; anything else as given."""
    if name is None or name in ("", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)
