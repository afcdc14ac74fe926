"""`colembed serve` against hostile HTTP: what a web page, a rebinding name, a client without the
key or a careless error message could do, each refused before any work.

- Host: only this server's names (DNS rebinding), 421 otherwise, before routing.
- Origin / Sec-Fetch-Site: a form POST or an API read from another site is 403 before its body
  is read, with or without a key.
- The key is checked from the headers: a 401 never reads the body.
- No absolute server path in job reports or error bodies.
- Status codes as documented (a pixel bomb PIL refuses at open: 413; too many parts: 422).
- Security headers on every response.

Requests go through the real app (the ASGI callable with a counting `receive`, or TestClient);
tests/runtime/serve/test_slow.py holds the real-socket ones."""

from __future__ import annotations

import asyncio
import io
import json
import struct
import zlib
from pathlib import Path

import pytest
from hypothesis import given, settings as hsettings, strategies as st
from PIL import Image

from tests.fixtures.documents import bad_folder, write_pdf

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from colembed.errors import ColembedError  # noqa: E402
from colembed.index import Index  # noqa: E402
from colembed.serve.app import Settings, create_app  # noqa: E402
from colembed.serve.hosts import AllowedHosts, parse_authority  # noqa: E402
from colembed.serve.limits import Limits  # noqa: E402
from colembed.serve.public import public_message  # noqa: E402
from colembed.serve.roots import Root, Roots, parse_roots  # noqa: E402
from tests.runtime.serve.test_serve import BASE, KEY, small_model, wait_job  # noqa: E402,F401 (the model fixture)

HOST = "127.0.0.1:8000"
EVIL = "http://attacker.example"


