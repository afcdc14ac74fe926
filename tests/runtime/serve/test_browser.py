"""The search page in a real browser: Debian's headless Chromium (driven by Playwright through
`executable_path`; Playwright's own browser download is never used) against a real uvicorn on
127.0.0.1 at a free port, over the tiny model and a real index. It enters the API key the page
asks for, types a query, sees the thumbnails, toggles the overlay, opens a page large and
toggles it there, and checks screenshots' pixels for the overlay's tint, not only the DOM.

Marked `browser`; skipped, saying why, when chromium or playwright is absent, except where
COLEMBED_REQUIRE_BROWSER=1 (.ci/run sets it and installs both): there a missing browser fails."""

from __future__ import annotations

import io
import os
import shutil
import socket
import threading
import time

import numpy as np
import pytest
from PIL import Image

import colembed
from tests.fixtures.documents import good_folder

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
if os.environ.get("COLEMBED_REQUIRE_BROWSER") == "1":
    assert CHROMIUM, "COLEMBED_REQUIRE_BROWSER=1 but no chromium on PATH"
    import playwright.sync_api  # noqa: F401  (an ImportError here fails the run, never skips)
pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(
        CHROMIUM is None,
        reason="no chromium on PATH (Debian: apt-get install chromium; .ci/run installs it)",
    ),
]
playwright_sync = pytest.importorskip(
    "playwright.sync_api", reason="playwright is not installed (the test extra)"
)
uvicorn = pytest.importorskip("uvicorn", reason="the serve extra is not installed")

KEY = "browser-key"
K = 4


@pytest.fixture(scope="module")
def server(tmp_path_factory, exported_tiny):
    from colembed.index import Index
    from colembed.serve.app import Settings, create_app
    from colembed.serve.run import uvicorn_config
    from colembed.serve.store_process import open_store_in_child

    base = tmp_path_factory.mktemp("browser")
    good_folder(base / "docs")
    index = Index(
        base / "db",
        model=colembed.load(exported_tiny.folder, max_image_tokens=64),
        store_opener=open_store_in_child,
    )  # as `colembed serve` opens it
    index.add([base / "docs"], progress=False)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # a free port, held by us until uvicorn takes the socket
    port = sock.getsockname()[1]
    app = create_app(index, Settings(api_key=KEY))
    server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", port, "warning"))  # as served
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started, "uvicorn did not start"
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(30)
    sock.close()
    index.close()


def tinted_share(png: bytes) -> float:
    """Share of pixels tinted towards the overlay colour (maps.OVERLAY_COLOR, red-orange) on a
    page that is otherwise black on white (grey: r = g = b)."""
    rgb = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.int32)
    r, g, b = rgb[..., 0], rgb[..., 1], rgb[..., 2]
    return float(((r - g > 40) & (r - b > 40)).mean())


def test_search_page_shows_pages_with_their_maps(server):
    with playwright_sync.sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=["--no-sandbox", "--disable-gpu"]
        )
        try:
            # the page's own Content-Security-Policy holds (no bypass): the test waits through
            # locators, which evaluate no string as script
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            expect = playwright_sync.expect
            errors = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(server + "/")
            # the status line asks for the key (401), the page takes it, then shows the index
            page.wait_for_selector("#key-box", state="visible", timeout=15000)
            page.fill("#key", KEY)
            page.click("#key-save")
            expect(page.locator("#index-status")).to_contain_text("7 pages indexed", timeout=15000)
            page.select_option("#k", "5")
            page.fill("#q", "what does the report say?")
            page.press("#q", "Enter")
            expect(page.locator(".result img[data-state=map]")).to_have_count(5, timeout=30000)
            assert "5 pages for" in page.inner_text("#status")
            first = page.locator(".result").first
            assert "score" in first.inner_text() and "page" in first.inner_text()
            with_map = tinted_share(first.locator("img").screenshot())
            assert with_map > 0.02, with_map  # the overlay's tint is on screen

            page.uncheck("#overlay-toggle")
            expect(page.locator(".result img:not([data-state=image])")).to_have_count(
                0, timeout=30000
            )
            plain = tinted_share(first.locator("img").screenshot())
            assert plain < 0.001, plain  # the plain page: black on white
            page.check("#overlay-toggle")
            expect(page.locator(".result img:not([data-state=map])")).to_have_count(
                0, timeout=30000
            )

            first.click()
            page.wait_for_selector("#viewer.open #viewer-img[data-state=map]", timeout=30000)
            large = page.locator("#viewer-img")
            box = large.bounding_box()
            assert box["width"] > 300  # opened large (thumbnails are ~220 px wide)
            assert tinted_share(large.screenshot()) > 0.02
            page.uncheck("#viewer-overlay")
            page.wait_for_selector("#viewer-img[data-state=image]", timeout=30000)
            assert tinted_share(large.screenshot()) < 0.001
            page.click("#viewer-close")
            page.wait_for_selector("#viewer", state="hidden")
            assert errors == []
        finally:
            browser.close()
