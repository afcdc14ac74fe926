"""The Python examples of the README and of docs/fastembed-qdrant.md, run as written (as
safetensors tests its README).

Every ```python block of each page runs, in order, in one namespace per page (each page's examples
stand alone), in a folder laid out as the pages assume: the model exported with default options as
`colqwen2-onnx` and in FastEmbed's cache, and two pages `page1.png` / `page2.jpg`. Then the claims
the pages make about the results are checked: the scorer's top pages, the Index example's counts
and maps, Qdrant's MAX_SIM ranking equal to colembed's exact `top_k`, and the MUVERA sizes.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from tests.fixtures.images import rgb as noise_page

import colembed
from colembed.registry import get_model

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
FASTEMBED_PAGE = ROOT / "docs" / "fastembed-qdrant.md"


def python_blocks(page: Path = README) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(encoding="utf-8"), flags=re.S)


def run_blocks(page: Path) -> dict:
    namespace: dict = {}
    for block in python_blocks(page):
        exec(compile(block, str(page), "exec"), namespace)
    return namespace


@pytest.fixture
def readme_folder(exported_tiny_default, tmp_path, monkeypatch):
    (tmp_path / "colqwen2-onnx").symlink_to(exported_tiny_default.folder)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / get_model("colqwen2").cache_folder_name).symlink_to(exported_tiny_default.folder)
    noise_page(150, 210, seed=1).save(tmp_path / "page1.png")
    noise_page(210, 150, seed=2).save(tmp_path / "page2.jpg", quality=95)
    (tmp_path / "reports").mkdir()  # the Index example's folder of PDFs and its multi-page scan
    noise_page(170, 220, seed=3).save(
        tmp_path / "reports" / "old.pdf",
        save_all=True,
        append_images=[noise_page(220, 170, seed=4)],
    )
    noise_page(160, 200, seed=5).save(
        tmp_path / "scan.tiff", save_all=True, append_images=[noise_page(200, 160, seed=6)]
    )
    (tmp_path / "maps").mkdir()
    monkeypatch.setenv("FASTEMBED_CACHE_PATH", str(cache))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_pages_have_the_examples_this_test_checks():
    blocks = python_blocks(README)
    assert len(blocks) == 2
    assert "colembed.load" in blocks[0] and "colembed.Index" in blocks[1]
    blocks = python_blocks(FASTEMBED_PAGE)
    assert len(blocks) == 3
    assert "LateInteractionMultimodalEmbedding" in blocks[0]
    assert "QdrantClient" in blocks[1] and "Muvera" in blocks[2]


def test_readme_links_point_at_files_that_exist():
    """The front page sends readers to docs/ and benchmarks/: every relative link must resolve."""
    for page in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            assert (page.parent / target).exists(), f"{page.name} links to missing {target}"


def test_readme_python_examples_run_as_written(readme_folder):
    namespace = run_blocks(README)

    # the runtime example: exact scores and the scorer's top pages agree
    scores, best = namespace["scores"], namespace["best"]
    assert scores.shape == (1, 2) and best.shape == (1, 2)
    assert best[0].tolist() == np.argsort(-scores[0], kind="stable").tolist()
    # the Index example: 2 PDF pages + 2 TIFF pages added, the PDF removed again, maps written
    result, index = namespace["result"], namespace["index"]
    assert len(result.added) == 2 and not result.failed and len(index) == 2
    assert len(list((readme_folder / "maps").glob("*.png"))) >= 1


def test_fastembed_page_examples_run_as_written(readme_folder):
    namespace = run_blocks(FASTEMBED_PAGE)

    # the Qdrant example ranks as colembed's exact MaxSim does
    query, page_vectors = namespace["query"], namespace["page_vectors"]
    indices, exact = colembed.top_k([query], page_vectors, 2)
    hits = namespace["hits"]
    assert [hit.id for hit in hits] == indices[0].tolist()
    assert np.allclose([hit.score for hit in hits], exact[0], atol=1e-4, rtol=0)
    assert [hit.payload["file"] for hit in hits] == [namespace["page_files"][i] for i in indices[0]]
    # MUVERA: the sizes the comment states
    assert namespace["page_fde"].shape == (20 * 2**5 * 16,) == (10240,)
    assert namespace["query_fde"].shape == (10240,)
