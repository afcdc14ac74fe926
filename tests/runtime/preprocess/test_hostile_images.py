"""Hostile image files: only the formats colembed documents are decoded, by content, on every
path (embed, the index's reader, serve uploads, Ray's reader, which is the index's), and every
page's size is checked against one pixel limit from its header before a pixel is decoded.

Ghostscript is real here in the way that matters: Pillow's EPS plugin really runs whatever `gs`
is first on PATH, so a logging `gs` proves it is never started.
"""

from __future__ import annotations

import io
import os
import stat
import warnings

import numpy as np
import pytest
from PIL import EpsImagePlugin, Image, ImageFile

import colembed
from colembed.errors import ImageError, InputError
from colembed.index import Index
from colembed.index.errors import SourceError
from colembed.index.index import render_stored_page
from colembed.index import sources
from colembed.index.sources import Document
from colembed.preprocess import images
from colembed.preprocess.images import load_image, prepare_image
from tests.fixtures.images import encode, rgb
from tests.fixtures.documents import write_pdf, write_tiff

# What `printf '%%!PS-Adobe-3.0 EPSF-3.0\n%%%%BoundingBox: 0 0 100 100\n'` writes
EPS = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 100 100\n"
TOKENS = 64


@pytest.fixture
def logging_gs(tmp_path, monkeypatch):
    """A `gs` first on PATH that logs every call and fails (as a broken Ghostscript would:
    Pillow's `gs --version` probe then raises CalledProcessError). Returns the log's path."""
    folder = tmp_path / "fake-bin"
    folder.mkdir()
    log = tmp_path / "gs-calls.log"
    script = folder / "gs"
    script.write_text(f'#!/bin/sh\necho "gs $*" >> "{log}"\nexit 1\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setattr(EpsImagePlugin, "gs_binary", None)  # Pillow caches where gs is
    return log


def _never_ran(log) -> bool:
    return not log.exists()


@pytest.fixture(scope="module")
def small_model(exported_tiny):
    return colembed.load(exported_tiny.folder, max_image_tokens=TOKENS)


# ------------------------------------------------------------------------ the format allowlist
def test_the_documented_formats_are_the_ones_the_index_takes():
    assert set(images.IMAGE_FORMATS) == {"PNG", "JPEG", "TIFF", "WEBP", "BMP", "GIF"}
    assert sources.IMAGE_SUFFIXES == {
        ".png",
        ".jpg",
        ".jpeg",
        ".tif",
        ".tiff",
        ".webp",
        ".bmp",
        ".gif",
    }


@pytest.mark.parametrize("as_input", ["bytes", "path", "file"])
def test_postscript_never_reaches_ghostscript_when_embedding(tmp_path, logging_gs, as_input):
    path = tmp_path / "scan.png"
    path.write_bytes(EPS)
    obj = {"bytes": EPS, "path": str(path), "file": io.BytesIO(EPS)}[as_input]
    with pytest.raises(ImageError, match="item 4: not an image of a format colembed reads"):
        load_image(obj, index=4)
    assert _never_ran(logging_gs)


def test_postscript_never_reaches_ghostscript_in_the_index_reader(tmp_path, logging_gs):
    path = tmp_path / "scan.png"
    path.write_bytes(EPS)
    with pytest.raises(SourceError) as info:
        Document(path, max_pixels=10**6)
    assert info.value.path == path and "not an image of a format colembed reads" in str(info.value)
    assert _never_ran(logging_gs)


def test_colembed_index_fails_a_postscript_file_by_name_and_runs_no_ghostscript(
    tmp_path, logging_gs, small_model
):
    docs = tmp_path / "d"
    docs.mkdir()
    (docs / "scan.png").write_bytes(EPS)
    _assert_index_fails_only(
        tmp_path, small_model, docs / "scan.png", "not an image of a format colembed reads"
    )
    assert _never_ran(logging_gs)


def _assert_index_fails_only(tmp_path, model, bad, reason: str) -> None:
    """Indexing `bad`'s folder with a good PNG beside it fails `bad` alone, for `reason`, and adds
    the good page."""
    docs = bad.parent
    (docs / "good.png").write_bytes(encode(rgb(64, 48), "PNG"))
    with Index(tmp_path / "db", model=model) as index:
        result = index.add([docs], progress=False)
    assert [r.path for r in result.failed] == [str(bad)]
    assert reason in result.failed[0].reason
    assert [r.path for r in result.added] == [str(docs / "good.png")]


def test_embed_images_refuses_postscript_with_its_image_error(logging_gs, small_model):
    good = encode(rgb(64, 48), "PNG")
    with pytest.raises(ImageError, match="item 1") as info:
        small_model.embed_images([good, EPS])
    assert len(info.value.completed) == 1
    assert _never_ran(logging_gs)


def test_serve_refuses_a_postscript_upload_from_its_header(logging_gs):
    pytest.importorskip("fastapi")
    from colembed.serve.app import check_images
    from colembed.serve.limits import Limits

    with pytest.raises(InputError, match="item 0"):
        check_images([EPS], Limits())
    assert _never_ran(logging_gs)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "TIFF", "WEBP", "BMP", "GIF"])
