"""`colembed.Index`: a searchable, resumable index of PDFs and images in Qdrant.

    index = colembed.Index("my-index", model="colqwen2-onnx")    # a folder: Qdrant Edge, embedded
    index = colembed.Index(url="http://qdrant:6333", api_key=..., model=...)   # a Qdrant server
    result = index.add(["reports/", "scan.tiff"], metadata={"team": "finance"})
    hits = index.search("revenue in 2023", k=5, where={"team": "finance"})
    hits[0].file, hits[0].page, hits[0].score, hits[0].metadata, hits[0].text

The model is loaded on first use (an index opened only to count or remove pages never loads
one). Reopened, an index loads the model it was built with (`model_source`, variant, image-token
budget) and renders at its dpi; it refuses a run whose vectors would differ in any of them
(records.ModelIdentity), naming both sides.
"""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from .backends import open_store, upgrade_index
from .errors import IndexNotFoundError, ModelMismatchError, SourceError, StoreError
from .ingest import ingest
from .maps import SimilarityMap, explain, overlay
from .records import (
    AddResult,
    FileReport,
    ModelIdentity,
    default_source,
    dpi_of,  # noqa: F401
    manifest_sha256,  # noqa: F401
    options_of,
    owned,
)
from .pooling import CLUSTERS_FIELD, DEFAULT_POOL_FACTOR, check_pool_factor, decode_clusters
from .metadata import MetadataError, check_metadata, merged, metadata_for
from .schema import META_FIELD, TEXT_FIELD, TEXT_TRUNCATED_FIELD, decode_text
from .sources import Document, discover
from .store import DEFAULT_SEARCH_MODE, check_mode
from .where import parse as parse_where


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

    @property
    def metadata(self) -> dict[str, Any]:
        """The user metadata of the page's file (`Index.add(metadata=...)`, `set_metadata`)."""
        return dict(self.payload.get(META_FIELD) or {})

    @property
    def text(self) -> str | None:
        """The page's PDF text layer as extracted at indexing (at most schema.MAX_TEXT_BYTES;
        `text_truncated` says when cut), "" for a PDF page without one, None when there is none
        to give: an image or scanned file, or a page indexed before colembed kept text."""
        stored = self.payload.get(TEXT_FIELD)
        if stored is None:
            return None
        try:
            return decode_text(stored)
        except ValueError:
            return None

    @property
    def text_truncated(self) -> bool:
        return bool(self.payload.get(TEXT_TRUNCATED_FIELD))


