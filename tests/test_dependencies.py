"""pyproject.toml's requirements: floors above known-vulnerable releases, one FAISS, and an
environment that satisfies them."""

from importlib.metadata import PackageNotFoundError, version

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.conftest import REPO

tomllib = pytest.importorskip("tomllib", reason="needs Python 3.11+")

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]

# distribution -> (a vulnerable release the floor must leave out, the advisory). Each is the
# last release before the fix, where the advisory reaches code this project runs.
ADVISORIES = {
    "torch": ("2.9.1", "GHSA-63cw-57p8-fm3p: torch.load(weights_only=True) memory corruption"),
    "starlette": ("1.3.0", "CVE-2026-54283: request.form() limits ignored for urlencoded"),
    "python-multipart": ("0.0.30", "GHSA-v9pg-7xvm-68hf: negative Content-Length"),
    "pillow": ("12.2.0", "PYSEC-2026-2253..2257"),
    "h11": ("0.15.0", "CVE-2025-43859: request smuggling"),
    "tqdm": ("4.66.2", "CVE-2024-34062"),
    "fastapi": ("0.109.0", "CVE-2024-24762: Content-Type ReDoS"),
    "setuptools": ("78.1.0", "CVE-2025-47273: path traversal (build requirement)"),
}
# Distributions that install the `faiss` module.
FAISS = {"faiss", "faiss-cpu", "faiss-gpu", "faiss-gpu-cu11", "faiss-gpu-cu12"}


def requirements(specs: list[str]) -> dict[str, Requirement]:
    reqs = [Requirement(s) for s in specs]
    return {canonicalize_name(r.name): r for r in reqs}


def runtime_and_build() -> dict[str, Requirement]:
    return requirements(PROJECT["dependencies"] + PYPROJECT["build-system"]["requires"])


@pytest.mark.parametrize("name", sorted(ADVISORIES))
def test_floor_excludes_vulnerable_release(name):
    vulnerable, advisory = ADVISORIES[name]
    reqs = runtime_and_build()
    assert name in reqs, f"{name} has no requirement, so no floor ({advisory})"
    assert not reqs[name].specifier.contains(vulnerable, prereleases=True), (
        f"{reqs[name]} admits {name} {vulnerable} ({advisory})")


@pytest.mark.parametrize("extra", [None, *PROJECT.get("optional-dependencies", {})])
def test_one_faiss_distribution(extra):
    specs = PROJECT["dependencies"] + PROJECT.get("optional-dependencies", {}).get(extra, [])
    faiss = sorted(set(requirements(specs)) & FAISS)
    assert len(faiss) == 1, f"extra {extra!r} installs the faiss module from {faiss}"


def test_installed_versions_satisfy_requirements():
    """The environment the tests run in is one the requirements admit (a `pip check` of
    the project's own requirements, floors included)."""
    specs = PROJECT["dependencies"] + PROJECT["optional-dependencies"]["dev"]
    bad = []
    for name, req in requirements(specs).items():
        if req.marker is not None and not req.marker.evaluate():
            continue
        try:
            have = version(name)
        except PackageNotFoundError:
            bad.append(f"{req}: not installed")
            continue
        if not req.specifier.contains(have, prereleases=True):
            bad.append(f"{req}: {have} installed")
    assert not bad, bad


def test_ray_extra_floor_and_dev_pulls_it():
    """The Ray engine's extra leaves out the dashboard advisory, and dev installs the same
    requirement so the Ray tests run wherever the tests run."""
    extras = PROJECT["optional-dependencies"]
    ray = requirements(extras["ray"])["ray"]
    assert not ray.specifier.contains("2.53.0"), "CVE-2026-27482: ray < 2.54.0"
    assert requirements(extras["dev"])["ray"] == ray


def test_constraints_pin_releases_the_requirements_admit():
    """constraints.txt (which the image and tests/run.sh install with) pins each package to a
    release that pyproject.toml admits: pip would otherwise fail to resolve the image's
    install step."""
    reqs = runtime_and_build()
    pins = [Requirement(line.split("#")[0].strip())
            for line in (REPO / "constraints.txt").read_text().splitlines()
            if line.split("#")[0].strip()]
    assert pins
    for pin in pins:
        (spec,) = pin.specifier
        assert spec.operator == "==", f"{pin}: constraints pin exact releases"
        name = canonicalize_name(pin.name)
        assert name in reqs, f"{pin} constrains a package pyproject.toml does not require"
        assert reqs[name].specifier.contains(spec.version, prereleases=True), (
            f"{pin} is outside {reqs[name]}")
