"""The ASGI app: `create_app(index, Settings(...))`. docs/serve.md is the user's description.

Every model or store call goes through `WorkerPool.run` (off the event loop, bounded; 503 +
Retry-After past the bound). Every limit is checked before work starts and refused naming the
limit and its option: body bytes (413, counted while the body streams in, not only from
Content-Length), image bytes and pixels (413, read from the image header before any decoding, so
a decompression bomb is never decoded), batch sizes, query length, k (422). Errors colembed raises
on purpose map to 4xx with their message; anything else is a 500 that is logged and leaves the
process running. Page images and maps are served only for points stored in the index, by id, and
only while the file's sha256 still matches what was indexed (410 otherwise); they are rendered in
worker processes (render.py), never waiting for an index job's pdfium.
"""

from __future__ import annotations

import base64
import binascii
import collections
import contextlib
import io
import logging
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from importlib import resources
from typing import Any, Literal

import numpy as np
from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from PIL import Image
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from ..errors import ColembedError, InputError
from ..index import SEARCH_MODES, DEFAULT_SEARCH_MODE, StoreError
from ..index.maps import overlay
from ..index.schema import TEXT_FIELD
from ..index.sources import SourceError
from ..preprocess.images import IMAGE_FORMATS
from . import guards
from .encoding import ENCODINGS, encode
from .hosts import AllowedHosts
from .jobs import JobQueueFull, JobRunner
from .limits import Limits
from .pool import Busy, WorkerPool
from .public import public_message
from .render import PageRenderer
from .roots import PathMissing, PathRefused, Roots

log = logging.getLogger("colembed.serve")
lifecycle = logging.getLogger("uvicorn.error")  # printed with uvicorn's own start/stop lines

# Payload fields a hit's JSON leaves out: the server's own model folder, and the stored form of
# the page text (given decoded as `text`).
HIDDEN_PAYLOAD = frozenset({"model_source", TEXT_FIELD})
QUERY_CACHE = 256  # query texts whose vectors are kept for the page maps


@dataclass
class Settings:
    api_key: str | None = None
    cors_origins: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"  # the bound address: which Host headers are this server's (hosts.py)
    allowed_hosts: list[str] = field(default_factory=list)  # --allowed-host
    roots: Roots = field(default_factory=lambda: Roots([]))
    limits: Limits = field(default_factory=Limits)
    workers: int = 1
    queue: int = 16
    render_workers: int = 2
    retry_after: int = 2
    max_queued_jobs: int = 8


class LimitExceeded(ColembedError):
    """A request over a configured limit: `status` 413 or 422, the message names the limit."""

    def __init__(self, status: int, message: str) -> None:
        self.status = status
        super().__init__(message)


def over(status: int, what: str, value: int, limit: int, option: str) -> LimitExceeded:
    return LimitExceeded(status, f"{what}: {value} is over the limit of {limit} ({option})")


# ----------------------------------------------------------------------------- request bodies
Encoding = Literal["float", "base64"]


class QueriesRequest(BaseModel):
    texts: list[str] = Field(description="query texts")
    encoding: Encoding = Field(
        "float",
        description="float: nested lists; base64: little-endian float32 bytes with the shape",
    )


class ImagesRequest(BaseModel):
    images: list[str] = Field(description="base64 image files (PNG, JPEG, TIFF, ...)")
    encoding: Encoding = "float"


class SearchRequest(BaseModel):
    query: str | None = Field(None, description="one query (or `queries`)")
    queries: list[str] | None = Field(None, description="several queries: one result list each")
    k: int = Field(5, ge=1)
    mode: Literal["two-stage", "exact", "hybrid"] = DEFAULT_SEARCH_MODE
    explain: bool = Field(False, description="add each hit's similarity map (as data)")
    where: dict[str, Any] | list[str] | str | None = Field(
        None,
        description='only pages this filter allows: a dict ({"lang": "en", "page": '
        '{"gte": 2}}) or conditions as strings (["lang=en", "page>=2"]); '
        "docs/search.md#filters",
    )


class IndexPath(BaseModel):
    root: str | None = Field(None, description="a root's name (optional with one root)")
    path: str = Field(description="file or folder relative to the root")


