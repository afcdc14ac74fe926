"""What one request may ask for: each field is a `colembed serve` option of the same name
(`--max-body-bytes` ...), and every refusal names the option. Standard library only (the CLI's
--help reads the defaults without importing the web framework)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 64 << 20  # a request body, however sent (413)
    max_image_bytes: int = 32 << 20  # one image file (413)
    # One image's width x height, read from its header before decoding (413): the
    # decompression-bomb guard. 40 MP holds an A4 page scanned at 600 dpi (35 MP).
    max_image_pixels: int = 40_000_000
    max_batch: int = 32  # query texts per /v1/embed/queries request (422)
    max_images: int = 8  # images per /v1/embed/images request (422)
    max_query_chars: int = 2000  # characters of one query (422)
    max_k: int = 100  # pages per query in a search (422)
    max_queries: int = 16  # queries per /v1/search request (422)

    HELP = {
        "max_body_bytes": "request body bytes (413)",
        "max_image_bytes": "bytes of one image (413)",
        "max_image_pixels": "pixels of one image, from its header before decoding (413)",
        "max_batch": "query texts per embed request (422)",
        "max_images": "images per embed request (422)",
        "max_query_chars": "characters of one query (422)",
        "max_k": "pages per query in a search (422)",
        "max_queries": "queries per search request (422)",
    }
