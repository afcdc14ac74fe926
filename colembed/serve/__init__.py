"""`colembed serve`: the model and one index behind an HTTP API (`/v1`) and a search page (`/`).

    colembed serve --db my-index [--allow-root docs=/srv/docs] [--api-key KEY]

- `app.py` builds the ASGI app (FastAPI): routes, the API key check, limits, error mapping.
- `pool.py` is the bounded worker pool: model and store calls run off the event loop, at most
  `workers` at once with `queue` more waiting; past that a request gets 503 + Retry-After.
- `roots.py` confines index-job paths to the `--allow-root` folders (no absolute paths, no `..`,
  no symlink out) and shows stored paths relative to their root.
- `jobs.py` runs index jobs one at a time on a thread of their own, one `Index.add` call each,
  with progress per page; shutdown stops a job once the pages being embedded are written (the
  index's own guarantees hold: a page is stored whole or not at all).
- `store_process.py` runs an index folder's store in a child process (qdrant-edge-py holds the
  GIL during a search: in-process, the event loop would wait for every search).
- `render.py` renders page images again in worker processes (pdfium is not thread-safe, and an
  index job is using it in this process).
- `encoding.py` turns multivectors into JSON (nested lists, or base64 little-endian float32 with
  the shape).
- `run.py` is what the CLI calls: the start-up checks (host, key) and uvicorn.
- `static/index.html` is the search page: plain HTML and a little JS, no CDN, works offline.

Needs the `serve` extra (fastapi, uvicorn, python-multipart). Nothing outside this package
imports fastapi, starlette or uvicorn, and `import colembed` does not import this package.
docs/serve.md describes the API.
"""
