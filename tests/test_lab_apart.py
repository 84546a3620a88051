"""The laboratory stays apart from the product: research/ and benchmarks/ are not in the
built wheel nor in the service image, no product module imports them, the research
scripts use the public API of ``training`` only (names its modules export, no private
names, no script importing another), and neither folder names a path of one machine."""

import ast
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PRODUCT = ("training", "index", "service")
LAB = ("research", "benchmarks")


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names) of every absolute import in a file, function-level ones too: ``import
    a.b`` gives ("a.b", []), ``from a.b import c, d`` ("a.b", ["c", "d"])."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.module, [a.name for a in node.names]))
    return out


def test_the_wheel_holds_the_product_only(tmp_path):
    """A wheel built from a copy of the checkout (setuptools, as pip builds it) holds
    training, index and service, and nothing of research, benchmarks or tests."""
    pytest.importorskip("setuptools")
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for folder in (*PRODUCT, *LAB, "tests"):
        shutil.copytree(REPO / folder, src / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                           "--no-build-isolation", "-q", "-w", str(tmp_path / "dist"), str(src)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    tops = {n.split("/")[0] for n in zipfile.ZipFile(wheel).namelist()}
    packages = {t for t in tops if not t.endswith(".dist-info")}
    assert packages == set(PRODUCT), packages


def test_the_image_copies_no_research():
    ignored = {line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()}
    assert set(LAB) <= ignored
    copied = [line.split()[1:-1] for line in (REPO / "Dockerfile").read_text().splitlines()
              if line.startswith("COPY ")]
    assert not [src for srcs in copied for src in srcs if src.split("/")[0] in LAB]


@pytest.mark.parametrize("package", PRODUCT)
def test_no_product_module_imports_the_lab(package):
    bad = [(str(p.relative_to(REPO)), module) for p in sorted((REPO / package).rglob("*.py"))
           for module, _ in _imports(p) if module.split(".")[0] in LAB]
    assert not bad


RESEARCH = sorted((REPO / "research").glob("*.py"))


@pytest.mark.parametrize("path", RESEARCH, ids=lambda p: p.name)
def test_research_uses_the_public_api_only(path):
    """Every name a research module takes from the product is public: exported by the
    module's __all__ where it has one, else not _private; and a script imports no other
    script (what they share is research.common) and no benchmark."""
    import importlib.util

    for module, names in _imports(path):
        top = module.split(".")[0]
        if top == "research":
            assert module in ("research", "research.common"), f"{path.name} imports {module}"
        assert top != "benchmarks", f"{path.name} imports {module}"
        if top not in PRODUCT:
            continue
        assert not any(part.startswith("_") for part in module.split(".")), module
        exported = getattr(importlib.import_module(module), "__all__", None)
        for name in names:
            assert not name.startswith("_"), f"{path.name}: {module}.{name} is private"
            if exported is not None:
                assert name in exported or importlib.util.find_spec(f"{module}.{name}"), (
                    f"{path.name}: {module}.{name} is not in {module}.__all__")


# paths and places of one machine: its package mirrors, a sibling checkout of the paper's
# code, the data folder beside a checkout
MACHINE = re.compile(r"/srv/pypi|/opt/pypi-more|file:///wheels|\.\./neural-svd|shared/data|"
                     r"[\"']shared[\"']\s*/")


@pytest.mark.parametrize("path", sorted(p for f in LAB for p in (REPO / f).rglob("*.py")),
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_no_machine_specific_text_in_the_lab(path):
    hits = [f"{i}: {line.strip()}" for i, line in
            enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if MACHINE.search(line)]
    assert not hits
