"""Page images against the reference ColQwen2Processor.process_images (PIL Qwen2VLImageProcessor,
transformers 4.57.1): pixel values bit for bit, grids, page prompt ids; sizes; bad input; config."""

from __future__ import annotations

import io
import json
import shutil
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

import tests.fixtures.images as fx
from colembed.errors import ImageError, InputError, InputTypeError, ModelFolderError
from colembed.preprocess.config import PreprocessConfig
from colembed_export.families.preprocess_config import read_preprocess_config
from colembed.preprocess.images import (
    load_image,
    num_image_tokens,
    prepare_image,
    resized_grid,
    smart_resize,
)
from colembed.preprocess.text import pad_batch

# name -> zero-argument factory of what the user passes (PIL image or encoded bytes)
IMAGE_CASES = {
    "rgb_20x20": lambda: fx.rgb(20, 20),
    "rgb_1x150": lambda: fx.rgb(1, 150),  # 1 px wide, 150 tall
    "rgb_997x613": lambda: fx.rgb(997, 613),
    "rgb_3000x4000_png": lambda: fx.encode(fx.rgb(3000, 4000, seed=7), "PNG", compress_level=1),
    "rgb_10000x7000": lambda: fx.rgb(10000, 7000, seed=8),
    "rgba_transparent": fx.rgba_with_transparency,
    "mode_L": fx.grayscale,
    "mode_P_palette": fx.palette,
    "cmyk_jpeg": fx.cmyk_jpeg,
    "gray16_png_I;16": fx.gray16_png,
    "letter_page": fx.document_page,
    # a transparency key: ColQwen2's reference drops it (convert("RGB")); ColQwen3's composites
    # those pixels onto white (tests/export/families/qwen3/test_reference.py)
    "palette_png_transparency_key": lambda: fx.keyed_transparency("PNG"),
    "palette_gif_transparency_key": lambda: fx.keyed_transparency("GIF"),
    "mode_L_png_transparency_key": lambda: fx.keyed_transparency("PNG", "L"),
    "rgb_png_transparency_key": lambda: fx.keyed_transparency("PNG", "RGB"),
}

# transformers infers the channel axis from the array shape: an RGB array (1|3, W, 3) is read as
# channels-first. colembed always reads channels-last, i.e. the reference told so explicitly.
AMBIGUOUS_CASES = {
    "rgb_150x1": lambda: fx.rgb(150, 1),  # 150 wide, 1 tall
    "rgb_150x3": lambda: fx.rgb(150, 3),
}


def as_reference_input(obj):
    return fx.open_bytes(obj) if isinstance(obj, bytes) else obj


def reference_pages(processor, images, **kwargs):
    return {k: v.numpy() for k, v in processor.process_images(list(images), **kwargs).items()}


def assert_matches_reference(ref, row, prepared, encoder):
    """Row `row` of a reference batch equals one PreparedImage: pixels (diff 0), grid, prompt ids."""
    n = prepared.patches.shape[0]
    assert prepared.patches.dtype == np.float32
    assert tuple(ref["image_grid_thw"][row]) == prepared.grid_thw
    assert float(np.abs(ref["pixel_values"][row, :n] - prepared.patches).max()) == 0.0
    np.testing.assert_array_equal(ref["pixel_values"][row, :n], prepared.patches)
    assert not ref["pixel_values"][row, n:].any()  # the reference's padding, which colembed omits
    mask = ref["attention_mask"][row] == 1
    np.testing.assert_array_equal(
        ref["input_ids"][row][mask], encoder.page_prompt_ids(prepared.num_image_tokens)
    )


@pytest.mark.parametrize("name", list(IMAGE_CASES))
def test_pixels_grid_and_ids_equal_reference(name, config, encoder, reference_processor):
    obj = IMAGE_CASES[name]()
    prepared = prepare_image(obj, config)
    ref = reference_pages(reference_processor, [as_reference_input(obj)])
    assert_matches_reference(ref, 0, prepared, encoder)
    assert prepared.num_image_tokens <= config.max_pixels // config.pixels_per_image_token


