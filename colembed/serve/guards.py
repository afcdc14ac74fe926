"""What is refused before a request reaches a route: pure ASGI middleware, each answering from
the request line and headers alone, so no refused request has its body read.

In the order a request meets them (`install`):
- `SecurityHeaders`: every response says nosniff, no referrer, no framing, same-origin resources.
- `TrustedHosts`: a `Host` that is not this server's is 421 (400 when missing or malformed):
  the DNS-rebinding guard (hosts.py has the rule).
- `SameOrigin`: a browser request from another origin is 403 when it could change state (any
  method but GET/HEAD/OPTIONS) or reads the API (`/v1`): `Origin` must be this server's own or a
  `--cors-origin`; without `Origin`, `Sec-Fetch-Site` must not say another site. A form POST from
  any web page (no CORS preflight) is refused here, with or without an API key.
- `RequireKey`: with an API key, every path but `/`, `/healthz` and `/openapi.json` needs it
  (401 + `WWW-Authenticate`), checked in constant time.
- `BodyLimit`: 413 once a body passes `--max-body-bytes` (Content-Length, or counted).

A refusal also says `Connection: close`: the server does not read what the client still sends.
"""

from __future__ import annotations

import hmac
import json

from fastapi import HTTPException

from .hosts import AllowedHosts, parse_authority

API_KEY_HEADER = "X-API-Key"
PUBLIC_PATHS = frozenset({"/", "/healthz", "/openapi.json"})  # hold no data: no key needed
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
SECURITY_HEADERS = [
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),
    # no-cors loads (an <img> on another site) of page images and answers are blocked
    (b"cross-origin-resource-policy", b"same-origin"),
]


async def refuse(send, status: int, detail: str, headers: list[tuple[bytes, bytes]] = ()):
    data = json.dumps({"detail": detail}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(data)).encode()),
                (b"connection", b"close"),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": data})


def header(scope, name: bytes) -> str | None:
    for key, value in scope.get("headers") or ():
        if key == name:
            return value.decode("latin-1")
    return None


class SecurityHeaders:
    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def with_headers(message):
            if message["type"] == "http.response.start":
                present = {k.lower() for k, _ in message.get("headers", ())}
                message = {
                    **message,
                    "headers": [
                        *message.get("headers", ()),
                        *((k, v) for k, v in SECURITY_HEADERS if k not in present),
                    ],
                }
            await send(message)

        await self.app(scope, receive, with_headers)


class TrustedHosts:
    def __init__(self, app, hosts: AllowedHosts) -> None:
        self.app, self.hosts = app, hosts

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        value = header(scope, b"host")
        if value is None:
            return await refuse(send, 400, "the request has no Host header")
        try:
            authority = parse_authority(value)
        except ValueError:
            return await refuse(send, 400, f"Host {value!r} is not a host name or address")
        if not self.hosts.allows(authority):
            return await refuse(
                send,
                421,
                (
                    f"Host {value!r} is not a name this server answers to (a server reached by a "
                    "name of its own is started with --allowed-host NAME)"
                ),
            )
        scope.setdefault("state", {})["host_authority"] = authority
        await self.app(scope, receive, send)


class SameOrigin:
    def __init__(self, app, hosts: AllowedHosts) -> None:
        self.app, self.hosts = app, hosts

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.guarded(scope):
            return await self.app(scope, receive, send)
        origin = header(scope, b"origin")
        site = (header(scope, b"sec-fetch-site") or "").strip().lower()
        if site in ("cross-site", "same-site") and not (
            origin is not None and self.hosts.is_cors_origin(origin)
        ):
            return await refuse(
                send,
                403,
                (
                    f"{scope['method']} {scope['path']} from another site is refused "
                    f"(Sec-Fetch-Site: {site}); allow an origin with --cors-origin"
                ),
            )
        if origin is not None:
            host = scope["state"]["host_authority"]  # set by TrustedHosts, which runs first
            if not self.hosts.allows_origin(origin, host):
                return await refuse(
                    send,
                    403,
                    (
                        f"{scope['method']} {scope['path']} from origin {origin!r} is refused: "
                        "not this server's own (allow it with --cors-origin)"
                    ),
                )
        await self.app(scope, receive, send)

    @staticmethod
    def guarded(scope) -> bool:
        path = scope["path"]
        return scope["method"] not in SAFE_METHODS or path == "/v1" or path.startswith("/v1/")


class RequireKey:
    def __init__(self, app, key: str) -> None:
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS:
            return await self.app(scope, receive, send)
        given = header(scope, API_KEY_HEADER.lower().encode())
        bearer = header(scope, b"authorization") or ""
        if given is None and bearer[:7].lower() == "bearer ":
            given = bearer[7:]
        if given is None or not hmac.compare_digest(given.encode("latin-1"), self.key):
            return await refuse(
                send,
                401,
                f"missing or wrong API key ({API_KEY_HEADER} or Authorization: Bearer)",
                [(b"www-authenticate", b"Bearer")],
            )
        await self.app(scope, receive, send)


class _BodyTooLarge(HTTPException):
    """Raised from the body stream; an HTTPException so that FastAPI's body parsing passes it
    on as it is (it turns other errors into 400)."""

    def __init__(self, message: str) -> None:
        super().__init__(413, message, headers={"Connection": "close"})


class BodyLimit:
    """413 once a request body passes `limit` bytes (Content-Length or count)."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        message = f"request body is over the limit of {self.limit} bytes (--max-body-bytes)"
        declared = header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await refuse(send, 413, message)
        seen = 0

        async def counted():
            nonlocal seen
            event = await receive()
            if event["type"] == "http.request":
                seen += len(event.get("body", b""))
                if seen > self.limit:
                    raise _BodyTooLarge(message)
            return event

        await self.app(scope, counted, send)


def install(app, *, hosts: AllowedHosts, api_key: str | None, max_body_bytes: int) -> None:
    """Add the middleware above to a FastAPI app (the one added last runs first), with CORS
    (when `--cors-origin` is given) between the origin check and the key: a browser on an
    allowed origin can read a 401."""
    app.add_middleware(BodyLimit, limit=max_body_bytes)
    if api_key is not None:
        app.add_middleware(RequireKey, key=api_key)
    if hosts.cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=sorted(hosts.cors_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", API_KEY_HEADER, "Content-Type"],
        )
    app.add_middleware(SameOrigin, hosts=hosts)
    app.add_middleware(TrustedHosts, hosts=hosts)
    app.add_middleware(SecurityHeaders)
