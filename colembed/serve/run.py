"""Starting the server: the exposure check, then uvicorn with the app on an open index.

`colembed serve` binds 127.0.0.1 unless told otherwise. Any address that is not loopback
(0.0.0.0, ::, a LAN address) exposes the model, the index's page images and, with roots, reading
of those folders: it is refused without an API key unless `--insecure` says so on purpose.
"""

from __future__ import annotations

import dataclasses
import ipaddress

from ..errors import ColembedError

API_KEY_ENV = "COLEMBED_API_KEY"
GRACEFUL_SHUTDOWN_S = 30  # uvicorn waits this long for open requests at shutdown
# uvicorn answers 503 past this many connections or requests in flight beyond the slow ones
# connections.py closes: the last bound on sockets and memory, far above the pool's own bound
# (the one that says Retry-After).
CONNECTION_HEADROOM = 64


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
            f"(--api-key KEY or ${API_KEY_ENV}), or --insecure to serve without one on purpose"
        )


def serve(
    index,
    settings,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    insecure: bool = False,
    on_ready=None,
) -> None:
    """Run until SIGINT/SIGTERM; then open requests get `GRACEFUL_SHUTDOWN_S` to finish, index
    jobs stop once the pages being embedded are written and the index is closed (a page is stored
    whole or not at all, so even a SIGKILL leaves a consistent index that the next job
    completes)."""
    import uvicorn

    from .app import create_app

    check_exposure(host, settings.api_key, insecure)
    settings = dataclasses.replace(settings, host=host)  # the Host rule follows the bound address
    app = create_app(index, settings, close_index=True)
    server = uvicorn.Server(uvicorn_config(app, host, port, log_level))
    if on_ready is not None:
        on_ready(server)
    server.run()


def uvicorn_config(
    app, host: str, port: int, log_level: str = "info", *, head_timeout: float | None = None
):
    """uvicorn's settings for `colembed serve`: its h11 protocol with the head deadline (default
    `HEAD_TIMEOUT_S`) and the eviction of slow connections (connections.py), the keep-alive and
    head-size bounds."""
    import uvicorn

    from .connections import (
        HEAD_TIMEOUT_S,
        KEEP_ALIVE_S,
        MAX_HEAD_BYTES,
        open_file_budget,
        protocol_class,
    )

    max_open = open_file_budget()
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        http=protocol_class(head_timeout or HEAD_TIMEOUT_S, max_open),
        timeout_keep_alive=KEEP_ALIVE_S,
        h11_max_incomplete_event_size=MAX_HEAD_BYTES,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        limit_concurrency=max_open + CONNECTION_HEADROOM,
        server_header=False,
    )