@pytest.mark.parametrize("name", list(AMBIGUOUS_CASES))
def test_one_or_three_pixel_tall_images_equal_reference_read_channels_last(
    name, config, encoder, reference_processor
):
    image = AMBIGUOUS_CASES[name]()
    prepared = prepare_image(image, config)
    ref = reference_pages(reference_processor, [image], input_data_format="channels_last")
    assert_matches_reference(ref, 0, prepared, encoder)


def test_reference_misreads_one_and_three_pixel_tall_images(reference_processor, config):
    """Pins the upstream behaviour colembed deliberately does not copy (see images.py)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError):
            reference_processor.process_images([AMBIGUOUS_CASES["rgb_150x1"]()])
        transposed = reference_processor.process_images([AMBIGUOUS_CASES["rgb_150x3"]()])
    ours = prepare_image(AMBIGUOUS_CASES["rgb_150x3"](), config)
    assert tuple(transposed["image_grid_thw"][0].tolist()) != ours.grid_thw


def test_batch_of_mixed_sizes_equals_reference_padded_batch(config, encoder, reference_processor):
    objs = [
        IMAGE_CASES[n]()
        for n in ("rgb_20x20", "rgb_997x613", "rgba_transparent", "mode_L", "cmyk_jpeg")
    ]
    prepared = [prepare_image(obj, config, index=i) for i, obj in enumerate(objs)]
    ref = reference_pages(reference_processor, [as_reference_input(o) for o in objs])
    for row, item in enumerate(prepared):
        assert_matches_reference(ref, row, item, encoder)
    ids, mask = pad_batch(
        [encoder.page_prompt_ids(p.num_image_tokens) for p in prepared], config.pad_token_id
    )
    np.testing.assert_array_equal(ids, ref["input_ids"])
    np.testing.assert_array_equal(mask, ref["attention_mask"])


@pytest.fixture(scope="module")
def encoded_samples():
    return {"png": fx.encode(fx.rgb(997, 613, seed=9), "PNG"), "cmyk_jpeg": fx.cmyk_jpeg()}


INPUT_FORMS = ["str_path", "pathlib", "bytes", "bytearray", "memoryview", "bytesio", "file", "pil"]


@pytest.mark.parametrize("fmt", ["png", "cmyk_jpeg"])
@pytest.mark.parametrize("form", INPUT_FORMS)
def test_every_input_form_gives_the_reference_pixels(
    form, fmt, encoded_samples, tmp_path, config, encoder, reference_processor
):
    data = encoded_samples[fmt]
    path = tmp_path / f"page.{fmt}"
    path.write_bytes(data)
    if form == "file":
        with open(path, "rb") as handle:
            prepared = prepare_image(handle, config)
            assert not handle.closed  # a caller's file is left to the caller
    else:
        obj = {
            "str_path": lambda: str(path),
            "pathlib": lambda: path,
            "bytes": lambda: data,
            "bytearray": lambda: bytearray(data),
            "memoryview": lambda: memoryview(data),
            "bytesio": lambda: io.BytesIO(data),
            "pil": lambda: fx.open_bytes(data),
        }[form]()
        prepared = prepare_image(obj, config)
    ref = reference_pages(reference_processor, [fx.open_bytes(data)])
    assert_matches_reference(ref, 0, prepared, encoder)


@pytest.mark.parametrize("fmt", ["GIF", "TIFF"])
@pytest.mark.parametrize("form", ["file", "path", "bytes"])
def test_multi_frame_files_use_the_first_frame_and_leave_caller_files_open(
    fmt, form, tmp_path, config, encoder, reference_processor
):
    data = fx.animated(fmt)
    path = tmp_path / f"pages.{fmt.lower()}"
    path.write_bytes(data)
    if form == "file":
        with open(path, "rb") as handle:
            prepared = prepare_image(handle, config)
            assert not handle.closed
    else:
        prepared = prepare_image(path if form == "path" else data, config)
    ref = reference_pages(reference_processor, [fx.open_bytes(data)])
    assert_matches_reference(ref, 0, prepared, encoder)


def test_load_image_converts_like_the_reference():
    rgba = fx.rgba_with_transparency()
    loaded = load_image(rgba)
    assert loaded.mode == "RGB"
    np.testing.assert_array_equal(
        np.asarray(loaded), np.asarray(rgba.convert("RGB"))
    )  # alpha dropped
    already = fx.rgb(30, 20)
    assert load_image(already) is already  # as convert_to_rgb: no copy of an RGB image


# -- sizes ---------------------------------------------------------------------------------------


def reference_smart_resize(*args, **kwargs):
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize as upstream

    return upstream(*args, **kwargs)


@settings(max_examples=400, deadline=None)
@given(
    height=st.integers(1, 20000),
    width=st.integers(1, 20000),
    min_tokens=st.integers(1, 64),
    extra_tokens=st.integers(0, 2000),
)
def test_smart_resize_equals_reference(height, width, min_tokens, extra_tokens):
    factor = 28
    min_pixels, max_pixels = min_tokens * factor**2, (min_tokens + extra_tokens) * factor**2
    kwargs = dict(factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)
    try:
        expected = reference_smart_resize(height, width, **kwargs)
    except ValueError:
        with pytest.raises(ImageError):
            smart_resize(height, width, **kwargs)
        return
    assert smart_resize(height, width, **kwargs) == expected


@pytest.mark.parametrize(
    "height, width",
    [
        (42, 42),
        (70, 70),
        (98, 126),
        (14, 14),
        (1, 1),
        (28, 5600),
        (1650, 1275),
        (4000, 3000),
        (200, 1),
    ],
)
def test_smart_resize_rounding_edges(height, width):
    # 42/28 = 1.5 and 70/28 = 2.5 round half to even, as Python's round in the reference
    kwargs = dict(factor=28, min_pixels=3136, max_pixels=602112)
    assert smart_resize(height, width, **kwargs) == reference_smart_resize(height, width, **kwargs)


@pytest.mark.parametrize(
    "height, width", [(20, 20), (613, 997), (1650, 1275), (4000, 3000), (7000, 10000), (150, 1)]
)
def test_resized_grid_and_token_count_equal_reference(height, width, config, reference_processor):
    t, gh, gw = resized_grid(height, width, config)
    assert t == 1
    assert gh * gw == reference_processor.image_processor.get_number_of_image_patches(
        height, width, {}
    )
    expected_tokens = reference_processor._get_num_multimodal_tokens(
        [(height, width)]
    ).num_image_tokens[0]
    assert num_image_tokens(height, width, config) == expected_tokens


# -- token budget --------------------------------------------------------------------------------


def reference_with_max_pixels(reference_processor, config, max_pixels):
    from transformers import ColQwen2Processor
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

    image_processor = Qwen2VLImageProcessor(min_pixels=config.min_pixels, max_pixels=max_pixels)
    return ColQwen2Processor(
        image_processor=image_processor, tokenizer=reference_processor.tokenizer
    )


@pytest.mark.parametrize("budget", [4, 64, 300])
def test_max_image_tokens_budget_equals_reference_with_that_bound(
    budget, config, encoder, reference_processor
):
    limited = config.with_max_image_tokens(budget)
    assert limited.max_pixels == budget * 28 * 28
    page = fx.document_page()
    prepared = prepare_image(page, limited)
    assert prepared.num_image_tokens <= budget
    ref = reference_pages(
        reference_with_max_pixels(reference_processor, config, limited.max_pixels), [page]
    )
    assert_matches_reference(ref, 0, prepared, encoder)


def test_max_image_tokens_validation(config):
    assert config.with_max_image_tokens(None) is config
    with pytest.raises(InputError):
        config.with_max_image_tokens(config.min_image_tokens - 1)
    with pytest.raises(InputTypeError):
        config.with_max_image_tokens(True)
    with pytest.raises(InputTypeError):
        config.with_max_image_tokens(12.0)
    assert config.with_max_image_tokens(config.min_image_tokens).max_pixels >= config.min_pixels


# -- configuration from the folder ---------------------------------------------------------------


@pytest.fixture
def copied_checkpoint(tiny_checkpoint, tmp_path):
    """The tiny checkpoint's small files (no weights: neither reader needs them)."""
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    return folder