def test_every_documented_format_still_decodes_by_content_whatever_its_name(tmp_path, fmt):
    path = tmp_path / "misnamed.png"  # a name says nothing: the content decides
    path.write_bytes(encode(rgb(40, 30), fmt))
    assert load_image(str(path)).size == (40, 30)
    with Document(path, max_pixels=10**6) as doc:
        assert doc.render(1).size == (40, 30)


# ------------------------------------------------------------------------ one pixel limit
@pytest.fixture
def small_limit(monkeypatch):
    """The limit at 1 Mpx; PIL's own check raises only above twice it, so a 1.2 Mpx page is the
    case only colembed's header check refuses."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1_000_000)
    warnings.simplefilter("ignore", Image.DecompressionBombWarning)
    return 1_000_000


@pytest.fixture
def decodes(monkeypatch):
    """Every pixel decode PIL starts (ImageFile.load), recorded by image size."""
    seen = []
    real = ImageFile.ImageFile.load

    def load(self):
        seen.append(self.size)
        return real(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", load)
    return seen


def test_the_limit_is_pils_and_moves_with_it(small_limit):
    assert images.pixel_limit() == small_limit


def test_the_index_reader_refuses_a_bomb_from_its_header_before_decoding(
    tmp_path, small_limit, decodes
):
    path = tmp_path / "bomb.png"
    Image.new("L", (1200, 1000), 255).save(path)  # 1.2 Mpx; a few KB on disk
    with pytest.raises(SourceError, match="decompression bomb refused: 1200x1000"):
        with Document(path, max_pixels=10**6) as doc:
            doc.page_image(1)
    assert (1200, 1000) not in decodes


def test_a_tiff_frame_over_the_limit_is_refused_alone(tmp_path, small_limit, decodes):
    path = tmp_path / "frames.tiff"
    small, big = Image.new("RGB", (40, 30), "white"), Image.new("RGB", (1200, 1000), "white")
    small.save(path, save_all=True, append_images=[big])
    with Document(path, max_pixels=10**6) as doc:
        assert doc.pages == 2
        assert doc.page_image(1).size == (40, 30)
        with pytest.raises(SourceError, match="page 2: .*decompression bomb refused"):
            doc.page_image(2)
    assert (1200, 1000) not in decodes


def test_a_pdf_drawn_at_a_dpi_over_the_limit_is_refused_before_drawing(tmp_path, small_limit):
    path = write_pdf(tmp_path / "a.pdf", ["one"])  # 420 x 560 pt: at 300 dpi 1750 x 2334 px
    with Document(path, max_pixels=10**6, dpi=300) as doc:
        with pytest.raises(SourceError, match="page 1: .*decompression bomb refused"):
            doc.page_image(1)
    with Document(path, max_pixels=500_000) as doc:  # at the model's budget: drawn
        image = doc.page_image(1)
        assert image.width * image.height <= 510_000


def test_a_stored_size_over_the_limit_is_not_drawn_again(tmp_path, small_limit):
    path = write_tiff(tmp_path / "a.tiff", ["one"])
    with Document(path, max_pixels=10**6) as doc:
        sha = doc.sha256
    payload = {"sha256": sha, "width": 100_000, "height": 100_000}  # a hostile stored point
    with pytest.raises(SourceError, match="decompression bomb refused"):
        render_stored_page(str(path), 1, payload, max_pixels=10**6, dpi=None)


def test_colembed_index_fails_a_bomb_file_and_indexes_the_rest(
    tmp_path, small_limit, decodes, small_model
):
    docs = tmp_path / "d"
    docs.mkdir()
    Image.new("L", (1200, 1000), 255).save(docs / "bomb.png")
    _assert_index_fails_only(tmp_path, small_model, docs / "bomb.png", "decompression bomb refused")
    assert (1200, 1000) not in decodes


def test_embedding_refuses_the_same_bomb_by_the_same_limit(small_limit, decodes, config):
    bomb = encode(Image.new("L", (1200, 1000), 255), "PNG")
    with pytest.raises(ImageError, match="item 2: decompression bomb refused: 1200x1000"):
        prepare_image(bomb, config, index=2)
    assert (1200, 1000) not in decodes


# ------------------------------------------------------------ a family's transparency rule
@pytest.mark.parametrize("fmt,mode", [("PNG", "P"), ("GIF", "P"), ("PNG", "L"), ("PNG", "RGB")])
def test_the_index_hands_the_model_the_page_as_decoded_so_each_family_keeps_its_rule(
    tmp_path, fmt, mode
):
    from tests.fixtures.images import keyed_transparency

    data = keyed_transparency(fmt, mode)
    path = tmp_path / f"keyed.{fmt.lower()}"
    path.write_bytes(data)
    with Document(path, max_pixels=10**6) as doc:
        page = doc.page_image(1)
    assert page.info.get("transparency") is not None
    for rule in images.TRANSPARENCY_RULES:  # the index's page and embed's bytes: the same RGB
        assert np.array_equal(
            np.asarray(images.to_rgb(page, rule)), np.asarray(load_image(data, transparency=rule))
        )
    white = np.asarray(load_image(data, transparency="on white"))
    dropped = np.asarray(load_image(data, transparency="dropped"))
    keyed = np.any(white != dropped, axis=-1)
    assert keyed.any() and (white[keyed] == 255).all()  # only keyed pixels differ: now white
