"""No document cites a file that is not there: markdown links and the file paths the docs name.

Checked over the README, docs/, ARCHITECTURE.md, CHANGELOG.md, SECURITY.md and every markdown file
under benchmarks/ (the suites' README and the result notes). A relative link resolves from the
document's folder; a path in backticks (`benchmarks/results/embed/embed.md`,
`results/scoring/scoring.json`, `export/pipeline/exporter.py`) resolves from the repository root,
a `results/...` path from benchmarks/. Brace and star forms (`NAME.{md,json}`, `NAME.*`) name
each file they stand for; a pattern that names a folder of files (`variants-fidelity*`) needs one
match. Paths a command writes (after `--out`, `--results`) and placeholders (`NAME`, `<...>`) are
not citations.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = sorted(
    {
        ROOT / "README.md",
        ROOT / "ARCHITECTURE.md",
        ROOT / "CHANGELOG.md",
        ROOT / "SECURITY.md",
        *(ROOT / "docs").glob("*.md"),
        *(ROOT / "benchmarks").rglob("*.md"),
    }
)
LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`\n]+)`")
PATH = re.compile(
    r"(?<![\w./-])((?:benchmarks|docs|colembed|export|tests|results)/[\w./+*{},-]*"
    r"[\w*}])"
)
ROOTS = ("benchmarks/", "docs/", "colembed/", "export/", "tests/")
# paths the docs name that are not this repository's files, each with what it is
NOT_OURS = {
    "colembed/models.json": "the wheel's copy of models.json, written by setup.py at build",
    "docs/OperatorKernels.md": "onnxruntime's table of kernels",
    "tests/models/": "transformers' test tree",
}


def expand(path: str) -> list[str]:
    """`a.{md,json}` -> [a.md, a.json]; other paths as they are."""
    m = re.search(r"\{([^}]*)\}", path)
    if not m:
        return [path]
    return [
        x
        for alt in m.group(1).split(",")
        for x in expand(path[: m.start()] + alt + path[m.end() :])
    ]


def cited_paths(text: str) -> list[str]:
    """The repository paths a document's code spans name (commands' outputs left out)."""
    found = []
    for span in CODE.findall(text):
        if re.search(r"--(out|results|workdir)\b|<|NAME|OLD|NEW|FOLDER", span):
            continue
        found += PATH.findall(span)
    return found


def missing(document: Path) -> list[str]:
    text = document.read_text(encoding="utf-8")
    out = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        file = target.split("#", 1)[0]
        if file and not (document.parent / file).exists():
            out.append(f"link {target}")
    for cited in cited_paths(text):
        if any(cited.startswith(other) for other in NOT_OURS):
            continue
        for path in expand(cited.rstrip(".,")):
            base = ROOT / "benchmarks" if path.startswith("results/") else ROOT
            if "*" in path:
                if not list(base.glob(path)):
                    out.append(f"pattern {cited}")
            elif (
                path.startswith(ROOTS + ("results/",))
                and "." in Path(path).name
                and not (base / path).exists()
            ):
                out.append(f"path {cited}")
    return out


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_cited_file_exists(document):
    assert missing(document) == []


def test_the_check_finds_a_missing_link_path_and_pattern(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text(
        "[here](gone.md) and [web](https://example.org) and [ok](doc.md)\n"
        "`benchmarks/results/never/there.md` and `results/nothing-{a,b}.json`\n"
        "`results/no-such-*` but not `--out benchmarks/results/new.md`\n"
    )
    assert missing(doc) == [
        "link gone.md",
        "path benchmarks/results/never/there.md",
        "path results/nothing-{a,b}.json",
        "path results/nothing-{a,b}.json",
        "pattern results/no-such-*",
    ]
