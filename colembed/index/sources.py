"""Files in, page images out: discovery, content hashes, PDF rendering and image frames.

- PDFs are rendered with pypdfium2 straight at the model's pixel budget (`render_scale`): a page
  is drawn at about `max_pixels` pixels, never at a multi-megapixel size that the preprocessing
  would then shrink; `dpi` overrides. pdfium is not thread-safe: only one thread may call into this
  module's PDF functions at a time (the indexer's single render thread, or the caller).
- Images are read directly, as the formats `preprocess.images.IMAGE_FORMATS` lists only (by
  content: a PostScript file named `scan.png` is refused, never handed to Ghostscript); a
  multi-page TIFF is one page per frame; other formats are one page. Every page, image or PDF, is
  checked against `preprocess.images.pixel_limit()` from its declared size before it is decoded
  or drawn.
- A file is opened once (`open_source`: `safe_fs.open_file`, confined to `within` folders when
  given, at open time, on the descriptor that is read) and that descriptor is hashed and decoded:
  the content hashed is the content rendered, and a file swapped for a link after a check is
  never read.
- Every way a file can be unreadable is turned into `SourceError(path, reason)`, so one bad file
  never stops a run (`DECODE_ERRORS` lists what the decoders are known to raise on bad data).
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterable, Iterator, Sequence

import pypdfium2 as pdfium
from PIL import Image, UnidentifiedImageError

from ..errors import ImageError
from ..preprocess.images import IMAGE_FORMATS, check_pixels, open_image
from ..safe_fs import UnsafePathError, open_file
from .errors import SourceError

PDF_SUFFIXES = frozenset({".pdf"})
IMAGE_SUFFIXES = frozenset(s for suffixes in IMAGE_FORMATS.values() for s in suffixes)
FRAME_SUFFIXES = frozenset(IMAGE_FORMATS["TIFF"])  # formats whose frames are pages
POINTS_PER_INCH = 72
HASH_CHUNK = 1 << 20
# What PIL and pdfium raise on corrupt input (PIL's TIFF plugin leaks KeyError/TypeError/
# SyntaxError on some damaged files; pdfium raises PdfiumError, a RuntimeError).
DECODE_ERRORS = (
    OSError,
    ValueError,
    SyntaxError,
    EOFError,
    KeyError,
    TypeError,
    IndexError,
    RuntimeError,
    UnidentifiedImageError,
    Image.DecompressionBombError,
)


@dataclass(frozen=True)
class Found:
    """Discovery's answer: documents to index, and files/paths left out with a reason."""

    documents: list[Path]
    ignored: list[tuple[Path, str]]
    missing: list[tuple[Path, str]]


def kind_of(path: Path) -> str | None:
    suffix = path.suffix.lower()
    return "pdf" if suffix in PDF_SUFFIXES else "image" if suffix in IMAGE_SUFFIXES else None


def discover(
    paths: Iterable[str | os.PathLike],
    exclude: Iterable[Path] = (),
    within: Sequence[str | os.PathLike] | None = None,
) -> Found:
    """Documents under `paths` (files as given, folders walked in sorted order, symlinked folders
    followed once; hidden entries and `exclude`d folders, such as the index itself, are skipped). A named file that is not a
    document, or a path that does not exist, is `missing`; other non-documents are `ignored`.
    With `within` (folders), every document is taken by its resolved path and one that lies
    outside them is `missing` (`open_source` checks again when the file is opened)."""
    excluded = {Path(p).resolve() for p in exclude}
    roots = None if within is None else [Path(r).resolve() for r in within]
    documents: list[Path] = []
    ignored: list[tuple[Path, str]] = []
    missing: list[tuple[Path, str]] = []
    for raw in paths:
        path = Path(raw).expanduser().resolve()
        if roots is not None and not _inside_any(path, roots):
            missing.append((path, "outside the folders this run may read"))
        elif path.is_dir():
            found = _walk(path, excluded, ignored)
            if roots is not None:
                found = _confined(found, roots, ignored)
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


def _inside_any(path: Path, roots: Sequence[Path]) -> bool:
    return any(path == r or r in path.parents for r in roots)


def _confined(
    found: list[Path], roots: Sequence[Path], ignored: list[tuple[Path, str]]
) -> list[Path]:
    """The walked files by their resolved paths, those outside `roots` left out with a reason."""
    kept = []
    for path in found:
        real = path.resolve()
        if _inside_any(real, roots):
            kept.append(real)
        else:
            ignored.append((path, "a link leading outside the folders this run may read"))
    return kept


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
                    ignored.append(
                        (here / d, "symlink to a folder already walked: not walked again")
                    )
                continue
            seen.add(real)
            keep.append(d)
        dirs[:] = keep
        for name in sorted(files):
            if name.startswith("."):
                continue
            path = here / name
            (found.append(path) if kind_of(path) else ignored.append((path, "not a PDF or image")))
    return found


def open_source(path: Path, within: Sequence[str | os.PathLike] | None = None) -> BinaryIO:
    """The file at `path` opened once for hashing and decoding (`safe_fs.open_file`: a regular
    file; with `within`, inside those folders with no link followed), or SourceError."""
    try:
        return open_file(path, within=within)
    except UnsafePathError as e:
        raise SourceError(path, str(e).removeprefix(f"{path}: ")) from None
    except OSError as e:
        raise SourceError(path, f"cannot read: {e.strerror or e}") from e


