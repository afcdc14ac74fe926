"""ColQwen2 and ColQwen2.5 as FastEmbed 0.9.x late-interaction multimodal models, in one line:

    from colembed.fastembed import LateInteractionMultimodalEmbedding
    model = LateInteractionMultimodalEmbedding("colqwen2")      # or "colqwen2.5", or another
                                                                # name of models.json

One class (`ColQwen2`) serves every name in models.json: the folder's manifest says its family and
the runtime follows it; a folder of another family is refused under a name (`registry`).

`LateInteractionMultimodalEmbedding` here is FastEmbed's own class (the same object), re-exported
after this module has registered ColQwen2 with it. Why an import at all: FastEmbed 0.9 has no
plugin entry points. It looks a name up in a class-level list (`EMBEDDINGS_REGISTRY`), so a model
from another package exists for it only after that package's code has appended its class, in the
same process. Importing this module does that once (`register`): it appends `ColQwen2` after
FastEmbed's own classes and never replaces them (if FastEmbed ever lists a "colqwen2" itself, its
own model keeps the name).

Why not on `import colembed`: importing fastembed costs 0.4-0.75 s, which every `colembed` command
and every runtime user would pay. Why not a meta-path hook that registers when fastembed is
imported: it would still need `import colembed` first (two lines, order-dependent), and wrapping
another package's loader breaks under reloads, frozen apps and other import hooks. An explicit
module is one line, works in any order, and fails loudly when fastembed is missing.

FastEmbed's `parallel=N` workers are started with spawn/forkserver; each unpickles the worker
classes below by reference, which imports this module (and so registers) in the worker, and
rebuilds `ColQwen2` directly from the already-resolved folder: no name lookup happens there.

What FastEmbed sees (its contract for multimodal late-interaction models):
- `embed_text` / `embed_image` yield one float32 (tokens, dim) array per item, padding removed, in
  input order, from lists or generators, at any batch size; images may be paths, str, bytes, file
  objects or PIL images. Queries run only the text graph (never the vision tower).
- `token_count` (with or without the "Query: " prefix and the 10 augmentation tokens),
  `lazy_load` (no onnxruntime session until the first embed; token counting never opens one),
  `parallel` (None: this process; N: N worker processes; 0: one per CPU), `providers`, `cuda`,
  `device_ids`, `threads`, `enable_cpu_mem_arena`, `local_files_only`, `specific_model_path`,
  `embedding_size` / `get_embedding_size`, `list_supported_models`.
- colembed's own options pass through as keywords: `variant`, `max_image_tokens`, `verify`,
  `dim` (each vector's first `dim` components, renormalised: `colembed.load`'s). With `dim`,
  this class's `embedding_size` is `dim`; FastEmbed's wrapper reports the model description's
  width (a class-level lookup), so size a collection by `dim`.
  `providers=["openvino"]` runs the folder's OpenVINO variant (the openvino extra).

Model descriptions come from `models.json` (`colembed.registry`); the folder is found by
`registry.resolve_model_folder` (specific path, cache, published export, else an error naming
`colembed export`), complete when it holds what its own manifest lists for the variant. The
vectors are colembed's own (`ColQwenModel`), bit for bit.

Imports fastembed (which never imports torch); `import colembed` works without fastembed.
"""

from __future__ import annotations

import os
import warnings
from multiprocessing import get_all_start_methods
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

try:
    import fastembed
    from fastembed.common.model_description import DenseModelDescription, ModelSource
    from fastembed.common.types import Device
    from fastembed.late_interaction_multimodal.late_interaction_multimodal_embedding import (
        LateInteractionMultimodalEmbedding,
    )
    from fastembed.late_interaction_multimodal.late_interaction_multimodal_embedding_base import (
        LateInteractionMultimodalEmbeddingBase,
    )
    from fastembed.parallel_processor import ParallelWorkerPool, Worker
except ImportError as e:
    raise ImportError(
        "colembed's FastEmbed integration needs fastembed 0.9.x: pip install 'colembed[fastembed]' "
        f"({e})"
    ) from e

from . import registry
from .errors import InputError
from .layout import BASE_VARIANT, MANIFEST_NAME, TOKENIZER_FILE, variant_files
from .integrity import verify_files
from .manifest import read_manifest
from .model import check_dim
from .safe_fs import inside
from .sessions import CUDA, available_providers, default_openvino_variant

SUPPORTED_FASTEMBED = ((0, 9), (0, 10))  # [lower, upper): the versions this module was tested with


