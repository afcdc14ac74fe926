"""Token ids for queries and page prompts, and right padding, with the `tokenizers` library.

Owns what `ColQwen2Processor.process_queries` and the text half of `process_images` do
(transformers 4.57.1):

- a query becomes `query_prefix + text + augmentation_token * count` (`text.strip()` when the
  folder's processor strips queries: TomoroAI's ColQwen3, `PreprocessConfig.query_strip`), tokenised as one string
  (added special tokens written in the text are matched, as the reference does; no BOS, no
  truncation). `encode_queries` returns one int64 vector per query, unpadded.
- a page becomes `page_prompt` with its single image token expanded to one copy per image token.
  Added special tokens are split out before BPE, so the expanded prompt tokenises to
  `head + [image_token_id] * n + tail`; `head` and `tail` are tokenised once and cached.
- queries are bounded: `max_query_tokens` is the longest page prompt of the folder's own image
  budget (768 image tokens + the prompt's ~20 for ColQwen2 = the longest sequence its language
  model was fine-tuned on; colpali-engine's training never truncates a query, and its training
  queries are short questions). A longer query keeps its first tokens and its augmentation tokens
  (`QueryTruncatedWarning` names it); the reference would run it whole, at quadratic cost.
- `pad_batch` right-pads to the longest row (the reference tokenizer pads right) and builds the
  attention mask from lengths: the query augmentation tokens share the pad id but have mask 1.

Never imports torch or transformers.
"""

from __future__ import annotations

from pathlib import Path
import warnings
from typing import TYPE_CHECKING, Sequence

import numpy as np

from ..errors import InputError, InputTypeError, ModelFolderError, QueryTruncatedWarning
from .config import PreprocessConfig

if TYPE_CHECKING:
    from tokenizers import Tokenizer

ID_DTYPE = np.int64