def edit_json(path, **changes):
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data))


def test_config_reads_the_image_processor_values(config, reference_processor):
    processor = reference_processor.image_processor
    assert (config.min_pixels, config.max_pixels) == (processor.min_pixels, processor.max_pixels)
    assert (config.patch_size, config.merge_size, config.temporal_patch_size) == (
        processor.patch_size,
        processor.merge_size,
        processor.temporal_patch_size,
    )
    assert config.image_mean == tuple(processor.image_mean)
    assert config.image_std == tuple(processor.image_std)
    assert config.rescale_factor == processor.rescale_factor
    assert config.patch_dim == 1176


def test_config_reflects_an_edited_max_pixels(copied_checkpoint, config, encoder):
    from transformers import ColQwen2Processor

    edit_json(copied_checkpoint / "preprocessor_config.json", max_pixels=100 * 784)
    edited = read_preprocess_config(copied_checkpoint)
    assert edited.max_pixels == 100 * 784 and edited.min_pixels == config.min_pixels
    page = fx.document_page()
    reference = ColQwen2Processor.from_pretrained(copied_checkpoint, use_fast=False)
    assert_matches_reference(
        reference_pages(reference, [page]), 0, prepare_image(page, edited), encoder
    )


def test_config_reads_the_size_form(copied_checkpoint):
    size = {"shortest_edge": 8 * 784, "longest_edge": 200 * 784}
    edit_json(
        copied_checkpoint / "preprocessor_config.json", min_pixels=None, max_pixels=None, size=size
    )
    edited = read_preprocess_config(copied_checkpoint)
    assert (edited.min_pixels, edited.max_pixels) == (8 * 784, 200 * 784)


