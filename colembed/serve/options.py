"""`colembed serve`'s own options (the index and model options are the CLI's shared ones).
Standard library only: `colembed --help` builds this parser without the serve extra."""

from __future__ import annotations

import argparse
from dataclasses import fields

from .limits import Limits


def add_serve_options(parser: argparse.ArgumentParser) -> None:
    net = parser.add_argument_group("network and access")
    net.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default 127.0.0.1; any other refuses to start "
        "without an API key unless --insecure)",
    )
    net.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    net.add_argument(
        "--api-key",
        help="require this key (X-API-Key or Authorization: Bearer) on "
        "/v1; or $COLEMBED_API_KEY (not visible in ps)",
    )
    net.add_argument(
        "--insecure", action="store_true", help="allow a non-loopback --host without an API key"
    )
    net.add_argument(
        "--allowed-host",
        action="append",
        metavar="NAME[:PORT]",
        help="also answer requests whose Host is NAME (repeatable): the name a "
        "reverse proxy or users reach the server by; any other Host than the "
        "bound address (and localhost forms on loopback) is refused",
    )
    net.add_argument(
        "--cors-origin",
        action="append",
        metavar="ORIGIN",
        help="allow cross-origin requests from ORIGIN (repeatable; default none)",
    )
    net.add_argument(
        "--allow-root",
        action="append",
        metavar="[NAME=]DIR",
        help="a folder POST /v1/index may read (repeatable; indexing over HTTP is off without one)",
    )
    work = parser.add_argument_group("work and limits")
    work.add_argument(
        "--workers",
        type=int,
        default=1,
        help="model/store calls run at once (default 1: each already uses every core)",
    )
    work.add_argument(
        "--queue",
        type=int,
        default=16,
        help="calls waiting for a worker before 503 + Retry-After (default 16)",
    )
    work.add_argument(
        "--render-workers",
        type=int,
        default=2,
        help="processes that render page images again (default 2; pdfium is not "
        "thread-safe, so they never wait for an index job's renders)",
    )
    work.add_argument(
        "--store-in-process",
        action="store_true",
        help="open an index folder's store in the server's own process (for "
        "measurement: an Edge search then holds up the event loop)",
    )
    work.add_argument(
        "--max-queued-jobs",
        type=int,
        default=8,
        help="index jobs waiting behind the running one (default 8)",
    )
    for f in fields(Limits):
        work.add_argument(
            "--" + f.name.replace("_", "-"),
            type=int,
            default=f.default,
            help=f"{Limits.HELP[f.name]} (default {f.default})",
        )
