"""The benchmarks package's import rules, read from the source (as test_import_cycles does).

A suite that imports another suite's helpers makes the two change together (a column added to one
could break three others). So:

- `benchmarks.shared` is what every benchmark may import (machine facts, documents, the data
  generators, the benchmark model); it imports only itself;
- a suite (`benchmarks.embed`, `benchmarks.index`, `benchmarks.variants`, or a single module such
  as `benchmarks.scoring`) imports its own modules and `benchmarks.shared`, nothing else;
- an experiment (`benchmarks.experiments.<name>`) imports `benchmarks.shared` only.

Every import counts (a lazy one inside a function too), every name imported from a benchmark
module must be defined at that module's top level (a helper moved without its callers is found
here rather than in the middle of a two-hour run), and no module of benchmarks/ edits sys.path:
a benchmark runs as `python -m benchmarks.<suite>` from the repository root.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.fixtures.source import imported_module, modules

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
SHARED = "benchmarks.shared"


def suite(module: str) -> str:
    """The unit a module belongs to: benchmarks.shared, a suite's folder or module, or one
    experiment."""
    parts = module.split(".")
    if len(parts) >= 3 and parts[1] == "experiments":
        return ".".join(parts[:3])
    return ".".join(parts[:2])


def imports(path: Path, module: str, known: dict[str, Path]) -> list[tuple[str, list[str], int]]:
    """(benchmark module imported, the names taken from it, line) for each import in `path`."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names if a.name in known]
        elif isinstance(node, ast.ImportFrom):
            source = imported_module(node, module, path)
            if source not in known:
                continue
            names = []
            for a in node.names:
                if f"{source}.{a.name}" in known:  # a submodule: an import of its own
                    out.append((f"{source}.{a.name}", [], node.lineno))
                else:
                    names.append(a.name)
            out.append((source, names, node.lineno))
    return out


def top_level_names(path: Path) -> set[str]:
    """Names a module defines at its top level (functions, classes, assignments, imports)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text(encoding="utf-8"), str(path)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def edits_sys_path(path: Path) -> bool:
    """Whether the code (docstrings and comments aside, code strings run elsewhere included)
    touches `sys.path`."""
    text = path.read_text(encoding="utf-8")
    tree = ast.parse(text, str(path))
    code_strings = [
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant)
        and isinstance(n.value, str)
        and "\n" in n.value
        and "import" in n.value
    ]
    uses = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute)
        and n.attr == "path"
        and isinstance(n.value, ast.Name)
        and n.value.id == "sys"
    ]
    return bool(uses) or any("sys.path" in code for code in code_strings)


def violations(folder: Path) -> list[str]:
    """Imports that break the rules of this file's docstring, names that do not resolve, and
    sys.path edits."""
    known = modules({"benchmarks": folder})
    out = []
    for module, path in known.items():
        where = path.relative_to(folder.parent).as_posix()
        if edits_sys_path(path):
            out.append(f"{where} edits sys.path")
        own = suite(module)
        for target, names, line in imports(path, module, known):
            theirs = suite(target)
            allowed = {SHARED} if own == SHARED else {own, SHARED, "benchmarks"}
            if theirs not in allowed:
                out.append(f"{where}:{line} imports {target}")
            missing = set(names) - top_level_names(known[target]) - {"*"}
            if missing:
                out.append(
                    f"{where}:{line} imports {sorted(missing)} that {target} does not define"
                )
    return out


def test_no_benchmark_imports_another_suite():
    assert violations(BENCHMARKS) == []


def test_the_check_sees_a_suite_import_a_lazy_one_a_missing_name_and_a_path_edit(tmp_path):
    """The check can fail: a suite importing another suite (inside a function too), the shared
    package importing a suite, an experiment importing a suite, a name its module does not
    define and a sys.path edit are each found; a suite over its own modules and the shared ones
    is not."""
    root = tmp_path / "benchmarks"
    files = {
        "__init__.py": "",
        "shared/__init__.py": "",
        "shared/common.py": "X = 1\n",
        "shared/gen.py": "def page():\n    from benchmarks.b import main\n",
        "a/__init__.py": "",
        "a/__main__.py": "from benchmarks.shared.common import X\nfrom .part import job\n"
        "def helper(): pass\n",
        "a/part.py": "from benchmarks.shared import common\ndef job(): pass\n",
        "b.py": "def main():\n    from benchmarks.a.part import job\n",
        "c.py": "from benchmarks.shared.common import Y\nimport sys\nsys.path.insert(0, '.')\n",
        "experiments/__init__.py": "",
        "experiments/e.py": "from benchmarks.a import part\n",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    assert sorted(violations(root)) == [
        "benchmarks/b.py:2 imports benchmarks.a.part",
        "benchmarks/c.py edits sys.path",
        "benchmarks/c.py:1 imports ['Y'] that benchmarks.shared.common does not define",
        "benchmarks/experiments/e.py:1 imports benchmarks.a",
        "benchmarks/experiments/e.py:1 imports benchmarks.a.part",
        "benchmarks/shared/gen.py:2 imports benchmarks.b",
    ]


def test_every_benchmark_compiles():
    """Parsing is not compiling: a `global` after the name's use (or a misplaced `nonlocal`) is
    only refused by the compiler, and a benchmark that cannot start is found here, not at the
    start of a long run."""
    for path in sorted(BENCHMARKS.rglob("*.py")):
        compile(path.read_text(encoding="utf-8"), str(path), "exec")
