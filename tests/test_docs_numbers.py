"""A measurement that README.md and docs/*.md quote has one value wherever it is quoted.

MEASUREMENTS names measurements the pages quote, each with the patterns that find its
quotes: regular expressions whose group ``v`` is the figure (a number, or a range such as
``71-119``), matched over each page's text with its whitespace runs made single spaces (so
a sentence wrapped over lines still matches). Two quotes agree when they are equal at the
precision of the less precise one (122 and 122.2 agree, 0.12 and 0.123 agree; 122 and 102
do not; a range agrees with a range whose ends agree). Each measurement must be quoted at
least once, so a pattern that no longer finds its page fails instead of checking nothing.
The check covers the measurements listed, not every number the pages repeat."""

import re
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

NUM = r"(?<![\d.])(?P<v>\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?)(?![\d.]*\d)"
ROW = r"[\d. /]+"  # a table cell of figures: "0.550 / 0.533 / 0.547"

# name -> patterns of its quotes (on any page)
MEASUREMENTS: dict[str, list[str]] = {
    "service start, the process to a healthy /health": [
        rf"process to healthy \| {NUM} s",
        rf"the first 200 of `/health` took {NUM} s",
    ],
    "p50 at one client, int8, the quick start's index": [
        rf"{NUM} ms p50 in int8",
        rf"\| p50 at one client \| {NUM} ms \|",
    ],
    "p50 at one client, float32, the quick start's index": [
        rf"ms p50 in int8 \(float32 {NUM}\)",
        rf"\| p50 at one client \| [\d.-]+ ms \| {NUM} ms \|",
    ],
    "requests/s at 16 clients, int8, the quick start's index": [
        rf"{NUM} per second in int8",
        rf"(?<!targets of ){NUM} (?:queries|requests)(?:/s| per second) at 16 clients",
        rf"\| requests/s at 16 clients \| {NUM} \|",
    ],
    "requests/s at 16 clients, float32, the quick start's index": [
        rf"per second in int8[^()]*\(float32 {NUM}\)",
        rf"\| requests/s at 16 clients \| [\d.-]+ \| {NUM} \|",
    ],
    "ms of the sketch encoder in a one-client int8 request": [
        rf"{NUM} ms of 15",
    ],
    "more requests at 16 clients with sketches at 192 px": [
        rf"{NUM} ?% more (?:queries|requests) at 16",
    ],
    "index.build of 1,000 photos, photos/s end to end": [
        rf"\({NUM} photos/s; embedding alone",
        rf"runs at {NUM} photos/s end to end",
        rf"the whole build, end to end \| {NUM} \(",
    ],
    "index.build of 1,000 photos, photos/s of its embedding": [
        rf"embedding alone {NUM}\)",
        rf"the build's `embedding:` line\) \| {NUM} \|",
    ],
    "hubness correction, generalized mAP gained on the class folds": [
        rf"added {NUM} generalized mAP",
        rf"\+{NUM} generalized mAP on the folds",
    ],
    "test classes, seed 0, zero-shot mAP as /retrieve answers (corrected)": [
        rf"the hubness correction on\) \| {NUM} /",  # README
        rf"\| 0 \| \*\*{NUM}\*\* / \*\*[\d.]+\*\* \| [\d.]+ / [\d.]+ \|",  # the default run
    ],
    "test classes, seed 0, zero-shot mAP without the correction": [
        rf"`--hubness-weight 0`\) \| {NUM} /",
        rf"\| 0 \| \*\*[\d.]+\*\* / \*\*[\d.]+\*\* \| {NUM} / [\d.]+ \|",
    ],
    "test classes, seed 0, generalized mAP as /retrieve answers (corrected)": [
        rf"the hubness correction on\) \|{ROW}\|{ROW}\| {NUM} /",
        rf"\| 0 \| \*\*{NUM}\*\* / \*\*[\d.]+\*\* / \d+ % \|",
    ],
    "test classes, seed 0, generalized mAP without the correction": [
        rf"`--hubness-weight 0`\) \|{ROW}\|{ROW}\| {NUM} /",
        rf"\| 0 \| \*\*[\d.]+\*\* / \*\*[\d.]+\*\* / \d+ % \| {NUM} /",
    ],
    "recall@10 at d = 512, 10^7 photos, scanprefix under 3 GB": [
        rf"but {NUM} at all 512 dims",
        rf"\*\*0\.\d+ / 0\.\d+\*\* / {NUM} \|",  # scale.md, the 10^7 row
    ],
    "hydrogen 2D, seed 0, mean eigenvalue error after Ritz (%)": [
        rf"\(`hydrogen`\), seeds 0 / 1 \| 16 \| {NUM}% /",
        rf"`hydrogen` \(2D\), seed 0 \| [^|]+ \| [\d.]+% / {NUM}% \|",
    ],
    "hydrogen 2D, seed 1, mean eigenvalue error after Ritz (%)": [
        rf"\(`hydrogen`\), seeds 0 / 1 \| 16 \| [\d.]+% / {NUM}% \|",
        rf"`hydrogen` \(2D\), seed 1 \| [^|]+ \| [\d.]+% / {NUM}% \|",
    ],
    "hydrogen-3d, mean eigenvalue error after Ritz (%)": [
        rf"\(`hydrogen-3d`\) \| 14 \| {NUM}% \|",
        rf"\| `hydrogen-3d` \| [^|]+ \| [\d.]+% / {NUM}% \|",
    ],
    "10D oscillator, seed 0, mean eigenvalue error after Ritz (%)": [
        rf"\(`oscillator --ndim 10`\), seeds 0 / 1 \| 11 \| {NUM}% /",
        rf"`oscillator --ndim 10`, seed 0 \| [^|]+ \| [\d.]+% / {NUM}% \|",
    ],
}


