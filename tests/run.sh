#!/usr/bin/env bash
# The test command (README, "Tests"): the virtual environment with the dev tools, Debian's
# Chromium for the browser test when it can be installed, lint, then the tests: those of
# the product, the benchmarks' and research/'s scripts in their smoke mode (marker
# "research": -m "not research" leaves the experiments out). Extra arguments go to pytest
# (tests/run.sh tests/index -x).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/pip install -q -c constraints.txt -e ".[dev]"
if ! command -v chromium >/dev/null; then
    { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; } \
        || echo "no chromium: the browser test will be skipped"
fi
.venv/bin/ruff check .
.venv/bin/python -m pytest -q "$@"
