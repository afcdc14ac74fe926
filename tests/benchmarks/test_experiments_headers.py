"""Every concluded experiment opens with its question, its answer and the note that holds them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENTS = sorted(
    p for p in (ROOT / "benchmarks" / "experiments").glob("*.py") if p.name != "__init__.py"
)


def test_there_are_experiments_to_check():
    assert EXPERIMENTS


@pytest.mark.parametrize("path", EXPERIMENTS, ids=lambda p: p.stem)
def test_experiment_opens_with_question_answer_and_note(path):
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")), clean=False)
    assert doc, f"{path.name}: no module docstring"
    lines = doc.splitlines()
    assert len(lines) >= 3, f"{path.name}: the docstring is shorter than the three-line header"
    for line, label in zip(lines, ("Question: ", "Answer: ", "Note: ")):
        assert line.startswith(label) and line[len(label) :].strip(), (
            f"{path.name}: expected a {label.strip()} line, got {line!r}"
        )
    note = lines[2][len("Note: ") :].strip()
    assert (ROOT / note).is_file(), f"{path.name}: its note {note} does not exist"
