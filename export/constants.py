"""The exporter's constants, each defined once; every module of `colembed_export` reads them here.

What the runtime also needs (the architecture string, the scorer's file and opset) is defined by
`colembed` and re-exported here, so the two halves cannot disagree. Imports nothing heavy.
"""

from __future__ import annotations

from colembed.layout import TOKENIZER_FILE
from colembed.maxsim_graph import MAXSIM_FILE, MAXSIM_OPSET
from colembed.registry import ARCHITECTURE

# opset 18: what torch's dynamo exporter emits cleanly and DirectML's kernels cover (<= 20).
OPSET = 18

# The export check (verify.py). Absolute, per token, on the final unit-norm embeddings (what users
# consume); relative to the tensor's own scale (max abs diff / max abs) on intermediate tensors,
# whose magnitude depends on the checkpoint (trained vision towers emit features in the hundreds).
EMBEDDING_TOLERANCE = 1e-4
FEATURE_TOLERANCE = 1e-4

# Above this many bytes of weights a graph is written with external data. Protobuf's hard limit
# is 2 GiB; staying well under it leaves room for the graph itself.
EXTERNAL_DATA_THRESHOLD = 1 << 30
DATA_SUFFIX = "_data"  # vision.onnx -> vision.onnx_data

# Graph file names by role.
GRAPH_FILES = {"vision": "vision.onnx", "text": "text.onnx"}
SCORER_FILE = MAXSIM_FILE
SCORER_OPSET = MAXSIM_OPSET

# The checkpoints colembed exports are the layouts `colembed.families` declares per family.
# What a checkpoint download needs; nothing else is fetched.
CHECKPOINT_PATTERNS = ("*.json", "*.safetensors", "*.txt", "*.jinja", "*.model")

# Files copied from the checkpoint: what the runtime's tokenizer and preprocessing read, plus the
# configs kept for provenance. Optional ones are copied when present.
# The image processor's settings are `preprocessor_config.json` or, as transformers 5.x saves a
# processor, the `image_processor` object of `processor_config.json` (preprocess_config.py reads
# either), so neither file is required on its own.
REQUIRED_FILES = (TOKENIZER_FILE, "config.json")
OPTIONAL_FILES = (
    "preprocessor_config.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "processor_config.json",
    "chat_template.jinja",
    "colembed_tiny.json",
)

__all__ = [
    "ARCHITECTURE",
    "CHECKPOINT_PATTERNS",
    "DATA_SUFFIX",
    "EMBEDDING_TOLERANCE",
    "EXTERNAL_DATA_THRESHOLD",
    "FEATURE_TOLERANCE",
    "GRAPH_FILES",
    "OPSET",
    "OPTIONAL_FILES",
    "REQUIRED_FILES",
    "SCORER_FILE",
    "SCORER_OPSET",
]
