"""What importing colembed costs, and what each module may import (ARCHITECTURE.md's rules).

- `import colembed` and `colembed --help` load no torch, transformers, onnxruntime or fastembed
  (fastembed alone costs 0.4-0.75 s); every module under colembed, imported, loads no torch or
  transformers. Both run in a fresh interpreter (this test process has torch loaded by the
  reference fixtures) and walk the package with pkgutil, so modules added later are covered.
- The import rules, read from the source with `ast` (module-level and lazy imports alike): each
  heavy third-party package is imported by the one module that owns it.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import colembed

PACKAGE = Path(colembed.__file__).parent
HEAVY = (
    "torch",
    "transformers",
    "onnxruntime",
    "fastembed",
    "onnx",
    "peft",
    "scipy",
    "openvino",
    "nncf",
)

# argv[1]: the code to run first; prints one JSON line: the heavy modules loaded.
PROBE = """
import json, sys
exec(sys.argv[1])
heavy = set(json.loads(sys.argv[2]))
print(json.dumps(sorted(n for n in sys.modules if n.split(".")[0] in heavy)))
"""

WALK = """
import importlib, pkgutil, colembed
for info in pkgutil.walk_packages(colembed.__path__, "colembed."):
    importlib.import_module(info.name)
"""

HELP = """
from colembed.cli import main
try:
    main(["--help"])
except SystemExit:
    pass
"""


def loaded_after(code: str, heavy: tuple[str, ...] = HEAVY) -> list[str]:
    command = [sys.executable, "-c", PROBE, code, json.dumps(heavy)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_import_colembed_loads_nothing_heavy():
    assert loaded_after("import colembed") == []


def test_colembed_help_loads_nothing_heavy():
    assert loaded_after(HELP) == []


def test_no_module_under_colembed_imports_torch_or_transformers():
    leaked = [n for n in loaded_after(WALK) if n.split(".")[0] in ("torch", "transformers", "peft")]
    assert leaked == []


def test_the_core_and_the_index_load_no_ray():
    """Ray (the ray extra) is loaded only by colembed.distributed, and only when a job runs."""
    assert loaded_after("import colembed, colembed.index", ("ray", "pyarrow")) == []
    assert loaded_after(HELP, ("ray", "pyarrow")) == []
    assert loaded_after("import colembed.distributed", ("ray",)) == []
    assert "ray" in loaded_after("import colembed.distributed.pipeline", ("ray",))


WEB = ("fastapi", "starlette", "uvicorn", "pydantic", "multipart", "httpx", "anyio")


def test_the_core_the_index_and_the_cli_load_no_web_framework():
    """The serve extra is loaded by `colembed serve` only: not by `import colembed`, the index,
    `colembed --help`, nor by colembed.serve's stdlib modules (the CLI's options, limits)."""
    assert loaded_after("import colembed, colembed.index", WEB) == []
    assert loaded_after(HELP, WEB) == []
    assert (
        loaded_after("import colembed.serve, colembed.serve.options, colembed.serve.limits", WEB)
        == []
    )
    assert "fastapi" in loaded_after("import colembed.serve.app", WEB)  # the probe sees it


RAG = ("langchain_core", "langchain", "llama_index", "httpx")


def test_the_rag_frameworks_load_only_with_their_retriever():
    """`import colembed`, the index and the CLI load neither framework; each retriever module
    loads its own framework and not the other."""
    assert loaded_after("import colembed, colembed.index, colembed.integrations", RAG) == []
    assert loaded_after(HELP, RAG) == []
    assert "llama_index" not in loaded_after("import colembed.integrations.langchain", RAG)
    assert "langchain_core" in loaded_after("import colembed.integrations.langchain", RAG)
    assert "langchain_core" not in loaded_after("import colembed.integrations.llamaindex", RAG)
    assert "llama_index" in loaded_after("import colembed.integrations.llamaindex", RAG)


def test_no_module_under_colembed_loads_openvino_when_imported():
    """OpenVINO (the openvino extra) and NNCF are loaded only when a graph is opened on OpenVINO:
    importing every colembed module, `colembed --help` included, loads neither."""
    assert loaded_after(WALK, ("openvino", "nncf")) == []
    assert loaded_after(HELP, ("openvino", "nncf")) == []


def test_the_probe_detects_a_leak():
    """The check can fail: with transformers imported first, the same probe reports it."""
    assert "transformers" in loaded_after("import transformers\nimport colembed")


# ------------------------------------------------------------------------------- import rules
# top-level package -> the colembed modules allowed to import it (lazily or not)
OWNERS = {
    "onnxruntime": {"sessions"},
    "openvino": {"openvino_runtime"},  # the openvino extra: the OpenVINO runtime's sessions
    "nncf": set(),  # OpenVINO's int8 weights at export: colembed_export only
    "fastembed": {"fastembed"},
    "onnx": {"maxsim_graph", "cli"},  # building the scorer graph; the export extra check
    "torch": {"cli"},  # the CLI's export-extra check, inside the export commands only
    "transformers": {"cli"},
    "colembed_export": {"cli"},
    "peft": set(),  # merging a LoRA adapter at export: colembed_export only (export/families/qwen2_5/adapter.py)
    "huggingface_hub": {"registry"},
    "qdrant_edge": {
        "index.edge",
        "index.lexical",
    },  # the index's two stores, each behind the store interface
    "qdrant_client": {"index.server"},
    "pypdfium2": {"index.sources"},
    "tqdm": {"index.index"},
    "scipy": {"index.pooling"},  # Ward linkage for index-time token pooling, on first use
    "ray": {"distributed.__init__", "distributed.pipeline"},  # the ray extra
    "pyarrow": {
        "distributed.targets",
        "distributed.pipeline",
        "evaluation.labelled",
    },  # `colembed eval` reading ViDoRe / MTEB Parquet
    # the serve extra: the web framework lives in colembed.serve.app and the middleware before
    # it (serve.guards), the server in serve.run and its protocol (serve.connections)
    "fastapi": {"serve.app", "serve.guards"},
    "starlette": {"serve.app"},  # the multipart parser's own HTTPException
    "pydantic": {"serve.app", "integrations.langchain"},  # LangChain's retriever is a model
    "uvicorn": {"serve.run", "serve.connections", "cli"},  # the CLI's check: in `serve` only
    "multipart": set(),
    "httpx": {"integrations.pages"},  # the retrievers' client of colembed serve
    # the RAG frameworks (the langchain / llamaindex extras), each by its retriever only
    "langchain_core": {"integrations.langchain"},
    "llama_index": {"integrations.llamaindex"},
    "playwright": set(),
}


def imports_of(path: Path) -> set[str]:
    """Top-level names of every absolute import in the file."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_each_heavy_package_is_imported_by_its_owner_only():
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
        for name in imports_of(path):
            if name in OWNERS and module not in OWNERS[name]:
                offenders.setdefault(name, []).append(module)
    assert offenders == {}


def test_the_rules_see_a_lazy_import(tmp_path):
    """The check can fail: an import inside a function is found."""
    source = tmp_path / "m.py"
    source.write_text("def f():\n    import onnxruntime as ort\n    return ort\n")
    assert "onnxruntime" in imports_of(source)
