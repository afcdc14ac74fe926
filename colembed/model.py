"""The runtime model: a verified model folder, two onnxruntime sessions, numpy preprocessing.

Data flow for a batch of pages:
    images -> prepare_image (resize, normalise, patchify; one PreparedImage each)
           -> image graph (one image per run) -> merged features
           -> page prompts (image tokens expanded) -> pad_batch -> 3-D positions, feature index
           -> text graph -> (B, L, dim) -> each page's real rows
Queries take the same text path with no image features; they never run the image graph.
"""

from __future__ import annotations

import functools
import itertools
import os
from dataclasses import dataclass
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np

from .contracts import GraphContract
from .errors import (
    DimensionError,
    GraphOutputError,
    ImageError,
    InputError,
    InputTypeError,
    ModelFolderError,
    ProviderError,
)
from .integrity import check_graph_files, verify_files
from .layout import BASE_VARIANT, GRAPH_ROLES, TOKENIZER_FILE, variant_files
from .families import get_family
from .manifest import Manifest, read_manifest
from .preprocess.images import PreparedImage, prepare_image
from .preprocess.positions import config_position_ids, vision_rotary_tables
from .preprocess.text import TextEncoder, pad_batch
from .safe_fs import inside
from .sessions import (
    OPENVINO,
    OPENVINO_VARIANTS,
    Session,
    _name,
    arena_shrinking_options,
    open_session,
    physical_cores,
    resolve_providers,
)

# Queries of a batch run in groups of similar length, chosen to cost the least: a run costs a fixed
# part (every weight read once, every kernel launched: RUN_COST_TOKENS, in padded tokens) plus its
# padded tokens (count x longest). So ordinary batches run in one padded run, as in 0.1.0 (16 report
# queries of 18-34 tokens: splitting them bought less padding than the extra run cost,
# benchmarks/results/embed/embed-against.md), while one long query never pads the short ones. Output order
# and values are those of running each query alone, within float tolerance. A group's attention
# scores (heads x count x longest^2 floats) also stay within TEXT_ATTENTION_BUDGET_BYTES, so a batch
# of queries at the length bound runs two at a time (Qwen2-VL-2B: 12 heads, 779 tokens; a run holds
# several tensors of that size: 8 such queries in one run peaked at 2.3 GB on a 2-layer model,
# benchmarks/results/query_memory/query_memory.md).
RUN_COST_TOKENS = 256
TEXT_ATTENTION_BUDGET_BYTES = 1 << 26
# A query run whose attention scores exceed this hands the CPU arena's free chunks back when it
# ends, so one large request does not leave the process at its peak (query_memory.md). Ordinary
# runs keep the arena: shrinking after every run made each next run fault its memory in again (a
# letter page, a 16-query batch and a single query were all slower for it,
# benchmarks/results/embed/embed-against.md). Page runs never shrink: their size is bounded by the image
# budget and the batch, and the next page needs the same memory.
SHRINK_AFTER_QUERY_BYTES = 1 << 24


