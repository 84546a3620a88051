"""Every command that README.md and docs/*.md show parses: each line of a fenced code block
that runs ``python -m`` one of the project's packages, or ``python benchmarks/...`` or
``python research/...``, is read from the markdown (continuation lines joined, comments
and shell operators cut; of a usage synopsis, ``[--flag a|b]`` is ``--flag a``, and a flag
whose value is a placeholder such as DIR or N is only looked up), run with ``--help``
appended, and must exit 0 with every ``--flag`` it names in the help its parser prints.
Options are parsed in order, so a bad value before ``--help`` fails too."""

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
PACKAGES = ("training", "index", "service", "benchmarks", "research")
SHELL = {"&&", "||", "|", ";", "&", ">", ">>", "2>", "<"}


def _python(token: str) -> bool:
    return re.fullmatch(r"(?:.*/)?python3?", token) is not None


def _synopsis(tokens: list[str]) -> list[str]:
    """A usage synopsis as arguments: brackets dropped, the first of alternatives a|b."""
    out = []
    for t in tokens:
        t = t.replace("[", "").replace("]", "")
        if t in ("", "...", "\u2026"):
            continue
        out.append(t.split("|")[0] if "|" in t and not t.startswith("-") else t)
    return out


def _placeholder(token: str) -> bool:
    return re.fullmatch(r"[A-Z][A-Z0-9_]*", token) is not None


def shown_commands(path: Path) -> list[tuple[str, list[str]]]:
    """(file:line, [entry, args...]) of the commands of ``path``'s code blocks: entry is
    "-m MODULE" or a script path relative to the checkout."""
    out, fenced, held, start = [], False, "", 0
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced, held = not fenced, ""
            continue
        if not fenced:
            continue
        if not held:
            start = number
        if line.rstrip().endswith("\\"):
            held += line.rstrip()[:-1] + " "
            continue
        text, held = held + line, ""
        try:
            tokens = shlex.split(text, comments=True)
        except ValueError:  # not a shell line (an unbalanced quote in Python code)
            continue
        cut = next((i for i, t in enumerate(tokens) if t in SHELL), len(tokens))
        tokens = tokens[:cut]
        if len(tokens) < 2 or not _python(tokens[0]):
            continue
        where = f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path.name}:{start}"
        if tokens[1] == "-m" and len(tokens) > 2 and tokens[2].split(".")[0] in PACKAGES:
            out.append((where, ["-m", tokens[2], *_synopsis(tokens[3:])]))
        elif tokens[1].split("/")[0] in ("benchmarks", "research") and tokens[1].endswith(".py"):
            out.append((where, [tokens[1], *_synopsis(tokens[2:])]))
    return out


COMMANDS = [c for path in DOCS for c in shown_commands(path)]

def parsed_and_named(args: list[str]) -> tuple[list[str], list[str]]:
    """(the arguments to parse, the flags only looked up): a flag followed by a placeholder
    value (D, DIR, RAY_ADDR) is left out of the parse, whose types it could not pass."""
    parsed, named = [], []
    i = 0
    while i < len(args):
        if args[i].startswith("--") and i + 1 < len(args) and _placeholder(args[i + 1]):
            named.append(args[i])
            i += 2
            continue
        parsed.append(args[i])
        i += 1
    return parsed, named


# Each command in the interpreter of a fresh process, one after another (the imports are
# paid once): argv as given, --help appended; its exit status and what it printed.
RUNNER = r"""
import contextlib, io, json, runpy, sys
results = []
for argv in json.loads(sys.stdin.read()):
    out, err = io.StringIO(), io.StringIO()
    module = argv[1] if argv[0] == "-m" else None
    args = argv[2:] if module else argv[1:]
    sys.argv = [module or argv[0], *args, "--help"]
    code = None
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            if module:
                runpy.run_module(module, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(argv[0], run_name="__main__")
            code = "returned without exiting"
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException as e:
            code = f"{type(e).__name__}: {e}"
    results.append({"code": code, "out": out.getvalue(), "err": err.getvalue()[-2000:]})
print(json.dumps(results))
"""


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    """(entry, its arguments) of a command."""
    n = 2 if argv[0] == "-m" else 1
    return argv[:n], argv[n:]


