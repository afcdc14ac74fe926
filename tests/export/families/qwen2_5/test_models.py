"""The published ColQwen2.5 retrievers by name: each (adapter + base) layout, replicated tiny,
merged against peft's own merge, exported, and served under its models.json name.

docs/models-colqwen2_5.md records what each published model is and where each fact came from.
Each `Layout` below replicates one way an adapter and its base are laid out on disk, built the way
its publisher built it: peft itself wraps a model of the training code's module layout (so the
saved keys and config are peft's, not ours), the LoRA weights are made non-zero, and the oracle is
peft's `merge_and_unload` on that model, run through colpali-engine 0.3.12's embedding forward
(`ColpaliColQwen2_5`, shared with test_qwen2_5_peft.py). What differs between layouts is data:

- `colnomic`: nomic-ai/colnomic-embed-multimodal-3b/-7b. Trained with nomic-ai's colpali fork:
  `ColQwen2_5` on Qwen2_5_VLForConditionalGeneration (transformers < 4.52: language model at
  `model.`, tower at `visual.`), target regex `(.*(model).*(proj names).*$|.*(custom_text_proj).*$)`
  with no vision exclusion, r = alpha. Its 7B base (nomic-ai/colqwen2.5-7B-base) is sharded,
  has untied embeddings (an `lm_head` stored) and the flat pre-4.52 config: the base here is all
  three (tiny-2.5 is untied).
- `retrained`: the same training config on today's Qwen2_5_VLForConditionalGeneration layout
  (`model.language_model.`, `model.visual.`), where that regex also reaches the vision tower's
  MLPs: an adapter with vision LoRA tensors (no published one has them; a retrain would).
- `saved_projection`: `custom_text_proj` trained whole (peft `modules_to_save`) with LoRA on the
  language model, on 0.3.12's layout. No published ColQwen2.5 config found uses it
  (docs/models-colqwen2_5.md); peft writes it for any ColPali-style training that does.
- `trained_biases`: the same with peft's `bias="all"`: every bias of the model trained and saved
  (LoRA layers' as `*.base_layer.bias`, plus peft's untrained `original_module` copy). None known.

vidore/colqwen2.5-v0.2's own layout (0.3.12 names, the vision-excluding regex, LoRA on
custom_text_proj) is test_qwen2_5_peft.py's. What the tiny replicas do not model: the published
widths and depths, bf16 storage, and the unpublished parts of each adapter (for T-Systems' and
Metric-AI's adapters the config itself; their names are served from the 0.3.12/vidore layout).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from torch import nn

from tests.fixtures.builds import PARITY_TOLERANCE
from tests.fixtures.qwen2_5 import checkpoint, reference_processor
from tests.fixtures.samples import QUERIES
from tests.export.families.qwen2_5.test_peft import ColpaliColQwen2_5, embed

pytestmark = pytest.mark.heavy("qwen2.5")

MERGE_TOLERANCE = 1e-5
# nomic-ai/colpali scripts/configs/qwen2/train_colqwen2.5-v0.2.yaml and train_nomic_qwen*.yaml
NOMIC_TARGETS = (
    r"(.*(model).*(down_proj|gate_proj|up_proj|k_proj|q_proj|v_proj|o_proj).*$|"
    r".*(custom_text_proj).*$)"
)
LANGUAGE_TARGETS = (
    r".*(language_model)(?!.*visual).*(down_proj|gate_proj|up_proj|k_proj|q_proj|"
    r"v_proj|o_proj).*$"
)
COLNOMIC_NAMES = ("nomic-ai/colnomic-embed-multimodal-3b", "nomic-ai/colnomic-embed-multimodal-7b")


class Pre452Layout(nn.Module):
    """colpali-engine's ColQwen2_5 module tree before transformers 4.52 (a
    Qwen2_5_VLForConditionalGeneration: `model` = language model, `visual`, `custom_text_proj`),
    over the very modules of a 0.3.12 model, so that peft's in-place wrapping and merging land in
    the model whose forward is the oracle."""

    def __init__(self, model: ColpaliColQwen2_5):
        super().__init__()
        self.model, self.visual = model.language_model, model.visual
        self.custom_text_proj = model.custom_text_proj


class ForConditionalGenerationLayout(nn.Module):
    """transformers >= 4.52's Qwen2_5_VLForConditionalGeneration tree (`model.language_model`,
    `model.visual`) plus `custom_text_proj`, over a 0.3.12 model's modules."""

    def __init__(self, model: ColpaliColQwen2_5):
        super().__init__()
        self.model = nn.Module()
        self.model.language_model, self.model.visual = model.language_model, model.visual
        self.custom_text_proj = model.custom_text_proj


