"""TomoroAI's ColQwen3 layout (`tomoro-colqwen3-embed-4b` / `-8b`): replicated tiny, exported,
equal to the reference, and served under its models.json names.

docs/models-colqwen3.md records what TomoroAI's published remote code does and where each fact
came from. The replica (`tiny_qwen3.to_tomoro_layout`) holds tiny-3's weights under TomoroAI's
names and config; two references judge the export:
- `TomoroReference`: TomoroAI's computation rebuilt from transformers 4.57.1's own classes, as
  their `ColQwen3` does it: `vlm` is the `Qwen3VLForConditionalGeneration` that
  `AutoModelForImageTextToText.from_config` builds from the config's text and vision configs, loaded
  strictly with the file's `vlm.*` tensors; `embedding_proj_layer` (Linear with bias) on the
  backbone's last hidden state, divided by its norm clamped at eps, times the mask. Their processor:
  the query text stripped, `"" + text + pad_token * 10`; pages with ColQwen2's prompt, the image
  processor's longest edge replaced by 1280 image tokens; left padding.
- the pinned colpali-engine 0.3.18 reference on transformers 5.24 (`tests.fixtures.qwen3.reference`) of
  tiny-3, the same weights: pages and the queries that stripping leaves unchanged.
What the replica does not model is listed in `to_tomoro_layout`'s docstring.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from tests.fixtures.builds import PARITY_TOLERANCE
from tests.fixtures.qwen3 import checkpoint, reference, tomoro_checkpoint, tomoro_exported

TOMORO_NAMES = ("TomoroAI/tomoro-colqwen3-embed-4b", "TomoroAI/tomoro-colqwen3-embed-8b")
# The family's plain name: an alias of the checkpoint colpali-engine's ColQwen3 targets (its README
# lists it as the ColQwen3 model, its integration tests load it; docs/models-colqwen3.md).
PLAIN_NAME = "colqwen3"
COLQWEN3_NAMES = (*TOMORO_NAMES, PLAIN_NAME)
# Queries whose text TomoroAI's processor changes (surrounding whitespace of several kinds) and
# ones it does not.
QUERIES = (
    "What was the revenue in 2023?",
    "  spaces around  ",
    "\ttab and newline\n",
    "表格中的数字是多少？",
    "",
)


class TomoroReference:
    """TomoroAI's ColQwen3 forward and processor semantics on 4.57.1's classes (module docstring)."""

    def __init__(self, folder) -> None:
        import torch
        from safetensors.torch import load_file
        from transformers import AutoModelForImageTextToText, Qwen2TokenizerFast, Qwen3VLConfig
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

        config = json.loads((folder / "config.json").read_text())
        image = json.loads((folder / "preprocessor_config.json").read_text())
        vlm_config = Qwen3VLConfig(
            text_config=config["text_config"],
            vision_config=config["vision_config"],
            image_token_id=config["image_token_id"],
            video_token_id=config["video_token_id"],
            vision_start_token_id=config["vision_start_token_id"],
            vision_end_token_id=config["vision_end_token_id"],
            tie_word_embeddings=config["text_config"].get("tie_word_embeddings", False),
        )
        self.vlm = AutoModelForImageTextToText.from_config(vlm_config).to(torch.float32).eval()
        weights = load_file(str(folder / "model.safetensors"))
        self.vlm.load_state_dict(
            {k[len("vlm.") :]: v for k, v in weights.items() if k.startswith("vlm.")}, strict=True
        )
        self.proj = torch.nn.Linear(vlm_config.text_config.hidden_size, config["embed_dim"])
        self.proj.load_state_dict(
            {
                "weight": weights["embedding_proj_layer.weight"],
                "bias": weights["embedding_proj_layer.bias"],
            }
        )
        # Their `from_pretrained(max_num_visual_tokens=1280)` sets the longest edge; the shortest
        # is the file's `size.shortest_edge`, which 4.57.1's slow processor would replace by its
        # default (colembed honours the file: docs/models-colqwen3.md), hence min_pixels here.
        tile = image["patch_size"] * image["merge_size"]
        self.image_processor = Qwen2VLImageProcessor(
            patch_size=image["patch_size"],
            merge_size=image["merge_size"],
            temporal_patch_size=image["temporal_patch_size"],
            image_mean=image["image_mean"],
            image_std=image["image_std"],
            min_pixels=image["size"]["shortest_edge"],
            max_pixels=1280 * tile * tile,
        )
        self.tokenizer = Qwen2TokenizerFast.from_pretrained(folder)
        self.tokenizer.padding_side = "left"

    def _embed(self, batch) -> list[np.ndarray]:
        import torch

        with torch.no_grad():
            hidden = self.vlm.model(**batch, use_cache=False).last_hidden_state
            out = self.proj(hidden)
            out = out / out.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(out.dtype).eps)
            out = out * batch["attention_mask"].unsqueeze(-1)
        return [row[mask == 1].numpy() for row, mask in zip(out, batch["attention_mask"])]

    def queries(self, texts) -> list[np.ndarray]:
        prompts = ["" + t.strip() + self.tokenizer.pad_token * 10 for t in texts]
        return self._embed(dict(self.tokenizer(prompts, padding="longest", return_tensors="pt")))

    @staticmethod
    def _rgb(image):
        """A page as colpali-engine's ColQwen3 hands it over on transformers 5.x: its own
        `convert("RGB")`, then 5.x's `convert_to_rgb`, which composites a transparency key the
        first conversion kept onto white (4.57.1's processor below would drop it)."""
        from PIL import Image

        rgb = image.convert("RGB")
        if rgb.info.get("transparency") is None:
            return rgb
        white = Image.new("RGBA", rgb.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgb.convert("RGBA")).convert("RGB")

    def pages(self, images) -> list[np.ndarray]:
        from colembed_export.families.preprocess_config import UPSTREAM_PAGE_PROMPT

        images = [self._rgb(image) for image in images]
        found = self.image_processor(images=images, return_tensors="pt")
        merge = self.image_processor.merge_size**2
        prompts = [
            UPSTREAM_PAGE_PROMPT.replace("<|image_pad|>", "<|image_pad|>" * int(g.prod() // merge))
            for g in found["image_grid_thw"]
        ]
        batch = dict(self.tokenizer(prompts, padding="longest", return_tensors="pt"))
        return self._embed(
            {
                **batch,
                "pixel_values": found["pixel_values"],
                "image_grid_thw": found["image_grid_thw"],
            }
        )


def test_the_replica_is_tomoros_layout(tmp_path_factory):
    from safetensors import safe_open

    folder = tomoro_checkpoint(tmp_path_factory)
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "colqwen3" and config["embed_dim"] == 320
    assert "text_config" in config and "vlm_config" not in config
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert {k.split(".")[0] for k in keys} == {"vlm", "embedding_proj_layer"}
    assert any(k.startswith("vlm.model.visual.deepstack_merger_list.") for k in keys)
    assert any(k.startswith("vlm.model.language_model.layers.") for k in keys)
    assert "vlm.lm_head.weight" in keys  # tiny-3 is untied, as the 8B
    image = json.loads((folder / "preprocessor_config.json").read_text())
    assert "max_pixels" not in image and image["size"]["longest_edge"] == 16777216


def test_tomoros_layout_reads_its_processors_differences(tmp_path_factory):
    from colembed_export.families.preprocess_config import read_preprocess_config

    tomoro = read_preprocess_config(tomoro_checkpoint(tmp_path_factory))
    colpali = read_preprocess_config(checkpoint(tmp_path_factory, "tiny-3"))
    assert tomoro.query_strip and not colpali.query_strip
    assert tomoro.query_prefix == "" and tomoro.query_augmentation_token == "<|endoftext|>"
    assert tomoro.max_image_tokens == 1280  # the processor's default, not the file's 16384
    assert tomoro.min_pixels == 65536 and tomoro.patch_size == 16


def test_tomoros_page_prompt_is_prefix_plus_suffix(tmp_path_factory, tmp_path):
    """TomoroAI's processor writes `visual_prompt_prefix + visual_prompt_suffix`: a
    processor_config.json stating its prefix still gives the whole prompt (ColQwen2's reading
    would drop the suffix), and a stated suffix is used."""
    import shutil

    from colembed_export.families.preprocess_config import (
        UPSTREAM_PAGE_PROMPT,
        read_preprocess_config,
    )

    folder = shutil.copytree(tomoro_checkpoint(tmp_path_factory), tmp_path / "with-processor")
    assert read_preprocess_config(folder).page_prompt == UPSTREAM_PAGE_PROMPT
    prefix = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe the image."
    (folder / "processor_config.json").write_text(json.dumps({"visual_prompt_prefix": prefix}))
    assert read_preprocess_config(folder).page_prompt == UPSTREAM_PAGE_PROMPT
    (folder / "processor_config.json").write_text(
        json.dumps({"visual_prompt_prefix": prefix, "visual_prompt_suffix": "<|im_end|>"})
    )
    assert read_preprocess_config(folder).page_prompt == prefix + "<|im_end|>"


def test_query_strip_reaches_the_encoder_and_the_manifest_only_when_set(tmp_path_factory):
    """The text encoder strips a Tomoro folder's queries and no other; the manifest field exists
    only when set (other folders' manifests, and older ones, read as before)."""
    from dataclasses import replace

    from colembed.errors import ManifestError
    from colembed.preprocess.config import PreprocessConfig
    from colembed.preprocess.text import TextEncoder
    from colembed_export.families.preprocess_config import read_preprocess_config

    folder = tomoro_checkpoint(tmp_path_factory)
    tomoro = read_preprocess_config(folder)
    colpali = replace(tomoro, query_strip=False)
    for config, stripped in ((tomoro, True), (colpali, False)):
        encoder = TextEncoder.from_file(folder / "tokenizer.json", config)
        padded, bare = encoder.encode_queries([" \tinvoice total\n ", "invoice total"])
        assert (padded.shape == bare.shape and (padded == bare).all()) == stripped
    assert tomoro.to_dict()["query_strip"] is True and "query_strip" not in colpali.to_dict()
    assert PreprocessConfig.from_dict(tomoro.to_dict()) == tomoro
    assert PreprocessConfig.from_dict(colpali.to_dict()) == colpali
    with pytest.raises(ManifestError, match="query_strip: expected bool"):
        PreprocessConfig.from_dict({**tomoro.to_dict(), "query_strip": 1})


def test_tomoros_layout_loads_the_same_model_as_colpalis(tmp_path_factory):
    """The same weights under both layouts' names load to the same embeddings, bit for bit."""
    import torch

    from colembed_export.families.qwen3.checkpoint import load_colqwen3

    tomoro = load_colqwen3(tomoro_checkpoint(tmp_path_factory))
    colpali = load_colqwen3(checkpoint(tmp_path_factory, "tiny-3"))
    ids = torch.tensor([[151644, 872, 198, 3838, 374, 151643, 151643]])
    with torch.no_grad():
        got = tomoro(input_ids=ids, attention_mask=torch.ones_like(ids)).embeddings
        want = colpali(input_ids=ids, attention_mask=torch.ones_like(ids)).embeddings
    assert torch.equal(got, want)


def test_a_projection_width_unlike_embed_dim_is_refused(tmp_path_factory, tmp_path):
    import shutil

    from colembed.errors import ExportError
    from colembed_export.families.qwen3.checkpoint import load_colqwen3

    folder = shutil.copytree(tomoro_checkpoint(tmp_path_factory), tmp_path / "wrong-dim")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "embed_dim": 128}))
    with pytest.raises(ExportError, match="embed_dim 128 disagrees with the projection's 320"):
        load_colqwen3(folder)