def _same(a: str, b: str) -> bool:
    """Two numbers equal at the precision of the less precise."""
    step = Decimal(1).scaleb(-min(len(x.partition(".")[2]) for x in (a, b)))
    return Decimal(a).quantize(step, ROUND_HALF_UP) == Decimal(b).quantize(step, ROUND_HALF_UP)


def agree(a: str, b: str) -> bool:
    """Whether two quoted figures (numbers, or ranges "lo-hi") are the same."""
    ends_a, ends_b = a.split("-"), b.split("-")
    return len(ends_a) == len(ends_b) and all(map(_same, ends_a, ends_b))


def quotes(patterns: list[str], pages: dict[str, str]) -> list[tuple[str, str]]:
    """(page, figure) of every quote the patterns find on the pages ({name: text})."""
    out = []
    for name, text in pages.items():
        flat = " ".join(text.split())
        for pattern in patterns:
            out += [(name, m.group("v")) for m in re.finditer(pattern, flat)]
    return out


def disagreements(found: list[tuple[str, str]]) -> list[str]:
    """Pairs of quotes that do not agree, as 'page figure vs page figure'."""
    return [f"{p} {a} vs {q} {b}" for i, (p, a) in enumerate(found)
            for q, b in found[i + 1:] if not agree(a, b)]


@pytest.fixture(scope="module")
def pages() -> dict[str, str]:
    return {str(p.relative_to(REPO)): p.read_text(encoding="utf-8") for p in PAGES}


def test_two_values_of_one_measurement_are_found():
    pages = {"README.md": "| queries at 16 clients | 71-119 per second in int8 over two runs "
                          "(float32 86-93) |\nThe service answers 44 % more queries at\n16.",
             "docs/service.md": "| requests/s at 16 clients | 71-122 | 86-93 |"}
    int8 = quotes(MEASUREMENTS["requests/s at 16 clients, int8, the quick start's index"], pages)
    assert int8 == [("README.md", "71-119"), ("docs/service.md", "71-122")]
    assert disagreements(int8) == ["README.md 71-119 vs docs/service.md 71-122"]
    fp32 = quotes(MEASUREMENTS["requests/s at 16 clients, float32, the quick start's index"],
                  pages)
    assert fp32 == [("README.md", "86-93"), ("docs/service.md", "86-93")]
    assert not disagreements(fp32)
    assert quotes(MEASUREMENTS["more requests at 16 clients with sketches at 192 px"],
                  pages) == [("README.md", "44")]
    target = {"docs/service.md": "The targets of 250 requests/s at 16 clients are not met."}
    assert quotes(MEASUREMENTS["requests/s at 16 clients, int8, the quick start's index"],
                  target) == []


def test_figures_agree_at_the_coarser_precision():
    assert agree("122", "122.2") and agree("0.12", "0.123") and agree("0.870", "0.87")
    assert agree("0.125", "0.13") and agree("67-69", "67.0-69.2")
    assert not agree("122", "102") and not agree("0.676", "0.677") and not agree("14.4", "14.5")
    assert not agree("0.12", "0.126") and not agree("71-119", "71-122")
    assert not agree("119", "71-119")


@pytest.mark.parametrize("name", MEASUREMENTS)
def test_a_measurement_has_one_value_on_every_page(name, pages):
    found = quotes(MEASUREMENTS[name], pages)
    assert found, f"no page quotes {name!r} any more: update its patterns or remove it"
    assert not disagreements(found), f"{name}: {disagreements(found)}"
