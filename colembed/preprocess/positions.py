"""Position inputs the graphs take from the host: 3-D M-RoPE ids and vision rotary tables.

Owns two integer/layout computations that the reference does in Python loops inside the model, so
that the exported graphs need no data-dependent control flow:

- `mrope_position_ids`: the language model's (3, B, L) int64 position ids (`config_position_ids`
  takes the token ids and merge size from a model's `PreprocessConfig`), equal to transformers
  4.57.1 `Qwen2VLModel.get_rope_index(input_ids, image_grid_thw, None, attention_mask)[0]`.
  Over the tokens with mask 1 of each row: text runs take consecutive positions starting at
  (max so far + 1) on all three axes; an image whose LLM grid is (t, gh/m, gw/m) takes
  (t, h, w) indices offset by the position where its image tokens start. Padding gets 1.
  A row with no images gets `cumsum(mask) - 1` (padding 1), as the reference does for a text-only
  batch (`image_grid_thw is None`) and for text rows in a batch with images.
  Rows may be padded on either side. Videos are not supported (colembed embeds images only).
- `vision_rotary_tables`: the vision tower's (cos, sin), each (t*h*w, head_dim) float32, equal to
  `Qwen2VisionTransformerPretrainedModel.forward`'s `cat((rot_pos_emb(grid), ...), -1).cos()/.sin()`,
  computed in float32 as torch does (inv_freq, outer product, cos/sin may differ by an ulp).

Deliberate difference in strictness, not in results: the reference finds each image's tokens by
searching for the next image token and trusts that the run is as long as the grid says; colembed
checks that the run is there and raises InputError naming the row otherwise.

Never imports torch or transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np

from ..errors import InputError

if TYPE_CHECKING:
    from .config import PreprocessConfig

POSITION_DTYPE = np.int64
MROPE_AXES = 3  # temporal, height, width
PADDING_POSITION = 1  # what the reference writes at mask-0 positions


def mrope_position_ids(
    input_ids: np.ndarray,
    attention_mask: np.ndarray,
    image_grids: Sequence[Sequence[tuple[int, int, int]]],
    *,
    image_token_id: int,
    vision_start_token_id: int,
    merge_size: int,
) -> np.ndarray:
    """(3, B, L) int64 M-RoPE position ids; `image_grids[i]` lists row i's image (t, h, w) grids
    in patches (as `PreparedImage.grid_thw`), in the order the images appear in the row."""
    input_ids = np.asarray(input_ids)
    attention_mask = np.asarray(attention_mask)
    if input_ids.ndim != 2 or input_ids.shape != attention_mask.shape:
        raise InputError(
            f"input_ids {input_ids.shape} and attention_mask {attention_mask.shape} must both be (B, L)"
        )
    if len(image_grids) != input_ids.shape[0]:
        raise InputError(
            f"{len(image_grids)} image grid lists for a batch of {input_ids.shape[0]} rows"
        )
    positions = np.full((MROPE_AXES,) + input_ids.shape, PADDING_POSITION, dtype=POSITION_DTYPE)
    for row, grids in enumerate(image_grids):
        real = attention_mask[row] == 1
        tokens = input_ids[row][real]
        if len(grids) == 0:
            row_positions = _text_positions(tokens.shape[0], 0)
        else:
            _check_image_count(tokens, len(grids), row, image_token_id, vision_start_token_id)
            row_positions = _row_positions(
                tokens, grids, row=row, image_token_id=image_token_id, merge_size=merge_size
            )
        positions[:, row, real] = row_positions
    return positions


def config_position_ids(
    input_ids: np.ndarray,
    attention_mask: np.ndarray,
    image_grids: Sequence[Sequence[tuple[int, int, int]]],
    config: PreprocessConfig,
) -> np.ndarray:
    """`mrope_position_ids` with the image token, vision start token and merge size of `config`
    (a model folder's `PreprocessConfig`)."""
    return mrope_position_ids(
        input_ids,
        attention_mask,
        image_grids,
        image_token_id=config.image_token_id,
        vision_start_token_id=config.vision_start_token_id,
        merge_size=config.merge_size,
    )


def _check_image_count(
    tokens: np.ndarray, expected: int, row: int, image_token_id: int, vision_start_token_id: int
) -> None:
    """The reference counts a row's images as `<|vision_start|>` tokens followed by an image
    token; that count must match the row's grid list for the positions to be the reference's."""
    starts = np.flatnonzero(tokens[:-1] == vision_start_token_id)
    found = int(np.count_nonzero(tokens[starts + 1] == image_token_id))
    if found != expected:
        raise InputError(
            f"row {row} has {found} vision-start + image-token pairs but {expected} image grids",
            index=row,
        )


def _row_positions(
    tokens: np.ndarray,
    grids: Sequence[tuple[int, int, int]],
    *,
    row: int,
    image_token_id: int,
    merge_size: int,
) -> np.ndarray:
    """(3, n) positions of one row's real tokens: text runs and image blocks, in order."""
    chunks: list[np.ndarray] = []
    next_position = 0  # max position so far + 1 (the reference: last chunk's max + 1)
    start = 0
    for t, h, w in grids:
        if min(t, h, w) < 1 or h % merge_size or w % merge_size:
            raise InputError(
                f"row {row}: invalid image grid {(t, h, w)} for merge size {merge_size}", index=row
            )
        llm_t, llm_h, llm_w = int(t), int(h) // merge_size, int(w) // merge_size
        count = llm_t * llm_h * llm_w
        first = _next_image_token(tokens, start, image_token_id, row=row)
        if first + count > tokens.shape[0] or np.any(
            tokens[first : first + count] != image_token_id
        ):
            raise InputError(
                f"row {row}: expected {count} image tokens for grid {(t, h, w)} at position {first}",
                index=row,
            )
        text_len = first - start
        chunks.append(_text_positions(text_len, next_position))
        chunks.append(_image_positions(llm_t, llm_h, llm_w, next_position + text_len))
        next_position = int(chunks[-1].max()) + 1
        start = first + count
    if start < tokens.shape[0]:
        chunks.append(_text_positions(tokens.shape[0] - start, next_position))
    return np.concatenate(chunks, axis=1)


def _next_image_token(tokens: np.ndarray, start: int, image_token_id: int, *, row: int) -> int:
    hits = np.flatnonzero(tokens[start:] == image_token_id)
    if hits.size == 0:
        raise InputError(f"row {row}: fewer image tokens than images in its grid list", index=row)
    return start + int(hits[0])


def _text_positions(length: int, offset: int) -> np.ndarray:
    return np.broadcast_to(
        np.arange(offset, offset + length, dtype=POSITION_DTYPE), (MROPE_AXES, length)
    )


def _image_positions(llm_t: int, llm_h: int, llm_w: int, offset: int) -> np.ndarray:
    """(3, t*h*w): temporal, row and column index of each merged token, row-major, plus offset."""
    t_index, h_index, w_index = np.meshgrid(
        np.arange(llm_t, dtype=POSITION_DTYPE),
        np.arange(llm_h, dtype=POSITION_DTYPE),
        np.arange(llm_w, dtype=POSITION_DTYPE),
        indexing="ij",
    )
    return np.stack([t_index.ravel(), h_index.ravel(), w_index.ravel()]) + offset


def vision_rotary_tables(
    grid_thw: tuple[int, int, int], *, merge_size: int, head_dim: int, theta: float
) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin, each (t*h*w, head_dim) float32, for one image's patches in merge-block order.

    Per patch: the (row, column) of the patch in the image, each turned into `head_dim/4` angles
    `pos * inv_freq` (inv_freq = 1 / theta**(arange(0, head_dim/2, 2) / (head_dim/2))), the two
    halves concatenated (head_dim/2) and then repeated (head_dim), as the reference does.
    """
    t, h, w = (int(v) for v in grid_thw)
    if min(t, h, w) < 1 or h % merge_size or w % merge_size:
        raise InputError(f"invalid image grid {(t, h, w)} for merge size {merge_size}")
    rows, cols = _patch_rows_and_columns(h, w, merge_size)
    freqs = _rotary_frequencies(max(h, w), head_dim, theta)  # (max(h, w), head_dim/4)
    half = np.concatenate([freqs[rows], freqs[cols]], axis=1)  # (h*w, head_dim/2)
    emb = np.concatenate([half, half], axis=1)
    emb = np.tile(emb, (t, 1))
    return np.cos(emb), np.sin(emb)


def _patch_rows_and_columns(h: int, w: int, merge_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Row and column of each patch, listed in merge-block order (the order of `patches`)."""
    m = merge_size
    row = np.broadcast_to(np.arange(h)[:, None], (h, w))
    col = np.broadcast_to(np.arange(w)[None, :], (h, w))

    def blocks(a: np.ndarray) -> np.ndarray:
        return a.reshape(h // m, m, w // m, m).transpose(0, 2, 1, 3).ravel()

    return blocks(row), blocks(col)


def _rotary_frequencies(length: int, head_dim: int, theta: float) -> np.ndarray:
    """`VisionRotaryEmbedding(head_dim // 2, theta)(length)` in float32: outer(arange, inv_freq)."""
    dim = head_dim // 2
    exponent = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    inv_freq = np.float32(1.0) / np.power(np.float32(theta), exponent)
    positions = np.arange(length, dtype=np.float32)
    return np.outer(positions, inv_freq).astype(np.float32)


__all__ = ["config_position_ids", "mrope_position_ids", "vision_rotary_tables"]
