"""Serve sketch-to-photo retrieval over HTTP.

    python -m service --index runs/index [--host 127.0.0.1] [--port 8000]

Every field of `service/settings.py:Settings` is a flag (`--photos-dir DIR`, `--max-k 50`,
`--log-level debug`); settings not given as flags come from `SKETCHSVD_*` environment
variables, then the defaults.
"""

from __future__ import annotations

import sys

from index.errors import IndexStoreError
from index.store import read_sidecar
from service.main import create_app
from service.server import Server, server_config
from service.settings import Settings
from training import cli
from training.allocator import tune_allocator

DEFAULT_MODEL = "runs/cdk/model"


def build_hint(settings: Settings) -> str:
    """The exact commands that create the missing index (DATA: the training data, PHOTOS:
    the photos to serve, which may be DATA)."""
    model = settings.model or DEFAULT_MODEL
    lines = [f"python -m index.build --model {model} --photos PHOTOS --out {settings.index}"]
    if settings.model is None:
        lines.insert(0, "python -m training.cdk --data DATA --split none --out runs/cdk")
    return " && ".join(lines)


def parse_args(argv: list[str] | None = None) -> Settings:
    """One dashed flag per Settings field (training.cli); flags given override the
    environment."""
    parser = cli.build_parser(Settings, prog="python -m service", description=__doc__)
    return cli.parse(parser, Settings, argv)


def main(argv: list[str] | None = None) -> int:
    return cli.main(_main, argv)


def _main(argv: list[str]) -> int:
    tune_allocator()
    settings = parse_args(argv)
    cli.setup_logging(settings.log_level)  # the flag or SKETCHSVD_LOG_LEVEL
    try:
        read_sidecar(settings.index)
    except IndexStoreError as err:
        print(f"error: {err}; build the index first: {build_hint(settings)} (or run "
              "./quickstart DATA)", file=sys.stderr)
        return 2
    app = create_app(settings)  # refuses bad keys before anything says it serves
    print(f"serving on http://{settings.host}:{settings.port}/ (open it in a browser to draw)",
          flush=True)
    server = Server(server_config(app, settings), app.state.drain)
    server.run()
    return 0 if server.started else 2  # not started: the reason is logged ("cannot start")


if __name__ == "__main__":
    raise SystemExit(main())
