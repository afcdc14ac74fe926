"""What an indexing run decides, whichever runs it: `Index.add` (ingest.py) or a Ray job
(colembed/distributed). One home per decision, so the two paths cannot drift apart:

- `ModelIdentity`: everything that changes a page's vectors (model, export, variant, image-token
  budget, render policy, schema, vector width `dim`), stamped on every page, and
  `check(stored)`: an index refuses a run whose vectors would differ, naming both sides (mixed
  budgets bias MaxSim toward the pages with more tokens, so they never mix). `options_of(stored)` is how a reopened index loads the
  model it was built with.
- `page_payload`: the payload of one page (schema.py's fields, the identity, the run's source).
- `Catalog` and `stale_ids`: what the store holds and which stored pages a changed file makes
  stale. Staleness is scoped to the run's `source` (the machine, or a name the user gives): the
  same path string written by another machine to a shared server is another file.
- `page_failure`, `embed_keeping_going`: what a bad page means (its file fails naming it; the
  other pages of the file and of the run go on), for a decoder error, a model refusal or any
  other exception (a MemoryError from a poster-size page is a bad page, not the end of a run).
- `FileReport`, `AddResult` and `file_report`: the outcome of a file, in the same words on both
  paths.

Standard library only (the model and store arrive as arguments).
"""

from __future__ import annotations

import hashlib
import os
import socket
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..errors import InputError
from ..layout import MANIFEST_NAME
from .errors import ModelMismatchError, SourceError

RENDER_AT_BUDGET = "pixel budget"  # `render` of a run without --dpi: PDFs drawn at max_pixels
SOURCE_ENV = "COLEMBED_SOURCE"  # the default source name, else the host name


def manifest_sha256(folder: str | os.PathLike) -> str:
    return hashlib.sha256((Path(folder) / MANIFEST_NAME).read_bytes()).hexdigest()


def render_policy(dpi: float | None) -> str:
    """How PDF pages are drawn, as stamped on each page: at the model's pixel budget, or a dpi."""
    return RENDER_AT_BUDGET if dpi is None else f"{float(dpi):g} dpi"


def dpi_of(policy: str | None) -> float | None:
    if not policy or policy == RENDER_AT_BUDGET:
        return None
    return float(policy.removesuffix(" dpi"))


def default_source() -> str:
    """The source a run writes as unless told (`--source NAME`): $COLEMBED_SOURCE, else the
    host name. Replacement and prune touch only pages of the run's own source."""
    return os.environ.get(SOURCE_ENV) or socket.gethostname()


@dataclass(frozen=True)
class ModelIdentity:
    """What makes two runs' vectors comparable; every field but `model_source` must match."""

    model: str
    variant: str
    manifest_sha256: str
    max_image_tokens: int
    render: str
    schema: int
    model_source: str = ""
    pool_factor: int = 1  # hierarchical token pooling of the image tokens (pooling.py); 1: none
    # The vectors' width: the model's own, or the first `dim` components it was loaded to keep
    # (`colembed.load(dim=)`); both constructors set it.
    dim: int = 0

    CHECKED = (
        "model",
        "variant",
        "manifest_sha256",
        "max_image_tokens",
        "render",
        "schema",
        "pool_factor",
        "dim",
    )
    # Recorded since colembed 0.2 (dim: since `dim=`): a page written before lacks them, and is
    # not refused for it (the store's own width still is checked against the model's).
    LATER = ("max_image_tokens", "render", "dim")
    # Recorded since pooling: a page without it was stored unpooled, and is compared as such.
    ABSENT_MEANS = {"pool_factor": 1}

    @classmethod
    def of_model(
        cls, model: Any, *, schema: int, dpi: float | None, pool_factor: int = 1
    ) -> ModelIdentity:
        """The identity of a loaded `ColQwenModel` (its effective image budget)."""
        return cls(
            model=model.name,
            variant=model.variant,
            manifest_sha256=manifest_sha256(model.folder),
            max_image_tokens=int(model.max_image_tokens),
            render=render_policy(dpi),
            schema=schema,
            model_source=str(Path(model.folder).resolve()),
            pool_factor=pool_factor,
            dim=int(model.embedding_size),
        )

    @classmethod
    def of_folder(
        cls,
        folder: str | os.PathLike,
        *,
        variant: str,
        max_image_tokens: int | None,
        dpi: float | None,
        schema: int,
        pool_factor: int = 1,
        dim: int | None = None,
    ) -> ModelIdentity:
        """The identity of a model folder, read without loading it (the Ray driver); `dim` as
        `colembed.load`'s (None: the model's own width)."""
        from ..manifest import read_manifest
        from ..model import check_dim

        folder = Path(folder).resolve()
        manifest = read_manifest(folder)
        config = manifest.preprocess.with_max_image_tokens(max_image_tokens)
        return cls(
            model=manifest.model.name,
            variant=variant,
            manifest_sha256=manifest_sha256(folder),
            max_image_tokens=config.max_pixels // config.pixels_per_image_token,
            render=render_policy(dpi),
            schema=schema,
            model_source=str(folder),
            pool_factor=pool_factor,
            dim=check_dim(dim, manifest.embedding_dim),
        )

    def payload(self) -> dict[str, Any]:
        return asdict(self)

    def mismatches(self, stored: dict[str, Any]) -> list[str]:
        """The fields on which a stored page and this run disagree ("field: index has a, this run
        b")."""
        return identity_mismatches(stored, self.payload(), "this run")

    def check(self, stored: dict[str, Any] | None, location: str) -> None:
        """Raise ModelMismatchError naming both sides when `stored` (any stored page's payload)
        was made another way; an empty index (None) accepts any identity."""
        problems = self.mismatches(stored) if stored else []
        if problems:
            raise ModelMismatchError(
                f"{location}: this index was built another way ("
                + "; ".join(problems)
                + "); its pages would not be comparable: use the settings it was built with, or "
                "another index"
            )