def test_an_unnamed_tensor_is_refused(tmp_path_factory, tmp_path):
    """A tensor neither layout rule names (here a colpali-engine name in a TomoroAI folder) is
    refused by name, not skipped."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from colembed.errors import ExportError
    from colembed_export.families.qwen3.checkpoint import load_colqwen3

    folder = shutil.copytree(tomoro_checkpoint(tmp_path_factory), tmp_path / "stray")
    weights = load_file(str(folder / "model.safetensors"))
    weights["model.custom_text_proj.weight"] = torch.zeros(320, 64)
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(ExportError, match="model.custom_text_proj.weight"):
        load_colqwen3(folder)


@pytest.mark.slow
def test_the_exported_tomoro_layout_gives_tomoros_embeddings(tmp_path_factory):
    """Queries (stripped where TomoroAI strips) and pages of several sizes, alone and batched,
    per token <= 1e-4 against TomoroAI's computation."""
    import colembed
    from colembed_export.families.qwen3.reference import reference_pages

    folder = tomoro_exported(tmp_path_factory)
    model = colembed.load(folder)
    assert model.family.name == "colqwen3" and model.embedding_size == 320
    oracle = TomoroReference(tomoro_checkpoint(tmp_path_factory))
    pages = reference_pages()
    figures = {}
    for i, (got, want) in enumerate(
        zip(model.embed_queries(list(QUERIES)), oracle.queries(list(QUERIES)))
    ):
        assert got.shape == want.shape, QUERIES[i]
        figures[f"query {i} batched"] = np.abs(got - want).max()
        (alone,) = model.embed_queries([QUERIES[i]])
        figures[f"query {i}"] = np.abs(alone - oracle.queries([QUERIES[i]])[0]).max()
    for i, (got, want) in enumerate(
        zip(model.embed_images(pages[:4], batch_size=4), oracle.pages(pages[:4]))
    ):
        assert got.shape == want.shape
        figures[f"page {i} batched"] = np.abs(got - want).max()
    for i, page in enumerate(pages):
        (alone,) = model.embed_images([page])
        (want,) = oracle.pages([page])
        assert alone.shape == want.shape, i
        figures[f"page {i}"] = np.abs(alone - want).max()
    bad = {k: v for k, v in figures.items() if not v <= PARITY_TOLERANCE}
    assert not bad, bad
    assert max(figures.values()) > 0


