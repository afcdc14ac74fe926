"""Starting the server: the exposure check, then uvicorn with the app on an open index.

`colembed serve` binds 127.0.0.1 unless told otherwise. Any address that is not loopback
(0.0.0.0, ::, a LAN address) exposes the model, the index's page images and, with roots, reading
of those folders: it is refused without an API key unless `--insecure` says so on purpose.
"""

from __future__ import annotations

import ipaddress

from ..errors import ColembedError

API_KEY_ENV = "COLEMBED_API_KEY"
GRACEFUL_SHUTDOWN_S = 30  # uvicorn waits this long for open requests at shutdown
# uvicorn answers 503 past this many open connections (before the app sees them): a cap on
# sockets and memory far above the pool's own bound, which is the one that says Retry-After.
MAX_CONNECTIONS = 1024


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def check_exposure(host: str, api_key: str | None, insecure: bool) -> None:
    if not is_loopback(host) and not api_key and not insecure:
        raise ColembedError(
            f"--host {host} makes the API reachable from other machines: give an API key "
            f"(--api-key KEY or ${API_KEY_ENV}), or --insecure to serve without one on purpose")


def serve(index, settings, *, host: str = "127.0.0.1", port: int = 8000,
          log_level: str = "info", insecure: bool = False, on_ready=None) -> None:
    """Run until SIGINT/SIGTERM; then open requests get `GRACEFUL_SHUTDOWN_S` to finish, index
    jobs stop once the pages being embedded are written and the index is closed (a page is stored
    whole or not at all, so even a SIGKILL leaves a consistent index that the next job
    completes)."""
    import uvicorn

    from .app import create_app

    check_exposure(host, settings.api_key, insecure)
    app = create_app(index, settings, close_index=True)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
                            limit_concurrency=MAX_CONNECTIONS, server_header=False)
    server = uvicorn.Server(config)
    if on_ready is not None:
        on_ready(server)
    server.run()
