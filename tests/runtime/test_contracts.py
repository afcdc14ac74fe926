"""The graph contracts bind both halves: a folder whose manifest redefines a graph's inputs is
refused at load, before any session runs, and every feed is built from the contract's names."""

from __future__ import annotations

import json

import numpy as np
import pytest

import colembed
from colembed.contracts import colqwen2_contracts
from colembed.layout import MANIFEST_NAME


def test_feeds_follow_the_contracts_names_and_order():
    text = colqwen2_contracts(
        patch_dim=1176, vision_head_dim=80, text_hidden=1536, embedding_dim=128
    )["text"]
    arrays = [np.zeros(1) for _ in text.inputs]
    feeds = text.feeds(*arrays)
    assert list(feeds) == [spec.name for spec in text.inputs]
    assert all(feeds[spec.name] is a for spec, a in zip(text.inputs, arrays))
    with pytest.raises(TypeError, match="takes 5 inputs"):
        text.feeds(*arrays[:4])


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: c["inputs"][4]["dims"].__setitem__(1, 7), "input image_features"),
        (lambda c: c["inputs"].reverse(), "inputs \\['image_features'"),
        (lambda c: c["outputs"][0].__setitem__("dtype", "float16"), "output embeddings"),
    ],
)
def test_a_manifest_contract_unlike_colqwen2s_is_refused(copy_model_folder, edit, message):
    folder = copy_model_folder()
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    edit(manifest["variants"]["fp32"]["text"]["contract"])
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(colembed.ModelFolderError, match="not ColQwen2's") as info:
        colembed.load(folder)
    assert message.replace("\\", "") in str(info.value).replace("\\", "")
