"""Decisions with one home stay there, checked from the source (as test_import_isolation does).

- The base variant's name: `"fp32"` is spelled once, as `layout.BASE_VARIANT` (the variant every
  export holds and the one that runs when none is named); every other module of colembed and
  colembed_export names it through that constant, so a reader finds the decision by its name;
  so does every benchmark (benchmarks/), but the one `SPELLED_ELSEWHERE` names with its reason.
  Docstrings may say "fp32" in prose.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [ROOT / "colembed", ROOT / "export", ROOT / "benchmarks"]
# a file that may spell the base variant itself, and why it cannot import the constant
SPELLED_ELSEWHERE = {
    "benchmarks/embed/against.py": "runs as the worker of other colembed versions (bench_embed.py "
    "--against REF), whose colembed may have no layout.BASE_VARIANT "
    "(0.1.0 has none)",
}


def literal_uses(path: Path, value: str) -> list[int]:
    """Lines where `value` is a string constant in the file's code (docstrings left out)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and node.value == value and id(node) not in docstrings
    ]


def test_the_base_variant_is_spelled_once():
    uses = {
        str(path.relative_to(ROOT)): lines
        for folder in SOURCES
        for path in sorted(folder.rglob("*.py"))
        if (lines := literal_uses(path, "fp32"))
    }
    assert sorted(set(uses) - set(SPELLED_ELSEWHERE)) == ["colembed/layout.py"]
    assert len(uses["colembed/layout.py"]) == 1


def test_the_check_sees_a_literal_but_not_a_docstring(tmp_path):
    """The check can fail: a default argument spelled "fp32" is found, the docstring is not."""
    source = tmp_path / "m.py"
    source.write_text('"""Runs fp32."""\ndef f(variant="fp32"):\n    """"fp32" here."""\n')
    assert literal_uses(source, "fp32") == [2]
