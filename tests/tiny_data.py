"""Tiny generated sketch/photo folders for the benchmarks' and research scripts' smoke runs."""

from pathlib import Path

import numpy as np
from PIL import Image


def tiny_paired(root: Path) -> tuple[Path, Path]:
    """7 classes of 4 generated sketch/photo pairs under ``root`` (dark strokes on white;
    colour fields; sketch ``<photo>-1.png`` drawn from photo ``<photo>.png``) and a split
    file naming 2 test classes: 5 others, 2 of which the split holds out for validation.
    Returns (root, split file)."""
    rng = np.random.default_rng(0)
    classes = [f"class{c}" for c in range(7)]
    for c, name in enumerate(classes):
        for mod in ("sketch", "photo"):
            (root / mod / name).mkdir(parents=True)
        for i in range(4):
            sketch = np.full((40, 40, 3), 255, np.uint8)
            r = int(rng.integers(4, 30))
            sketch[r : r + 3, 4 + c : 36] = 0
            sketch[4:36, (r + 5 * c) % 34 : (r + 5 * c) % 34 + 3] = 0
            photo = (rng.random((40, 40, 3)) * 60).astype(np.uint8)
            photo[..., c % 3] += 40 * (1 + c // 3)
            Image.fromarray(sketch).save(root / "sketch" / name / f"{name}{i}-1.png")
            Image.fromarray(photo).save(root / "photo" / name / f"{name}{i}.png")
    split = root / "split.txt"
    split.write_text("class5\nclass6\n")
    return root, split