class IndexRequest(BaseModel):
    paths: list[IndexPath | str] = Field(description="paths relative to an --allow-root root")


# ---------------------------------------------------------------------------------- the app
class Service:
    """What the routes share: the index, its model, the pool, the jobs, the query cache."""

    def __init__(self, index, settings: Settings) -> None:
        self.index, self.settings = index, settings
        self.model = index.model  # loaded now: the first request does not pay for it
        self.pool = WorkerPool(settings.workers, settings.queue, settings.retry_after)
        self.renderer = PageRenderer(
            settings.render_workers,
            dict(index.render_options(), within=[str(r.folder) for r in settings.roots.roots]),
        )
        self.jobs = JobRunner(index, settings.roots, max_queued=settings.max_queued_jobs)
        self._queries: collections.OrderedDict[str, np.ndarray] = collections.OrderedDict()
        self._queries_lock = threading.Lock()

    def identity(self) -> dict[str, Any]:
        return {
            "model": self.model.name,
            "variant": self.model.variant,
            "dim": self.model.embedding_size,
        }

    def query_vectors(self, text: str) -> np.ndarray:
        with self._queries_lock:
            if text in self._queries:
                self._queries.move_to_end(text)
                return self._queries[text]
        [vectors] = self.model.embed_queries([text])
        with self._queries_lock:
            self._queries[text] = vectors
            while len(self._queries) > QUERY_CACHE:
                self._queries.popitem(last=False)
        return vectors

    def hit_json(self, hit, explain: bool) -> dict[str, Any]:
        roots = self.settings.roots
        payload = {k: v for k, v in hit.payload.items() if k not in HIDDEN_PAYLOAD}
        payload["path"] = roots.display(hit.file)
        out = {
            "id": hit.id,
            "file": roots.display(hit.file),
            "page": hit.page,
            "score": float(hit.score),
            "payload": payload,
            "metadata": hit.metadata,
            "text": hit.text,
            "text_truncated": hit.text_truncated,
            "image_url": f"/v1/pages/{hit.id}/image",
        }
        if explain and hit.map is not None:
            m = hit.map
            out["map"] = {
                "score": m.score,
                "grid": list(m.contribution.shape),
                "contribution": m.contribution.tolist(),
                "similarity": m.similarity.tolist(),
                "prompt_contribution": m.prompt_contribution,
                "hottest": list(m.hottest_token()),
                "token_px": m.layout.token_px,
                "resized_size": list(m.layout.resized_size),
                "image_size": [hit.payload.get("width"), hit.payload.get("height")],
            }
        return out

    def render(self, hit, width: int | None, query: str | None) -> bytes:
        """The page (or its overlay for `query`) as PNG, rendered in a worker process."""
        image = self.renderer.render(hit)
        if query is not None:
            image = overlay(image, self.index.explain_page(self.query_vectors(query), hit).map)
        if width and width < image.width:
            image = image.resize(
                (width, max(1, round(image.height * width / image.width))),
                Image.Resampling.BILINEAR,
            )
        buffer = io.BytesIO()
        image.save(buffer, "PNG", compress_level=3)
        return buffer.getvalue()

    def close(self) -> None:
        self.jobs.shutdown(timeout=None)
        self.pool.shutdown()
        self.renderer.shutdown()


def check_images(blobs: list[bytes], limits: Limits) -> None:
    """Size limits from each image's header (no pixel is decoded here)."""
    if len(blobs) > limits.max_images:
        raise over(422, "images in the request", len(blobs), limits.max_images, "--max-images")
    if not blobs:
        raise LimitExceeded(422, "no images in the request")
    for i, blob in enumerate(blobs):
        if len(blob) > limits.max_image_bytes:
            raise over(
                413, f"image {i} bytes", len(blob), limits.max_image_bytes, "--max-image-bytes"
            )
        try:
            with Image.open(io.BytesIO(blob), formats=list(IMAGE_FORMATS)) as header:
                width, height = header.size
        except Image.DecompressionBombError as e:  # PIL's own bound refuses it at open
            raise LimitExceeded(
                413,
                f"image {i} pixels: over the limit of "
                f"{limits.max_image_pixels} (--max-image-pixels; {e})",
            ) from None
        except Exception as e:  # noqa: BLE001 (PIL raises many types on bad data)
            raise InputError(
                f"not an image PIL can read ({type(e).__name__}: {e})", index=i
            ) from None
        if width * height > limits.max_image_pixels:
            raise over(
                413,
                f"image {i} pixels ({width}x{height})",
                width * height,
                limits.max_image_pixels,
                "--max-image-pixels",
            )