def test_reference_ignores_the_size_form(copied_checkpoint):
    """Pins the upstream quirk colembed deliberately does not copy: Qwen2VLImageProcessor.__init__
    replaces a valid `size` by its defaults, so a size-only folder gets 56*56 / 28*28*1280."""
    from transformers import ColQwen2Processor

    size = {"shortest_edge": 8 * 784, "longest_edge": 200 * 784}
    edit_json(
        copied_checkpoint / "preprocessor_config.json", min_pixels=None, max_pixels=None, size=size
    )
    processor = ColQwen2Processor.from_pretrained(copied_checkpoint, use_fast=False).image_processor
    assert (processor.min_pixels, processor.max_pixels) == (56 * 56, 28 * 28 * 1280)


def test_config_without_pixel_bounds_is_refused(copied_checkpoint):
    edit_json(
        copied_checkpoint / "preprocessor_config.json", min_pixels=None, max_pixels=None, size={}
    )
    with pytest.raises(ModelFolderError, match="pixel bounds"):
        read_preprocess_config(copied_checkpoint)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"patch_size": 16}, "disagrees"),
        ({"do_normalize": False}, "do_normalize"),
        ({"resample": 2}, "resample"),
    ],
)
def test_config_refuses_pipelines_it_does_not_implement(copied_checkpoint, changes, message):
    edit_json(copied_checkpoint / "preprocessor_config.json", **changes)
    with pytest.raises(ModelFolderError, match=message):
        read_preprocess_config(copied_checkpoint)


def test_config_reads_prompts_and_keeps_an_empty_query_prefix(copied_checkpoint):
    edit_json(copied_checkpoint / "processor_config.json", query_prefix="")
    assert read_preprocess_config(copied_checkpoint).query_prefix == ""


def test_config_missing_file_names_it(copied_checkpoint):
    (copied_checkpoint / "preprocessor_config.json").unlink()
    (copied_checkpoint / "processor_config.json").unlink(missing_ok=True)
    with pytest.raises(
        ModelFolderError, match="neither preprocessor_config.json nor an `image_processor` object"
    ) as info:
        read_preprocess_config(copied_checkpoint)
    assert info.value.path == copied_checkpoint


def test_config_refuses_token_ids_the_tokenizer_contradicts(copied_checkpoint):
    path = copied_checkpoint / "config.json"
    data = json.loads(path.read_text())
    data["vlm_config"]["image_token_id"] += 1
    path.write_text(json.dumps(data))
    with pytest.raises(ModelFolderError, match="image_token_id") as info:
        read_preprocess_config(copied_checkpoint)
    assert info.value.path == path