def run_with_help(commands: list[list[str]]) -> list[dict]:
    """{"code", "out", "err"} of each command (its placeholder flags left out) run with
    --help appended, in one fresh interpreter."""
    argvs = []
    for argv in commands:
        entry, args = _split(argv)
        argvs.append([*entry, *parsed_and_named(args)[0]])
    proc = subprocess.run([sys.executable, "-c", RUNNER], input=json.dumps(argvs), cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def problems(argv: list[str], row: dict) -> list[str]:
    """What is wrong with a command, given its run with --help: an exit status other than
    0, or a flag its parser does not list."""
    if row["code"] != 0:
        return [f"`{' '.join(argv)} --help` exited {row['code']}: {row['err']}"]
    flags = {a.split("=")[0] for a in _split(argv)[1] if re.fullmatch(r"--[\w-]+(=.*)?", a)}
    return [f"{flag} is not an option of `{' '.join(_split(argv)[0])}`" for flag in sorted(flags)
            if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", row["out"])]


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    rows = run_with_help([argv for _, argv in COMMANDS])
    return {where: row for (where, _), row in zip(COMMANDS, rows, strict=True)}


def test_the_docs_show_commands():
    """The reader finds the commands (a broken reader would make the test below vacuous)."""
    found = {" ".join(argv[:2]) for _, argv in COMMANDS}
    assert {"-m training.cdk", "-m training.pde", "-m index.build", "-m service"} <= found
    assert any(argv[0].startswith("benchmarks/") for _, argv in COMMANDS)


def test_the_reader_joins_lines_cuts_comments_and_reads_a_synopsis(tmp_path):
    doc = tmp_path / "page.md"
    doc.write_text("text python -m training.cdk --not-read\n```bash\n"
                   "python -m training.cdk --data DIR \\\n    --seed 1  # --comment\n"
                   "python -m index.build [--kind auto|flat] [--dims D] && python -m o --x\n"
                   "python3 -m venv .venv\n"
                   ".venv/bin/python research/x.py --a 'b c'\n```\n")
    got = [argv for _, argv in shown_commands(doc)]
    assert parsed_and_named(got[1][2:]) == (["--kind", "auto"], ["--dims"])
    assert got == [["-m", "training.cdk", "--data", "DIR", "--seed", "1"],
                   ["-m", "index.build", "--kind", "auto", "--dims", "D"],
                   ["research/x.py", "--a", "b c"]]


def test_a_flag_that_does_not_exist_or_a_bad_value_fails():
    bad = [["-m", "training.pde", "hydrogen", "--n-modes", "6"],  # no such flag
           ["-m", "training.pde", "hydrogen", "--threads", "two"],  # not an int
           ["benchmarks/loss_bench.py", "--smoke", "--repeat", "3"],  # an abbreviation
           ["-m", "training.pde", "hydrogen", "--modes", "6", "--dims", "D"]]  # placeholder
    rows = run_with_help(bad)
    found = [problems(argv, row) for argv, row in zip(bad, rows, strict=True)]
    assert found[0] == ["--n-modes is not an option of `-m training.pde`"]
    assert "invalid int value: 'two'" in found[1][0]
    assert found[2] == ["--repeat is not an option of `benchmarks/loss_bench.py`"]
    assert found[3] == ["--dims is not an option of `-m training.pde`"]
    good = [["-m", "training.pde", "hydrogen", "--modes", "6", "--shift", "4"]]
    assert problems(good[0], run_with_help(good)[0]) == []


@pytest.mark.parametrize("where, argv", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_a_command_the_docs_show_parses(where, argv, results):
    assert not problems(argv, results[where]), where