def call(app, method: str, path: str, headers: dict[str, str], body: bytes = b"{}"):
    """(status, json body, times `receive` was called): one request through the ASGI app."""
    reads = 0

    async def receive():
        nonlocal reads
        reads += 1
        return {"type": "http.request", "body": body, "more_body": False}

    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    headers = {"host": HOST, **{k.lower(): v for k, v in headers.items()}}
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
        "state": {},
        "headers": [(k.encode(), v.encode("latin-1")) for k, v in headers.items()],
    }
    asyncio.run(app(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    data = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    try:
        parsed = json.loads(data)
    except ValueError:
        parsed = None
    return (
        start["status"],
        parsed,
        reads,
        dict((k.decode(), v.decode()) for k, v in start["headers"]),
    )


@pytest.fixture(scope="module")
def apps(tmp_path_factory, small_model):
    """{"keyless": app, "keyed": app, "cors": app} over one empty index."""
    base = tmp_path_factory.mktemp("hostile")
    index = Index(base / "db", model=small_model)
    limits = Limits(max_images=2, max_image_pixels=1_000_000)
    built = {
        "keyless": create_app(index, Settings(limits=limits)),
        "keyed": create_app(index, Settings(api_key=KEY, limits=limits)),
        "cors": create_app(index, Settings(cors_origins=["http://good.example"], limits=limits)),
    }
    clients = {name: TestClient(app, base_url=BASE) for name, app in built.items()}
    for client in clients.values():
        client.__enter__()
    yield built
    for client in clients.values():
        client.__exit__(None, None, None)
    index.close()


FORMS = [
    (
        "multipart/form-data; boundary=x",
        b'--x\r\nContent-Disposition: form-data; name="files"; filename="a.png"\r\n\r\n'
        b"%!PS-Adobe-3.0 EPSF-3.0\r\n--x--\r\n",
    ),
    ("application/x-www-form-urlencoded", b"query=x"),
    ("text/plain", b'{"query": "x"}'),
]


# ---------------------------------------------------------------------------- Host (rebinding)
@pytest.mark.parametrize(
    "bind, extra, allowed, refused",
    [
        (
            "127.0.0.1",
            [],
            [
                "127.0.0.1:8000",
                "localhost:8000",
                "LOCALHOST.:9000",
                "localhost",
                "[::1]:8000",
                "127.0.0.1",
            ],
            [
                "attacker.example:8000",
                "attacker.example",
                "127.0.0.1.nip.io:8000",
                "10.0.0.1:8000",
                "[::2]:8000",
                "localhost.attacker.example",
            ],
        ),
        ("::1", [], ["[::1]:8000", "localhost:8000", "127.0.0.1:8000"], ["example.com"]),
        (
            "0.0.0.0",
            [],
            ["192.168.1.5:8000", "[fe80::1]:8000", "localhost:8000"],
            ["myhost.lan:8000", "attacker.example"],
        ),
        ("192.168.1.5", [], ["192.168.1.5:8000"], ["127.0.0.1:8000", "192.168.1.6", "myhost.lan"]),
        (
            "0.0.0.0",
            ["Docs.Example.com", "proxy.example:8443"],
            ["docs.example.com", "docs.example.com.:443", "proxy.example:8443", "10.1.2.3"],
            ["proxy.example:8444", "proxy.example", "other.example.com"],
        ),
        ("myhost.lan", [], ["myhost.lan:8000", "MyHost.Lan."], ["localhost:8000", "10.0.0.1"]),
    ],
)
def test_only_the_servers_own_hosts_are_allowed(bind, extra, allowed, refused):
    hosts = AllowedHosts(bind, extra)
    for value in allowed:
        assert hosts.allows(parse_authority(value)), (bind, value)
    for value in refused:
        assert not hosts.allows(parse_authority(value)), (bind, value)


@pytest.mark.parametrize(
    "value",
    [
        "",
        "[::1",
        "::1",
        "a b",
        "x:99999",
        "x:8o",
        "x/y",
        "[::1]x",
        "a..b",
        "\u0430pple.com",
        "[fe80::1%25eth0]",
        "x@y",
    ],
)
def test_malformed_hosts_do_not_parse(value):
    with pytest.raises(ValueError):
        parse_authority(value)
    with pytest.raises(ColembedError, match="--allowed-host"):
        AllowedHosts("127.0.0.1", [value])


@hsettings(max_examples=300, deadline=None)
@given(st.text(max_size=40))
def test_any_host_header_parses_or_is_refused_cleanly(value):
    """Whatever a client puts in Host: a ValueError, or an authority the rule can judge."""
    hosts = AllowedHosts("127.0.0.1", ["docs.example.com"])
    try:
        authority = parse_authority(value)
    except ValueError:
        return
    assert isinstance(hosts.allows(authority), bool)
    assert hosts.allows(authority) == hosts.allows(parse_authority(value.upper()))


def test_a_rebinding_host_is_refused_before_routing(apps):
    """The DNS-rebinding request: a page at attacker.example:8000 whose name now resolves to
    127.0.0.1 searches the keyless server: 421, the body never read."""
    status, body, reads, _ = call(
        apps["keyless"],
        "POST",
        "/v1/search",
        {"host": "attacker.example:8000", "content-type": "application/json"},
        b'{"query": "x"}',
    )
    assert (status, reads) == (421, 0) and "--allowed-host" in body["detail"]
    for host in ("attacker.example", "[::1", ""):
        status, _, reads, _ = call(apps["keyless"], "GET", "/healthz", {"host": host})
        assert status in (400, 421) and reads == 0
    status, _, _, _ = call(apps["keyless"], "GET", "/healthz", {"host": "localhost:8000"})
    assert status == 200


def test_allowed_host_opens_a_name_for_a_reverse_proxy(tmp_path, small_model):
    index = Index(tmp_path / "db", model=small_model)
    app = create_app(index, Settings(allowed_hosts=["docs.example.com"]))
    with TestClient(app, base_url="https://docs.example.com") as client:
        assert client.get("/healthz").status_code == 200
        r = client.post(
            "/v1/search", json={"query": "x"}, headers={"Origin": "https://docs.example.com"}
        )
        assert r.status_code == 200, r.text
    with TestClient(app, base_url="https://other.example.com") as client:
        assert client.get("/healthz").status_code == 421
    index.close()


# ----------------------------------------------------------------------- Origin (cross-site)
@pytest.mark.parametrize("app_name", ["keyless", "keyed"])
@pytest.mark.parametrize("kind, body", FORMS)
def test_a_cross_origin_form_post_is_refused_before_its_body(apps, app_name, kind, body):
    """A web page's form (no CORS preflight) POSTing to the local server: 403, body unread,
    with or without a key (and with the right key too)."""
    for path in ("/v1/embed/images", "/v1/search", "/v1/index", "/anything"):
        headers = {"content-type": kind, "origin": EVIL}
        if app_name == "keyed":
            headers["x-api-key"] = KEY
        status, detail, reads, _ = call(apps[app_name], "POST", path, headers, body)
        assert (status, reads) == (403, 0), (path, detail)
        assert "attacker.example" in detail["detail"] and "--cors-origin" in detail["detail"]
    # Origin `null` (a sandboxed frame, a file: page) is another origin too
    status, _, reads, _ = call(
        apps[app_name], "POST", "/v1/search", {"content-type": kind, "origin": "null"}, body
    )
    assert (status, reads) == (403, 0)


def test_sec_fetch_site_refuses_other_sites_without_an_origin(apps):
    app = apps["keyless"]
    for site in ("cross-site", "same-site"):
        status, _, reads, _ = call(
            app,
            "POST",
            "/v1/search",
            {"content-type": "text/plain", "sec-fetch-site": site},
            b'{"query":"x"}',
        )
        assert (status, reads) == (403, 0)
        # reading the API from another site (an <img> of a page image, a no-cors fetch)
        status, _, _, _ = call(app, "GET", "/v1/info", {"sec-fetch-site": site})
        assert status == 403
        # the page itself may be linked to from anywhere
        status, _, _, _ = call(app, "GET", "/", {"sec-fetch-site": site})
        assert status == 200
    for site in ("same-origin", "none"):
        status, _, _, _ = call(app, "GET", "/v1/info", {"sec-fetch-site": site})
        assert status == 200


def test_the_servers_own_origin_and_cors_origins_pass(apps):
    search = b'{"query": "x"}'
    json_kind = {"content-type": "application/json"}
    for origin in ("http://127.0.0.1:8000", "http://localhost:8000"):
        host = origin.split("//")[1]
        status, body, reads, _ = call(
            apps["keyless"],
            "POST",
            "/v1/search",
            {**json_kind, "origin": origin, "host": host, "sec-fetch-site": "same-origin"},
            search,
        )
        assert status == 200 and reads >= 1, body
    # same host, another port: another origin (another local web app)
    status, _, reads, _ = call(
        apps["keyless"],
        "POST",
        "/v1/search",
        {**json_kind, "origin": "http://127.0.0.1:3000"},
        search,
    )
    assert (status, reads) == (403, 0)
    status, _, _, headers = call(
        apps["cors"],
        "POST",
        "/v1/search",
        {**json_kind, "origin": "http://good.example", "sec-fetch-site": "cross-site"},
        search,
    )
    assert status == 200 and headers["access-control-allow-origin"] == "http://good.example"
    status, _, _, _ = call(
        apps["cors"],
        "POST",
        "/v1/search",
        {**json_kind, "origin": EVIL, "sec-fetch-site": "cross-site"},
        search,
    )
    assert status == 403


# --------------------------------------------------------------------------- key before body
@pytest.mark.parametrize(
    "method, path",
    [
        ("POST", "/v1/search"),
        ("POST", "/v1/embed/queries"),
        ("POST", "/v1/index"),
        ("POST", "/v1/embed/images"),
        ("GET", "/v1/info"),
        ("GET", "/v1/jobs"),
        ("POST", "/v1/no-such-route"),
        ("GET", "/docs"),
    ],
)
def test_the_key_is_checked_before_the_body_is_read(apps, method, path):
    body = b'{"texts": ["' + b"x" * 1_000_000 + b'"]}'
    for headers in ({}, {"x-api-key": "wrong"}, {"authorization": "Bearer wrong"}):
        status, detail, reads, sent = call(
            apps["keyed"], method, path, {"content-type": "application/json", **headers}, body
        )
        assert (status, reads) == (401, 0), detail
        assert sent["www-authenticate"] == "Bearer" and sent["connection"] == "close"
    status, _, _, _ = call(apps["keyed"], "GET", "/v1/info", {"authorization": f"Bearer {KEY}"})
    assert status == 200


# ------------------------------------------------------------------------------ status codes
def png_header_claiming(width: int, height: int) -> bytes:
    """A 1x1 PNG whose header says `width` x `height` (CRC fixed): PIL reads the size only."""
    buffer = io.BytesIO()
    Image.new("1", (1, 1)).save(buffer, "PNG")
    data = bytearray(buffer.getvalue())
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


def test_status_codes_as_documented(apps):
    client = TestClient(apps["keyless"], base_url=BASE)
    bomb = png_header_claiming(20000, 20000)  # 400 MP: over PIL's own 2x bound (refused at open)
    r = client.post("/v1/embed/images", files=[("files", ("b.png", bomb, "image/png"))])
    assert r.status_code == 413 and "--max-image-pixels" in r.json()["detail"], r.text
    small = png_header_claiming(8, 8)
    for parts in (3, 4, 9):
        r = client.post(
            "/v1/embed/images",
            files=[("files", (f"{i}.png", small, "image/png")) for i in range(parts)],
        )
        assert r.status_code == 422 and "--max-images" in r.json()["detail"], (parts, r.text)


def test_security_headers_and_no_path_in_404(apps):
    client = TestClient(apps["keyless"], base_url=BASE)
    page = client.get("/")
    csp = page.headers["content-security-policy"]
    assert "frame-ancestors 'none'" in csp and "object-src 'none'" in csp
    for r in (
        page,
        client.get("/healthz"),
        client.get("/no/such/file.txt"),
        client.get("/healthz", headers={"host": "attacker.example"}),
    ):
        assert r.headers["x-content-type-options"] == "nosniff"
        assert r.headers["x-frame-options"] == "DENY"
        assert r.headers["cross-origin-resource-policy"] == "same-origin"
    missing = client.get("/no/such/file.txt")
    assert missing.status_code == 404 and "file.txt" not in missing.text


# --------------------------------------------------------------------------- no server paths
def test_no_absolute_server_path_in_job_reasons_or_410(tmp_path, small_model):
    root = tmp_path / "root"
    bad = bad_folder(root / "bad")
    write_pdf(root / "changing.pdf", ["first"])
    index = Index(tmp_path / "db", model=small_model)
    settings = Settings(roots=Roots(parse_roots([f"docs={root}"])))
    with TestClient(create_app(index, settings), base_url=BASE) as client:
        job = wait_job(
            client, client.post("/v1/index", json={"paths": ["."]}).json()["id"], headers={}
        )
        reports = job["failed"] + job["skipped"]
        assert {Path(r["file"]).name for r in reports} >= set(bad)
        text = json.dumps(job)
        assert str(tmp_path) not in text and str(tmp_path.resolve()) not in text, text
        assert "docs/bad/broken.png" in text
        [hit] = index.search("first", k=1)
        write_pdf(root / "changing.pdf", ["changed"])
        r = client.get(f"/v1/pages/{hit.id}/image")
        assert r.status_code == 410, r.text
        assert str(tmp_path.resolve()) not in r.text and str(tmp_path) not in r.text
        assert r.json()["detail"].startswith("docs/changing.pdf: ")
    index.close()


paths = st.lists(
    st.text(
        st.characters(codec="utf-8", exclude_characters="/\\\x00'\""), min_size=1, max_size=12
    ).filter(lambda p: p not in (".", "..")),
    min_size=1,
    max_size=4,
)


@hsettings(max_examples=200, deadline=None)
@given(inside=paths, outside=paths, quote=st.sampled_from(["'", '"', ""]))
def test_public_messages_hold_no_absolute_path(inside, outside, quote):
    """A message naming a file inside the root and one outside it (quoted as decoders quote,
    or bare, with any characters in their names): no absolute prefix survives."""
    root = Roots([Root("docs", Path("/srv/secret-layout/docs"))])
    inner = "/srv/secret-layout/docs/" + "/".join(inside)
    outer = "/var/private-place/" + "/".join(outside)
    text = f"cannot read {quote}{inner}{quote} nor {quote}{outer}{quote}: failed"
    shown = public_message(text, root)
    assert "secret-layout" not in shown and "/var/" not in shown and "/srv/" not in shown, shown
    if quote:  # quoted as a decoder quotes it: shown whole, relative to its root
        assert f"{quote}docs/{'/'.join(inside)}{quote}" in shown, shown