def identity_field(payload: dict[str, Any], name: str) -> Any:
    """A page's identity field as compared: a field recorded only by later colembeds
    (`ModelIdentity.ABSENT_MEANS`) has its meaning when absent."""
    return payload.get(name, ModelIdentity.ABSENT_MEANS.get(name))


def identity_mismatches(stored: dict[str, Any], ours: dict[str, Any], who: str) -> list[str]:
    """The identity fields on which two payloads disagree ("field: the index has a, `who` b"); a
    `ModelIdentity.LATER` field one side predates is not a disagreement."""
    out = []
    for f in ModelIdentity.CHECKED:
        a, b = identity_field(stored, f), identity_field(ours, f)
        if a != b and not (f in ModelIdentity.LATER and (f not in stored or f not in ours)):
            out.append(f"{f}: the index has {a!r}, {who} {b!r}")
    return out


def options_of(stored: dict[str, Any] | None) -> dict[str, Any]:
    """What reopening an index loads and renders with: the stored model folder, variant, image
    budget, vector width, render dpi and pool factor (empty for an empty index; fields an older
    index lacks are left out, but for the pool factor: absent means 1)."""
    if not stored:
        return {}
    out = {
        k: stored[k] for k in ("model_source", "variant", "max_image_tokens", "dim") if k in stored
    }
    if "render" in stored:
        out["dpi"] = dpi_of(stored["render"])
    out["pool_factor"] = identity_field(stored, "pool_factor")
    return out


def page_payload(
    identity: ModelIdentity,
    *,
    path: str,
    page: int,
    pages: int,
    sha256: str,
    size: tuple[int, int],
    source: str,
    meta: dict[str, Any] | None = None,
    text: str | None = None,
) -> dict[str, Any]:
    """The payload of page `page` of a file (everything but the grid, which `make_point` adds);
    with the file's checked metadata and the page's text layer when it has them (schema.py's
    META_FIELD, TEXT_FIELD)."""
    from .schema import META_FIELD, TEXT_FIELD, TEXT_TRUNCATED_FIELD, encode_text

    out = dict(
        identity.payload(),
        path=path,
        page=page,
        pages=pages,
        sha256=sha256,
        width=int(size[0]),
        height=int(size[1]),
        source=source,
    )
    if meta:
        out[META_FIELD] = dict(meta)
    if text is not None:  # "" too: a PDF page without a text layer (a scan) says so
        out[TEXT_FIELD], cut = encode_text(text)
        if cut:
            out[TEXT_TRUNCATED_FIELD] = True
    return out


# ---------------------------------------------------------------------------------- what is stored
@dataclass
class Catalog:
    """What the store holds: path -> sha256 -> page -> id; sha256 -> page -> id (any path);
    sha256 -> page count; id -> the source that wrote it ("" before sources were recorded)."""

    by_path: dict[str, dict[str, dict[int, str]]] = field(default_factory=dict)
    by_sha: dict[str, dict[int, str]] = field(default_factory=dict)
    pages: dict[str, int] = field(default_factory=dict)
    source: dict[str, str] = field(default_factory=dict)
    meta: dict[str, dict[str, Any]] = field(default_factory=dict)  # id -> stored metadata

    @classmethod
    def of(cls, payloads: list[tuple[str, dict[str, Any]]]) -> Catalog:
        out = cls()
        for pid, p in payloads:
            sha, page = p.get("sha256", ""), int(p.get("page", 0))
            out.by_path.setdefault(p.get("path", ""), {}).setdefault(sha, {})[page] = pid
            out.by_sha.setdefault(sha, {}).setdefault(page, pid)
            out.pages[sha] = int(p.get("pages", 0))
            out.source[pid] = p.get("source", "")
            if p.get("meta"):
                out.meta[pid] = p["meta"]
        return out

    def have(self, path: str, sha256: str) -> set[int]:
        """Pages of this content at this path already stored (by any source: same id)."""
        return set(self.by_path.get(path, {}).get(sha256, {}))


def owned(payload_source: str, source: str) -> bool:
    """Whether a stored page belongs to the run of `source` (a page written before sources were
    recorded belongs to whoever runs: that index had one writer)."""
    return payload_source in ("", source)


