"""Ask a running sketchsvd service for the photos of one sketch, and check the answer against
the photo folder the index was built from.

    python3 deploy/probe.py --url http://127.0.0.1:18000 --photos DATA/photo \
        --sketch DATA/sketch/bat/n02139199_1332-1.png --k 5
    python3 deploy/probe.py ... --photos FLAT --labels FLAT.json   # a folder without classes

The answer passes when the status is 200, it holds exactly k results sorted by score, and
each result's path is a photo of the folder with that photo's class: its folder in a
`<class>/<file>` gallery, none (null) in a flat one, whose true classes `--labels` gives
(a JSON object {file name: class}) for the precision below.
With `--sketches DIR` it also asks for the first sketch of each class of DIR
(`<class>/<file>`, sorted; `--classes N`: the first N classes) and requires the share of
their top-k photos in the sketch's own class, averaged, to reach `--min-precision`: a
service that answers well formed but wrong photos (images decoded or normalised otherwise
than in training, a table that does not match the index) fails it. Prints one line per
check and exits 0 when all pass; prints the problems and exits 1 otherwise. The standard
library only: it runs with the host's python3, outside the image.
"""

from __future__ import annotations

import argparse
import collections
import json
import mimetypes
import sys
import urllib.error
import urllib.request
import uuid
from pathlib import Path

PHOTO_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp"}


def gallery_of(photos: Path, labels: Path | None = None
               ) -> tuple[dict[str, str | None], dict[str, str]]:
    """({photo path in the folder: the class the service must answer}, {path: true class})
    of a folder of <class>/<file> photos, or with `labels` of a flat folder (no class
    answered; the true classes from the labels file)."""
    if labels is not None:
        truth = json.loads(labels.read_text(encoding="utf-8"))
        files = {f.name for f in photos.iterdir() if f.suffix.lower() in PHOTO_SUFFIXES}
        if set(truth) != files:
            raise ValueError(f"{str(labels)!r} does not label exactly the photos of "
                             f"{str(photos)!r}")
        return dict.fromkeys(truth), truth
    out = {f"{f.parent.name}/{f.name}": f.parent.name for f in sorted(photos.glob("*/*"))
           if f.suffix.lower() in PHOTO_SUFFIXES}
    if not out:
        raise ValueError(f"no photos in {str(photos)!r} (expected <class>/<file>.jpg)")
    return out, out


def multipart(field: str, path: Path) -> tuple[bytes, str]:
    """A multipart/form-data body holding one file, and its Content-Type header."""
    boundary = uuid.uuid4().hex
    ctype = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
    head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"{field}\"; "
            f"filename=\"{path.name}\"\r\nContent-Type: {ctype}\r\n\r\n").encode()
    return head + path.read_bytes() + f"\r\n--{boundary}--\r\n".encode(), \
        f"multipart/form-data; boundary={boundary}"


def retrieve(url: str, sketch: Path, k: int, timeout: float = 60) -> tuple[int, object]:
    """POST the sketch to {url}/retrieve?k=k; (status, decoded JSON or the raw text)."""
    body, ctype = multipart("file", sketch)
    req = urllib.request.Request(f"{url.rstrip('/')}/retrieve?k={k}", data=body,
                                 headers={"Content-Type": ctype}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as err:
        status, raw = err.code, err.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def problems(status: int, answer: object, k: int, gallery: dict[str, str | None]
             ) -> list[str]:
    """What is wrong with a /retrieve answer (empty: nothing)."""
    if status != 200:
        return [f"status {status}: {answer!r}"]
    if not isinstance(answer, dict) or not isinstance(answer.get("results"), list):
        return [f"no results list in {answer!r}"]
    found = []
    results = answer["results"]
    if len(results) != k or answer.get("k") != k:
        found.append(f"asked for k={k}, got k={answer.get('k')!r} and {len(results)} results")
    scores = [r.get("score") for r in results]
    if scores != sorted(scores, reverse=True):
        found.append(f"results not sorted by score: {scores}")
    for r in results:
        path, cls = r.get("path"), r.get("class")
        if path not in gallery:
            found.append(f"path {path!r} (id {r.get('id')!r}) is not a photo of the gallery")
        elif gallery[path] != cls:
            found.append(f"{path!r} has class {cls!r}, expected {gallery[path]!r}")
    if len({r.get("id") for r in results}) != len(results):
        found.append(f"repeated ids in {[r.get('id') for r in results]}")
    return found


def first_sketches(sketches: Path, classes: int = 0) -> list[Path]:
    """The first sketch file of each of the first `classes` class folders (sorted; 0: all)."""
    out = []
    folders = sorted(d for d in sketches.iterdir() if d.is_dir())
    for folder in folders[:classes] if classes else folders:
        files = sorted(f for f in folder.iterdir() if f.suffix.lower() in PHOTO_SUFFIXES)
        out += files[:1]
    if not out:
        raise ValueError(f"no sketches in {str(sketches)!r} (expected <class>/<file>.png)")
    return out


def class_precision(url: str, sketches: list[Path], k: int, gallery: dict[str, str | None],
                    truth: dict[str, str]) -> tuple[float, float, list[str]]:
    """(mean share of each sketch's top-k photos in its folder's class, the same share for
    photos drawn at random, problems with the answers)."""
    shares, found = [], []
    for sketch in sketches:
        status, answer = retrieve(url, sketch, k)
        wrong = problems(status, answer, k, gallery)
        if wrong:
            found += [f"{sketch.name}: {w}" for w in wrong]
            continue
        cls = sketch.parent.name
        shares.append(sum(truth[r["path"]] == cls for r in answer["results"]) / k)
    sizes = collections.Counter(truth.values())  # photos a class
    chance = sum(sizes[s.parent.name] for s in sketches) / len(sketches) / len(truth)
    return (sum(shares) / len(shares) if shares else 0.0), chance, found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="the service, e.g. http://127.0.0.1:8000")
    parser.add_argument("--photos", type=Path, required=True,
                        help="<class>/<file> folder, or a flat one with --labels")
    parser.add_argument("--labels", type=Path, help="JSON {file name: class} of a flat "
                        "--photos folder")
    parser.add_argument("--sketch", type=Path, required=True, help="a PNG/JPEG sketch")
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--sketches", type=Path, help="<class>/<file> sketch folder: check "
                        "that the answers find the sketches' classes")
    parser.add_argument("--classes", type=int, default=0,
                        help="sketches asked for, one a class (0: every class)")
    parser.add_argument("--min-precision", type=float, default=0.5,
                        help="the least mean share of the top-k photos in the sketch's class")
    args = parser.parse_args(argv)
    gallery, truth = gallery_of(args.photos, args.labels)
    status, answer = retrieve(args.url, args.sketch, args.k)
    found = problems(status, answer, args.k, gallery)
    if found:
        print(f"retrieve {args.sketch.name}: " + "; ".join(found))
        return 1
    top = ", ".join(f"{r['path']} ({truth[r['path']]}, {r['score']:.3f})"
                    for r in answer["results"])
    print(f"retrieve {args.sketch.name} ({args.sketch.parent.name}): 200, k={args.k}: {top}")
    if args.sketches is None:
        return 0
    sketches = first_sketches(args.sketches, args.classes)
    share, chance, found = class_precision(args.url, sketches, args.k, gallery, truth)
    line = (f"precision@{args.k} over the first sketch of {len(sketches)} classes: {share:.3f} "
            f"(at least {args.min_precision}; photos drawn at random: {chance:.3f})")
    if found or share < args.min_precision:
        print(line + ("; " + "; ".join(found) if found else "") + ": FAILED")
        return 1
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
