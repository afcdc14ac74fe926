"""`import colembed` and every module under it must leave torch and transformers unimported.

Runs in a fresh interpreter (this test process has torch loaded by the reference fixtures) and
walks the package with pkgutil, so runtime modules added later are covered without editing this
file.
"""

from __future__ import annotations

import json
import subprocess
import sys

FORBIDDEN = ("torch", "transformers")

# argv[1]: JSON list of forbidden top-level names; argv[2:]: modules to import first (for the
# self-test). Prints one JSON line: what was imported, what failed to import, what leaked.
PROBE = """
import importlib, json, pkgutil, sys

forbidden = set(json.loads(sys.argv[1]))
for name in sys.argv[2:]:
    importlib.import_module(name)

import colembed
import colembed.preprocess.config, colembed.preprocess.text
import colembed.preprocess.images, colembed.preprocess.positions

failed = {}
def record(name):
    failed[name] = repr(sys.exc_info()[1])

imported = [m.name for m in pkgutil.walk_packages(colembed.__path__, "colembed.", onerror=record)]
for name in imported:
    try:
        importlib.import_module(name)
    except Exception as e:
        failed[name] = repr(e)
leaked = sorted(n for n in sys.modules if n.split(".")[0] in forbidden)
print(json.dumps({"imported": imported, "failed": failed, "leaked": leaked}))
"""


def run_probe(*preimport: str) -> dict:
    command = [sys.executable, "-c", PROBE, json.dumps(FORBIDDEN), *preimport]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_no_module_under_colembed_imports_torch_or_transformers():
    report = run_probe()
    expected = {
        "colembed.errors",
        "colembed.preprocess",
        "colembed.preprocess.config",
        "colembed.preprocess.text",
        "colembed.preprocess.images",
        "colembed.preprocess.positions",
    }
    assert expected <= set(report["imported"]), report["imported"]
    assert report["failed"] == {}, report["failed"]
    assert report["leaked"] == [], f"importing colembed pulled in {report['leaked']}"


def test_the_probe_detects_a_leak():
    """The check can fail: with transformers imported first, the same probe reports it."""
    report = run_probe("transformers")
    assert "transformers" in report["leaked"]