@dataclass(frozen=True)
class Layout:
    """One (adapter + base) layout: how the base is stored, what peft wrapped, what it targeted."""

    name: str
    tree: type | None  # the training model's module tree (None: 0.3.12's own, the model itself)
    target_modules: str
    modules_to_save: tuple[str, ...] = ()
    base_pre_4_52: bool = False  # flat config, LM head when untied (to_colpali_layout)
    base_shards: int = 1
    vision_lora: bool = False  # the saved adapter holds LoRA tensors of the vision tower
    bias: str = "none"  # peft's bias training ("all": every bias of the model, vision included)
    config: dict = field(default_factory=lambda: {"r": 8, "lora_alpha": 8})


LAYOUTS = {
    "colnomic": Layout("colnomic", Pre452Layout, NOMIC_TARGETS, base_pre_4_52=True, base_shards=3),
    "retrained": Layout(
        "retrained", ForConditionalGenerationLayout, NOMIC_TARGETS, vision_lora=True
    ),
    "saved_projection": Layout(
        "saved_projection",
        None,
        LANGUAGE_TARGETS,
        modules_to_save=("custom_text_proj",),
        config={"r": 4, "lora_alpha": 16},
    ),
    "trained_biases": Layout(
        "trained_biases", None, LANGUAGE_TARGETS, modules_to_save=("custom_text_proj",), bias="all"
    ),
}


def batches(folder):
    from tests.fixtures.images import rgb

    processor = reference_processor(folder)
    pages = [rgb(140, 196, seed=1), rgb(56, 84, seed=2)]  # several windows; smaller than one
    return [processor.process_queries(list(QUERIES[:3])), processor.process_images(pages)]


def base_folder(tmp_path_factory, layout: Layout):
    """The layout's base: tiny-2.5's weights in colpali-engine's layout as this publisher stores it."""
    from colembed_export.testing.tiny_qwen2_5 import to_colpali_layout
    from tests.fixtures.builds import build_once

    if not layout.base_pre_4_52 and layout.base_shards == 1:
        return checkpoint(tmp_path_factory, "tiny-2.5", "colpali")
    source = checkpoint(tmp_path_factory, "tiny-2.5", "transformers")
    name = f"tiny-2.5-colpali-pre452-{layout.base_shards}"
    return (
        build_once(
            tmp_path_factory,
            f"qwen2_5-{name}",
            lambda f: to_colpali_layout(
                source, f / name, pre_4_52=layout.base_pre_4_52, shards=layout.base_shards
            ),
        )
        / name
    )


def build_adapter(tmp_path_factory, layout: Layout):
    """(base folder, adapter folder, peft-merged embeddings per batch, unmerged ones, batches)."""
    from peft import LoraConfig, get_peft_model

    base = base_folder(tmp_path_factory, layout)
    # transformers' own conversion mapping ("^model" -> "language_model") reads every layout
    model = ColpaliColQwen2_5.from_pretrained(base, dtype=torch.float32).eval()
    inputs = batches(base)
    before = [embed(model, b) for b in inputs]
    tree = model if layout.tree is None else layout.tree(model)
    config = LoraConfig(
        **layout.config,
        lora_dropout=0.1,
        init_lora_weights="gaussian",
        bias=layout.bias,
        task_type="FEATURE_EXTRACTION",
        target_modules=layout.target_modules,
        modules_to_save=list(layout.modules_to_save) or None,
    )
    peft_model = get_peft_model(tree, config)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():  # "trained": away from the init
            if param.requires_grad and "lora_A" not in name:  # B, saved modules, trained biases
                param.add_(0.05 * torch.randn(param.shape, generator=generator))
    folder = tmp_path_factory.mktemp(f"adapter-{layout.name}") / layout.name
    peft_model.save_pretrained(folder)
    saved = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(
        json.dumps({**saved, "base_model_name_or_path": str(base)})
    )
    merged = peft_model.merge_and_unload().eval()
    for name in layout.modules_to_save:  # the trained copy lives on the training tree
        setattr(model, name, getattr(merged, name))
    return base, folder, [embed(model, b) for b in inputs], before, inputs


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def layout_adapter(request, tmp_path_factory):
    return LAYOUTS[request.param], build_adapter(tmp_path_factory, LAYOUTS[request.param])


def saved_keys(folder) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(folder / "adapter_model.safetensors"), "pt") as f:
        return list(f.keys())


