"""`colembed.Index`: a searchable, resumable index of PDFs and images in Qdrant.

    index = colembed.Index("my-index", model="colqwen2-onnx")    # a folder: Qdrant Edge, embedded
    index = colembed.Index(url="http://qdrant:6333", api_key=..., model=...)   # a Qdrant server
    result = index.add(["reports/", "scan.tiff"])    # .added / .skipped / .failed, with reasons
    hits = index.search("revenue in 2023", k=5)     # Hit(file, page, score, payload, ...)

The model is loaded on first use (an index opened only to count or remove pages never loads
one). Without `model=`, the model recorded in the index (`model_source`) is loaded. An index
refuses a model whose name, variant or manifest differs from the one it was built with.
"""

from __future__ import annotations

import hashlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from ..layout import MANIFEST_NAME
from .ingest import AddResult, FileReport, ingest
from .maps import SimilarityMap, explain, overlay
from .schema import identity_mismatch
from .sources import Document, SourceError, discover
from .store import (DEFAULT_SEARCH_MODE, ModelMismatchError, StoreError, check_mode, open_store,
                    upgrade_index)



@dataclass(frozen=True)
class Hit:
    """One page found: `file`, 1-based `page`, MaxSim `score`, the stored `payload`; with
    `explain=True` also the `map` (a SimilarityMap) of where the score comes from."""

    file: str
    page: int
    score: float
    payload: dict[str, Any]
    id: str
    map: SimilarityMap | None = None


def manifest_sha256(folder: str | os.PathLike) -> str:
    return hashlib.sha256((Path(folder) / MANIFEST_NAME).read_bytes()).hexdigest()