@pytest.mark.slow
def test_the_exported_folder_strips_queries(tmp_path_factory):
    """What TomoroAI's processor does to a query the exported folder does: "  x\n" is "x"
    (the encoder-level test shows the unstripped ids differ)."""
    import colembed

    model = colembed.load(tomoro_exported(tmp_path_factory))
    assert model.config.query_strip
    padded, bare = model.embed_queries(["  spaces around\n", "spaces around"])
    np.testing.assert_array_equal(padded, bare)


@pytest.mark.slow
def test_the_exported_tomoro_layout_gives_colpali_engines_embeddings(tmp_path_factory):
    """The pinned reference (colpali-engine 0.3.18 ColQwen3 on transformers 5.24) of the same
    weights: every page, and the queries stripping leaves as they are, <= 1e-4 per token."""
    import colembed
    from colembed_export.families.qwen3.reference import QUERIES as REFERENCE_QUERIES
    from colembed_export.families.qwen3.reference import reference_pages

    ref = reference(tmp_path_factory, "tiny-3")
    model = colembed.load(tomoro_exported(tmp_path_factory))
    figures = {}
    for i, query in enumerate(REFERENCE_QUERIES):
        if query == query.strip():
            (got,) = model.embed_queries([query])
            figures[f"query {i}"] = np.abs(got - ref[f"query{i}"]).max()
    for i, page in enumerate(reference_pages()):
        (got,) = model.embed_images([page])
        assert got.shape == ref[f"page{i}"].shape
        figures[f"page {i}"] = np.abs(got - ref[f"page{i}"]).max()
    assert len(figures) >= 9
    bad = {k: v for k, v in figures.items() if not v <= PARITY_TOLERANCE}
    assert not bad, bad