def test_each_adapter_is_what_its_training_config_saves(layout_adapter):
    """The replicas differ where the published layouts do (names, vision targets, saved modules)."""
    layout, (base, folder, *_) = layout_adapter
    keys = saved_keys(folder)
    lora = [k for k in keys if ".lora_" in k]
    assert lora and all(k.startswith("base_model.model.") for k in keys)
    assert any("visual" in k for k in lora) == layout.vision_lora
    prefix = {
        "colnomic": "base_model.model.model.layers.",
        "retrained": "base_model.model.model.language_model.layers.",
    }.get(layout.name, "base_model.model.language_model.layers.")
    assert any(k.startswith(prefix) for k in lora)
    whole = sorted(k for k in keys if ".lora_" not in k)
    if layout.bias == "all":
        assert any(k.endswith(".q_proj.base_layer.bias") for k in whole)
        assert any(k.startswith("base_model.model.visual.") for k in whole)
        assert "base_model.model.custom_text_proj.original_module.bias" in whole
    else:
        assert whole == (
            ["base_model.model.custom_text_proj.bias", "base_model.model.custom_text_proj.weight"]
            if layout.modules_to_save
            else []
        )
    if layout.base_shards > 1:
        index = json.loads((base / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) == layout.base_shards
        assert "lm_head.weight" in index["weight_map"]
        assert "text_config" not in json.loads((base / "config.json").read_text())


def test_each_layout_merges_like_peft(layout_adapter):
    """colembed's merge (renamed modules, whole tensors applied after) equals peft's own merge."""
    from colembed_export.families.qwen2_5.adapter import merge_adapter

    _, (base, folder, want, unmerged, inputs) = layout_adapter
    model = merge_adapter(folder)
    model.vlm.model.visual.get_dtype = lambda: torch.float32  # docs/reference-colqwen2_5.md
    for batch, expected, before in zip(inputs, want, unmerged):
        got = embed(model, batch)
        assert (got - expected).abs().max() <= MERGE_TOLERANCE
        assert (got - before).abs().max() > 100 * MERGE_TOLERANCE  # the adapter changed the model


def test_a_whole_tensor_outside_modules_to_save_is_refused(tmp_path_factory, tmp_path):
    """A non-LoRA tensor is applied only where the config says peft saved it."""
    import shutil

    from colembed.errors import ModelFolderError
    from colembed_export.families.qwen2_5.adapter import merge_adapter

    _, folder, *_ = build_adapter(tmp_path_factory, LAYOUTS["saved_projection"])
    copy = tmp_path / "no-modules-to-save"
    shutil.copytree(folder, copy)
    config = json.loads((copy / "adapter_config.json").read_text())
    (copy / "adapter_config.json").write_text(json.dumps({**config, "modules_to_save": None}))
    with pytest.raises(ModelFolderError, match=r"not in modules_to_save.*custom_text_proj"):
        merge_adapter(copy)


@pytest.fixture(scope="module")
def exported_colnomic_layout(tmp_path_factory):
    """`colembed export ADAPTER` of the colnomic layout (sharded pre-4.52 base with an LM head,
    nomic's regex), with the check on; and the peft oracle's embeddings."""
    from colembed_export.pipeline.exporter import export_model

    base, folder, want, _, inputs = build_adapter(tmp_path_factory, LAYOUTS["colnomic"])
    out = tmp_path_factory.mktemp("colnomic-export") / "colnomic"
    report = export_model(folder, out, random_weights=True)
    return report, want, inputs


def test_colnomic_layout_exports_within_the_check(exported_colnomic_layout):
    """The export merges the adapter into the sharded base, passes the check at 1e-4 per token,
    and serves peft's merged model: queries and pages, per token."""
    import colembed
    from tests.fixtures.images import rgb

    report, want, inputs = exported_colnomic_layout
    assert report.check["fp32"]["max_abs_diff"] <= PARITY_TOLERANCE
    assert report.manifest.family == "colqwen2.5" and report.manifest.embedding_dim == 128
    assert "LoRA adapter" in report.manifest.model.source
    model = colembed.load(report.folder)
    pages = [rgb(140, 196, seed=1), rgb(56, 84, seed=2)]
    for got_rows, batch, expected in zip(
        (model.embed_queries(list(QUERIES[:3])), model.embed_images(pages)), inputs, want
    ):
        # `embed` keeps each row's real tokens, rows in batch order (whatever the padding side)
        offsets = np.cumsum([0] + batch["attention_mask"].sum(dim=1).tolist())
        for i, got in enumerate(got_rows):
            rows = expected[offsets[i] : offsets[i + 1]].numpy()
            assert got.shape == rows.shape and np.abs(got - rows).max() <= PARITY_TOLERANCE


def _package_imports(module: str) -> set[str]:
    """The export package's modules (dotted, under colembed_export) that `module` imports, at the
    top or inside functions."""
    import ast
    from pathlib import Path

    import colembed_export

    path = Path(colembed_export.__file__).parent.joinpath(*module.split(".")).with_suffix(".py")
    package = module.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - node.level + 1]
            found.add(".".join(base + ([node.module] if node.module else [])))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
            "colembed_export."
        ):
            found.add(node.module.split(".", 1)[1])
    return found