def sha256_of(handle: BinaryIO, path: Path) -> str:
    """The sha256 of an open file's whole content (read from its start; left at its start)."""
    digest = hashlib.sha256()
    try:
        handle.seek(0)
        while chunk := handle.read(HASH_CHUNK):
            digest.update(chunk)
        handle.seek(0)
    except OSError as e:
        raise SourceError(path, f"cannot read: {e.strerror or e}") from e
    return digest.hexdigest()


def file_sha256(path: Path, within: Sequence[str | os.PathLike] | None = None) -> str:
    with open_source(path, within) as handle:
        return sha256_of(handle, path)


def render_scale(width_pt: float, height_pt: float, *, max_pixels: int, dpi: float | None) -> float:
    """pdfium scale (pixels per point) for a page: `dpi / 72`, or the scale whose render holds
    about `max_pixels` pixels (what the model would shrink a larger render to anyway)."""
    if dpi is not None:
        return dpi / POINTS_PER_INCH
    return math.sqrt(max_pixels / max(width_pt * height_pt, 1.0))


class Document:
    """An open PDF or image file; `pages` page images, 1-based; `sha256` of the bytes it reads.
    Use as a context manager.

    The file is opened once (`open_source`, confined to `within` when given) unless `handle`, an
    open file the caller hashed already (`sha256`), is passed; pdfium and PIL read that
    descriptor, never the path again."""

    def __init__(
        self,
        path: Path,
        *,
        max_pixels: int,
        dpi: float | None = None,
        within: Sequence[str | os.PathLike] | None = None,
        handle: BinaryIO | None = None,
        sha256: str | None = None,
    ) -> None:
        self.path, self.max_pixels, self.dpi = Path(path), max_pixels, dpi
        self.kind = kind_of(self.path)
        self._pdf = self._image = None
        self._owns_handle = handle is None
        self._file = open_source(self.path, within) if handle is None else handle
        try:
            self.sha256 = sha256 or sha256_of(self._file, self.path)
            if os.fstat(self._file.fileno()).st_size == 0:
                raise SourceError(self.path, "empty file (0 bytes)")
            self._file.seek(0)
            if self.kind == "pdf":
                self._pdf = pdfium.PdfDocument(self._file)
                self.pages = len(self._pdf)
            else:
                self._image = open_image(self._file, item=str(self.path))
                frames = getattr(self._image, "n_frames", 1)
                self.pages = frames if self.path.suffix.lower() in FRAME_SUFFIXES else 1
        except SourceError:
            self.close()
            raise
        except ImageError as e:
            self.close()
            raise SourceError(self.path, _reason(self.kind, e.reason)) from e
        except DECODE_ERRORS as e:
            self.close()
            raise SourceError(self.path, _reason(self.kind, e)) from e
        if self.pages < 1:
            self.close()
            raise SourceError(self.path, "document has no pages")

    def render(self, page: int, size: tuple[int, int] | None = None) -> Image.Image:
        """Page `page` (1-based) as an RGB image (transparency dropped), for display; `size`
        (width, height) renders to that size."""
        image = self._page(page, size)
        if image.mode != "RGB":
            image = image.convert("RGB")
        if size and image.size != tuple(size):
            image = image.resize(tuple(size), Image.Resampling.BICUBIC)
        return image

    def page_image(self, page: int) -> Image.Image:
        """Page `page` (1-based) as the model receives it: a PDF page drawn as RGB at the pixel
        budget (or dpi), an image frame as decoded (its mode and transparency kept: the model's
        family decides how it becomes RGB, preprocess/images.py)."""
        return self._page(page, None)

    def _page(self, page: int, size: tuple[int, int] | None) -> Image.Image:
        """The page decoded (PDFs drawn at `size`'s width if given); every page's size is checked
        against the pixel limit before it is decoded or drawn."""
        try:
            if size is not None:
                check_pixels(tuple(size))
            if self._pdf is not None:
                pdf_page = self._pdf[page - 1]
                width, height = pdf_page.get_size()
                scale = (
                    size[0] / width
                    if size
                    else render_scale(width, height, max_pixels=self.max_pixels, dpi=self.dpi)
                )
                check_pixels((math.ceil(width * scale), math.ceil(height * scale)))
                # RGB byte order straight from pdfium: no BGR swap, no second copy (same pixels)
                image = pdf_page.render(scale=scale, rev_byteorder=True).to_pil()
                pdf_page.close()
                return image if image.mode == "RGB" else image.convert("RGB")
            self._image.seek(page - 1)
            check_pixels(self._image.size)  # a TIFF's frames each have their own size
            return self._image.copy()  # decoded now: the next seek moves the file's frame
        except ImageError as e:
            raise SourceError(self.path, f"page {page}: {_reason(self.kind, e.reason)}") from e
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
            yield page, self.page_image(page)

    def close(self) -> None:
        for handle in (self._pdf, self._image):
            if handle is not None:
                handle.close()
        self._pdf = self._image = None
        if self._owns_handle and self._file is not None:
            self._file.close()
        self._file = None

    def __enter__(self) -> Document:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _reason(kind: str | None, error: BaseException | str) -> str:
    text = error if isinstance(error, str) else (str(error) or type(error).__name__)
    if kind == "pdf":
        if "password" in text.lower():
            return "encrypted PDF (a password is needed)"
        return f"cannot open as PDF ({text})"
    return f"cannot decode image ({text})"