def test_config_dict_round_trip_is_json(config):
    data = json.loads(json.dumps(config.to_dict()))
    assert PreprocessConfig.from_dict(data) == config
    from colembed.errors import ManifestError

    with pytest.raises(ManifestError):
        PreprocessConfig.from_dict({k: v for k, v in data.items() if k != "max_pixels"})
    with pytest.raises(ManifestError):
        PreprocessConfig.from_dict({**data, "surprise": 1})
    with pytest.raises(ManifestError):
        PreprocessConfig.from_dict({**data, "max_pixels": 1})


def test_alt_architecture_head_dim(tiny_alt_checkpoint):
    alt = read_preprocess_config(tiny_alt_checkpoint)
    vision = json.loads((tiny_alt_checkpoint / "config.json").read_text())["vlm_config"][
        "vision_config"
    ]
    assert alt.vision_head_dim == vision["embed_dim"] // vision["num_heads"]


# -- bad input -----------------------------------------------------------------------------------


def truncated(data: bytes) -> bytes:
    return data[: len(data) // 2]


BAD_IMAGES = {
    "aspect_ratio_300": (lambda: fx.rgb(1, 300), ImageError, "aspect ratio"),
    "aspect_ratio_201_bytes": (
        lambda: fx.encode(fx.rgb(201, 1), "PNG"),
        ImageError,
        "aspect ratio",
    ),
    "zero_bytes": (lambda: b"", ImageError, "zero-size"),
    "zero_size_pil": (lambda: Image.new("RGB", (0, 0)), ImageError, "zero-size"),
    "zero_height_pil": (lambda: Image.new("RGB", (5, 0)), ImageError, "zero-size"),
    "corrupt_bytes": (lambda: np.random.default_rng(0).bytes(4096), ImageError, "not an image"),
    "png_header_then_garbage": (lambda: b"\x89PNG\r\n\x1a\n" + b"\0" * 64, ImageError, ""),
    "truncated_png": (lambda: truncated(fx.encode(fx.rgb(200, 150), "PNG")), ImageError, "decode"),
    "truncated_jpeg": (
        lambda: truncated(fx.encode(fx.rgb(200, 150), "JPEG")),
        ImageError,
        "decode",
    ),
    "int": (lambda: 42, InputTypeError, "int"),
    "dict": (lambda: {"image": "page.png"}, InputTypeError, "dict"),
    "none": (lambda: None, InputTypeError, "NoneType"),
    "numpy_array": (lambda: np.zeros((28, 28, 3), np.uint8), InputTypeError, "ndarray"),
    "missing_path": (lambda: "/nonexistent/page.png", ImageError, "no such file"),
}


@pytest.mark.parametrize("name", list(BAD_IMAGES))
def test_bad_image_raises_with_index_and_reason(name, config):
    make, error, reason = BAD_IMAGES[name]
    obj = make()
    with pytest.raises(error) as info:
        prepare_image(obj, config, index=7)
    assert info.value.index == 7
    assert reason in info.value.reason
    assert isinstance(info.value, InputError) and isinstance(info.value, ValueError)
    # the rest of the API is still usable afterwards
    assert prepare_image(fx.rgb(40, 40), config).grid_thw == (1, 4, 4)


def test_text_mode_file_is_refused(tmp_path, config):
    path = tmp_path / "page.png"
    path.write_bytes(fx.encode(fx.rgb(40, 40), "PNG"))
    with open(path, encoding="latin-1") as handle, pytest.raises(ImageError) as info:
        prepare_image(handle, config, index=3)
    assert info.value.index == 3


@pytest.mark.parametrize("pixels, expect_pil_error", [(40 * 40, False), (100 * 100, True)])
def test_decompression_bomb_is_refused(monkeypatch, config, pixels, expect_pil_error):
    side = int(pixels**0.5)
    data = fx.encode(fx.rgb(side, side), "PNG")
    # 1000 px: 1600 is between PIL's warning and error thresholds, 10000 is above both
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        with pytest.raises(ImageError, match="decompression bomb") as info:
            prepare_image(data, config, index=11)
    assert info.value.index == 11
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)
    assert prepare_image(data, config).grid_thw[0] == 1
