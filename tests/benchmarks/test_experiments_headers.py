"""Every concluded experiment opens with its question, its answer and the note that holds them."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENTS = sorted(
    p for p in (ROOT / "benchmarks" / "experiments").glob("*.py") if p.name != "__init__.py"
)
# A note is a result file under benchmarks/results/, or, when none was kept, the doc or CHANGELOG
# section that records the answer.
NONE_KEPT = re.compile(r"none kept \(answer recorded in ([^\s,)]+)[^)]*\)")


def test_there_are_experiments_to_check():
    assert EXPERIMENTS


@pytest.mark.parametrize("path", EXPERIMENTS, ids=lambda p: p.stem)
def test_experiment_opens_with_question_answer_and_note(path):
    source = path.read_text(encoding="utf-8")
    doc = ast.get_docstring(ast.parse(source), clean=False)
    assert doc, f"{path.name}: no module docstring"
    assert source.startswith('"""'), f"{path.name}: the docstring is not the file's first line"
    lines = doc.splitlines()
    assert len(lines) >= 4, f"{path.name}: the docstring is shorter than the three-line header"
    for line, label in zip(lines, ("Question: ", "Answer: ", "Note: ")):
        assert line.startswith(label) and line[len(label) :].strip(), (
            f"{path.name}: expected a {label.strip()} line, got {line!r}"
        )
    assert lines[3] == "", f"{path.name}: the header is not followed by a blank line"
    for number, line in enumerate(source.splitlines()[:3], 1):
        assert len(line) <= 100, f"{path.name}:{number}: header line longer than 100 characters"
    note = lines[2][len("Note: ") :].strip()
    if note.startswith("benchmarks/results/"):
        assert (ROOT / note).is_file(), f"{path.name}: its note {note} does not exist"
    else:
        kept = NONE_KEPT.fullmatch(note)
        assert kept, (
            f"{path.name}: Note must be benchmarks/results/... or "
            f"'none kept (answer recorded in ...)', got {note!r}"
        )
        doc_path = kept.group(1)
        assert (ROOT / doc_path).is_file(), f"{path.name}: {doc_path} does not exist"