def check_texts(texts: list[str], limits: Limits, *, batch: int, option: str) -> None:
    if not texts:
        raise LimitExceeded(422, "no query texts in the request")
    if len(texts) > batch:
        raise over(422, "query texts in the request", len(texts), batch, option)
    for i, text in enumerate(texts):
        if len(text) > limits.max_query_chars:
            raise over(
                422, f"query {i} characters", len(text), limits.max_query_chars, "--max-query-chars"
            )


def create_app(index, settings: Settings | None = None, *, close_index: bool = False) -> FastAPI:
    """The app over an open `Index`. `close_index`: the app's shutdown closes the index too (the
    server's process ends right after: uvicorn re-raises SIGTERM/SIGINT once it has shut down,
    so code after `uvicorn.Server.run` never runs)."""
    settings = settings or Settings()
    limits = settings.limits
    service = Service(index, settings)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        service.close()  # queued jobs cancelled, the running one stops once its embedded pages are written
        if close_index:
            index.close()  # flushed; the folder's lock released
            lifecycle.info("colembed serve: jobs stopped, index closed")

    app = FastAPI(
        title="colembed",
        version=__version__,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,  # their pages load scripts from a CDN
        description="ColQwen2-family embeddings and page search (docs/serve.md).",
    )
    app.state.service = service
    guards.install(
        app,
        hosts=AllowedHosts(settings.host, settings.allowed_hosts, settings.cors_origins),
        api_key=settings.api_key,
        max_body_bytes=limits.max_body_bytes,
    )

    # ------------------------------------------------------------------------- error mapping
    @app.exception_handler(Busy)
    async def busy(_, e: Busy):
        return JSONResponse({"detail": str(e)}, 503, headers={"Retry-After": str(e.retry_after)})

    @app.exception_handler(JobQueueFull)
    async def jobs_full(_, e: JobQueueFull):
        return JSONResponse(
            {"detail": str(e)}, 503, headers={"Retry-After": str(settings.retry_after * 5)}
        )

    @app.exception_handler(ColembedError)
    async def refused(_, e: ColembedError):
        if isinstance(e, LimitExceeded):
            status = e.status
        elif isinstance(e, PathMissing):
            status = 404
        elif isinstance(e, PathRefused):
            status = 403
        elif isinstance(e, SourceError):
            status = 410  # the indexed file changed or vanished
        elif isinstance(e, StoreError):
            log.error("store error: %s", e)
            status = 500
        elif isinstance(e, (InputError, ValueError)):
            status = 422
        else:
            status = 500
        if isinstance(e, (LimitExceeded, PathRefused)):  # the client's own words
            return JSONResponse({"detail": str(e)}, status)
        about = [e.path] if isinstance(e, SourceError) else []
        return JSONResponse({"detail": public_message(str(e), settings.roots, about)}, status)

    @app.exception_handler(Exception)
    async def internal(request: Request, e: Exception):
        log.exception("request %s %s failed", request.method, request.url.path)
        return JSONResponse(
            {
                "detail": f"internal error ({type(e).__name__}); the server "
                "logged it and keeps running"
            },
            500,
        )

    @app.exception_handler(RequestValidationError)
    async def invalid(_, e: RequestValidationError):
        problems = [
            "{}: {}".format(".".join(str(p) for p in err.get("loc", ())), err.get("msg"))
            for err in e.errors()
        ]
        return JSONResponse({"detail": "; ".join(problems), "errors": jsonable(e.errors())}, 422)

    # ---------------------------------------------------------------------------------- page
    page_html = resources.files(__package__).joinpath("static/index.html").read_text("utf-8")

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def search_page():
        return HTMLResponse(
            page_html,
            headers={
                "Content-Security-Policy": "default-src 'self'; img-src 'self' blob: data:; "
                "style-src 'self' 'unsafe-inline'; "
                "script-src 'self' 'unsafe-inline'; object-src 'none'; "
                "base-uri 'none'; form-action 'self'; "
                "frame-ancestors 'none'"
            },
        )

    @app.get("/healthz", tags=["status"])
    async def healthz():
        return {"status": "ok"}

    @app.get("/v1/info", tags=["status"])
    async def info():
        m = service.model
        running = service.jobs.running
        return {
            **service.identity(),
            "family": m.family.name,
            "version": __version__,
            "pages": await service.pool.run(len, index),
            "schema": index.store.schema,
            "max_image_tokens": m.max_image_tokens,
            "search_modes": list(SEARCH_MODES),
            "roots": settings.roots.names(),
            "indexing": settings.roots.__bool__(),
            "job_running": running.id if running else None,
            "limits": asdict(limits),
            "workers": settings.workers,
            "queue": settings.queue,
        }

    # ------------------------------------------------------------------------------ embedding
    @app.post("/v1/embed/queries", tags=["embed"])
    async def embed_queries(body: QueriesRequest):
        check_texts(body.texts, limits, batch=limits.max_batch, option="--max-batch")
        vectors = await service.pool.run(service.model.embed_queries, body.texts)
        return {
            **service.identity(),
            "encoding": body.encoding,
            "embeddings": [encode(v, body.encoding) for v in vectors],
        }

    @app.post(
        "/v1/embed/images",
        tags=["embed"],
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {
                    "multipart/form-data": {
                        "schema": {
                            "type": "object",
                            "properties": {
                                "files": {
                                    "type": "array",
                                    "items": {"type": "string", "format": "binary"},
                                },
                                "encoding": {"type": "string", "enum": list(ENCODINGS)},
                            },
                        }
                    },
                    "application/json": {"schema": ImagesRequest.model_json_schema()},
                },
            }
        },
    )
    async def embed_images(request: Request):
        """Images as multipart `files` (one part each) or JSON `{"images": [base64, ...]}`."""
        kind = request.headers.get("content-type", "")
        if kind.startswith("multipart/form-data"):
            try:
                form = await request.form(max_files=limits.max_images, max_fields=8)
            except StarletteHTTPException as e:  # Starlette's 400 for a malformed form
                if "files" in str(e.detail).lower():  # more file parts than max_files
                    raise LimitExceeded(
                        422,
                        (
                            f"images in the request: more than the limit of {limits.max_images} "
                            "(--max-images)"
                        ),
                    ) from None
                raise LimitExceeded(422, f"multipart: {e.detail}") from None
            uploads = [v for v in form.getlist("files") if not isinstance(v, str)]
            if len(uploads) > limits.max_images:
                raise over(
                    422, "images in the request", len(uploads), limits.max_images, "--max-images"
                )
            blobs = [await u.read() for u in uploads]
            encoding = form.get("encoding") or "float"
            if encoding not in ENCODINGS:
                raise LimitExceeded(422, f"encoding must be one of {ENCODINGS}")
        elif kind.startswith("application/json"):
            try:
                parsed = ImagesRequest.model_validate_json(await request.body())
            except ValueError as e:
                raise LimitExceeded(422, f"body: {e}") from None
            if len(parsed.images) > limits.max_images:
                raise over(
                    422,
                    "images in the request",
                    len(parsed.images),
                    limits.max_images,
                    "--max-images",
                )
            blobs = []
            for i, text in enumerate(parsed.images):
                try:
                    blobs.append(base64.b64decode(text, validate=True))
                except (binascii.Error, ValueError):
                    raise InputError("not valid base64", index=i) from None
            encoding = parsed.encoding
        else:
            raise LimitExceeded(
                415 if kind else 422,
                "send multipart/form-data (files) or application/json (images: base64)",
            )
        check_images(blobs, limits)
        vectors = await service.pool.run(service.model.embed_images, blobs)
        return {
            **service.identity(),
            "encoding": encoding,
            "embeddings": [encode(v, encoding) for v in vectors],
        }

    # --------------------------------------------------------------------------------- search
    @app.post("/v1/search", tags=["search"])
    async def search(body: SearchRequest):
        if (body.query is None) == (body.queries is None):
            raise LimitExceeded(422, "give exactly one of query or queries")
        texts = [body.query] if body.query is not None else body.queries
        check_texts(texts, limits, batch=limits.max_queries, option="--max-queries")
        if body.k > limits.max_k:
            raise over(422, "k", body.k, limits.max_k, "--max-k")

        def work():
            start = time.perf_counter()
            found = index.search(
                texts, k=body.k, mode=body.mode, explain=body.explain, where=body.where
            )
            return found, time.perf_counter() - start

        asked = time.perf_counter()
        found, took = await service.pool.run(work)
        waited = time.perf_counter() - asked - took
        results = [
            {"query": q, "hits": [service.hit_json(h, body.explain) for h in hits]}
            for q, hits in zip(texts, found)
        ]
        # Server-Timing: the Index.search call itself and the wait for a worker, so a client
        # can tell the HTTP layer's cost from the search's (benchmarks/serve.py does)
        return JSONResponse(
            {**service.identity(), "mode": body.mode, "k": body.k, "results": results},
            headers={
                "Server-Timing": f"search;dur={took * 1000:.3f}, "
                f"queue;dur={max(waited, 0.0) * 1000:.3f}"
            },
        )

    # ---------------------------------------------------------------------------------- pages
    def stored_hit(page_id: str):
        try:
            canonical = str(uuid.UUID(page_id))
        except ValueError:
            canonical = None
        hit = index.page(canonical) if canonical else None
        if hit is None:
            raise HTTPException(404, f"unknown page id {page_id!r}: not a page of this index")
        return hit

    async def page_png(page_id: str, width: int | None, query: str | None) -> Response:
        if query is not None:
            check_texts([query], limits, batch=1, option="--max-batch")

        def work():
            return service.render(stored_hit(page_id), width, query)

        return Response(
            await service.pool.run(work),
            media_type="image/png",
            headers={"Cache-Control": "private, max-age=60"},
        )

    @app.get(
        "/v1/pages/{page_id}/image",
        tags=["pages"],
        response_class=Response,
        responses={200: {"content": {"image/png": {}}}},
    )
    async def page_image(page_id: str, width: int | None = Query(None, ge=16, le=4096)):
        """The page re-rendered at its indexed size (or `width` pixels wide), as PNG."""
        return await page_png(page_id, width, None)

    @app.get(
        "/v1/pages/{page_id}/map",
        tags=["pages"],
        response_class=Response,
        responses={200: {"content": {"image/png": {}}}},
    )
    async def page_map(
        page_id: str,
        q: str = Query(..., min_length=1),
        width: int | None = Query(None, ge=16, le=4096),
    ):
        """The page with the similarity overlay for query `q`, as PNG."""
        return await page_png(page_id, width, q)

    # ----------------------------------------------------------------------------------- jobs
    @app.post("/v1/index", tags=["index"], status_code=202)
    async def start_index(body: IndexRequest):
        if not body.paths:
            raise LimitExceeded(422, "no paths in the request")
        targets = []
        for item in body.paths:
            root, path = (None, item) if isinstance(item, str) else (item.root, item.path)
            targets.append(settings.roots.resolve(root, path))
        job = service.jobs.submit(targets)
        return {"id": job.id, "state": job.state, "url": f"/v1/jobs/{job.id}"}

    @app.get("/v1/jobs/{job_id}", tags=["index"])
    async def job_status(job_id: str):
        job = service.jobs.jobs.get(job_id)
        if job is None:
            raise HTTPException(404, f"unknown job id {job_id!r}")
        return job.to_dict()

    @app.get("/v1/jobs", tags=["index"])
    async def job_list():
        return {
            "jobs": [
                {
                    "id": j.id,
                    "state": j.state,
                    "files_done": j.files_done,
                    "files_total": j.files_total,
                }
                for j in service.jobs.jobs.values()
            ]
        }

    return app


def jsonable(errors: list[dict]) -> list[dict]:
    """Pydantic's error dicts without the raw input or exception objects (not JSON-safe)."""
    return [
        {"loc": list(e.get("loc", ())), "msg": e.get("msg"), "type": e.get("type")} for e in errors
    ]