@pytest.mark.slow
def test_an_index_refuses_a_model_of_another_family_by_name(
    exported_tiny, tmp_path, tmp_path_factory
):
    """A ColQwen3 index (320-dim pages) opened with a ColQwen2 model (128-dim) is refused with an
    error naming both widths and the family, whether it holds pages or is still empty."""
    import colembed
    from colembed.index import Index, ModelMismatchError
    from colembed_export.families.qwen3.reference import reference_pages

    qwen3 = colembed.load(tomoro_exported(tmp_path_factory))
    qwen2 = colembed.load(exported_tiny.folder)
    reference_pages()[0].save(tmp_path / "page.png")
    with Index(tmp_path / "empty", model=qwen3):
        pass
    with Index(tmp_path / "db", model=qwen3) as index:
        index.add([tmp_path / "page.png"])
        assert len(index) == 1
    for name in ("db", "empty"):
        with pytest.raises(
            ModelMismatchError,
            match=r"holds 320-dim page vectors.*ColQwen2 model "
            r".* makes 128-dim ones.*another model family",
        ):
            Index(tmp_path / name, model=qwen2)
    with Index(tmp_path / "db", model=qwen3) as index:  # the refusal left the index usable
        assert len(index) == 1


# ------------------------------------------------------------------------------------ by name
def test_both_tomoro_models_are_named():
    from colembed import registry

    for name in TOMORO_NAMES:
        entry = registry.get_model(name)
        assert (entry.family, entry.dim, entry.checkpoint) == ("colqwen3", 320, name)
        assert entry.base_checkpoint is None
        assert entry.export_command("OUT") == f"colembed export {name} --out OUT"


