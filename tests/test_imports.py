"""The layers run one way, training.loss -> training -> index -> service, and no modules
import each other in a circle.

Static: every import statement of every module (function-level ones too, since a lazy
import is how a circle hides) is read with ``ast`` and resolved to the project module it
loads. Dynamic: each package's modules are imported in a fresh interpreter, which must not
load a later layer.
"""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("training", "index", "service")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py"))}


def layer(module: str) -> int:
    """0 training.loss, 1 the rest of training, 2 index, 3 service."""
    if module == "training.loss":
        return 0
    return 1 + PACKAGES.index(module.split(".")[0])


def _is_package(module: str) -> bool:
    return MODULES[module].name == "__init__.py"


def _project_module(name: str) -> str | None:
    """The longest prefix of a dotted name that is a module of ours."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in MODULES:
            return ".".join(parts[:n])
    return None


def imports_of(module: str) -> set[str]:
    """Project modules (not packages' __init__) that ``module`` imports anywhere in it."""
    tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
    package = module if _is_package(module) else module.rpartition(".")[0]
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from pkg import mod` loads pkg.mod; `from mod import name` loads mod
            names += [f"{base}.{a.name}" for a in node.names]
    found = {_project_module(n) for n in names}
    return {m for m in found if m is not None and m != module and not _is_package(m)}


GRAPH = {m: imports_of(m) for m in MODULES}


def test_the_scan_sees_the_known_edges():
    assert "training.loss" in GRAPH["training.cdk.train"]  # a relative `from ..loss import`
    assert "training.pde.plots" in GRAPH["training.pde.run"]  # `from training.pde import plots`
    assert "index.gallery" in GRAPH["index.add"]
    assert "training.cdk.model.bundle" in GRAPH["service.loading"]


def test_no_module_imports_a_later_layer():
    upward = sorted(f"{m} -> {d}" for m, deps in GRAPH.items() for d in deps
                    if layer(d) > layer(m))
    assert upward == []


def test_no_import_cycles():
    """Depth-first search over the module graph; any back edge closes a cycle."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []
    cycles: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for d in sorted(GRAPH[m]):
            if state.get(d) == 1:
                cycles.append(" -> ".join([*path[path.index(d):], d]))
            elif d not in state:
                visit(d)
        path.pop()
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m)
    assert cycles == []


def loaded_by_importing(modules) -> set[str]:
    """Every module a fresh interpreter holds after importing ``modules``."""
    code = "\n".join([
        "import importlib, json, sys",
        f"for m in {sorted(modules)!r}:",
        "    importlib.import_module(m)",
        "print(json.dumps(sorted(sys.modules)))",
    ])
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("package", PACKAGES)
def test_importing_a_package_loads_no_later_layer(package):
    later = PACKAGES[PACKAGES.index(package) + 1 :]
    loaded = loaded_by_importing(m for m in MODULES if m.split(".")[0] == package)
    assert sorted(m for m in loaded if m.split(".")[0] in later) == []


# What serving reads of a model is the bundle's inference block: the modules index and service
# import never load the training configuration, the training loop or the bundle writer.
TRAINING_ONLY = ("training.cdk.config", "training.cdk.train", "training.cdk.run",
                 "training.cdk.checkpoint", "training.cdk.make_bundle", "training.cdk.quantize",
                 "training.cdk.splits", "training.cdk.data")


def closure(modules) -> set[str]:
    seen, todo = set(), list(modules)
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(GRAPH[m])
    return seen


def test_serving_never_imports_the_training_configuration():
    serving = [m for m in MODULES if m.split(".")[0] in ("index", "service")]
    reached = closure(serving)
    assert sorted(reached & set(TRAINING_ONLY)) == []
    assert "training.cdk.model.bundle" in reached  # what they read instead
    assert sorted(loaded_by_importing(serving) & set(TRAINING_ONLY)) == []