class TextEncoder:
    """Tokenises queries and page prompts exactly as the reference processor does."""

    def __init__(self, tokenizer: Tokenizer, config: PreprocessConfig) -> None:
        # ColQwen2 never truncates, and padding is done by `pad_batch` (masks from lengths).
        # A tokenizer.json may carry padding/truncation settings; they are switched off here.
        tokenizer.no_padding()
        tokenizer.no_truncation()
        self._tokenizer = tokenizer
        self.config = config
        self._suffix = config.query_augmentation_token * config.query_augmentation_count
        self._check_token_ids()
        self._page_head, self._page_tail = self._split_page_prompt()
        self._suffix_ids = np.asarray(self._tokenizer.encode(self._suffix).ids, dtype=ID_DTYPE)
        if not np.array_equal(
            self._suffix_ids, np.full(config.query_augmentation_count, config.pad_token_id)
        ):
            raise ModelFolderError(
                "the query augmentation token is not a single special token of this tokenizer"
            )

    @property
    def max_query_tokens(self) -> int:
        """Longest query (prefix and augmentation tokens included): the longest page prompt this
        config allows, i.e. the longest sequence the model was trained on (module docstring)."""
        cfg = self.config
        return len(self._page_head) + len(self._page_tail) + cfg.max_image_tokens

    @classmethod
    def from_file(cls, tokenizer_json_path: str | Path, config: PreprocessConfig) -> TextEncoder:
        from tokenizers import Tokenizer

        path = Path(tokenizer_json_path)
        if not path.is_file():
            raise ModelFolderError("missing tokenizer file", path=path)
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception for malformed files
            raise ModelFolderError(f"unreadable tokenizer: {e}", path=path) from e
        return cls(tokenizer, config)

    # -- queries ---------------------------------------------------------------------------------

    def encode_queries(self, texts: Sequence[str], *, start_index: int = 0) -> list[np.ndarray]:
        """One int64 id vector per query, identical to the reference's unpadded ids for it, cut
        to `max_query_tokens` (with a QueryTruncatedWarning) when longer.

        Raises InputTypeError naming `start_index + i` for the first item that is not a str, and
        InputError for a str that is not valid Unicode text (a lone surrogate).
        """
        texts = _check_texts(texts, start_index)
        prefix, suffix = self.config.query_prefix, self._suffix
        encode_batch = getattr(self._tokenizer, "encode_batch_fast", self._tokenizer.encode_batch)
        if self.config.query_strip:
            texts = [t.strip() for t in texts]
        encodings = encode_batch([prefix + t + suffix for t in texts])  # fast: no char offsets
        ids = [np.asarray(e.ids, dtype=ID_DTYPE) for e in encodings]
        return [self._bounded(row, start_index + i) for i, row in enumerate(ids)]

    def _bounded(self, ids: np.ndarray, index: int) -> np.ndarray:
        """`ids` cut to `max_query_tokens`: the first tokens, then the augmentation tokens."""
        limit, tail = self.max_query_tokens, len(self._suffix_ids)
        if len(ids) <= limit:
            return ids
        warnings.warn(
            QueryTruncatedWarning(
                f"item {index}: query of {len(ids)} tokens cut to {limit}, the longest sequence this "
                "model was trained on",
                index=index,
            ),
            stacklevel=4,
        )
        return np.concatenate([ids[: limit - tail], self._suffix_ids])

    def count_query_tokens(self, text: str, *, include_extension: bool = True) -> int:
        """Tokens of a query: with the prefix and augmentation tokens (what the model sees), or of
        the bare text."""
        if include_extension:
            return len(self.encode_queries([text])[0])
        (text,) = _check_texts([text], 0)
        return len(self._tokenizer.encode(text).ids)

    @property
    def vocabulary_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids`, special tokens kept."""
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_texts(self, ids: Sequence[int]) -> list[tuple[str, bool]]:
        """(the text each id stands for, whether it is a special token), id by id: a byte-level
        token that is part of one UTF-8 character decodes to U+FFFD."""
        special = {
            i for i, token in self._tokenizer.get_added_tokens_decoder().items() if token.special
        }
        return [
            (self._tokenizer.decode([int(i)], skip_special_tokens=False), int(i) in special)
            for i in ids
        ]

    # -- pages -----------------------------------------------------------------------------------

    def page_prompt_ids(self, num_image_tokens: int) -> np.ndarray:
        """int64 ids of the page prompt with its image token repeated `num_image_tokens` times."""
        if isinstance(num_image_tokens, bool) or not isinstance(
            num_image_tokens, (int, np.integer)
        ):
            raise InputTypeError(
                f"num_image_tokens must be an int, got {type(num_image_tokens).__name__}"
            )
        if num_image_tokens < 1:
            raise InputError(f"num_image_tokens must be >= 1, got {num_image_tokens}")
        image = np.full(int(num_image_tokens), self.config.image_token_id, dtype=ID_DTYPE)
        return np.concatenate([self._page_head, image, self._page_tail])

    # -- internals -------------------------------------------------------------------------------

    def _check_token_ids(self) -> None:
        """The config's ids must be this tokenizer's ids for the same token names."""
        expected = {
            self.config.image_token: self.config.image_token_id,
            self.config.query_augmentation_token: self.config.pad_token_id,
        }
        for token, token_id in expected.items():
            actual = self._tokenizer.token_to_id(token)
            if actual != token_id:
                raise ModelFolderError(
                    f"tokenizer maps {token!r} to {actual}, the preprocess config says {token_id}"
                )

    def _split_page_prompt(self) -> tuple[np.ndarray, np.ndarray]:
        """Ids before and after the prompt's single image token.

        Tokenising the prompt once with one image token and splitting at it equals tokenising the
        expanded prompt, because added special tokens are matched before the pre-tokenizer runs;
        the check below makes sure the image token really is such a token for this tokenizer.
        """
        ids = np.asarray(self._tokenizer.encode(self.config.page_prompt).ids, dtype=ID_DTYPE)
        where = np.flatnonzero(ids == self.config.image_token_id)
        if where.size != 1:
            raise ModelFolderError(
                f"page prompt tokenises to {where.size} image tokens, expected 1: "
                f"{self.config.image_token!r} is not a special token of this tokenizer"
            )
        cut = int(where[0])
        return ids[:cut].copy(), ids[cut + 1 :].copy()


def _check_texts(texts: Sequence[str], start_index: int) -> list[str]:
    if isinstance(texts, str):
        raise InputTypeError("expected a sequence of query strings, got a single str", item=texts)
    texts = list(texts)
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise InputTypeError(
                f"query must be a str, got {type(text).__name__}", index=start_index + i, item=text
            )
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise InputError(
                f"query is not valid Unicode text ({e.reason} at character {e.start})",
                index=start_index + i,
                item=text,
            ) from None
    return texts


def pad_batch(sequences: Sequence[np.ndarray], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad 1-D id vectors to the longest: ids (B, L) int64 and attention_mask (B, L) int64.

    The mask is 1 for the first len(row) positions of each row, whatever the ids are. Right,
    not left: the text graph's attention is causal with no padding mask, so padding must come
    after every real token (export/families/qwen2/graphs.py `causal_attention`).
    """
    rows = [np.asarray(s) for s in sequences]
    for i, row in enumerate(rows):
        if row.ndim != 1 or not np.issubdtype(row.dtype, np.integer):
            raise InputTypeError(
                f"expected a 1-D integer id vector, got {row.dtype} {row.shape}", index=i
            )
    lengths = np.array([row.shape[0] for row in rows], dtype=ID_DTYPE)
    width = int(lengths.max()) if rows else 0
    ids = np.full((len(rows), width), pad_id, dtype=ID_DTYPE)
    for i, row in enumerate(rows):
        ids[i, : row.shape[0]] = row
    mask = (np.arange(width, dtype=ID_DTYPE)[None, :] < lengths[:, None]).astype(ID_DTYPE)
    return ids, mask


__all__ = ["TextEncoder", "pad_batch"]
