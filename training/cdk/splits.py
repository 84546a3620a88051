"""Zero-shot class splits of Sketchy: split 2 (Yelamarthi et al., ECCV 2018), split 1
(Shen et al. 2018 / SEM-PCYC: seeded random 80/10/10 over the sorted class list), or a
user file listing the test classes (one per line, ``#`` comments allowed)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

__all__ = ["SKETCHY2_TEST", "split_classes"]

# The 21 test classes of Sketchy split 2; the other 104 classes are for training.
SKETCHY2_TEST = (
    "bat", "cabin", "cow", "dolphin", "door", "giraffe", "helicopter", "mouse", "pear",
    "raccoon", "rhinoceros", "saw", "scissors", "seagull", "skyscraper", "songbird", "sword",
    "tree", "wheelchair", "windmill", "window",
)  # fmt: skip


def _sketchy1(classes: list[str]) -> tuple[list[str], list[str], list[str]]:
    # As in the SEM-PCYC code: the global legacy seed, then choice without replacement.
    rng_state = np.random.get_state()
    np.random.seed(0)
    try:
        all_c = np.array(sorted(classes))
        n = len(all_c)
        train = np.random.choice(all_c, int(0.8 * n), replace=False)
        rest = np.setdiff1d(all_c, train)
        valid = np.random.choice(rest, int(0.1 * n), replace=False)
        test = np.setdiff1d(rest, valid)
    finally:
        np.random.set_state(rng_state)
    return sorted(train.tolist()), sorted(valid.tolist()), sorted(test.tolist())


def _read_class_file(path: Path) -> list[str]:
    names = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.append(line)
    if not names:
        raise ValueError(f"split file {str(path)!r} lists no test classes")
    return names


def split_classes(spec: str, classes: list[str]) -> dict[str, list[str]]:
    """{"train", "valid", "test"} class lists for ``spec`` (sketchy2 | sketchy1 | FILE)
    over the dataset's ``classes``; a test class missing from the data is an error."""
    classes = sorted(classes)
    if spec == "sketchy1":
        train, valid, test = _sketchy1(classes)
        return {"train": train, "valid": valid, "test": test}
    if spec == "sketchy2":
        test = list(SKETCHY2_TEST)
    elif Path(spec).is_file():
        test = _read_class_file(Path(spec))
    else:
        raise ValueError(f"split must be sketchy2, sketchy1 or an existing file, got {spec!r}")
    missing = sorted(set(test) - set(classes))
    if missing:
        raise ValueError(f"split {spec!r}: test classes not in the data: {missing}")
    if len(set(test)) != len(test):
        raise ValueError(f"split {spec!r} lists a test class twice")
    train = [c for c in classes if c not in set(test)]
    if not train:
        raise ValueError(f"split {spec!r} leaves no training classes")
    return {"train": train, "valid": [], "test": sorted(test)}
