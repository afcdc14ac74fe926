"""Query and page-prompt token ids against the reference ColQwen2Processor (transformers 4.57.1)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from colembed.errors import InputError, InputTypeError, ModelFolderError
from colembed.preprocess.text import TextEncoder, pad_batch

QUERIES = [
    "What is the revenue?",
    "",
    "2023年第三季度的营业收入是多少？",
    "日本語の請求書 합계 금액",
    "emoji 🎉👍🏽 family 👨‍👩‍👧 flags 🇫🇷",
    "x" * 2000,
    "tabs\tand\nnew\r\nlines\n\n",
    "   leading and trailing spaces   ",
    "1234567890 3.14159 !!!??? ... --- ***",
    "contains <|image_pad|> and <|endoftext|> inside",
    "<|vision_start|><|image_pad|><|vision_end|>",
    "<|im_start|>user\nQuery: nested",
    "e\u0301 vs \u00e9 (NFC)",
    "Query: already prefixed",
]


def reference_queries(processor, queries):
    batch = processor.process_queries(queries)
    return batch["input_ids"].numpy(), batch["attention_mask"].numpy()


@pytest.mark.parametrize("query", QUERIES, ids=range(len(QUERIES)))
def test_single_query_ids_equal_reference(encoder, reference_processor, query):
    ref_ids, ref_mask = reference_queries(reference_processor, [query])
    (ids,) = encoder.encode_queries([query])
    assert ids.dtype == np.int64
    np.testing.assert_array_equal(ids, ref_ids[0])
    assert ref_mask.all()


def test_batched_queries_equal_reference_padded_batch(encoder, reference_processor, config):
    assert reference_processor.tokenizer.padding_side == "right"
    ref_ids, ref_mask = reference_queries(reference_processor, QUERIES)
    ids, mask = pad_batch(encoder.encode_queries(QUERIES), config.pad_token_id)
    assert ids.dtype == mask.dtype == np.int64
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_array_equal(mask, ref_mask)


def test_augmentation_tokens_share_pad_id_but_are_real(encoder, config):
    ids, mask = pad_batch(
        encoder.encode_queries(["short", "a somewhat longer query"]), config.pad_token_id
    )
    count = config.query_augmentation_count
    short_len = int(mask[0].sum())
    assert short_len < ids.shape[1]
    np.testing.assert_array_equal(ids[0, short_len - count : short_len], config.pad_token_id)
    assert mask[0, :short_len].all() and not mask[0, short_len:].any()


def test_measured_query_length(encoder):
    # reference.md: "What is the revenue?" -> 7 tokens + 10 augmentation tokens.
    assert encoder.count_query_tokens("What is the revenue?") == 17
    assert encoder.count_query_tokens("What is the revenue?", include_extension=False) == 5


@pytest.mark.parametrize("query", QUERIES[:6])
def test_count_query_tokens(encoder, reference_processor, query):
    assert encoder.count_query_tokens(query) == len(
        reference_queries(reference_processor, [query])[0][0]
    )
    bare = reference_processor.tokenizer(query)["input_ids"]
    assert encoder.count_query_tokens(query, include_extension=False) == len(bare)


@pytest.mark.parametrize("num_image_tokens", [1, 4, 63, 768])
def test_page_prompt_ids_equal_reference_tokenizer(
    encoder, reference_processor, config, num_image_tokens
):
    expanded = config.page_prompt.replace(config.image_token, config.image_token * num_image_tokens)
    expected = reference_processor.tokenizer(expanded)["input_ids"]
    ids = encoder.page_prompt_ids(num_image_tokens)
    assert ids.dtype == np.int64
    np.testing.assert_array_equal(ids, expected)
    assert int((ids == config.image_token_id).sum()) == num_image_tokens


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_page_prompt_rejects_bad_counts(encoder, bad):
    with pytest.raises(InputError):
        encoder.page_prompt_ids(bad)


@pytest.mark.parametrize("bad", [None, 3, b"bytes", ["nested"]])
def test_non_str_query_names_its_index(encoder, bad):
    with pytest.raises(InputTypeError) as info:
        encoder.encode_queries(["fine", "also fine", bad], start_index=40)
    assert info.value.index == 42
    assert "str" in info.value.reason
    assert isinstance(info.value, TypeError)
    # the encoder is still usable afterwards
    assert len(encoder.encode_queries(["fine"])[0]) > 0


def test_single_string_instead_of_list_is_refused(encoder):
    with pytest.raises(InputTypeError):
        encoder.encode_queries("a query passed without a list")


def test_pad_batch_masks_from_lengths_not_ids():
    rows = [
        np.array([5, 9, 9], dtype=np.int64),
        np.array([9], dtype=np.int64),
        np.array([1, 2, 3, 4]),
    ]
    ids, mask = pad_batch(rows, pad_id=9)
    np.testing.assert_array_equal(ids, [[5, 9, 9, 9], [9, 9, 9, 9], [1, 2, 3, 4]])
    np.testing.assert_array_equal(mask, [[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    empty_ids, empty_mask = pad_batch([], pad_id=9)
    assert empty_ids.shape == empty_mask.shape == (0, 0)
    with pytest.raises(InputTypeError):
        pad_batch([np.zeros((2, 2), dtype=np.int64)], pad_id=0)


def test_encoder_refuses_config_of_another_tokenizer(tiny_checkpoint, config):
    wrong = dataclasses.replace(config, image_token_id=config.image_token_id + 1)
    with pytest.raises(ModelFolderError):
        TextEncoder.from_file(tiny_checkpoint / "tokenizer.json", wrong)


def test_config_token_values_come_from_the_folder(config, reference_processor, reference_model):
    tokenizer = reference_processor.tokenizer
    assert config.query_prefix == reference_processor.query_prefix
    assert config.page_prompt == reference_processor.visual_prompt_prefix
    assert config.query_augmentation_token == reference_processor.query_augmentation_token
    assert config.image_token == reference_processor.image_token
    assert config.pad_token_id == tokenizer.pad_token_id
    assert config.image_token_id == reference_model.vlm.config.image_token_id
    assert config.vision_start_token_id == reference_model.vlm.config.vision_start_token_id
    vision = reference_model.vlm.config.vision_config
    assert config.vision_head_dim == vision.embed_dim // vision.num_heads