class Index:
    """Create or open an index (see the module docstring).

    `variant` and `max_image_tokens` default to the ones the index was built with (fp32 and the
    model's own budget for a new index); so does `pool_factor` (1, no pooling, for a new index:
    >= 2 stores each page's image tokens hierarchically pooled to 1/pool_factor as many,
    pooling.py; what that costs in recall, size and speed: docs/index.md). An index refuses a
    pool factor other than its own (ModelMismatchError). `dim` (`colembed.load`'s: each vector's
    first `dim` components, renormalised) defaults to the index's; an index refuses another
    (ModelMismatchError naming both). `create=False` opens an existing index only
    (IndexNotFoundError otherwise: `colembed search` never creates one). `source` names the
    writer (default: $COLEMBED_SOURCE, else the host name): replacing a changed file's pages and
    `prune` touch only pages this source wrote. `store_opener` replaces `backends.open_store`
    (same arguments): colembed serve opens an Edge folder in a child process that owns it."""

    def __init__(
        self,
        location: str | os.PathLike | None = None,
        *,
        model: Any = None,
        url: str | None = None,
        api_key: str | None = None,
        collection: str | None = None,
        variant: str | None = None,
        max_image_tokens: int | None = None,
        local: bool = False,
        create: bool = True,
        source: str | None = None,
        pool_factor: int | None = None,
        store_opener: Callable[..., Any] | None = None,
        dim: int | None = None,
        **load_options: Any,
    ) -> None:
        self._model_arg = model
        self._pool_factor = None if pool_factor is None else check_pool_factor(pool_factor)
        self._model = model if hasattr(model, "embed_pages") else None
        self._requested = dict(
            load_options, variant=variant, max_image_tokens=max_image_tokens, dim=dim
        )
        self.source = source or default_source()
        self.store = None  # the model, if loaded before the store is open, has nothing to check
        self._stored: dict[str, Any] = {}  # what the index was built with (records.options_of)
        where = dict(url=url, api_key=api_key, collection=collection, local=local)
        opener = store_opener or open_store
        try:
            self.store = opener(location, create=False, **where)
        except IndexNotFoundError as e:
            if not create or model is None:
                hint = "" if not create else " (give a model to create one)"
                raise IndexNotFoundError(f"{e}{hint}") from None
            self.store = opener(location, dim=self.model.embedding_size, **where)
        try:
            self._stored = options_of(self.store.any_payload())
            if (
                self._pool_factor is not None
                and self._stored
                and self._stored["pool_factor"] != self._pool_factor
            ):
                raise ModelMismatchError(
                    f"{self.store.location}: this index stores pages pooled with pool factor "
                    f"{self._stored['pool_factor']} (1: not pooled), not {self._pool_factor}; its "
                    "pages would not be comparable: open it without pool_factor (it keeps its "
                    "own), or use another index"
                )
            if self._model_arg is not None:  # a model given: refused now, not at the first add
                self._check(self.model_identity(), self.model)
        except BaseException:
            self.store.close()  # a refused index is not left locked
            raise

    # ------------------------------------------------------------------------------ the model
    @property
    def model(self):
        """The model, loaded on first use: `model=` if given, else the folder the index records,
        with the variant, image budget and vector width (`dim`) it was built with unless told
        otherwise."""
        if self._model is None:
            stored = self._stored
            source = self._model_arg or stored.get("model_source")
            if source is None:
                raise StoreError(
                    f"{self.store.location}: the index is empty and no model "
                    "was given (pass model=... / --model)"
                )
            options = {k: v for k, v in self._requested.items() if v is not None}
            for k in ("variant", "max_image_tokens", "dim"):
                if options.get(k) is None and stored.get(k) is not None:
                    options[k] = stored[k]
            import colembed

            model = colembed.load(source, **options)
            if self.store is not None:
                self._check(
                    ModelIdentity.of_model(
                        model,
                        schema=self.store.schema,
                        dpi=stored.get("dpi"),
                        pool_factor=self.pool_factor,
                    ),
                    model,
                )
            self._model = model
        return self._model

    def model_identity(self, dpi: float | None = None) -> ModelIdentity:
        """What this index's pages are stamped with for a run at `dpi` (None: the index's own
        render policy, or the pixel budget)."""
        dpi = self._stored.get("dpi") if dpi is None else dpi
        return ModelIdentity.of_model(
            self.model, schema=self.store.schema, dpi=dpi, pool_factor=self.pool_factor
        )

    @property
    def pool_factor(self) -> int:
        """The hierarchical token pooling factor of this index's pages (1: none): the one asked
        for, else the one it was built with, else 1."""
        if self._pool_factor is not None:
            return self._pool_factor
        return int(self._stored.get("pool_factor", DEFAULT_POOL_FACTOR))

    @property
    def identity(self) -> dict[str, Any]:
        return self.model_identity().payload()

    def _check(self, identity: ModelIdentity, model: Any = None) -> None:
        """`model` (default: this index's) may write to and search this index: vectors of the store's width (a model of
        another family, e.g. a 320-dim ColQwen3 against a 128-dim ColQwen2 index, is refused by
        name even while the index is empty) made the way its pages were (`ModelIdentity`)."""
        model = self.model if model is None else model
        if self.store.dim != model.embedding_size:
            stored = self.store.any_payload() or {}
            held = f" by model {stored['model']!r}" if stored.get("model") else ""
            full = getattr(model, "full_embedding_size", model.embedding_size)
            # the same model at another `dim` (or a truncated one): name the widths; any other
            # model: name the family
            if stored.get("model") == model.name or model.embedding_size != full:
                raise ModelMismatchError(
                    f"{self.store.location}: this index holds {self.store.dim}-dim page "
                    f"vectors{held} (dim {self.store.dim}); model {model.name!r} is loaded to "
                    f"make {model.embedding_size}-dim ones (dim {model.embedding_size}, of its "
                    f"{full}): vectors of another width are not comparable. Open it with "
                    f"dim={self.store.dim} (or no dim: it keeps its own), or use another index"
                )
            raise ModelMismatchError(
                f"{self.store.location}: this index holds {self.store.dim}-dim page vectors{held}; "
                f"{model.family.display_name} model {model.name!r} makes "
                f"{model.embedding_size}-dim ones: pages of another model family are not "
                "comparable. Open it with the model it was built with, or use another index"
            )
        identity.check(self.store.any_payload(), self.store.location)

    # ---------------------------------------------------------------------------------- writes
    def add(
        self,
        paths: Iterable[str | os.PathLike] | str | os.PathLike,
        *,
        dpi: float | None = None,
        prune: bool = False,
        batch_size: int = 4,
        progress: bool | None = None,
        on_progress: Callable[[int, int, AddResult], None] | None = None,
        stop: threading.Event | None = None,
        metadata: dict[str, Any] | Callable[[str], dict[str, Any] | None] | None = None,
        within: Sequence[str | os.PathLike] | None = None,
    ) -> AddResult:
        """Index PDFs and images (files or folders, walked). Stored pages are skipped; a changed
        file's old pages are replaced; `prune` drops pages of files that no longer exist under
        the folders and files given here (never under one that is missing), written by this
        index's `source`. A bad file is reported in `.failed` with its reason and never stops the
        run. `dpi` must be the index's own (ModelMismatchError otherwise: never mixed).

        `on_progress(pages_stored, pages_planned, result)` is called from the writer thread after
        every batch of pages stored and every file reported (`result` fills in as it goes), so a
        caller shows progress per page, not per call. `stop` set: the run ends after the pages
        being embedded are written (each page whole), without the remaining files' reports; the
        next run does the rest (colembed serve cancels a job this way). `within`: folders every
        file must lie in, checked again when each file is opened, with no link followed
        (colembed serve's `--allow-root`s): a file swapped for a link meanwhile is refused.

        `metadata`: the files' user metadata (metadata.py says what is accepted), a dict for
        every file or a function of a file's path (str) returning its dict (or None); merged
        into what the file's pages hold (stored pages too: nothing is embedded for it), kept
        when a changed file is replaced. A bad dict raises MetadataError before anything is
        stored; a function's bad answer fails that file, naming it."""
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        paths = list(paths)
        meta_of = metadata_for(metadata)
        identity = self.model_identity(dpi)
        self._check(identity)
        exclude = [Path(self.store.location)] if Path(str(self.store.location)).is_dir() else []
        found = discover(paths, exclude=exclude, within=within)
        result = AddResult.of_discovery(found.ignored, found.missing)
        file_meta: dict[str, dict[str, Any]] = {}
        documents = []
        for doc in found.documents:
            try:
                meta = meta_of(str(doc))
            except MetadataError as e:
                result.failed.append(FileReport(str(doc), reason=str(e)))
                continue
            except Exception as e:  # noqa: BLE001 (the caller's function failed on this file)
                result.failed.append(
                    FileReport(
                        str(doc), reason=f"metadata function failed: {type(e).__name__}: {e}"
                    )
                )
                continue
            if meta:
                file_meta[str(doc)] = meta
            documents.append(doc)
        found = type(found)(documents, found.ignored, found.missing)
        bar = _progress_bar(progress, f"indexing {len(found.documents)} file(s)")
        already = len(result.skipped) + len(result.failed)
        counts = {"stored": 0, "planned": 0}

        def on_pages(n: int) -> None:
            done = len(result.added) + len(result.skipped) + len(result.failed) - already
            bar.set_postfix_str(f"files {done}/{len(found.documents)}", refresh=False)
            bar.update(n)
            counts["stored"] += n
            if on_progress is not None:
                on_progress(counts["stored"], counts["planned"], result)

        def on_total(n: int) -> None:
            counts["planned"] += n
            _grow(bar, n)

        try:
            ingest(
                found.documents,
                self.store,
                self.model,
                identity,
                dpi=dpi_of(identity.render),
                batch_size=batch_size,
                result=result,
                on_pages=on_pages,
                on_total=on_total,
                source=self.source,
                stop=stop,
                metadata=file_meta,
                within=within,
            )
            on_pages(0)  # the last files' reports come after their pages
        finally:
            bar.close()
        if prune:
            roots = [Path(p).expanduser().resolve() for p in paths]
            result.removed = self._prune([r for r in roots if r.exists()])
            for report in result.failed:
                if Path(report.path) in roots and not Path(report.path).exists():
                    report.reason += "; nothing under it was pruned"
        return result

    def add_embedded(self, pages, *, identity: dict[str, Any] | None = None) -> int:
        """Store pages embedded elsewhere: `embedded.EmbeddedPage`s (vectors, grid, source) or
        ready `PagePoint`s (`colembed.distributed.read_points`), checked as `add` checks its own
        (embedded.py); returns the pages stored. The pages carry this index's model identity
        (`identity=` or the model given; else the stored pages', or a ready point's)."""
        from .embedded import add_embedded

        if identity is None and self._model_arg is not None:
            identity = self.identity
        elif identity is not None:
            identity = {"pool_factor": self.pool_factor, **identity}
        return add_embedded(
            self.store, pages, identity, self.source, lambda: self._token_px(identity)
        )

    def _token_px(self, identity: dict[str, Any] | None = None) -> int | None:
        """The pixels one image token of this index's model saw along each side (its manifest's
        patch x merge), from the model if one was given or loaded, else from the manifest of the
        model folder the pages' identity or the index records; None when none is at hand."""
        if self._model is not None or self._model_arg is not None:
            return int(self.model.config.resize_factor)
        source = (identity or {}).get("model_source") or self._stored.get("model_source")
        if source and Path(source).is_dir():
            from ..errors import ManifestError
            from ..manifest import read_manifest

            try:
                return int(read_manifest(Path(source)).preprocess.resize_factor)
            except ManifestError:  # not a model folder (any more): the page must say
                return None
        return None

    def set_metadata(
        self,
        paths: Iterable[str | os.PathLike] | str | os.PathLike,
        metadata: dict[str, Any],
        *,
        pages: Iterable[int] | None = None,
        replace: bool = False,
    ) -> int:
        """Change the metadata of the stored pages of these files (or of the files under these
        folders), without embedding anything: `metadata` is merged into each page's (a value
        None removes that key), or replaces it with `replace=True`; `pages`: only these page
        numbers. Returns the pages whose metadata changed."""
        update = check_metadata(metadata, removals=True)
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        targets = [Path(p).expanduser().resolve() for p in paths]
        wanted = None if pages is None else {int(n) for n in pages}
        groups: dict[str, tuple[dict[str, Any], list[str]]] = {}
        for pid, p in self.store.payloads():
            if not any(_under(Path(p["path"]), t) for t in targets):
                continue
            if wanted is not None and int(p.get("page", 0)) not in wanted:
                continue
            stored = p.get(META_FIELD) or {}
            new = merged(stored, update, replace)
            if new != stored:
                groups.setdefault(repr(sorted(new.items())), (new, []))[1].append(pid)
        for new, ids in groups.values():
            self.store.set_payload(ids, {META_FIELD: new})
        self.store.flush()
        return sum(len(ids) for _, ids in groups.values())

    def metadata(
        self, paths: Iterable[str | os.PathLike] | str | os.PathLike
    ) -> dict[str, dict[int, dict[str, Any]]]:
        """The stored metadata of these files' pages (or of the files under these folders):
        path -> page -> metadata."""
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        targets = [Path(p).expanduser().resolve() for p in paths]
        out: dict[str, dict[int, dict[str, Any]]] = {}
        for _, p in self.store.payloads():
            if any(_under(Path(p["path"]), t) for t in targets):
                out.setdefault(p["path"], {})[int(p.get("page", 0))] = dict(p.get(META_FIELD) or {})
        return {path: dict(sorted(pages.items())) for path, pages in sorted(out.items())}

    def remove(self, paths: Iterable[str | os.PathLike] | str | os.PathLike) -> int:
        """Drop every page of these files (or of the files under these folders); returns pages."""
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        targets = [Path(p).expanduser().resolve() for p in paths]
        doomed = [
            pid
            for pid, p in self.store.payloads()
            if any(_under(Path(p["path"]), t) for t in targets)
        ]
        self.store.delete(doomed)
        self.store.flush()
        return len(doomed)

    def _prune(self, roots: list[Path]) -> list[FileReport]:
        """Drop pages of vanished files: files under `roots` (each present on this machine),
        written by this index's source."""
        gone: dict[str, list[str]] = {}
        for pid, p in self.store.payloads():
            path = Path(p["path"])
            if (
                owned(p.get("source", ""), self.source)
                and any(_under(path, r) for r in roots)
                and not path.is_file()
            ):
                gone.setdefault(p["path"], []).append(pid)
        self.store.delete([pid for ids in gone.values() for pid in ids])
        self.store.flush()
        return [FileReport(path, len(ids), "file no longer exists") for path, ids in gone.items()]

    # ----------------------------------------------------------------------------------- reads
    def __len__(self) -> int:
        """Pages stored."""
        return self.store.count()

    def search(
        self,
        queries: str | Sequence[str],
        k: int = 5,
        *,
        mode: str = DEFAULT_SEARCH_MODE,
        explain: bool = False,
        where: Any = None,
    ) -> list[Hit] | list[list[Hit]]:
        """The k best pages per query (a list of Hits for one str, one list per query for a
        list). `mode`: "two-stage" (cheap candidates, exact MaxSim rerank), "exact" (full
        scan) or "hybrid" (two-stage fused with BM25 over the pages' text by reciprocal rank
        fusion: finds exact identifiers MaxSim ranks low; scores are fusion scores).
        `explain=True` attaches each hit's SimilarityMap. `where`: only pages this filter
        allows (where.py: file, folder, path glob, page range, metadata equality / in / ranges;
        a dict or "key=value" strings), in every stage of the search, so k pages come back
        whenever k pages are allowed."""
        check_mode(mode)
        condition = parse_where(where)
        single = isinstance(queries, str)
        texts = [queries] if single else list(queries)
        vectors = self.model.embed_queries(texts)
        found = self.store.search(vectors, k, mode, condition, texts if mode == "hybrid" else None)
        hits = [
            [
                Hit(
                    h.payload.get("path", ""),
                    int(h.payload.get("page", 0)),
                    h.score,
                    h.payload,
                    h.id,
                )
                for h in row
            ]
            for row in found
        ]
        if explain:
            hits = [self._explain(q, row) for q, row in zip(vectors, hits)]
        return hits[0] if single else hits

    def _explain(self, query: np.ndarray, hits: list[Hit]) -> list[Hit]:
        from ..model import PageLayout

        stored = self.store.page_vectors([h.id for h in hits])
        out = []
        for h in hits:
            page = stored[h.id]
            clusters = (
                decode_clusters(h.payload[CLUSTERS_FIELD])
                if h.payload.get(CLUSTERS_FIELD)
                else None
            )
            layout = PageLayout(
                grid_rows=h.payload["grid"][0],
                grid_cols=h.payload["grid"][1],
                image_start=h.payload["image_start"],
                num_tokens=len(page)
                if clusters is None
                else len(page) - int(clusters.max()) - 1 + len(clusters),
                token_px=self.model.config.resize_factor,
            )
            out.append(
                Hit(
                    h.file, h.page, h.score, h.payload, h.id, explain(query, page, layout, clusters)
                )
            )
        return out

    def page(self, page_id: str) -> Hit | None:
        """The stored page with this point id as a Hit (score 0.0, no map), or None: how a
        caller that kept only an id (colembed serve's page URLs) gets back to `page_image`."""
        point = self.store.points([page_id]).get(page_id)
        if point is None:
            return None
        p = point.payload
        return Hit(p.get("path", ""), int(p.get("page", 0)), 0.0, p, point.id)

    def explain_page(self, query: str | np.ndarray, hit: Hit) -> Hit:
        """`hit` with its SimilarityMap for `query` (text, or its (tokens, dim) vectors) and that
        query's MaxSim score for the page: the map of a page found earlier, without a search."""
        vectors = self.model.embed_queries([query])[0] if isinstance(query, str) else query
        [explained] = self._explain(vectors, [hit])
        return Hit(hit.file, hit.page, explained.map.score, hit.payload, hit.id, explained.map)

    def page_image(self, hit: Hit):
        """The hit's page, rendered again at its indexed size (SourceError if the file changed)."""
        return render_stored_page(hit.file, hit.page, hit.payload, **self.render_options())

    def render_options(self) -> dict[str, Any]:
        """How this index renders a page again: `render_stored_page`'s keyword arguments (plain
        values: colembed serve renders in worker processes of its own)."""
        return {"max_pixels": self.model.config.max_pixels, "dpi": self._stored.get("dpi")}

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