def _fastembed_version() -> tuple[int, ...]:
    parts = []
    for piece in str(getattr(fastembed, "__version__", "0")).split(".")[:2]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def _describe(entry: registry.ModelEntry, name: str) -> DenseModelDescription:
    # FastEmbed requires a source. Until a colembed export is published, it names the checkpoint
    # the export is made from; FastEmbed never downloads it for us (ColQwen2 resolves its folder
    # through colembed.registry). The model file is the manifest: it lists every other file.
    # FastEmbed finds a model by its description's name, so each alias gets one (registry: an
    # alias is the same entry, the same cache folder).
    alias = "" if name == entry.model else f" (the name {name!r} stands for {entry.model})"
    return DenseModelDescription(
        model=name,
        dim=entry.dim,
        description=entry.description + alias,
        license=entry.license,
        size_in_GB=entry.size_in_GB,
        sources=ModelSource(hf=entry.export_repo or entry.checkpoint),
        model_file=MANIFEST_NAME,
    )


def _is_single_image(images: Any) -> bool:
    from PIL import Image

    return isinstance(images, (str, Path, bytes, bytearray, memoryview, Image.Image)) or (
        hasattr(images, "read")
    )


def _batched(items: Iterable[Any], size: int) -> Iterator[tuple[int, list[Any]]]:
    """(index of the first item, items) per batch, lazily; file objects are read into bytes, so
    that a batch can be pickled for a worker process."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"batch_size must be a positive int, got {size!r}")
    batch: list[Any] = []
    start = 0
    for item in items:
        batch.append(item.read() if hasattr(item, "read") else item)
        if len(batch) == size:
            yield start, batch
            start, batch = start + size, []
    if batch:
        yield start, batch


class ColQwen2(LateInteractionMultimodalEmbeddingBase):
    """ColQwen2 through colembed, for `LateInteractionMultimodalEmbedding("colqwen2")`."""

    def __init__(
        self,
        model_name: str,
        cache_dir: str | None = None,
        threads: int | None = None,
        providers: Sequence[Any] | None = None,
        cuda: bool | Device = Device.AUTO,
        device_ids: list[int] | None = None,
        lazy_load: bool = False,
        device_id: int | None = None,
        specific_model_path: str | None = None,
        enable_cpu_mem_arena: bool = True,
        variant: str | None = None,
        max_image_tokens: int | None = None,
        verify: bool = True,
        dim: int | None = None,
        **kwargs: Any,
    ) -> None:
        unknown = sorted(set(kwargs) - {"local_files_only"})
        if unknown:
            raise TypeError(f"ColQwen2 got unexpected keyword arguments {unknown}")
        super().__init__(model_name, cache_dir, threads, **kwargs)  # sets _local_files_only
        # unnamed: fp32, or on OpenVINO its exact variant (the only exact one it runs)
        variant = variant or default_openvino_variant(providers) or BASE_VARIANT
        self.model_description = self._get_model_description(model_name)
        self.dim = None if dim is None else check_dim(dim, self.model_description.dim)
        self._entry = registry.get_model(self.model_description.model)
        self.cache_dir = str(registry.default_cache_dir(cache_dir))
        self._specific_model_path = specific_model_path
        self._model_dir = registry.resolve_model_folder(
            self._entry,
            specific_model_path=specific_model_path,
            cache_dir=self.cache_dir,
            local_files_only=self._local_files_only,
            variant=variant,
        )

        self.providers = providers
        self.cuda = cuda
        self.device_ids = device_ids
        self.device_id = (
            device_id if device_id is not None else (device_ids[0] if device_ids else None)
        )
        self.lazy_load = lazy_load
        self.enable_cpu_mem_arena = enable_cpu_mem_arena
        self.variant = variant
        self.max_image_tokens = max_image_tokens
        self.verify = verify
        self._verified = not verify
        self._text_encoder = None
        # `self.model` (a colembed ColQwenModel) exists only once loaded, as in FastEmbed.
        if not lazy_load:
            self.load_onnx_model()

    # ------------------------------------------------------------------------------ FastEmbed API
    @classmethod
    def _list_supported_models(cls) -> list[DenseModelDescription]:
        return [_describe(entry, name) for entry in registry.known_models() for name in entry.names]

    @classmethod
    def get_embedding_size(cls, model_name: str) -> int:
        dim = cls._get_model_description(model_name).dim
        assert dim is not None  # DenseModelDescription guarantees it
        return dim

    @property
    def embedding_size(self) -> int:
        if self._embedding_size is None:
            self._embedding_size = self.dim or self.get_embedding_size(self.model_name)
        return self._embedding_size

    def load_onnx_model(self) -> None:
        """Open the two onnxruntime sessions (done on first use with lazy_load=True)."""
        import colembed

        providers, fallback = self._onnx_providers()
        options = dict(
            variant=self.variant,
            threads=self.threads,
            max_image_tokens=self.max_image_tokens,
            verify=not self._verified,
            cpu_mem_arena=self.enable_cpu_mem_arena,
            dim=self.dim,
        )
        try:
            self.model = colembed.load(self._model_dir, providers=providers, **options)
        except colembed.ProviderError as e:
            if not fallback:
                raise
            warnings.warn(
                f"CUDA was available but not usable ({e}); running on CPU",
                RuntimeWarning,
                stacklevel=2,
            )
            self.model = colembed.load(self._model_dir, providers=None, **options)
        self._verified = True
        self._text_encoder = self.model.text_encoder

    def embed_text(
        self,
        documents: str | Iterable[str],
        batch_size: int = 256,
        parallel: int | None = None,
        **kwargs: Any,
    ) -> Iterator[np.ndarray]:
        """One float32 (tokens, dim) array per query, in order. `parallel`: see the module doc."""
        _no_extra(kwargs)
        if isinstance(documents, str):
            documents = [documents]
        yield from self._embed(_TextWorker, documents, batch_size, parallel)

    def embed_image(
        self,
        images: Any,
        batch_size: int = 16,
        parallel: int | None = None,
        **kwargs: Any,
    ) -> Iterator[np.ndarray]:
        """One float32 (tokens, dim) array per page, in order. Images: paths, str, bytes, file
        objects or PIL images, one or an iterable of them."""
        _no_extra(kwargs)
        if _is_single_image(images):
            images = [images]
        yield from self._embed(_ImageWorker, images, batch_size, parallel)

    def token_count(
        self,
        texts: str | Iterable[str],
        batch_size: int = 1024,
        include_extension: bool = False,
        **kwargs: Any,
    ) -> int:
        """Tokens of the texts as queries: with `include_extension`, the "Query: " prefix and the
        augmentation tokens are counted too. Loads only the tokenizer."""
        _no_extra(kwargs)
        if isinstance(texts, str):
            texts = [texts]
        encoder = self._encoder()
        total = 0
        for _, batch in _batched(texts, batch_size):
            total += sum(
                encoder.count_query_tokens(t, include_extension=include_extension) for t in batch
            )
        return total

    # -------------------------------------------------------------------------------- internals
    def _embed(
        self, worker: type["_Worker"], items: Any, batch_size: int, parallel: int | None
    ) -> Iterator[np.ndarray]:
        """Here (colembed's lazy iterator) or in FastEmbed's worker processes, as FastEmbed does."""
        if self._use_workers(items, batch_size, parallel):
            yield from self._embed_in_workers(worker, items, batch_size, parallel)
        else:
            model = self._loaded()
            serial = (
                model.iter_query_embeddings
                if worker is _TextWorker
                else model.iter_image_embeddings
            )
            yield from serial(items, batch_size=batch_size)

    def _loaded(self):
        if getattr(self, "model", None) is None:
            self.load_onnx_model()
        return self.model

    def _encoder(self):
        if self._text_encoder is None:
            from .preprocess.text import TextEncoder

            config = read_manifest(self._model_dir).preprocess
            self._text_encoder = TextEncoder.from_file(
                inside(self._model_dir, TOKENIZER_FILE), config
            )
        return self._text_encoder

    def _onnx_providers(self) -> tuple[Any, bool]:
        """(providers for colembed.load, whether a CUDA failure may fall back to CPU), following
        FastEmbed: explicit providers win; cuda=True/Device.CUDA demands CUDA; Device.AUTO uses
        CUDA when onnxruntime has it."""
        explicit_cuda = self.cuda is True or self.cuda == Device.CUDA
        if self.providers is not None:
            if explicit_cuda:
                warnings.warn(
                    "`cuda` and `providers` are mutually exclusive; using `providers`",
                    UserWarning,
                    stacklevel=3,
                )
            return list(self.providers), False
        cuda = [CUDA] if self.device_id is None else [(CUDA, {"device_id": self.device_id})]
        if explicit_cuda:
            return cuda, False
        if self.cuda == Device.AUTO and CUDA in available_providers():
            return cuda, True
        return None, False

    @staticmethod
    def _use_workers(items: Any, batch_size: int, parallel: int | None) -> bool:
        # As FastEmbed: a list shorter than one batch is not worth starting processes for.
        if parallel is None:
            return False
        return not (isinstance(items, list) and len(items) < batch_size)

    def _verify_once(self) -> None:
        """Check the graph files' sha256 here once, instead of in every worker."""
        if self._verified:
            return
        manifest = read_manifest(self._model_dir)
        verify_files(
            self._model_dir, manifest, variant_files(manifest, self.variant), check_hashes=True
        )
        self._verified = True

    def _worker_params(self) -> dict[str, Any]:
        """How a worker process rebuilds this model: the resolved folder, never a new lookup."""
        return {
            "model_name": self.model_name,
            "cache_dir": self.cache_dir,
            "specific_model_path": str(self._model_dir),
            "local_files_only": True,
            "providers": self.providers,
            "threads": self.threads or 1,
            "enable_cpu_mem_arena": self.enable_cpu_mem_arena,
            "variant": self.variant,
            "max_image_tokens": self.max_image_tokens,
            "verify": not self._verified,
            "dim": self.dim,
        }

    def _embed_in_workers(
        self, worker: type[Worker], items: Iterable[Any], batch_size: int, parallel: int
    ) -> Iterator[np.ndarray]:
        self._verify_once()
        start_method = "forkserver" if "forkserver" in get_all_start_methods() else "spawn"
        pool = ParallelWorkerPool(
            num_workers=parallel or os.cpu_count() or 1,
            worker=worker,
            cuda=self.cuda,
            device_ids=self.device_ids,
            start_method=start_method,
        )
        for result in pool.ordered_map(_batched(items, batch_size), **self._worker_params()):
            if isinstance(result, _Failure):
                raise result.error()
            yield from result


def _no_extra(kwargs: dict[str, Any]) -> None:
    if kwargs:
        raise TypeError(f"ColQwen2 got unexpected keyword arguments {sorted(kwargs)}")


class _Failure:
    """A bad item met in a worker, sent back so the caller gets the real InputError (with the
    item's index in the whole input) instead of FastEmbed's generic worker error."""

    def __init__(self, error: InputError, start: int) -> None:
        self.kind = type(error)
        self.reason = error.reason
        self.index = None if error.index is None else start + error.index

    def error(self) -> InputError:
        return self.kind(self.reason, index=self.index)


class _Worker(Worker):
    """Runs in a FastEmbed worker process: one ColQwen2, batches in, embeddings out."""

    def __init__(self, model: ColQwen2) -> None:
        self.model = model

    @classmethod
    def start(cls, model_name: str, cache_dir: str, **kwargs: Any) -> "_Worker":
        return cls(ColQwen2(model_name, cache_dir, **kwargs))

    def _embed(self, batch: list[Any]) -> list[np.ndarray]:
        raise NotImplementedError

    def process(self, items: Iterable[tuple[int, Any]]) -> Iterable[tuple[int, Any]]:
        for idx, (start, batch) in items:
            try:
                yield idx, self._embed(batch)
            except InputError as e:
                yield idx, _Failure(e, start)


class _TextWorker(_Worker):
    def _embed(self, batch: list[Any]) -> list[np.ndarray]:
        return self.model._loaded().embed_queries(batch, batch_size=len(batch))


class _ImageWorker(_Worker):
    def _embed(self, batch: list[Any]) -> list[np.ndarray]:
        return self.model._loaded().embed_images(batch, batch_size=len(batch))


def register() -> type[ColQwen2]:
    """Add ColQwen2 to FastEmbed's multimodal late-interaction registry, once.

    Idempotent; a class left there by an earlier import of this module (a reload) is replaced in
    place; a name FastEmbed already serves itself is left to FastEmbed (with a warning).
    """
    models = LateInteractionMultimodalEmbedding.EMBEDDINGS_REGISTRY
    ours = f"{ColQwen2.__module__}.{ColQwen2.__qualname__}"
    for i, cls in enumerate(models):
        if cls is ColQwen2:
            return ColQwen2
        if f"{cls.__module__}.{cls.__qualname__}" == ours:
            models[i] = ColQwen2
            return ColQwen2
    taken = {d.model.lower() for cls in models for d in cls._list_supported_models()}
    clash = [d.model for d in ColQwen2._list_supported_models() if d.model.lower() in taken]
    if clash:
        warnings.warn(
            f"FastEmbed already provides {clash}; colembed leaves FastEmbed's own model "
            "registered under that name",
            RuntimeWarning,
            stacklevel=2,
        )
        return ColQwen2
    models.append(ColQwen2)
    return ColQwen2


__all__ = ["ColQwen2", "LateInteractionMultimodalEmbedding", "register"]

if not SUPPORTED_FASTEMBED[0] <= _fastembed_version() < SUPPORTED_FASTEMBED[1]:
    warnings.warn(
        f"colembed's FastEmbed integration was tested with fastembed 0.9.x, not "
        f"{fastembed.__version__}",
        RuntimeWarning,
        stacklevel=2,
    )

register()
