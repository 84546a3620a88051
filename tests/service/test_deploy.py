"""Deployment files: the compose file's structure and the commands it runs (no Docker here)."""

import dataclasses
import json
import re
import shlex
from pathlib import Path

import pytest

from index.build import parse_args as build_args
from service.__main__ import parse_args as service_args
from tests.conftest import REPO
from training.cdk.config import PRESETS, Config

yaml = pytest.importorskip("yaml", reason="pyyaml is not installed")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


def mounts(service: dict) -> dict[str, str]:
    """container path -> host path of a service's bind mounts ("HOST:CONTAINER[:ro]")."""
    out = {}
    for v in service["volumes"]:
        parts = v.split(":")  # the host side may hold ":" itself, e.g. ${VAR:-default}
        if parts[-1] in ("ro", "rw"):
            parts = parts[:-1]
        out[parts[-1]] = ":".join(parts[:-1])
    return out


def test_api_service(compose):
    api = compose["services"]["api"]
    assert "profiles" not in api  # starts with a plain `docker compose up`
    assert api["command"][:3] == ["python", "-m", "service"]
    index_dir = api["command"][api["command"].index("--index") + 1]
    m = mounts(api)
    assert m[index_dir] == "./runs/index"
    checkpoint = api["environment"]["SKETCHSVD_CHECKPOINT"]
    assert m[str(Path(checkpoint).parent)] == "./runs/cdk"
    assert any(api["environment"]["SKETCHSVD_PHOTOS_DIR"].startswith(c) for c in m)
    assert all(v.endswith(":ro") for v in api["volumes"])  # serving never writes
    health = api["healthcheck"]
    assert health["test"][0] == "CMD" and "/health" in " ".join(health["test"])
    assert {"interval", "timeout", "retries"} <= set(health)
    assert api["ports"][0].endswith(":8000") and "0.0.0.0" in api["command"]
    settings = service_args(api["command"][3:])  # the service CLI accepts exactly these flags
    assert (str(settings.index), settings.host, settings.port) == (index_dir, "0.0.0.0", 8000)


def test_train_service_runs_training_then_index_build(compose):
    train = compose["services"]["train"]
    assert train["profiles"] == ["train"]
    script = train["command"][-1]
    steps = [shlex.split(s) for s in script.split("&&")]
    assert [s[:3] for s in steps] == [["python", "-m", "training.cdk"],
                                      ["python", "-m", "index.build"]]
    train_args = dict(zip(steps[0][3::2], steps[0][4::2], strict=True))
    # training.cdk flags are the dashed Config fields and --preset
    fields = {f.name for f in dataclasses.fields(Config)}
    assert {f[2:].replace("-", "_") for f in train_args} <= fields
    assert "_" not in "".join(train_args) and train_args["--preset"] in PRESETS
    cfg = build_args(steps[1][3:])  # the index CLI accepts exactly these flags
    assert cfg.checkpoint == str(Path(train_args["--out"]) / "checkpoint.pt")
    assert cfg.photos == train_args["--data"]
    m = mounts(train)
    assert m["/runs"] == "./runs" and not train["volumes"][0].endswith(":ro")
    assert Path(cfg.out).parent == Path("/runs")  # atomic rename stays inside the mount
    api = compose["services"]["api"]
    assert cfg.out == api["command"][api["command"].index("--index") + 1]


def test_optional_gpu_reservation(compose):
    gpu = compose["services"]["train-gpu"]
    assert gpu["profiles"] == ["gpu"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
    assert gpu["command"] == compose["services"]["train"]["command"]
    assert "deploy" not in compose["services"]["api"] and "deploy" not in compose[
        "services"]["train"]


def test_dockerfile_copies_what_it_runs():
    text = (REPO / "Dockerfile").read_text()
    for line in text.splitlines():
        if line.startswith("COPY "):
            for src in line.split()[1:-1]:
                assert (REPO / src).exists(), src
    assert 'CMD ["python", "-m", "service"' in text and "/health" in text
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", text, re.M).group(1))
    settings = service_args(cmd[3:])
    assert (settings.host, settings.port) == ("0.0.0.0", 8000)
    assert "-c constraints.txt" in text
