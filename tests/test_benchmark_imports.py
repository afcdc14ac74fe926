"""Benchmark scripts do not import each other, read from the source (as test_import_cycles does).

Each benchmark is a script over shared modules; a script that imports another script's helpers
makes the two change together (bench_distributed.py, bench_serve.py and local_answer.py importing
bench_index.py's generators did: a column added to bench_index.py could break three others). So:

- `SHARED` modules are what every benchmark may import (machine facts, documents, the data
  generators, the benchmark model); they import only each other;
- a script split by job (bench_embed.py, bench_index.py) owns its `PARTS`: the script and its
  parts import each other and the shared modules, nothing else;
- every other module of benchmarks/ is a script: it imports shared modules only.

Every import counts (a lazy one inside a function too), and every name imported from a benchmark
module must be defined at that module's top level, so a helper moved without its callers is found
here rather than in the middle of a two-hour run.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
SHARED = {
    "common": "machine facts re-exported, documents, PDFs, the tiny model, runners, tables, the "
              "results writer",
    "machine": "CPU, instruction sets, load, versions, command (common.py re-exports it)",
    "synthetic_pages": "the page-wide-topic page embeddings (bench_index, bench_serve)",
    "local_answer": "the local-answer page embeddings (bench_index, search_scale)",
    "retrieval": "a rendered retrieval set and its agreement figures",
    "flops": "useful FLOPs of a page and a query from the architecture",
    "benchmark_specs": "the reduced-depth checkpoints of each family",
    "embed_models": "the benchmark model, built and exported once (bench_embed, bench_index)",
}
PARTS = {
    "bench_embed": {"embed_worker", "embed_report", "embed_against", "embed_optimiser",
                    "torch_reference"},
    # search_large.py measures the large stores bench_index.py --long-run builds, with its store
    # helpers (index_stores): the same job, run as a second command
    "bench_index": {"index_stores", "index_ingest", "index_report", "index_long", "search_large"},
    # variants_int4_recipes.py measures int4 text-graph arms on variants_fidelity.py's checkpoints
    # (its `build`), and variants_fidelity.py --int4 takes the arms' knob syntax (`parse_arm`)
    "variants_fidelity": {"variants_int4_recipes"},
}


def benchmark_imports(folder: Path) -> dict[str, list[tuple[str, list[str], int]]]:
    """module -> (benchmark module it imports, the names it takes from it, line) for every
    import of a sibling module (`import x` takes no names)."""
    known = {p.stem for p in folder.glob("*.py")}
    found: dict[str, list[tuple[str, list[str], int]]] = {}
    for path in sorted(folder.glob("*.py")):
        edges = found.setdefault(path.stem, [])
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                edges += [(a.name, [], node.lineno) for a in node.names if a.name in known]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module in known:
                edges.append((node.module, [a.name for a in node.names], node.lineno))
    return found


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


def owner(module: str, parts: dict[str, set[str]]) -> str:
    """The script a module belongs to: its own name, or the script it is a part of."""
    return next((script for script, own in parts.items() if module in own), module)


def violations(folder: Path, shared: set[str], parts: dict[str, set[str]]) -> list[str]:
    """Imports that break the rules of this file's docstring, and names that do not resolve."""
    out = []
    for module, edges in benchmark_imports(folder).items():
        for target, names, line in edges:
            allowed = target in shared if module in shared else (
                target in shared or owner(target, parts) == owner(module, parts))
            if not allowed:
                out.append(f"{module}.py:{line} imports {target}")
            missing = set(names) - top_level_names(folder / f"{target}.py") - {"*"}
            if missing:
                out.append(f"{module}.py:{line} imports {sorted(missing)} that {target}.py "
                           "does not define")
    return out


def test_no_benchmark_imports_another_benchmark():
    assert violations(BENCHMARKS, set(SHARED), PARTS) == []


def test_the_declared_modules_exist():
    """A renamed module leaves no stale entry that would let its new name through unchecked."""
    stems = {p.stem for p in BENCHMARKS.glob("*.py")}
    declared = set(SHARED) | set(PARTS) | set().union(*PARTS.values())
    assert declared - stems == set()


def test_the_check_sees_a_script_import_a_lazy_one_and_a_missing_name(tmp_path):
    """The check can fail: a script importing another script (inside a function too), a shared
    module importing a script, a part of one script imported by another, and a name its module
    does not define are each found; a script over shared modules and its own parts is not."""
    files = {
        "common.py": "X = 1\n",
        "gen.py": "def page():\n    from bench_a import helper\n",  # shared importing a script
        "bench_a.py": "from common import X\nfrom a_part import job\ndef helper(): pass\n",
        "a_part.py": "from common import X\ndef job(): pass\n",
        "bench_b.py": "import gen\ndef main():\n    from bench_a import helper\n",
        "bench_c.py": "from a_part import job\nfrom common import Y\n",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    assert sorted(violations(tmp_path, {"common", "gen"}, {"bench_a": {"a_part"}})) == [
        "bench_b.py:3 imports bench_a",
        "bench_c.py:1 imports a_part",
        "bench_c.py:2 imports ['Y'] that common.py does not define",
        "gen.py:2 imports bench_a",
    ]


def test_every_benchmark_compiles():
    """Parsing is not compiling: a `global` after the name's use (or a misplaced `nonlocal`) is
    only refused by the compiler, and a benchmark that cannot start is found here, not at the
    start of a long run."""
    for path in sorted(BENCHMARKS.glob("*.py")):
        compile(path.read_text(encoding="utf-8"), str(path), "exec")
