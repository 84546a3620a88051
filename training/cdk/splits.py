"""Zero-shot class splits of Sketchy: split 2 (Yelamarthi et al., ECCV 2018), split 1
(Shen et al. 2018 / SEM-PCYC: seeded random 80/10/10 over the sorted class list), or a
user file listing the test classes (one per line, ``#`` comments allowed); and ``none``,
which holds out no test class: every class but the validation classes trains, for a model
that serves a gallery of the classes it was trained on.

Split 2 and file splits name no validation classes, so ``validation_classes`` carves them
from the training classes by a fixed rule (no RNG): the round(n_train / 10) training
classes (halves up; 2 where that is 1) with the lowest sha256 of their UTF-8 name. The
rule looks at the training list only, so adding or removing test classes does not move
it."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

__all__ = ["NO_TEST", "SKETCHY2_TEST", "class_folds", "split_classes", "validation_classes"]

NO_TEST = "none"  # the split that holds out no test classes

# The 21 test classes of Sketchy split 2; of the other 104, validation_classes holds out 10.
SKETCHY2_TEST = (
    "bat", "cabin", "cow", "dolphin", "door", "giraffe", "helicopter", "mouse", "pear",
    "raccoon", "rhinoceros", "saw", "scissors", "seagull", "skyscraper", "songbird", "sword",
    "tree", "wheelchair", "windmill", "window",
)  # fmt: skip


def validation_classes(train: list[str]) -> list[str]:
    """The validation classes carved from the n classes ``train``, sorted: the
    round(n / 10) (halves up) names with the lowest sha256 hex digest of their UTF-8
    bytes, but 2 where that is 1 (none for n < 5). A hash, not an RNG: the choice depends
    on the names alone, not on seeds, on the order of ``train`` or on any class outside it."""
    n = (len(train) + 5) // 10  # integer round-half-up: no float or banker's rounding
    if n == 1:  # one class alone makes retrieval trivial: every photo relevant, mAP 1
        n = 2
    return sorted(_by_hash(train)[:n])


def _by_hash(names: list[str]) -> list[str]:
    return sorted(names, key=lambda c: hashlib.sha256(c.encode()).hexdigest())


def class_folds(classes: list[str], n: int) -> list[list[str]]:
    """The classes cut into n folds for cross-validation over classes, each sorted: in the
    order of validation_classes' hash (sha256 of the UTF-8 name), the i-th class goes to
    fold i mod n. Fold sizes differ by at most one; like validation_classes, the folds
    depend on the names alone. Split 2's 104 non-test classes in 5 folds give folds of 20-21
    classes, the size of its test set."""
    if not 2 <= n <= len(classes):
        raise ValueError(f"need 2 <= folds <= {len(classes)} classes, got {n}")
    if len(set(classes)) != len(classes):
        raise ValueError("a class is listed twice")
    ranked = _by_hash(list(classes))
    return [sorted(ranked[i::n]) for i in range(n)]


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
    """{"train", "valid", "test"} disjoint sorted class lists for ``spec`` (sketchy2 |
    sketchy1 | none | FILE) over the dataset's ``classes``; a test class missing from the
    data is an error. sketchy1 keeps its own validation classes; the others get
    ``validation_classes`` of their training classes (which then leave training). ``none``
    lists no test class, and needs the validation classes that the others may go without
    (at least 5 classes): they are what its run is evaluated on."""
    classes = sorted(classes)
    if spec == "sketchy1":
        train, valid, test = _sketchy1(classes)
        return {"train": train, "valid": valid, "test": test}
    if spec == NO_TEST:
        test = []
    elif spec == "sketchy2":
        test = list(SKETCHY2_TEST)
    elif Path(spec).is_file():
        test = _read_class_file(Path(spec))
    else:
        raise ValueError(f"split must be sketchy2, sketchy1, none or an existing file, "
                         f"got {spec!r}")
    missing = sorted(set(test) - set(classes))
    if missing:
        raise ValueError(f"split {spec!r}: test classes not in the data: {missing}")
    if len(set(test)) != len(test):
        raise ValueError(f"split {spec!r} lists a test class twice")
    rest = [c for c in classes if c not in set(test)]
    if not rest:
        raise ValueError(f"split {spec!r} leaves no training classes")
    valid = validation_classes(rest)
    if spec == NO_TEST and not valid:
        raise ValueError(f"split 'none' is evaluated on validation classes, and "
                         f"{len(rest)} classes give none (it needs at least 5)")
    train = [c for c in rest if c not in set(valid)]
    return {"train": train, "valid": valid, "test": sorted(test)}
