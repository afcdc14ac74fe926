"""Which provider and variant `colembed doctor --measure` timed fastest for a model folder on this
machine, within the variant's gate: what `providers="auto"` reads to choose OpenVINO.

"auto" never guesses that OpenVINO is faster: the answer depends on the CPU (bf16 and int8 gain
only where it has AVX512-BF16 / AMX / VNNI), the model and the installed runtimes, so it takes
OpenVINO only when a measurement on this CPU, for this folder's manifest and this OpenVINO
release, said so. A record is keyed by all three; a missing, unreadable or foreign record is no
measurement (onnxruntime's CPU provider then runs). Standard library only.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from importlib import metadata
from pathlib import Path
from typing import Any

from .integrity import user_cache_root
from .layout import MANIFEST_NAME

RECORD_FILE = "provider-choice.json"
FIELDS = ("provider", "variant")


def cpu_signature() -> str:
    """This CPU: its model name and instruction-set flags (Linux), else the platform's name."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            lines = {}
            for line in f:
                key, _, value = line.partition(":")
                lines.setdefault(key.strip(), value.strip())
                if not line.strip():
                    break
        if lines.get("model name"):
            return f"{lines['model name']} | {hashlib.sha256(lines.get('flags', '').encode()).hexdigest()[:16]}"
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"


def _openvino_release() -> str | None:
    try:
        return metadata.version("openvino")
    except metadata.PackageNotFoundError:
        return None


def record_key(folder: str | os.PathLike) -> str:
    """The folder's manifest (its bytes' sha256), this CPU and the installed OpenVINO release."""
    manifest = Path(folder) / MANIFEST_NAME
    digest = hashlib.sha256(manifest.read_bytes()).hexdigest()
    return f"{digest} | {cpu_signature()} | openvino {_openvino_release()}"


def _store() -> Path:
    return user_cache_root() / RECORD_FILE


def _read_all() -> dict[str, Any]:
    try:
        data = json.loads(_store().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def measured(folder: str | os.PathLike) -> dict[str, Any] | None:
    """The measured choice for `folder` on this machine ({"provider", "variant", ...}), or None."""
    try:
        key = record_key(folder)
    except OSError:
        return None
    found = _read_all().get(key)
    if not isinstance(found, dict) or not all(isinstance(found.get(f), str) for f in FIELDS):
        return None
    return found


def remember(folder: str | os.PathLike, choice: dict[str, Any]) -> Path:
    """Record `choice` (at least FIELDS) for `folder` on this machine; returns the record file."""
    if not all(isinstance(choice.get(f), str) for f in FIELDS):
        raise ValueError(f"a provider choice needs {FIELDS}, got {choice!r}")
    records = _read_all()
    records[record_key(folder)] = choice
    store = _store()
    store.parent.mkdir(parents=True, exist_ok=True)
    temporary = store.with_name(f".{store.name}.{os.getpid()}")
    temporary.write_text(json.dumps(records, indent=1), encoding="utf-8")
    os.replace(temporary, store)
    return store
