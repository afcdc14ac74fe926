"""`colembed serve`: the model and one index behind an HTTP API (`/v1`) and a search page (`/`).

    colembed serve --db my-index [--allow-root docs=/srv/docs] [--api-key KEY]

- `app.py` builds the ASGI app (FastAPI): routes, the API key check, limits, error mapping.
- `pool.py` is the bounded worker pool: model and store calls run off the event loop, at most
  `workers` at once with `queue` more waiting; past that a request gets 503 + Retry-After.
- `roots.py` confines index-job paths to the `--allow-root` folders (no absolute paths, no `..`,
  no symlink out) and shows stored paths relative to their root.
- `jobs.py` runs index jobs one at a time on a thread of their own, file by file through
  `Index.add`, with progress; shutdown cancels between files (the index's own guarantees hold:
  a page is stored whole or not at all).
- `encoding.py` turns multivectors into JSON (nested lists, or base64 little-endian float32 with
  the shape).
- `run.py` is what the CLI calls: the start-up checks (host, key) and uvicorn.
- `static/index.html` is the search page: plain HTML and a little JS, no CDN, works offline.

Needs the `serve` extra (fastapi, uvicorn, python-multipart). Nothing outside this package
imports fastapi, starlette or uvicorn, and `import colembed` does not import this package.
docs/serve.md describes the API.
"""