class Index:
    """Create or open an index (see the module docstring)."""

    def __init__(self, location: str | os.PathLike | None = None, *, model: Any = None,
                 url: str | None = None, api_key: str | None = None,
                 collection: str | None = None, variant: str = "fp32",
                 max_image_tokens: int | None = None, local: bool = False,
                 **load_options: Any) -> None:
        self._model_arg = model
        self._load_options = dict(load_options, variant=variant, max_image_tokens=max_image_tokens)
        self._model = model if hasattr(model, "embed_pages") else None
        dim = self.model.embedding_size if model is not None else None
        self.store = open_store(location, url=url, api_key=api_key, dim=dim,
                                collection=collection, local=local)
        if self._model is not None:
            self._check_identity()

    # ------------------------------------------------------------------------------ the model
    @property
    def model(self):
        if self._model is None:
            source = self._model_arg
            if source is None:
                stored = self.store.any_payload()
                if not stored:
                    raise StoreError(f"{self.store.location}: the index is empty and no model "
                                     "was given (pass model=... / --model)")
                source = stored["model_source"]
            import colembed

            self._model = colembed.load(source, **self._load_options)
            if hasattr(self, "store"):
                self._check_identity()
        return self._model

    @property
    def identity(self) -> dict[str, Any]:
        m = self.model
        return {"model": m.name, "variant": m.variant, "manifest_sha256": manifest_sha256(m.folder),
                "schema": self.store.schema, "model_source": str(Path(m.folder).resolve())}

    def _check_identity(self) -> None:
        stored = self.store.any_payload()
        problems = identity_mismatch(stored, self.identity) if stored else []
        if problems:
            raise ModelMismatchError(f"{self.store.location}: this index was built with another "
                                     "model or export (" + "; ".join(problems) + ")")

    # ---------------------------------------------------------------------------------- writes
    def add(self, paths: Iterable[str | os.PathLike] | str | os.PathLike, *,
            dpi: float | None = None, prune: bool = False, batch_size: int = 4,
            progress: bool | None = None) -> AddResult:
        """Index PDFs and images (files or folders, walked). Stored pages are skipped; a changed
        file's old pages are replaced; `prune` drops pages of files that no longer exist. A bad
        file is reported in `.failed` with its reason and never stops the run."""
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        exclude = [Path(self.store.location)] if Path(str(self.store.location)).is_dir() else []
        found = discover(paths, exclude=exclude)
        result = AddResult(
            skipped=[FileReport(str(p), reason=r) for p, r in found.ignored],
            failed=[FileReport(str(p), reason=r) for p, r in found.missing])
        bar = _progress_bar(progress, f"indexing {len(found.documents)} file(s)")
        already = len(result.skipped) + len(result.failed)

        def on_pages(n: int) -> None:
            done = len(result.added) + len(result.skipped) + len(result.failed) - already
            bar.set_postfix_str(f"files {done}/{len(found.documents)}", refresh=False)
            bar.update(n)

        try:
            ingest(found.documents, self.store, self.model, self.identity, dpi=dpi,
                   batch_size=batch_size, result=result, on_pages=on_pages,
                   on_total=lambda n: _grow(bar, n))
            on_pages(0)  # the last files' reports come after their pages
        finally:
            bar.close()
        if prune:
            result.removed = self._prune()
        return result

    def add_embedded(self, pages, *, identity: dict[str, Any] | None = None) -> int:
        """Store pages embedded elsewhere: `embedded.EmbeddedPage`s (vectors, grid, source) or
        ready `PagePoint`s (`colembed.distributed.read_points`), checked as `add` checks its own
        (embedded.py); returns the pages stored. The pages carry this index's model identity
        (`identity=` or the model given; else the stored pages', or a ready point's)."""
        from .embedded import add_embedded

        if identity is None and self._model_arg is not None:
            identity = self.identity
        return add_embedded(self.store, pages, identity)

    def remove(self, paths: Iterable[str | os.PathLike] | str | os.PathLike) -> int:
        """Drop every page of these files (or of the files under these folders); returns pages."""
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        targets = [Path(p).expanduser().resolve() for p in paths]
        doomed = [pid for pid, p in self.store.payloads()
                  if any(_under(Path(p["path"]), t) for t in targets)]
        self.store.delete(doomed)
        self.store.flush()
        return len(doomed)

    def _prune(self) -> list[FileReport]:
        gone: dict[str, list[str]] = {}
        for pid, p in self.store.payloads():
            if not Path(p["path"]).is_file():
                gone.setdefault(p["path"], []).append(pid)
        self.store.delete([pid for ids in gone.values() for pid in ids])
        self.store.flush()
        return [FileReport(path, len(ids), "file no longer exists") for path, ids in gone.items()]

    # ----------------------------------------------------------------------------------- reads
    def __len__(self) -> int:
        """Pages stored."""
        return self.store.count()

    def search(self, queries: str | Sequence[str], k: int = 5, *, mode: str = DEFAULT_SEARCH_MODE,
               explain: bool = False) -> list[Hit] | list[list[Hit]]:
        """The k best pages per query (a list of Hits for one str, one list per query for a
        list). `mode`: "two-stage" (pooled prefetch, exact rerank) or "exact" (full scan).
        `explain=True` attaches each hit's SimilarityMap."""
        check_mode(mode)
        single = isinstance(queries, str)
        texts = [queries] if single else list(queries)
        vectors = self.model.embed_queries(texts)
        found = self.store.search(vectors, k, mode)
        hits = [[Hit(h.payload.get("path", ""), int(h.payload.get("page", 0)), h.score, h.payload,
                     h.id) for h in row] for row in found]
        if explain:
            hits = [self._explain(q, row) for q, row in zip(vectors, hits)]
        return hits[0] if single else hits

    def _explain(self, query: np.ndarray, hits: list[Hit]) -> list[Hit]:
        from ..model import PageLayout

        stored = self.store.page_vectors([h.id for h in hits])
        out = []
        for h in hits:
            page = stored[h.id]
            layout = PageLayout(grid_rows=h.payload["grid"][0], grid_cols=h.payload["grid"][1],
                                image_start=h.payload["image_start"], num_tokens=len(page),
                                token_px=self.model.config.resize_factor)
            out.append(Hit(h.file, h.page, h.score, h.payload, h.id, explain(query, page, layout)))
        return out

    def page_image(self, hit: Hit):
        """The hit's page, rendered again at its indexed size (SourceError if the file changed)."""
        from .sources import file_sha256

        path = Path(hit.file)
        if file_sha256(path) != hit.payload.get("sha256"):
            raise SourceError(path, "file changed since it was indexed")
        with Document(path, max_pixels=self.model.config.max_pixels) as doc:
            return doc.render(hit.page, (hit.payload["width"], hit.payload["height"]))

    def save_map(self, hit: Hit, path: str | os.PathLike) -> Path:
        """Write the hit's similarity overlay (needs `search(..., explain=True)`) as a PNG."""
        if hit.map is None:
            raise ValueError("this hit has no map: search with explain=True")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        overlay(self.page_image(hit), hit.map).save(path)
        return path

    def close(self) -> None:
        self.store.close()

    def __enter__(self) -> Index:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _under(path: Path, target: Path) -> bool:
    return path == target or target in path.parents


def upgrade_with_progress(location, progress: bool | None = None) -> int:
    """`store.upgrade_index` with the progress bar of `Index.add` (pages copied, rate, ETA): the
    CLI's `colembed upgrade` (tqdm is imported in this module only)."""
    with _progress_bar(progress, f"upgrading {location}") as bar:
        def step(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        return upgrade_index(location, step)


def _progress_bar(progress: bool | None, desc: str):
    """tqdm on stderr (pages, pages/s, ETA); shown when stderr is a terminal unless told."""
    from tqdm.auto import tqdm

    show = sys.stderr.isatty() if progress is None else progress
    return tqdm(total=0, unit="page", desc=desc, disable=not show, file=sys.stderr,
                dynamic_ncols=True)


def _grow(bar, pages: int) -> None:
    bar.total = (bar.total or 0) + pages
    bar.refresh()
