"""The README's first command: the main job, offline, on a tiny RANDOM-WEIGHT ColQwen2.

Builds a tiny checkpoint of the real architecture with the real Qwen tokenizer, exports it with
the check on, writes a few multi-page PDFs (Pillow's PDF writer), a PNG and a two-page TIFF,
indexes them into an embedded Qdrant Edge store, searches, and writes a similarity-map overlay
per hit. The rankings mean nothing (random weights); the pipeline is the one users run.

The working folder is colembed's own: created with a marker (`safe_fs.make_work_folder`), and
replaced on the next run only if it carries that marker. A folder with anything else in it is
refused, never emptied.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from PIL import Image, ImageDraw

from colembed.layout import BASE_VARIANT
from colembed.safe_fs import is_work_folder, make_work_folder, remove_tree

DOCUMENTS = {
    "annual-report.pdf": [
        "Annual report 2023",
        "Revenue grew 12% to 4.2 billion in 2023",
        "Outlook for 2024",
    ],
    "contract.pdf": ["Service contract", "Signed by Jane Doe, CEO, on 3 March 2024"],
    "invoice.pdf": ["Invoice 1042", "Total due: 1,250.00 EUR", "Payment terms: 30 days"],
    "whiteboard.png": ["Team meeting notes: ship the index in Q1"],
    "scan.tiff": ["Scanned letter, page 1", "Scanned letter, page 2: best regards"],
}
QUERIES = ["What was the revenue in 2023?", "Who signed the contract?"]
PAGE_SIZE = (850, 1100)  # letter at 100 dpi


def _page(title: str, number: int) -> Image.Image:
    image = Image.new("RGB", PAGE_SIZE, "white")
    draw = ImageDraw.Draw(image)
    draw.rectangle((60, 60, 790, 140), outline="black", width=3)
    draw.text((80, 90), title, fill="black")
    for line in range(24):
        draw.text((80, 200 + 34 * line), f"{title} -- line {line + 1}", fill=(60, 60, 60))
    draw.text((400, 1050), str(number), fill="black")
    return image


def write_documents(folder: Path) -> list[Path]:
    """The demo's documents, written by real writers (Pillow's PDF, PNG and TIFF encoders)."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, titles in DOCUMENTS.items():
        pages = [_page(t, i + 1) for i, t in enumerate(titles)]
        path = folder / name
        pages[0].save(
            path,
            save_all=len(pages) > 1,
            append_images=pages[1:],
            **({"resolution": 100} if name.endswith(".pdf") else {}),
        )
        paths.append(path)
    return paths


def run_demo(workdir: Path, *, progress: Callable[[str], None] = print, k: int = 3) -> dict:
    import colembed

    from .exporter import export_model
    from ..testing.tiny_qwen2 import build_checkpoint

    workdir = Path(workdir)
    if is_work_folder(workdir):
        remove_tree(workdir, owner=is_work_folder)  # our previous run, and nothing else
    workdir = make_work_folder(workdir, "colembed demo")
    progress("building a tiny RANDOM-WEIGHT ColQwen2 checkpoint (real architecture and tokenizer)")
    checkpoint = build_checkpoint(workdir / "checkpoint", "tiny", seed=0)
    report = export_model(
        checkpoint,
        workdir / "model",
        name="colqwen2-tiny-random",
        random_weights=True,
        progress=progress,
    )
    model = colembed.load(report.folder)
    documents = write_documents(workdir / "documents")
    progress(
        f"indexing {len(documents)} documents into {workdir / 'index'} (Qdrant Edge, embedded)"
    )
    with colembed.Index(workdir / "index", model=model) as index:
        added = index.add([workdir / "documents"])
        results = index.search(QUERIES, k=k, explain=True)
        maps = [
            [
                str(
                    index.save_map(
                        hit,
                        workdir / "maps" / f"q{qi}-rank{rank}-"
                        f"{Path(hit.file).stem}-p{hit.page}.png",
                    )
                )
                for rank, hit in enumerate(hits, 1)
            ]
            for qi, hits in enumerate(results, 1)
        ]
        pages = len(index)
    _print_results(model, report, added, pages, results, maps)
    return {
        "folder": str(report.folder),
        "index": str(workdir / "index"),
        "pages": pages,
        "hits": [[(h.file, h.page, h.score) for h in hits] for hits in results],
        "maps": maps,
    }


def _print_results(model, report, added, pages, results, maps) -> None:
    print("=" * 72)
    print(
        "colembed demo -- RANDOM WEIGHTS: the rankings below are meaningless, the pipeline is real"
    )
    print(model)
    print(f"export check: max abs diff vs torch = {report.check[BASE_VARIANT]['max_abs_diff']:.2e}")
    print(
        f"indexed {added.pages_added} pages from {len(added.added)} files "
        f"({len(added.failed)} failed); the index holds {pages} pages"
    )
    for query, hits, paths in zip(QUERIES, results, maps):
        print(f"\nquery: {query}")
        print(f"{'rank':>4}  {'score':>8}  {'page':>4}  file")
        for rank, hit in enumerate(hits, 1):
            print(f"{rank:>4}  {hit.score:>8.3f}  {hit.page:>4}  {Path(hit.file).name}")
        print(f"similarity maps: {', '.join(paths)}")
    print("=" * 72)
