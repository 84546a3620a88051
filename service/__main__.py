"""Serve sketch-to-photo retrieval over HTTP.

    python -m service --index runs/index [--host 127.0.0.1] [--port 8000]

Settings not given as flags come from `SKETCHSVD_*` environment variables (see
`service/settings.py`).
"""

from __future__ import annotations

import argparse
import logging
import sys

import uvicorn

from index.store import IndexStoreError, read_sidecar
from service.main import create_app
from service.settings import Settings

DEFAULT_DATA = "../shared/data/sketchy-mini"
DEFAULT_CHECKPOINT = "runs/cdk/checkpoint.pt"


def build_hint(settings: Settings) -> str:
    """The exact commands that create the missing index."""
    ckpt = settings.checkpoint or DEFAULT_CHECKPOINT
    lines = [f"python -m index.build --checkpoint {ckpt} --photos {DEFAULT_DATA} "
             f"--out {settings.index}"]
    if settings.checkpoint is None:
        lines.insert(0, f"python -m training.cdk --data {DEFAULT_DATA} --preset cpu --out runs/cdk")
    return "\n  ".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m service", description=__doc__.split("\n")[0])
    p.add_argument("--index", default=None, help="index folder (SKETCHSVD_INDEX)")
    p.add_argument("--checkpoint", default=None, help="default: from the index sidecar")
    p.add_argument("--photos-dir", default=None, help="default: from the index sidecar")
    p.add_argument("--host", default=None, help="default 127.0.0.1 (SKETCHSVD_HOST)")
    p.add_argument("--port", type=int, default=None, help="default 8000 (SKETCHSVD_PORT)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    args = p.parse_args(argv)
    flags = {"index": args.index, "checkpoint": args.checkpoint, "photos_dir": args.photos_dir,
             "host": args.host, "port": args.port}
    overrides = {k: v for k, v in flags.items() if v is not None}
    settings = Settings(**overrides)
    try:
        read_sidecar(settings.index)
    except IndexStoreError as err:
        print(f"error: {err}\nbuild the index first:\n  {build_hint(settings)}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    print(f"serving on http://{settings.host}:{settings.port}/ (open it in a browser to draw)",
          flush=True)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port,
                log_level=args.log_level, access_log=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