def stale_ids(catalog: Catalog, path: str, sha256: str, source: str) -> list[str]:
    """The stored pages a changed file at `path` (now `sha256`) replaces: those of other contents
    at the same path written by the same source."""
    return [
        pid
        for sha, pages in catalog.by_path.get(path, {}).items()
        if sha != sha256
        for pid in pages.values()
        if owned(catalog.source.get(pid, ""), source)
    ]


# ------------------------------------------------------------------------------------- bad pages
def page_failure(page: int, error: BaseException) -> str:
    """Why a page failed, in the words its file's report uses (without "page N: ")."""
    if isinstance(error, SourceError):
        return error.reason.removeprefix(f"page {page}: ")
    if isinstance(error, InputError):
        return error.reason
    return (
        f"unexpected {type(error).__name__}: {error}"
        if str(error)
        else f"unexpected {type(error).__name__}"
    )


def embed_keeping_going(
    model: Any, images: list, batch_size: int, on_embedded: Callable[[int, list], None]
) -> dict[int, str]:
    """Embed `images`; `on_embedded(first, results)` gets each run of consecutive pages embedded
    (results for images[first:first + len(results)]), and the returned dict says why each other
    page (by index) failed: the model refused it (InputError, which says how many came before),
    or anything else went wrong, in which case the pages are tried again one at a time to find
    the bad one. The pages after a bad one are embedded all the same."""
    errors: dict[int, str] = {}
    start, one_by_one = 0, False
    while start < len(images):
        window = images[start : start + 1] if one_by_one else images[start:]
        try:
            done, bad = model.embed_pages(window, batch_size=batch_size), None
        except Exception as e:  # noqa: BLE001 (any failure is a page's, reported by name)
            done, bad = list(getattr(e, "completed", None) or []), e
        if done:
            on_embedded(start, done)
        if bad is None:
            start += len(done)
            if not one_by_one:
                return errors
            continue
        start += len(done)
        if not isinstance(bad, InputError) and not one_by_one and len(images) - start > 1:
            one_by_one = True  # which page of the batch failed is unknown: one at a time
            continue
        errors[start] = page_failure(0, bad)
        start += 1
    return errors


# --------------------------------------------------------------------------------------- reports
@dataclass
class FileReport:
    """One file's outcome: `pages` points stored in this run (`reused` of them copied from stored
    pages of identical content instead of embedded) and why it was skipped or failed."""

    path: str
    pages: int = 0
    reason: str = ""
    reused: int = 0


@dataclass
class AddResult:
    """What `Index.add` did: files added (with their new pages), skipped and failed (with why),
    and with prune, removed."""

    added: list[FileReport] = field(default_factory=list)
    skipped: list[FileReport] = field(default_factory=list)
    failed: list[FileReport] = field(default_factory=list)
    removed: list[FileReport] = field(default_factory=list)

    @property
    def pages_added(self) -> int:
        return sum(r.pages for r in self.added)

    @property
    def ok(self) -> bool:
        return not self.failed

    def to_dict(self) -> dict[str, list[dict[str, Any]]]:
        """The JSON shape of `colembed index --json` (with or without --ray)."""
        return {
            k: [asdict(r) for r in getattr(self, k)]
            for k in ("added", "skipped", "failed", "removed")
        }

    @classmethod
    def of_discovery(cls, ignored, missing) -> AddResult:
        """The reports of what discovery left out (sources.Found's `ignored`, `missing`)."""
        return cls(
            skipped=[FileReport(str(p), reason=r) for p, r in ignored],
            failed=[FileReport(str(p), reason=r) for p, r in missing],
        )


ALREADY_INDEXED = "already indexed"
REPLACED = "replaced an older version"


def failure_reason(pages: int, errors: dict[int, str], indexed: int) -> str:
    """A file with bad pages: the first one and its reason, the others by number, and how many of
    its pages are indexed."""
    bad = sorted(errors)
    first = f"page {bad[0]} of {pages}: {errors[bad[0]]}"
    more = f" (and {len(bad) - 1} more page(s): {', '.join(map(str, bad[1:]))})" if bad[1:] else ""
    kept = f"; its other {indexed} page(s) are indexed" if indexed else ""
    return first + more + kept


def file_report(
    result: AddResult,
    path: str,
    *,
    pages: int,
    stored: int,
    had: int,
    errors: dict[int, str],
    stale: bool,
    reused: int = 0,
    reused_from: str = "",
) -> None:
    """File the outcome of one file whose every page was tried into `result`: failed (naming its
    bad pages), added (new pages, or an older version replaced), or skipped (already indexed)."""
    report = FileReport(path, stored, reused=reused)
    if errors:
        report.reason = failure_reason(pages, errors, stored + had)
        result.failed.append(report)
    elif stored or stale:
        report.reason = (
            REPLACED
            if stale
            else f"same content as {reused_from}: its vectors were reused"
            if reused and reused == stored
            else ""
        )
        result.added.append(report)
    else:
        result.skipped.append(FileReport(path, reason=ALREADY_INDEXED))