def _batches(items: Iterable[Any], size: int) -> Iterator[tuple[int, list[Any]]]:
    """(index of the first item, items) for consecutive batches, without materialising `items`."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"batch_size must be a positive int, got {size!r}")
    try:
        iterator = iter(items)
    except TypeError:
        raise InputTypeError(
            f"expected an iterable of items, got {type(items).__name__}", item=items
        ) from None
    start = 0
    while batch := list(itertools.islice(iterator, size)):
        yield start, batch
        start += len(batch)


@dataclass(frozen=True)
class PageLayout:
    """Where a page's image tokens sit in its embedding, and which pixels each one saw.

    The page prompt is `head + image tokens + tail`: output rows
    `[image_start, image_start + grid_rows * grid_cols)` are image tokens, row-major over the
    merged grid; token (r, c) saw the resized image's square
    `[c*token_px, (c+1)*token_px) x [r*token_px, (r+1)*token_px)` (token_px = patch x merge = 28).
    The resize stretches the whole input (no crop, no padding), so on an input of any size
    the box scales by `input size / resized_size`.
    """

    grid_rows: int
    grid_cols: int
    image_start: int
    num_tokens: int
    token_px: int

    @property
    def num_image_tokens(self) -> int:
        return self.grid_rows * self.grid_cols

    @property
    def image_rows(self) -> slice:
        return slice(self.image_start, self.image_start + self.num_image_tokens)

    @property
    def resized_size(self) -> tuple[int, int]:
        """(width, height) in pixels of the image the model saw."""
        return self.grid_cols * self.token_px, self.grid_rows * self.token_px

    def token_box(
        self, row: int, col: int, image_size: tuple[int, int]
    ) -> tuple[float, float, float, float]:
        """(left, top, right, bottom) in pixels of `image_size` (width, height) seen by token (row, col)."""
        sx = image_size[0] / self.resized_size[0]
        sy = image_size[1] / self.resized_size[1]
        t = self.token_px
        return col * t * sx, row * t * sy, (col + 1) * t * sx, (row + 1) * t * sy


@dataclass(frozen=True)
class ImageGraphOutputs:
    """What the image graph gave for a list of pages (`ColQwenModel.run_image_graph`): each page
    as prepared, its merged features (tokens, text width) and, for ColQwen3, its DeepStack
    features (layers, tokens, text width; None for the other families)."""

    prepared: list[PreparedImage]
    features: list[np.ndarray]
    deepstack: list[np.ndarray] | None


class ColQwenModel:
    """A ColQwen-family model (ColQwen2, ColQwen2.5, ColQwen3: the manifest's `family`) on onnxruntime.
    Make one with `colembed.load(...)`.

    `embed_queries` / `embed_images` return one float32 (tokens, dim) array per item, padding
    removed, in input order; `iter_*` do the same lazily over any iterable. `graphs`: the graphs
    whose sessions open with the model (both by default; `open_graph` opens one later).
    """

    def __init__(
        self,
        folder: str | Path,
        *,
        variant: str = BASE_VARIANT,
        providers: Any = None,
        threads: int | None = None,
        max_image_tokens: int | None = None,
        verify: bool | str = True,
        cpu_mem_arena: bool = True,
        session_config: Mapping[str, str] | None = None,
        execution_order: str = "default",
        dim: int | None = None,
        graphs: Sequence[str] = GRAPH_ROLES,
    ) -> None:
        if verify not in (True, False, "full"):
            raise ValueError(f"verify must be True, False or 'full', got {verify!r}")
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise ModelFolderError("not a folder", path=self.folder)
        self.manifest: Manifest = read_manifest(self.folder)
        # The graphs stay as exported (full width); `dim` truncates their output (`truncate`).
        self.full_embedding_size = self.manifest.embedding_dim
        self.embedding_size = check_dim(dim, self.full_embedding_size)
        self.variant = variant
        verify_files(
            self.folder, self.manifest, variant_files(self.manifest, variant), check_hashes=verify
        )
        for role in GRAPH_ROLES:
            check_graph_files(self.folder, self.manifest.graph(variant, role))

        self.config = self.manifest.preprocess.with_max_image_tokens(max_image_tokens)
        # Built on the folder's own config: the query bound follows the trained image budget,
        # not a caller's max_image_tokens.
        self.text_encoder = TextEncoder.from_file(
            inside(self.folder, TOKENIZER_FILE), self.manifest.preprocess
        )
        self._text_hidden = self.manifest.architecture.text_hidden
        self.family = get_family(self.manifest.family)
        # The page prompt's tokens besides its image tokens, and where the image tokens start:
        # from the tokenizer once, read for every page (`_check_text_bound`, `_layout`).
        one = self.text_encoder.page_prompt_ids(1)
        self._page_prompt_overhead = len(one) - 1
        self._page_image_start = int(np.flatnonzero(one == self.config.image_token_id)[0])
        self._check_text_bound(self.config.max_image_tokens, item=max_image_tokens)
        self._contracts = self.family.contracts(
            patch_dim=self.config.patch_dim,
            vision_head_dim=self.config.vision_head_dim,
            text_hidden=self._text_hidden,
            embedding_dim=self.full_embedding_size,
            extras=self.manifest.vision_extras,
        )
        self._provider_request = resolve_providers(
            providers, auto_openvino=_auto_openvino(self.folder)
        )
        check_variant_provider(variant, self._provider_request, self.manifest.variants)
        self._session_options = {
            "threads": threads,
            "cpu_mem_arena": cpu_mem_arena,
            "session_config": session_config,
            "execution_order": execution_order,
        }
        self._sessions: dict[str, Session] = {}
        self._providers: list[str] = []
        self._run_options = None
        unknown = [role for role in graphs if role not in GRAPH_ROLES]
        if unknown:
            raise ValueError(f"graphs must be among {list(GRAPH_ROLES)}, got {unknown}")
        for role in graphs:
            self.open_graph(role)
        self._verify = verify
        self._preprocess_threads = threads if threads else physical_cores()
        self._grid_cache: dict[tuple[int, int, int], tuple[np.ndarray, ...]] = {}
        self._scorer = None

    def open_graph(self, role: str) -> None:
        """Open the `role` graph's session ("vision" or "text") if it is not open. `load` opens
        both; a caller short of memory opens one, runs it, closes it (`close_graph`) and opens
        the other (the export's check: `run_image_graph` then `embed_image_graph_outputs`)."""
        if role in self._sessions:
            return
        if role not in GRAPH_ROLES:
            raise ValueError(f"role must be one of {list(GRAPH_ROLES)}, got {role!r}")
        options = self._session_options
        self._sessions[role] = self._open(
            self.manifest.graph(self.variant, role), self._contracts[role], **options
        )
        # The model reports the text graph's providers (the first open graph's until it opens);
        # its run options apply to text runs: passed only when a run was unusually large
        # (SHRINK_AFTER_QUERY_BYTES).
        if role == "text" or not self._providers:
            self._providers = list(self._sessions[role].providers)
            self._run_options = arena_shrinking_options(self._providers, options["cpu_mem_arena"])

    def close_graph(self, role: str) -> None:
        """Drop the `role` graph's session: onnxruntime frees its weights, mapped pages and arena
        once nothing else holds it. Running that graph again needs `open_graph`."""
        self._sessions.pop(role, None)

    def _session(self, role: str) -> Session:
        session = self._sessions.get(role)
        if session is None:
            raise ModelFolderError(
                f"the {role} graph's session is closed (open it with open_graph({role!r}))",
                path=self.folder,
            )
        return session

    def _open(
        self,
        entry,
        family: GraphContract,
        *,
        threads,
        cpu_mem_arena,
        session_config=None,
        execution_order="default",
    ) -> Session:
        """The graph's session, after its manifest contract was checked against the family's own
        (so a folder cannot redefine what the runtime feeds) and the session against both."""
        path = inside(self.folder, entry.file)
        problems = entry.contract.differences(family)
        if problems:
            raise ModelFolderError(
                f"the manifest's contract is not {self.family.display_name}'s: "
                + "; ".join(problems),
                path=path,
            )
        if _name(self._provider_request[0]) == OPENVINO:
            session = open_session(
                str(path),
                self._provider_request,
                threads=threads,
                precision=OPENVINO_VARIANTS[self.variant],
            )
        else:
            session = open_session(
                str(path),
                self._provider_request,
                threads=threads,
                cpu_mem_arena=cpu_mem_arena,
                session_config=session_config,
                execution_order=execution_order,
            )
        problems = entry.contract.mismatches(session.session)
        if problems:
            raise ModelFolderError(
                "graph does not match its manifest contract: " + "; ".join(problems), path=path
            )
        return session

    # ----------------------------------------------------------------------------- properties
    @property
    def providers(self) -> list[str]:
        return self._providers

    @property
    def max_image_tokens(self) -> int:
        return self.config.max_image_tokens

    @property
    def name(self) -> str:
        return self.manifest.model.name

    def __repr__(self) -> str:
        random = ", random_weights=True" if self.manifest.model.random_weights else ""
        truncated = (
            f" (of {self.full_embedding_size})"
            if self.embedding_size != self.full_embedding_size
            else ""
        )
        return (
            f"ColQwenModel(name={self.name!r}, family={self.family.name!r}, "
            f"variant={self.variant!r}, "
            f"dim={self.embedding_size}{truncated}, max_image_tokens={self.max_image_tokens}, "
            f"providers={self.providers}{random}, folder='{self.folder}')"
        )

    # ---------------------------------------------------------------------------------- queries
    def iter_query_embeddings(
        self, texts: Iterable[str], batch_size: int = 16
    ) -> Iterator[np.ndarray]:
        _refuse_single(texts, "query strings")
        for start, batch in _batches(texts, batch_size):
            try:
                ids = self.text_encoder.encode_queries(batch, start_index=start)
            except InputError as e:  # embed the queries before the bad one, then raise
                good = (e.index - start) if e.index is not None else 0
                if good > 0:
                    yield from self._run_queries(
                        self.text_encoder.encode_queries(batch[:good], start_index=start)
                    )
                raise
            yield from self._run_queries(ids)

    def embed_queries(self, texts: Iterable[str], batch_size: int = 16) -> list[np.ndarray]:
        return _collect(self.iter_query_embeddings(texts, batch_size))

    def _run_queries(self, ids: list[np.ndarray]) -> list[np.ndarray]:
        """One text-graph run per group of similar lengths (`RUN_COST_TOKENS`); results in input order."""
        out: list[np.ndarray | None] = [None] * len(ids)
        per_cell = self.manifest.architecture.text_heads * np.dtype(np.float32).itemsize
        for group in _length_groups(
            [len(row) for row in ids], max_cells=TEXT_ATTENTION_BUDGET_BYTES // per_cell
        ):
            longest = max(len(ids[i]) for i in group)
            shrink = len(group) * longest**2 * per_cell > SHRINK_AFTER_QUERY_BYTES
            vectors = self._run_text(
                [ids[i] for i in group], [()] * len(group), None, shrink_arena=shrink
            )
            for i, vector in zip(group, vectors):
                out[i] = vector
        return out  # type: ignore[return-value]

    # ----------------------------------------------------------------------------------- images
    def iter_image_embeddings(
        self, images: Iterable[Any], batch_size: int = 4
    ) -> Iterator[np.ndarray]:
        """Pages in, one (tokens, dim) array per page out.

        If an image in a batch is bad, the pages before it are still embedded and yielded, then
        the ImageError (naming the page's index) is raised.
        """
        _refuse_single(images, "images")
        for start, batch in _batches(images, batch_size):
            prepared, error = self._prepare_batch(batch, start)
            if prepared:
                yield from self._embed_prepared(prepared)
            if error is not None:
                raise error

    def embed_images(self, images: Iterable[Any], batch_size: int = 4) -> list[np.ndarray]:
        return _collect(self.iter_image_embeddings(images, batch_size))

    def iter_page_embeddings(
        self, images: Iterable[Any], batch_size: int = 4
    ) -> Iterator[tuple[np.ndarray, PageLayout]]:
        """As `iter_image_embeddings`, each page's vectors with its `PageLayout` (image-token grid
        and rows), for pooling by rows/columns and for similarity maps."""
        for start, batch in _batches(images, batch_size):
            prepared, error = self._prepare_batch(batch, start)
            if prepared:
                vectors = self._embed_prepared(prepared)
                yield from zip(
                    vectors, (self._layout(p, len(v)) for p, v in zip(prepared, vectors))
                )
            if error is not None:
                raise error

    def embed_pages(
        self, images: Iterable[Any], batch_size: int = 4
    ) -> list[tuple[np.ndarray, PageLayout]]:
        """`iter_page_embeddings` as a list; an ImageError carries the finished pages (`.completed`)."""
        return _collect(self.iter_page_embeddings(images, batch_size))

    def _layout(self, prepared: PreparedImage, num_tokens: int) -> PageLayout:
        _, h, w = prepared.grid_thw
        m = prepared.merge_size
        return PageLayout(
            grid_rows=h // m,
            grid_cols=w // m,
            image_start=self._page_image_start,
            num_tokens=num_tokens,
            token_px=self.config.resize_factor,
        )

    def _prepare_batch(
        self, batch: list[Any], start: int
    ) -> tuple[list[PreparedImage], InputError | None]:
        """The batch's pages decoded, resized and patchified in threads (PIL's decode and resize
        and numpy's gathers release the GIL), in order, up to the first bad one and its error."""
        workers = min(len(batch), self._preprocess_threads)
        if workers > 1:
            with ThreadPoolExecutor(workers, thread_name_prefix="colembed-prepare") as pool:
                futures = [
                    pool.submit(
                        prepare_image,
                        obj,
                        self.config,
                        index=start + offset,
                        transparency=self.family.transparency,
                    )
                    for offset, obj in enumerate(batch)
                ]
            outcomes = (future.result for future in futures)
        else:  # lazily, so a bad page stops the work at once
            outcomes = (
                functools.partial(
                    prepare_image,
                    obj,
                    self.config,
                    index=start + offset,
                    transparency=self.family.transparency,
                )
                for offset, obj in enumerate(batch)
            )
        results: list[PreparedImage] = []
        for offset, outcome in enumerate(outcomes):
            try:
                page = outcome()
                self._check_text_bound(page.num_image_tokens, index=start + offset)
            except InputError as e:
                return results, e
            results.append(page)
        return results, None

    def image_features(self, images: Sequence[Any]) -> list[np.ndarray]:
        """The image graph's merged features per image, (tokens, text width): for checks."""
        return self._vision_features(
            [
                prepare_image(o, self.config, index=i, transparency=self.family.transparency)
                for i, o in enumerate(images)
            ]
        )[0]

    def _check_text_bound(
        self, image_tokens: int, *, index: int | None = None, item: Any = None
    ) -> None:
        """InputError when a page of `image_tokens` image tokens makes a prompt longer than the
        family's text graph computes exactly (`Family.max_text_tokens`)."""
        bound = self.family.max_text_tokens
        if bound is None:
            return
        prompt = self._page_prompt_overhead + image_tokens
        if prompt > bound:
            raise ImageError(
                f"a page of {image_tokens} image tokens makes a prompt of {prompt} tokens, past "
                f"the {bound} {self.family.display_name}'s text graph computes exactly; "
                f"use max_image_tokens <= {bound - prompt + image_tokens}",
                index=index,
                item=item,
            )

    def run_image_graph(self, images: Sequence[Any]) -> ImageGraphOutputs:
        """The image graph's half of embedding `images`: each page prepared and run alone, as
        `embed_images` does. `embed_image_graph_outputs` finishes them with the text graph, so
        the two graphs' sessions need not be open at once (`open_graph`, `close_graph`)."""
        _refuse_single(images, "images")
        prepared, error = self._prepare_batch(list(images), 0)
        if error is not None:
            raise error
        features, deepstack = self._vision_features(prepared)
        return ImageGraphOutputs(prepared, features, deepstack)

    def embed_image_graph_outputs(self, outputs: ImageGraphOutputs) -> list[np.ndarray]:
        """The text graph's half: the pages' (tokens, dim) embeddings, all in one text run (as
        `embed_images` with a batch of them all)."""
        prepared = outputs.prepared
        ids = [self.text_encoder.page_prompt_ids(p.num_image_tokens) for p in prepared]
        return self._run_text(
            ids, [(p.grid_thw,) for p in prepared], outputs.features, outputs.deepstack
        )

    def _embed_prepared(self, prepared: list[PreparedImage]) -> list[np.ndarray]:
        features, deepstack = self._vision_features(prepared)
        return self.embed_image_graph_outputs(ImageGraphOutputs(prepared, features, deepstack))

    def _grid_inputs(self, grid: tuple[int, int, int]) -> tuple[np.ndarray, ...]:
        """The image graph's per-grid host inputs after the pixels, in contract order: the rotary
        tables, then what the family's vision attention adds (ColQwen2.5's window layout), then
        the position-table interpolation of the vision extras (ColQwen3).
        Cached per grid: pages of one size share them."""
        if grid not in self._grid_cache:
            if len(self._grid_cache) > 64:
                self._grid_cache.clear()
            cfg = self.config
            cos, sin = vision_rotary_tables(
                grid,
                merge_size=cfg.merge_size,
                head_dim=cfg.vision_head_dim,
                theta=cfg.vision_rope_theta,
            )
            extra = self.manifest.vision_attention.grid_inputs(
                grid, merge_size=cfg.merge_size, patch_size=cfg.patch_size
            )
            extras = self.manifest.vision_extras
            positions = (
                () if extras is None else extras.grid_inputs(grid, merge_size=cfg.merge_size)
            )
            self._grid_cache[grid] = (cos, sin, *extra, *positions)
        return self._grid_cache[grid]

    def _vision_features(self, prepared: list[PreparedImage]) -> list[np.ndarray]:
        """Each image through the image graph on its own; output in input order.

        Batching same-grid images does not pay since the vision attention is onnxruntime's fused
        MultiHeadAttention. Measured at Qwen2-VL-2B width (2 vision layers, 2 threads, CPU seconds
        per page, 2026-12-01): letter pages (2976 patches) 6.20 alone vs 6.30 / 6.09 in batches of
        2 / 4; 256-token pages 1.59 vs 1.80 (4); 64-token pages 0.354 vs 0.368 (4). Each extra
        letter page in a batch cost ~0.85 GB of peak RSS.

        Returns (features, deepstack): deepstack holds each page's (layers, tokens, text width)
        DeepStack features when the folder's vision extras have DeepStack (ColQwen3), else None.
        """
        features, deepstack = [], []
        for page in prepared:
            feeds = self._contracts["vision"].feeds(
                page.patches[None], *self._grid_inputs(page.grid_thw)
            )
            outs = self._session("vision").run(feeds)  # page runs keep the arena (docs/speed.md)
            features.append(outs[0][0])
            if len(outs) > 1:
                deepstack.append(outs[1][0])
        extras = self.manifest.vision_extras
        return features, (deepstack if extras is not None and extras.deepstack_layers else None)

    # ---------------------------------------------------------------------------------- scoring
    @property
    def scorer(self):
        """The folder's MaxSim scorer graph (checked against the manifest), or numpy without one."""
        if self._scorer is None:
            from .scoring import MaxSimScorer

            entry = self.manifest.scorer
            if entry is None:
                self._scorer = MaxSimScorer()
            else:
                verify_files(
                    self.folder, self.manifest, list(entry.files), check_hashes=self._verify
                )
                check_graph_files(self.folder, entry)
                self._scorer = MaxSimScorer(inside(self.folder, entry.file))
        return self._scorer

    def score(self, queries: Any, documents: Any, **options: Any) -> np.ndarray:
        """Exact MaxSim scores (queries, documents); options as `colembed.score`."""
        return self.scorer.score(queries, documents, **options)

    def top_k(self, queries: Any, documents: Any, k: int, **options: Any):
        """Per query the k best documents: (indices, scores); options as `colembed.top_k`."""
        return self.scorer.top_k(queries, documents, k, **options)

    # ------------------------------------------------------------------------------- text graph
    def _run_text(
        self,
        ids: list[np.ndarray],
        grids: Sequence[Sequence[tuple[int, int, int]]],
        features: list[np.ndarray] | None,
        deepstack: list[np.ndarray] | None = None,
        *,
        shrink_arena: bool = False,
    ) -> list[np.ndarray]:
        """`deepstack`: per page (layers, tokens, width), concatenated along tokens like the
        features (the same index places both); queries pass none (a zero-row table).
        `shrink_arena`: hand the CPU arena's free chunks back after this run (an unusually large
        query run, SHRINK_AFTER_QUERY_BYTES)."""
        cfg = self.config
        input_ids, mask = pad_batch(ids, cfg.pad_token_id)
        positions = config_position_ids(input_ids, mask, grids, cfg)
        index = np.zeros_like(input_ids)
        if features:
            offset = 0
            for row, row_features in enumerate(features):
                slots = np.flatnonzero((input_ids[row] == cfg.image_token_id) & (mask[row] == 1))
                if len(slots) != len(row_features):
                    raise GraphOutputError(
                        f"the image graph returned {len(row_features)} feature rows for a page "
                        f"whose prompt has {len(slots)} image tokens: this folder's graphs and "
                        "manifest disagree (re-export it)",
                        path=self.folder,
                    )
                index[row, slots] = np.arange(offset + 1, offset + 1 + len(slots))
                offset += len(slots)
            table = np.concatenate(features).astype(np.float32, copy=False)
        else:
            table = np.zeros((0, self._text_hidden), dtype=np.float32)
        extra = ()
        extras = self.manifest.vision_extras
        if extras is not None and extras.deepstack_layers:
            extra = (
                np.concatenate(deepstack, axis=1).astype(np.float32, copy=False)
                if features
                else np.zeros((extras.deepstack_layers, 0, self._text_hidden), np.float32),
            )
        (out,) = self._session("text").run(
            self._contracts["text"].feeds(input_ids, mask, positions, index, table, *extra),
            self._run_options if shrink_arena else None,
        )
        if out.ndim != 3 or out.shape[-1] != self.full_embedding_size:
            raise ModelFolderError(
                f"the text graph gives {out.shape[-1:]}-wide vectors, the "
                f"manifest says embedding_dim {self.full_embedding_size}",
                path=self.folder / self.manifest.graph(self.variant, "text").file,
            )
        lengths = mask.sum(axis=1)
        if self.embedding_size != self.full_embedding_size:
            return [truncate(out[row, :n], self.embedding_size) for row, n in enumerate(lengths)]
        return [np.ascontiguousarray(out[row, :n]) for row, n in enumerate(lengths)]


# The old name, kept importable for one release (see CHANGELOG.md).
ColQwen2Model = ColQwenModel


def check_dim(dim: Any, width: int) -> int:
    """The vector width a model of `width`-dim vectors gives for `dim` (None: its own width);
    DimensionError unless 1 <= dim <= width."""
    if dim is None:
        return width
    if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)) or not 1 <= dim <= width:
        raise DimensionError(f"dim must be an int from 1 to the model's width {width}, got {dim!r}")
    return int(dim)


