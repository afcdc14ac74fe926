"""Multivectors in JSON: float32 as nested lists ("float"), or "base64": the little-endian float32
bytes of the (tokens, dim) array, row-major, with its shape. base64 is 4/3 of the raw bytes; the
nested lists are ~2.5x that (a float printed in ~10 characters) and slow to parse for a batch of
pages (~750 x 128 each). Decoding: `np.frombuffer(base64.b64decode(data), "<f4").reshape(shape)`.
"""

from __future__ import annotations

import base64

import numpy as np

ENCODINGS = ("float", "base64")


def encode(vectors: np.ndarray, encoding: str) -> dict:
    array = np.ascontiguousarray(vectors, dtype="<f4")
    if encoding == "base64":
        return {
            "shape": list(array.shape),
            "dtype": "float32",
            "byteorder": "little",
            "data": base64.b64encode(array.tobytes()).decode("ascii"),
        }
    return {"shape": list(array.shape), "values": array.tolist()}


def decode(item: dict) -> np.ndarray:
    """The array `encode` made (either encoding): for clients and tests."""
    if "data" in item:
        return np.frombuffer(base64.b64decode(item["data"]), "<f4").reshape(item["shape"])
    return np.asarray(item["values"], dtype=np.float32).reshape(item["shape"])
