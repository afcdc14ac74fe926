"""Files in, page images out: discovery, content hashes, PDF rendering and image frames.

- PDFs are rendered with pypdfium2 straight at the model's pixel budget (`render_scale`): a page
  is drawn at about `max_pixels` pixels, never at a multi-megapixel size that the preprocessing
  would then shrink; `dpi` overrides. pdfium is not thread-safe: only one thread may call into this
  module's PDF functions at a time (the indexer's single render thread, or the caller).
- Images are read directly; a multi-page TIFF is one page per frame; other formats are one page.
- Every way a file can be unreadable is turned into `SourceError(path, reason)`, so one bad file
  never stops a run (`DECODE_ERRORS` lists what the decoders are known to raise on bad data).
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import pypdfium2 as pdfium
from PIL import Image, UnidentifiedImageError

from .errors import SourceError

PDF_SUFFIXES = frozenset({".pdf"})
IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".tif", ".tiff", ".bmp", ".webp", ".gif"})
FRAME_SUFFIXES = frozenset({".tif", ".tiff"})  # formats whose frames are pages
POINTS_PER_INCH = 72
HASH_CHUNK = 1 << 20
# What PIL and pdfium raise on corrupt input (PIL's TIFF plugin leaks KeyError/TypeError/
# SyntaxError on some damaged files; pdfium raises PdfiumError, a RuntimeError).
DECODE_ERRORS = (OSError, ValueError, SyntaxError, EOFError, KeyError, TypeError, IndexError,
                 RuntimeError, UnidentifiedImageError, Image.DecompressionBombError)


@dataclass(frozen=True)
class Found:
    """Discovery's answer: documents to index, and files/paths left out with a reason."""

    documents: list[Path]
    ignored: list[tuple[Path, str]]
    missing: list[tuple[Path, str]]


def kind_of(path: Path) -> str | None:
    suffix = path.suffix.lower()
    return "pdf" if suffix in PDF_SUFFIXES else "image" if suffix in IMAGE_SUFFIXES else None


def discover(paths: Iterable[str | os.PathLike], exclude: Iterable[Path] = ()) -> Found:
    """Documents under `paths` (files as given, folders walked in sorted order, symlinked folders
    followed once; hidden entries and `exclude`d folders, such as the index itself, are skipped). A named file that is not a
    document, or a path that does not exist, is `missing`; other non-documents are `ignored`."""
    excluded = {Path(p).resolve() for p in exclude}
    documents: list[Path] = []
    ignored: list[tuple[Path, str]] = []
    missing: list[tuple[Path, str]] = []
    for raw in paths:
        path = Path(raw).expanduser().resolve()
        if path.is_dir():
            found = _walk(path, excluded, ignored)
            if not found:
                ignored.append((path, "folder holds no PDFs or images"))
            documents.extend(found)
        elif path.is_file():
            if kind_of(path) is None:
                missing.append((path, f"not a PDF or image (suffix {path.suffix or 'none'!r})"))
            else:
                documents.append(path)
        else:
            missing.append((path, "no such file or folder"))
    unique = list(dict.fromkeys(documents))
    return Found(unique, ignored, missing)


def _walk(root: Path, excluded: set[Path], ignored: list[tuple[Path, str]]) -> list[Path]:
    """Files under `root` in sorted order. Symlinked folders are followed (an archive of links is
    still an archive), each real folder once: a link back into a folder already walked (a cycle,
    or two links to one place) is noted in `ignored` instead of walked again."""
    found: list[Path] = []
    seen = {os.path.realpath(root)}
    for folder, dirs, files in os.walk(root, followlinks=True):
        here = Path(folder)
        keep = []
        for d in sorted(dirs):
            if d.startswith(".") or here / d in excluded:
                continue
            real = os.path.realpath(here / d)
            if real in seen or Path(real) in excluded:
                if (here / d).is_symlink():
                    ignored.append((here / d, "symlink to a folder already walked: not walked "
                                              "again"))
                continue
            seen.add(real)
            keep.append(d)
        dirs[:] = keep
        for name in sorted(files):
            if name.startswith("."):
                continue
            path = here / name
            (found.append(path) if kind_of(path) else
             ignored.append((path, "not a PDF or image")))
    return found


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(HASH_CHUNK):
                digest.update(chunk)
    except OSError as e:
        raise SourceError(path, f"cannot read: {e.strerror or e}") from e
    return digest.hexdigest()