def truncate(vectors: np.ndarray, dim: int) -> np.ndarray:
    """Each row's first `dim` components, L2-normalised again: the Matryoshka reading of a
    model trained so (its first dims carry a usable embedding on their own). A row whose first
    `dim` components are all zero stays zero (the norm is floored as torch's `normalize`)."""
    head = np.array(vectors[..., :dim], dtype=np.float32)
    norms = np.linalg.norm(head, axis=-1, keepdims=True)
    head /= np.maximum(norms, np.float32(1e-12))
    return head


def _refuse_single(items: Any, what: str) -> None:
    """A str/bytes/path is one item, not a batch: iterating it would embed characters or bytes."""
    if (
        isinstance(items, (str, bytes, bytearray, memoryview, os.PathLike))
        or hasattr(items, "read")
        or type(items).__module__.startswith("PIL.")
    ):
        raise InputTypeError(
            f"expected an iterable of {what}, got a single "
            f"{type(items).__name__} (wrap it in a list)",
            item=items,
        )


def _length_groups(lengths: Sequence[int], max_cells: int) -> list[list[int]]:
    """Indices grouped by length (shortest first) into the runs of least total cost: each run
    costs RUN_COST_TOKENS plus count x longest padded tokens, and holds count x longest^2 <=
    `max_cells` (a group always holds at least one item). Ties go to the larger first group."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    n = len(order)
    sizes = [lengths[i] for i in order]
    best = [0.0] * (n + 1)  # best[i]: least cost of items i.. (sorted)
    cut = [n] * (n + 1)
    for i in range(n - 1, -1, -1):
        best[i] = float("inf")
        for j in range(i + 1, n + 1):
            count, longest = j - i, sizes[j - 1]
            if count > 1 and count * longest**2 > max_cells:
                break  # longer groups from i only grow
            cost = RUN_COST_TOKENS + count * longest + best[j]
            if cost <= best[i]:
                best[i], cut[i] = cost, j
    groups, i = [], 0
    while i < n:
        groups.append(order[i : cut[i]])
        i = cut[i]
    return groups


def _collect(iterator: Iterator[np.ndarray]) -> list[np.ndarray]:
    """list(iterator), but an InputError carries the embeddings finished before it (`.completed`)."""
    done: list[np.ndarray] = []
    try:
        for item in iterator:
            done.append(item)
    except InputError as e:
        e.completed = done  # type: ignore[attr-defined]
        raise
    return done


def load(
    source: str | Path,
    *,
    variant: str | None = None,
    providers: Any = None,
    threads: int | None = None,
    max_image_tokens: int | None = None,
    verify: bool | str = True,
    cpu_mem_arena: bool = True,
    session_config: Mapping[str, str] | None = None,
    execution_order: str = "default",
    dim: int | None = None,
) -> ColQwenModel:
    """Load an exported colembed model folder, or a model named in models.json ("colqwen2").

    - `variant`: which graphs ("fp32"; quantised variants when the folder has them). Unnamed:
      "fp16" when the session will run on DirectML and the folder has it, else "fp32".
    - `providers`: None (CPU), "auto" (DirectML when available), or onnxruntime provider names /
      (name, options) pairs; the session must really get the first one or ProviderError is raised.
    - `threads`: intra-op threads (default: physical cores).
    - `max_image_tokens`: cap image tokens per page (max_pixels = K * 28 * 28), overriding the
      folder's bound (ColQwen2 was trained with at most 768).
    - `verify`: check every graph file's sha256 against the manifest (sizes are always checked).
      A file already hashed, unchanged since (size, mtime, inode), is not hashed again;
      `verify="full"` always hashes, `verify=False` checks sizes only.
    - `cpu_mem_arena`: onnxruntime's CPU memory arena (off: each tensor's memory goes back when
      its last reader ran, not kept at the largest run's high-water mark).
    - `session_config`: onnxruntime session config entries for both graphs' sessions, e.g.
      {"optimization.disable_specified_optimizers": "FuseFp16InitializerToFp32NodeTransformer"}
      keeps an fp16 variant's weights fp16 in memory on CPU (the export gate's load).
    - `execution_order`: onnxruntime's node order, "default" or "priority" (see
      `colembed.sessions.Session`; the export gate runs fp16 with "priority", so each weight's
      fp32 cast is made next to the MatMul that reads it).
    - `dim`: keep each vector's first `dim` components, L2-normalised again (pages and queries;
      1 <= dim <= the model's width; `embedding_size` reports it). The graphs run at full width.
      Meaningful only for a model trained with Matryoshka losses (docs/runtime.md).

    A name is resolved like FastEmbed does (its cache folder, then a published export on the hub,
    see `colembed.registry`); an unknown name that is not a folder is an error naming both.
    """
    path = Path(source).expanduser()
    if not path.is_dir():
        from . import registry

        known = {name.lower() for name in registry.known_names()}
        if str(source).lower() not in known:
            raise ModelFolderError(
                "no such model folder, and not a model name from models.json "
                f"({sorted(known)}); export one with `colembed export CHECKPOINT --out DIR`",
                path=path,
            )
        path = registry.resolve_model_folder(str(source))
    if variant is None:
        variant = default_variant(path, providers)
    return ColQwenModel(
        path,
        variant=variant,
        providers=providers,
        threads=threads,
        max_image_tokens=max_image_tokens,
        verify=verify,
        cpu_mem_arena=cpu_mem_arena,
        session_config=session_config,
        execution_order=execution_order,
        dim=dim,
    )


def default_variant(folder: str | Path, providers: Any) -> str:
    """fp16 when DirectML would run the graphs and the folder has fp16 (the variant built for GPUs,
    with fp32 islands); "openvino" (fp32 in OpenVINO's form, exact) on OpenVINO; fp32 otherwise.
    A reduced precision is never chosen for the caller: name it (`colembed doctor --measure`
    says what each costs and gains here)."""
    from .sessions import DIRECTML

    folder = Path(folder)
    first = _name(resolve_providers(providers, auto_openvino=_auto_openvino(folder))[0])
    if first == DIRECTML and "fp16" in read_manifest(folder).variants:
        return "fp16"
    if first == OPENVINO:
        return "openvino"
    return BASE_VARIANT


def _auto_openvino(folder: Path) -> bool:
    """Whether "auto" picks OpenVINO for this folder: only when `colembed doctor --measure` timed
    its exact variant ("openvino") faster than onnxruntime fp32 on this machine for this folder
    (`provider_choice`)."""
    from . import provider_choice

    measured = provider_choice.measured(folder)
    return bool(measured) and measured["provider"] == OPENVINO


def check_variant_provider(variant: str, providers: list[Any], variants: Any) -> None:
    """OpenVINO runs the variants made for it and no other; they run on OpenVINO only."""
    on_openvino = _name(providers[0]) == OPENVINO
    if on_openvino and variant not in OPENVINO_VARIANTS:
        made = sorted(v for v in variants if v in OPENVINO_VARIANTS)
        raise ProviderError(
            f"variant {variant!r} is not made for OpenVINO (its ONNX front end reads the fp32 "
            f"graphs' vision rotary with another meaning); this folder has {made or 'none'} "
            "(export one with `colembed export ... --variant openvino`)"
        )
    if not on_openvino and variant in OPENVINO_VARIANTS:
        raise ProviderError(
            f'variant {variant!r} is made for OpenVINO: load it with providers="openvino"'
        )