def test_adapter_and_checkpoint_loading_import_one_way():
    """One home per decision: the layouts' names import nothing of the package, the checkpoint
    loader knows no adapter, the adapter builds on the loader."""
    family = "families.qwen2_5"
    assert _package_imports(f"{family}.layouts") == set()
    assert f"{family}.adapter" not in _package_imports(f"{family}.checkpoint")
    assert f"{family}.checkpoint" in _package_imports(f"{family}.adapter")
    assert f"{family}.checkpoint" not in _package_imports("testing.tiny_qwen2_5")
    assert f"{family}.layouts" in _package_imports("testing.tiny_qwen2_5")


# ------------------------------------------------------------------------------------ by name
def colqwen2_5_names() -> list[str]:
    from colembed import registry

    return [e.model for e in registry.known_models() if e.family == "colqwen2.5"]


def test_every_published_colqwen2_5_adapter_is_named():
    """models.json names each retriever of docs/models-colqwen2_5.md with the adapter `colembed
    export` reads and the base its adapter_config.json names."""
    from colembed import registry

    expected = {
        "colqwen2.5": ("vidore/colqwen2.5-v0.2", "vidore/colqwen2.5-base"),
        "nomic-ai/colnomic-embed-multimodal-3b": (
            "nomic-ai/colnomic-embed-multimodal-3b",
            "vidore/colqwen2.5-base",
        ),
        "nomic-ai/colnomic-embed-multimodal-7b": (
            "nomic-ai/colnomic-embed-multimodal-7b",
            "nomic-ai/colqwen2.5-7B-base",
        ),
        "tsystems/colqwen2.5-3b-multilingual-v1.0": (
            "tsystems/colqwen2.5-3b-multilingual-v1.0",
            "tsystems/colqwen2.5-3b-base",
        ),
        "Metric-AI/ColQwen2.5-3b-multilingual-v1.0": (
            "Metric-AI/ColQwen2.5-3b-multilingual-v1.0",
            "Metric-AI/colqwen2.5-3b-base",
        ),
    }
    assert sorted(colqwen2_5_names()) == sorted(expected)
    for name, (source, base) in expected.items():
        entry = registry.get_model(name)
        assert (entry.checkpoint, entry.base_checkpoint, entry.dim) == (source, base, 128)
        assert entry.export_command("OUT") == f"colembed export {source} --out OUT"


@pytest.mark.parametrize(
    "name",
    COLNOMIC_NAMES
    + ("tsystems/colqwen2.5-3b-multilingual-v1.0", "Metric-AI/ColQwen2.5-3b-multilingual-v1.0"),
)
def test_fastembed_by_name_is_colembed_load_bit_for_bit(
    name, exported_colnomic_layout, tmp_path, monkeypatch
):
    """`LateInteractionMultimodalEmbedding(name)` and `colembed.load(name)`, both found in the
    cache under the name, give the vectors of `colembed.load(folder)` exactly."""
    import os

    import colembed
    from colembed import registry
    from colembed.fastembed import LateInteractionMultimodalEmbedding
    from tests.fixtures.images import rgb

    folder = exported_colnomic_layout[0].folder
    entry = registry.get_model(name)
    cached = tmp_path / entry.cache_folder_name
    cached.mkdir()
    for path in folder.iterdir():
        os.link(path, cached / path.name)
    monkeypatch.setenv("FASTEMBED_CACHE_PATH", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    pages = [rgb(140, 196, seed=1), rgb(56, 84, seed=2)]
    own = colembed.load(folder)
    want_q, want_p = own.embed_queries(list(QUERIES[:3])), own.embed_images(pages)
    fe = LateInteractionMultimodalEmbedding(name)
    assert fe.embedding_size == 128
    by_name = colembed.load(name)
    for got_q, got_p in (
        (list(fe.embed_text(list(QUERIES[:3]))), list(fe.embed_image(pages))),
        (by_name.embed_queries(list(QUERIES[:3])), by_name.embed_images(pages)),
    ):
        for got, want in zip(got_q + got_p, list(want_q) + list(want_p)):
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("name", COLNOMIC_NAMES)
def test_a_missing_export_names_the_adapter_command(name, tmp_path):
    from colembed.errors import ModelFolderError
    from colembed.fastembed import LateInteractionMultimodalEmbedding

    with pytest.raises(ModelFolderError, match=f"colembed export {name} --out"):
        LateInteractionMultimodalEmbedding(name, cache_dir=str(tmp_path))