def render_scale(width_pt: float, height_pt: float, *, max_pixels: int, dpi: float | None) -> float:
    """pdfium scale (pixels per point) for a page: `dpi / 72`, or the scale whose render holds
    about `max_pixels` pixels (what the model would shrink a larger render to anyway)."""
    if dpi is not None:
        return dpi / POINTS_PER_INCH
    return math.sqrt(max_pixels / max(width_pt * height_pt, 1.0))


class Document:
    """An open PDF or image file; `pages` page images, 1-based. Use as a context manager."""

    def __init__(self, path: Path, *, max_pixels: int, dpi: float | None = None) -> None:
        self.path, self.max_pixels, self.dpi = Path(path), max_pixels, dpi
        self.kind = kind_of(self.path)
        self._pdf = self._image = None
        try:
            if self.path.stat().st_size == 0:
                raise SourceError(self.path, "empty file (0 bytes)")
            if self.kind == "pdf":
                self._pdf = pdfium.PdfDocument(str(self.path))
                self.pages = len(self._pdf)
            else:
                self._image = Image.open(self.path)
                frames = getattr(self._image, "n_frames", 1)
                self.pages = frames if self.path.suffix.lower() in FRAME_SUFFIXES else 1
        except SourceError:
            self.close()
            raise
        except DECODE_ERRORS as e:
            self.close()
            raise SourceError(self.path, _reason(self.kind, e)) from e
        if self.pages < 1:
            self.close()
            raise SourceError(self.path, "document has no pages")

    def render(self, page: int, size: tuple[int, int] | None = None) -> Image.Image:
        """Page `page` (1-based) as an RGB image; `size` (width, height) renders to that size."""
        try:
            if self._pdf is not None:
                pdf_page = self._pdf[page - 1]
                width, height = pdf_page.get_size()
                scale = (size[0] / width if size else
                         render_scale(width, height, max_pixels=self.max_pixels, dpi=self.dpi))
                # RGB byte order straight from pdfium: no BGR swap, no second copy (same pixels)
                image = pdf_page.render(scale=scale, rev_byteorder=True).to_pil()
                pdf_page.close()
                if image.mode != "RGB":
                    image = image.convert("RGB")
            else:
                self._image.seek(page - 1)
                image = self._image.convert("RGB")  # a copy: the next seek moves the file's frame
            if size and image.size != tuple(size):
                image = image.resize(tuple(size), Image.Resampling.BICUBIC)
            return image
        except DECODE_ERRORS as e:
            raise SourceError(self.path, f"page {page}: {_reason(self.kind, e)}") from e

    def text(self, page: int) -> str | None:
        """Page `page`'s text layer as pdfium reads it (a PDF; "" when the page has none, as a
        scanned page), None for an image file (no text layer: OCR is not done). Lines end in
        newlines; the caller bounds the size it stores (schema.encode_text)."""
        if self._pdf is None:
            return None
        try:
            pdf_page = self._pdf[page - 1]
            try:
                textpage = pdf_page.get_textpage()
                try:
                    text = textpage.get_text_bounded()
                finally:
                    textpage.close()
            finally:
                pdf_page.close()
        except DECODE_ERRORS as e:
            raise SourceError(self.path, f"page {page}: text layer: {_reason(self.kind, e)}") from e
        return text.replace("\r\n", "\n").replace("\r", "\n").replace("\x00", "").strip()

    def iter_pages(self, pages: Iterable[int]) -> Iterator[tuple[int, Image.Image]]:
        for page in pages:
            yield page, self.render(page)

    def close(self) -> None:
        for handle in (self._pdf, self._image):
            if handle is not None:
                handle.close()
        self._pdf = self._image = None

    def __enter__(self) -> Document:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _reason(kind: str | None, error: BaseException) -> str:
    text = str(error) or type(error).__name__
    if kind == "pdf":
        if "password" in text.lower():
            return "encrypted PDF (a password is needed)"
        return f"cannot open as PDF ({text})"
    return f"cannot decode image ({text})"