def test_colqwen3_is_the_4b_under_its_family_name():
    """ "colqwen3" is the same entry as TomoroAI's 4B (any case): one cache folder, one export
    command, listed to FastEmbed under both names with the entry's width."""
    from colembed import registry
    from colembed.fastembed import LateInteractionMultimodalEmbedding

    four_b = registry.get_model(TOMORO_NAMES[0])
    for name in (PLAIN_NAME, "ColQwen3"):
        assert registry.get_model(name) is four_b
    assert four_b.names == (TOMORO_NAMES[0], PLAIN_NAME)
    assert registry.get_model(TOMORO_NAMES[1]).aliases == ()
    described = {d["model"]: d for d in LateInteractionMultimodalEmbedding.list_supported_models()}
    assert described[PLAIN_NAME]["dim"] == 320
    assert described[PLAIN_NAME]["sources"] == described[TOMORO_NAMES[0]]["sources"]
    assert TOMORO_NAMES[0] in described[PLAIN_NAME]["description"]
    assert LateInteractionMultimodalEmbedding.get_embedding_size(PLAIN_NAME) == 320


@pytest.mark.parametrize(
    "aliases, error",
    [
        (["colqwen2"], "unique"),  # another entry's name
        (["colqwen3", "COLQWEN3"], "unique"),
        (["../evil"], "not a plain name"),
        ("colqwen3", "must be a list"),
    ],
)
def test_an_alias_that_clashes_or_could_leave_the_cache_is_refused(tmp_path, aliases, error):
    import colembed
    from colembed import registry

    data = json.loads(registry.models_json_path().read_text())
    (four_b,) = [m for m in data["models"] if m["model"] == TOMORO_NAMES[0]]
    four_b["aliases"] = aliases
    path = tmp_path / "models.json"
    path.write_text(json.dumps(data))
    with pytest.raises(colembed.ColembedError, match=error):
        registry.known_models(path)


@pytest.mark.slow
@pytest.mark.parametrize("name", COLQWEN3_NAMES)
def test_fastembed_by_name_is_colembed_load_bit_for_bit(
    name, tmp_path_factory, tmp_path, monkeypatch
):
    """`LateInteractionMultimodalEmbedding(name)` and `colembed.load(name)`, both found in the
    cache under the name, give `colembed.load(folder)`'s vectors exactly."""
    import colembed
    from colembed import registry
    from colembed.fastembed import LateInteractionMultimodalEmbedding
    from colembed_export.families.qwen3.reference import reference_pages

    folder = tomoro_exported(tmp_path_factory)
    cached = tmp_path / registry.get_model(name).cache_folder_name
    cached.mkdir()
    for path in folder.iterdir():
        os.link(path, cached / path.name)
    monkeypatch.setenv("FASTEMBED_CACHE_PATH", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    pages, queries = reference_pages()[:2], list(QUERIES[:3])
    own = colembed.load(folder)
    want = list(own.embed_queries(queries)) + list(own.embed_images(pages))
    fe = LateInteractionMultimodalEmbedding(name)
    assert fe.embedding_size == 320
    by_name = colembed.load(name)
    assert fe.model.model.folder == by_name.folder == cached
    for got in (
        list(fe.embed_text(queries)) + list(fe.embed_image(pages)),
        list(by_name.embed_queries(queries)) + list(by_name.embed_images(pages)),
    ):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("name", COLQWEN3_NAMES)
def test_a_missing_export_names_the_export_command(name, tmp_path, monkeypatch):
    import colembed
    from colembed import registry
    from colembed.errors import ModelFolderError
    from colembed.fastembed import LateInteractionMultimodalEmbedding

    checkpoint = registry.get_model(name).checkpoint  # the plain name: the 4B's
    assert checkpoint in TOMORO_NAMES
    cached = tmp_path / registry.get_model(name).cache_folder_name
    command = f"colembed export {checkpoint} --out {cached}"
    with pytest.raises(ModelFolderError) as refused:
        LateInteractionMultimodalEmbedding(name, cache_dir=str(tmp_path))
    assert command in str(refused.value)
    monkeypatch.setenv("FASTEMBED_CACHE_PATH", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelFolderError) as refused:
        colembed.load(name)
    assert command in str(refused.value)
