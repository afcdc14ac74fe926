"""A LoRA adapter over a colpali-layout ColQwen2.5 base, merged at load, against peft's own merge.

The adapter is made the way colpali-engine trains ColQwen2.5: peft on colpali-engine 0.3.12's
model layout (a `Qwen2_5_VLModel` plus `custom_text_proj`), with its training config's target
regex (the language model's projections and `custom_text_proj`, not the vision tower), and LoRA
weights made non-zero (peft's "gaussian" init leaves B at zero: merging would change nothing).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from torch import nn
from transformers import Qwen2_5_VLModel

from tests.fixtures.qwen2_5 import checkpoint, reference_processor
from tests.fixtures.samples import QUERIES

pytestmark = pytest.mark.heavy("qwen2.5")

# colpali-engine's ColQwen2.5 training configs (LoraConfig.target_modules, r 32, alpha 32).
COLPALI_TARGETS = (
    r"(.*(model)(?!.*visual).*(down_proj|gate_proj|up_proj|k_proj|q_proj|v_proj|"
    r"o_proj).*$|.*(custom_text_proj).*$)"
)
TOLERANCE = 1e-5


class ColpaliColQwen2_5(Qwen2_5_VLModel):
    """colpali-engine 0.3.12's `ColQwen2_5` module layout and embedding forward (the code the
    published adapter was trained with; the package itself pins torch < 2.8)."""

    def __init__(self, config):
        super().__init__(config)
        self.custom_text_proj = nn.Linear(config.text_config.hidden_size, 128)

    def forward(self, input_ids, attention_mask, pixel_values=None, image_grid_thw=None):
        if pixel_values is not None:  # the processor pads each page's patches to the longest
            counts = image_grid_thw[:, 1] * image_grid_thw[:, 2]
            pixel_values = torch.cat([p[:n] for p, n in zip(pixel_values, counts)])
        hidden = (
            super()
            .forward(
                input_ids=input_ids,
                attention_mask=attention_mask,
                pixel_values=pixel_values,
                image_grid_thw=image_grid_thw,
                use_cache=False,
                return_dict=True,
            )
            .last_hidden_state
        )
        proj = self.custom_text_proj(hidden)
        return proj / proj.norm(dim=-1, keepdim=True) * attention_mask.unsqueeze(-1)


def batches(folder):
    from tests.fixtures.images import rgb

    processor = reference_processor(folder)
    pages = [rgb(140, 196, seed=1), rgb(56, 84, seed=2)]  # several windows; smaller than one
    return [processor.process_queries(list(QUERIES[:3])), processor.process_images(pages)]


def embed(model, batch):
    with torch.no_grad():
        out = model(**batch)
    out = out if isinstance(out, torch.Tensor) else out.embeddings
    return out[batch["attention_mask"].bool()]


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    """(base folder, adapter folder, peft's merged embeddings per batch, base embeddings)."""
    from peft import LoraConfig, get_peft_model

    base = checkpoint(tmp_path_factory, "tiny-2.5", "colpali")
    model = ColpaliColQwen2_5.from_pretrained(base, dtype=torch.float32).eval()
    inputs = batches(base)
    before = [embed(model, b) for b in inputs]
    config = LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=0.1,
        init_lora_weights="gaussian",
        bias="none",
        task_type="FEATURE_EXTRACTION",
        target_modules=COLPALI_TARGETS,
    )
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(0.05 * torch.randn(param.shape, generator=generator))
    folder = tmp_path_factory.mktemp("adapter") / "colqwen2.5-lora"
    peft_model.save_pretrained(folder)
    merged = peft_model.merge_and_unload().eval()
    return base, folder, [embed(merged, b) for b in inputs], before, inputs


def load_shimmed(folder, **kwargs):
    from colembed_export.families.qwen2_5.adapter import merge_adapter

    model = merge_adapter(folder, **kwargs)
    model.vlm.model.visual.get_dtype = lambda: torch.float32  # docs/reference-colqwen2_5.md
    return model


def assert_merged(model, adapter):
    _, _, want, base, inputs = adapter
    for batch, expected, unmerged in zip(inputs, want, base):
        got = embed(model, batch)
        assert (got - expected).abs().max() <= TOLERANCE
        assert (got - unmerged).abs().max() > 100 * TOLERANCE  # the adapter changed the model


