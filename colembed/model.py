"""The runtime model: a verified model folder, two onnxruntime sessions, numpy preprocessing.

Data flow for a batch of pages:
    images -> prepare_image (resize, normalise, patchify; one PreparedImage each)
           -> grouped by grid -> image graph (B same-grid images at once) -> merged features
           -> page prompts (image tokens expanded) -> pad_batch -> 3-D positions, feature index
           -> text graph -> (B, L, dim) -> each page's real rows
Queries take the same text path with no image features; they never run the image graph.
"""

from __future__ import annotations

import functools
import itertools
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

from .errors import InputError, ModelFolderError
from .manifest import Manifest, read_manifest, verify_files
from .preprocess.config import PreprocessConfig
from .preprocess.images import PreparedImage, prepare_image
from .preprocess.positions import mrope_position_ids, vision_rotary_tables
from .preprocess.text import TextEncoder, pad_batch
from .sessions import Session, physical_cores, resolve_providers

# Attention scores dominate the image graph's memory: heads * patches^2 floats per image per layer.
# Same-grid pages are batched until their scores reach this budget (always at least one page).
VISION_ATTENTION_BUDGET_BYTES = 1 << 30


def _batches(items: Iterable[Any], size: int) -> Iterator[tuple[int, list[Any]]]:
    """(index of the first item, items) for consecutive batches, without materialising `items`."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"batch_size must be a positive int, got {size!r}")
    iterator = iter(items)
    start = 0
    while batch := list(itertools.islice(iterator, size)):
        yield start, batch
        start += len(batch)


class ColQwen2Model:
    """ColQwen2 on onnxruntime. Make one with `colembed.load(...)`.

    `embed_queries` / `embed_images` return one float32 (tokens, dim) array per item, padding
    removed, in input order; `iter_*` do the same lazily over any iterable.
    """

    def __init__(
        self,
        folder: str | Path,
        *,
        variant: str = "fp32",
        providers: Any = None,
        threads: int | None = None,
        max_image_tokens: int | None = None,
        verify: bool | str = True,
        cpu_mem_arena: bool = True,
    ) -> None:
        if verify not in (True, False, "full"):
            raise ValueError(f"verify must be True, False or 'full', got {verify!r}")
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise ModelFolderError("not a folder", path=self.folder)
        self.manifest: Manifest = read_manifest(self.folder)
        self.variant = variant
        vision_entry = self.manifest.graph(variant, "vision")
        text_entry = self.manifest.graph(variant, "text")
        graph_files = [f for e in (vision_entry, text_entry) for f in (e.file, e.data_file) if f]
        verify_files(self.folder, self.manifest, graph_files + ["tokenizer.json"],
                     check_hashes=verify)

        self.config = PreprocessConfig.from_dict(self.manifest.preprocess).with_max_image_tokens(
            max_image_tokens)
        self.text_encoder = TextEncoder.from_file(self.folder / "tokenizer.json", self.config)
        self.embedding_size = int(self.manifest.embedding_dim)
        self._provider_request = resolve_providers(providers)
        self._sessions: dict[str, Session] = {}
        for role, entry in (("vision", vision_entry), ("text", text_entry)):
            self._sessions[role] = self._open(entry, threads=threads, cpu_mem_arena=cpu_mem_arena)
        self._verify = verify
        self._preprocess_threads = threads if threads else physical_cores()
        self._rotary_cache: dict[tuple[int, int, int], tuple[np.ndarray, np.ndarray]] = {}
        self._scorer = None

    def _open(self, entry, *, threads, cpu_mem_arena) -> Session:
        path = self.folder / entry.file
        try:
            session = Session(str(path), self._provider_request, threads=threads,
                              cpu_mem_arena=cpu_mem_arena)
        except ModelFolderError:
            raise
        except Exception as e:  # onnxruntime raises its own types for unreadable graphs
            if type(e).__module__.startswith("colembed"):
                raise
            raise ModelFolderError(f"onnxruntime cannot load this graph ({e})", path=path) from e
        problems = entry.contract.mismatches(session.session)
        if problems:
            raise ModelFolderError("graph does not match its manifest contract: "
                                   + "; ".join(problems), path=path)
        return session

    # ----------------------------------------------------------------------------- properties
    @property
    def providers(self) -> list[str]:
        return self._sessions["text"].providers

    @property
    def max_image_tokens(self) -> int:
        return self.config.max_pixels // (self.config.patch_size * self.config.merge_size) ** 2

    @property
    def name(self) -> str:
        return str(self.manifest.model.get("name", self.folder.name))

    def __repr__(self) -> str:
        random = ", random_weights=True" if self.manifest.model.get("random_weights") else ""
        return (f"ColQwen2Model(name={self.name!r}, variant={self.variant!r}, "
                f"dim={self.embedding_size}, max_image_tokens={self.max_image_tokens}, "
                f"providers={self.providers}{random}, folder='{self.folder}')")

    # ---------------------------------------------------------------------------------- queries
    def iter_query_embeddings(self, texts: Iterable[str], batch_size: int = 16) -> Iterator[np.ndarray]:
        if isinstance(texts, str):
            raise InputError("expected an iterable of query strings, got a single str "
                             "(wrap it in a list)")
        for start, batch in _batches(texts, batch_size):
            ids = self.text_encoder.encode_queries(batch, start_index=start)
            yield from self._run_text(ids, [()] * len(ids), None)

    def embed_queries(self, texts: Iterable[str], batch_size: int = 16) -> list[np.ndarray]:
        return _collect(self.iter_query_embeddings(texts, batch_size))

    # ----------------------------------------------------------------------------------- images
    def iter_image_embeddings(self, images: Iterable[Any], batch_size: int = 4) -> Iterator[np.ndarray]:
        """Pages in, one (tokens, dim) array per page out.

        If an image in a batch is bad, the pages before it are still embedded and yielded, then
        the ImageError (naming the page's index) is raised.
        """
        for start, batch in _batches(images, batch_size):
            prepared, error = self._prepare_batch(batch, start)
            if prepared:
                yield from self._embed_prepared(prepared)
            if error is not None:
                raise error

    def embed_images(self, images: Iterable[Any], batch_size: int = 4) -> list[np.ndarray]:
        return _collect(self.iter_image_embeddings(images, batch_size))

    def _prepare_batch(self, batch: list[Any], start: int) -> tuple[list[PreparedImage], InputError | None]:
        """The batch's pages decoded, resized and patchified in threads (PIL's decode and resize
        and numpy's gathers release the GIL), in order, up to the first bad one and its error."""
        workers = min(len(batch), self._preprocess_threads)
        if workers > 1:
            with ThreadPoolExecutor(workers, thread_name_prefix="colembed-prepare") as pool:
                futures = [pool.submit(prepare_image, obj, self.config, index=start + offset)
                           for offset, obj in enumerate(batch)]
            outcomes = (future.result for future in futures)
        else:  # lazily, so a bad page stops the work at once
            outcomes = (functools.partial(prepare_image, obj, self.config, index=start + offset)
                        for offset, obj in enumerate(batch))
        results: list[PreparedImage] = []
        for outcome in outcomes:
            try:
                results.append(outcome())
            except InputError as e:
                return results, e
        return results, None

    def image_features(self, images: Sequence[Any]) -> list[np.ndarray]:
        """The image graph's merged features per image, (tokens, text width): for checks."""
        return self._vision_features([prepare_image(o, self.config, index=i)
                                      for i, o in enumerate(images)])

    def _embed_prepared(self, prepared: list[PreparedImage]) -> list[np.ndarray]:
        features = self._vision_features(prepared)
        ids = [self.text_encoder.page_prompt_ids(p.num_image_tokens) for p in prepared]
        return self._run_text(ids, [(p.grid_thw,) for p in prepared], features)

    def _rotary(self, grid: tuple[int, int, int]) -> tuple[np.ndarray, np.ndarray]:
        if grid not in self._rotary_cache:
            if len(self._rotary_cache) > 64:
                self._rotary_cache.clear()
            self._rotary_cache[grid] = vision_rotary_tables(
                grid, merge_size=self.config.merge_size, head_dim=self.config.vision_head_dim,
                theta=self.config.vision_rope_theta)
        return self._rotary_cache[grid]

    def _vision_features(self, prepared: list[PreparedImage]) -> list[np.ndarray]:
        """Same-grid images go through the image graph together; output in input order."""
        by_grid: dict[tuple[int, int, int], list[int]] = defaultdict(list)
        for i, p in enumerate(prepared):
            by_grid[p.grid_thw].append(i)
        heads = int(self.manifest.architecture.get("vision_heads", 16))
        features: list[np.ndarray | None] = [None] * len(prepared)
        for grid, members in by_grid.items():
            patches = prepared[members[0]].patches.shape[0]
            per_image = heads * patches * patches * 4
            chunk = max(1, VISION_ATTENTION_BUDGET_BYTES // per_image)
            cos, sin = self._rotary(grid)
            for lo in range(0, len(members), chunk):
                group = members[lo:lo + chunk]
                pixels = np.stack([prepared[i].patches for i in group])
                (out,) = self._sessions["vision"].run(
                    {"pixel_patches": pixels, "rotary_cos": cos, "rotary_sin": sin})
                for i, rows in zip(group, out):
                    features[i] = rows
        return features  # type: ignore[return-value]

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
                verify_files(self.folder, self.manifest, [entry.file], check_hashes=self._verify)
                self._scorer = MaxSimScorer(self.folder / entry.file)
        return self._scorer

    def score(self, queries: Any, documents: Any, **options: Any) -> np.ndarray:
        """Exact MaxSim scores (queries, documents); options as `colembed.score`."""
        return self.scorer.score(queries, documents, **options)

    def top_k(self, queries: Any, documents: Any, k: int, **options: Any):
        """Per query the k best documents: (indices, scores); options as `colembed.top_k`."""
        return self.scorer.top_k(queries, documents, k, **options)

    # ------------------------------------------------------------------------------- text graph
    def _run_text(self, ids: list[np.ndarray], grids: Sequence[Sequence[tuple[int, int, int]]],
                  features: list[np.ndarray] | None) -> list[np.ndarray]:
        cfg = self.config
        input_ids, mask = pad_batch(ids, cfg.pad_token_id)
        positions = mrope_position_ids(input_ids, mask, grids, image_token_id=cfg.image_token_id,
                                       vision_start_token_id=cfg.vision_start_token_id,
                                       merge_size=cfg.merge_size)
        index = np.zeros_like(input_ids)
        hidden = int(self.manifest.architecture["text_hidden"])
        if features:
            offset = 0
            for row, row_features in enumerate(features):
                slots = np.flatnonzero((input_ids[row] == cfg.image_token_id) & (mask[row] == 1))
                if len(slots) != len(row_features):
                    raise RuntimeError(f"page prompt has {len(slots)} image tokens for "
                                       f"{len(row_features)} feature rows")
                index[row, slots] = np.arange(offset + 1, offset + 1 + len(slots))
                offset += len(slots)
            table = np.concatenate(features).astype(np.float32, copy=False)
        else:
            table = np.zeros((0, hidden), dtype=np.float32)
        (out,) = self._sessions["text"].run({
            "input_ids": input_ids, "attention_mask": mask, "position_ids": positions,
            "image_feature_index": index, "image_features": table,
        })
        lengths = mask.sum(axis=1)
        return [np.ascontiguousarray(out[row, :n]) for row, n in enumerate(lengths)]


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
) -> ColQwen2Model:
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

    A name is resolved like FastEmbed does (its cache folder, then a published export on the hub,
    see `colembed.registry`); an unknown name that is not a folder is an error naming both.
    """
    path = Path(source).expanduser()
    if not path.is_dir():
        from . import registry

        known = {entry.model.lower() for entry in registry.known_models()}
        if str(source).lower() not in known:
            raise ModelFolderError(
                "no such model folder, and not a model name from models.json "
                f"({sorted(known)}); export one with `colembed export CHECKPOINT --out DIR`",
                path=path)
        path = registry.resolve_model_folder(str(source))
    if variant is None:
        variant = default_variant(path, providers)
    return ColQwen2Model(path, variant=variant, providers=providers, threads=threads,
                         max_image_tokens=max_image_tokens, verify=verify,
                         cpu_mem_arena=cpu_mem_arena)


def default_variant(folder: str | Path, providers: Any) -> str:
    """fp16 when DirectML would run the graphs and the folder has fp16 (the variant built for GPUs,
    with fp32 islands), fp32 otherwise."""
    from .sessions import DIRECTML, resolve_providers

    first = resolve_providers(providers)[0]
    first = first if isinstance(first, str) else first[0]
    if first == DIRECTML and "fp16" in read_manifest(Path(folder)).variants:
        return "fp16"
    return "fp32"