def render_stored_page(
    file: str,
    page: int,
    payload: dict[str, Any],
    *,
    max_pixels: int,
    dpi: float | None,
    within: Sequence[str | os.PathLike] | None = None,
):
    """A stored page rendered again at its indexed size, only while the file's sha256 is the one
    indexed (SourceError otherwise): `Index.page_image`, as a function of plain values. The file
    is opened once, hashed and drawn from that descriptor; a stored path inside one of `within`
    (colembed serve's roots) is opened confined to it, with no link followed."""
    from .sources import open_source, sha256_of

    path = Path(file)
    roots = [Path(r).resolve() for r in within or ()]
    confined = [r for r in roots if path == r or r in path.parents] or None
    with open_source(path, confined) as handle:
        sha = sha256_of(handle, path)
        if sha != payload.get("sha256"):
            raise SourceError(path, "file changed since it was indexed")
        with Document(path, max_pixels=max_pixels, dpi=dpi, handle=handle, sha256=sha) as doc:
            return doc.render(page, (payload["width"], payload["height"]))


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
    return tqdm(
        total=0, unit="page", desc=desc, disable=not show, file=sys.stderr, dynamic_ncols=True
    )


def _grow(bar, pages: int) -> None:
    bar.total = (bar.total or 0) + pages
    bar.refresh()