def test_adapter_targets_match_colpali_engine(adapter):
    """The regex picks the language model's projections and custom_text_proj, no vision module."""
    config = json.loads((adapter[1] / "adapter_config.json").read_text())
    from safetensors import safe_open

    with safe_open(str(adapter[1] / "adapter_model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert config["peft_type"] == "LORA" and config["base_model_name_or_path"] == str(adapter[0])
    assert any(k.startswith("base_model.model.custom_text_proj.lora_B") for k in keys)
    assert any(".language_model.layers.0.mlp.down_proj.lora_A" in k for k in keys)
    assert not any("visual" in k for k in keys)


def test_adapter_merges_like_peft(adapter):
    """Base from the adapter's own (local) base path, merged, equals peft's merged model."""
    assert_merged(load_shimmed(adapter[1]), adapter)


def test_adapter_in_the_older_colpali_names_merges_the_same(adapter, tmp_path):
    """colpali-engine before 0.3.12 (on Qwen2_5_VLForConditionalGeneration) named the language
    model `model.`; the same adapter under those names, with its base given explicitly."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "older"
    shutil.copytree(adapter[1], folder)
    weights = load_file(str(folder / "adapter_model.safetensors"))
    save_file(
        {
            k.replace("base_model.model.language_model.", "base_model.model.model."): v
            for k, v in weights.items()
        },
        str(folder / "adapter_model.safetensors"),
    )
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(
        json.dumps({**config, "base_model_name_or_path": "colembed-tests/no-such-base"})
    )
    assert_merged(load_shimmed(folder, base=adapter[0]), adapter)


def test_unreachable_base_is_named(adapter, tmp_path):
    from colembed.errors import ModelFolderError
    from colembed_export.families.qwen2_5.adapter import merge_adapter

    folder = tmp_path / "hub-base"
    shutil.copytree(adapter[1], folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(
        json.dumps({**config, "base_model_name_or_path": "colembed-tests/no-such-base"})
    )
    with pytest.raises(ModelFolderError, match=r"'colembed-tests/no-such-base'.*--base PATH"):
        merge_adapter(folder)


def test_adapters_that_cannot_be_merged_are_refused(adapter, tmp_path):
    from colembed.errors import ModelFolderError
    from colembed_export.families.qwen2_5.adapter import merge_adapter
    from colembed_export.families.qwen2_5.checkpoint import load_colqwen2_5
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "bad"
    shutil.copytree(adapter[1], folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, "peft_type": "IA3"}))
    with pytest.raises(ModelFolderError, match="only LoRA"):
        merge_adapter(folder)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    weights = load_file(str(folder / "adapter_model.safetensors"))
    save_file(
        {k.replace("custom_text_proj", "score_head"): v for k, v in weights.items()},
        str(folder / "adapter_model.safetensors"),
    )
    with pytest.raises(ModelFolderError, match="score_head"):
        merge_adapter(folder)
    with pytest.raises(ModelFolderError, match="not a full checkpoint"):
        load_colqwen2_5(folder)  # an adapter is merged by adapter.py, never loaded as a model


@pytest.mark.slow  # one export of tiny-2.5
def test_export_merges_the_adapter_and_names_it(adapter, tmp_path):
    """`colembed export ADAPTER --base BASE`: the folder serves peft's merged model (queries,
    per token within the export check's 1e-4), names the adapter, and leaves no merged copy."""
    import numpy as np

    import colembed
    from colembed_export.pipeline.exporter import export_model

    base, folder, want, _, inputs = adapter
    out = tmp_path / "exported"
    report = export_model(folder, out, base=base, random_weights=True)
    assert report.check["fp32"]["max_abs_diff"] <= 1e-4
    assert report.manifest.family == "colqwen2.5"
    assert (
        str(folder) in report.manifest.model.source
        and "LoRA adapter" in report.manifest.model.source
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exported"]  # the merged copy is gone
    got = colembed.load(out).embed_queries(list(QUERIES[:3]))
    mask = inputs[0]["attention_mask"].bool()
    expected = [want[0][int(mask[:i].sum()) : int(mask[: i + 1].sum())].numpy() for i in range(3)]
    for g, w in zip(got, expected):
        assert g.shape == w.shape and np.abs(g - w).max() <= 1e-4
