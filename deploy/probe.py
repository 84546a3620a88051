"""Ask a running sketchsvd service for the photos of one sketch, and check the answer against
the photo folder the index was built from.

    python3 deploy/probe.py --url http://127.0.0.1:18000 --photos DATA/photo \
        --sketch DATA/sketch/bat/n02139199_1332-1.png --k 5

The answer passes when the status is 200, it holds exactly k results sorted by score, and
each result's id is a photo of the folder (`<class>/<id>.<ext>`) with that photo's class.
Prints one line and exits 0 when it passes; prints the problems and exits 1 otherwise. The
standard library only: it runs with the host's python3, outside the image.
"""

from __future__ import annotations

import argparse
import json
import mimetypes
import sys
import urllib.error
import urllib.request
import uuid
from pathlib import Path

PHOTO_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp"}


def gallery_of(photos: Path) -> dict[str, str]:
    """{photo id: class} of a folder of <class>/<id>.<ext> photos."""
    out = {}
    for f in sorted(photos.glob("*/*")):
        if f.suffix.lower() in PHOTO_SUFFIXES:
            out[f.stem] = f.parent.name
    if not out:
        raise ValueError(f"no photos in {str(photos)!r} (expected <class>/<id>.jpg)")
    return out


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


def problems(status: int, answer: object, k: int, gallery: dict[str, str]) -> list[str]:
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
        pid, cls = r.get("id"), r.get("class")
        if pid not in gallery:
            found.append(f"id {pid!r} is not a photo of the gallery")
        elif gallery[pid] != cls:
            found.append(f"id {pid!r} has class {cls!r}, its folder is {gallery[pid]!r}")
    if len({r.get("id") for r in results}) != len(results):
        found.append(f"repeated ids in {[r.get('id') for r in results]}")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="the service, e.g. http://127.0.0.1:8000")
    parser.add_argument("--photos", type=Path, required=True, help="<class>/<id>.jpg folder")
    parser.add_argument("--sketch", type=Path, required=True, help="a PNG/JPEG sketch")
    parser.add_argument("--k", type=int, default=5)
    args = parser.parse_args(argv)
    status, answer = retrieve(args.url, args.sketch, args.k)
    found = problems(status, answer, args.k, gallery_of(args.photos))
    if found:
        print(f"retrieve {args.sketch.name}: " + "; ".join(found))
        return 1
    top = ", ".join(f"{r['id']} ({r['class']}, {r['score']:.3f})" for r in answer["results"])
    print(f"retrieve {args.sketch.name} ({args.sketch.parent.name}): 200, k={args.k}: {top}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
