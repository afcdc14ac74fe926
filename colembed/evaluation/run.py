"""One evaluation run: index a labelled set's corpus with each (variant, image-token budget),
search its queries in each mode, and score the rankings against the labels.

The run indexes the corpus itself, into index folders under a work folder it owns (a marker file
says so; a folder it did not create is refused, never emptied): `index-<variant>-<budget>`, one
per setting, reused and resumed by a later run on the same set. Corpus pages given as image bytes
(ViDoRe / MTEB Parquet) are written there as files first. The reference every row is compared
with is fp32 (the base variant) exact search at the first budget given: it is always run.
"""

from __future__ import annotations

import json
import re
import tempfile
from dataclasses import asdict, dataclass, field
from io import BytesIO
from pathlib import Path
from typing import Any, Callable, Sequence

from ..layout import BASE_VARIANT
from .labelled import LabelledSet, LabelledSetError, read_labelled_set
from .metrics import mrr_at_k, ndcg_at_k, overlap_at_k, recall_at_k

MARKER = "colembed-eval.json"
DEFAULT_MODES = ("exact", "two-stage", "hybrid")


@dataclass(frozen=True)
class Setting:
    variant: str
    max_image_tokens: int | None  # None: the model's own budget
    mode: str

    @property
    def label(self) -> str:
        tokens = "model's" if self.max_image_tokens is None else str(self.max_image_tokens)
        return f"{self.variant} / {tokens} tokens / {self.mode}"


@dataclass
class Row:
    variant: str
    max_image_tokens: int | None
    mode: str
    ndcg: float
    recall: float
    mrr: float
    top1_agreement: float  # share of queries whose first page is the reference's
    overlap: float  # mean share of the reference's top k in this top k
    reference: bool = False


@dataclass
class Report:
    dataset: str
    k: int
    queries: int  # queries scored (with at least one relevant page)
    skipped_queries: int  # queries without a relevant label
    corpus_pages: int
    unknown_labels: int  # relevant labels naming no page of the corpus
    rows: list[Row] = field(default_factory=list)
    rankings: dict[str, dict[str, list[str]]] = field(default_factory=dict)  # setting -> qid -> ids

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("rankings")
        return out

    def table(self) -> str:
        k = self.k
        head = (
            f"{'variant':<10} {'image tokens':>12} {'mode':<10} {f'nDCG@{k}':>8} "
            f"{f'recall@{k}':>9} {f'MRR@{k}':>7} {'top-1 = fp32 exact':>18} "
            f"{f'top-{k} overlap':>14}"
        )
        lines = [head]
        for r in self.rows:
            tokens = "model's" if r.max_image_tokens is None else str(r.max_image_tokens)
            lines.append(
                f"{r.variant:<10} {tokens:>12} {r.mode:<10} {r.ndcg:>8.4f} "
                f"{r.recall:>9.4f} {r.mrr:>7.4f} {r.top1_agreement:>18.3f} "
                f"{r.overlap:>14.3f}" + ("  (reference)" if r.reference else "")
            )
        return "\n".join(lines)


def evaluate(
    dataset: str | Path,
    model: Any,
    *,
    variants: Sequence[str] = (BASE_VARIANT,),
    budgets: Sequence[int | None] = (None,),
    modes: Sequence[str] = DEFAULT_MODES,
    k: int = 10,
    split: str = "test",
    work: str | Path | None = None,
    progress: bool | None = False,
    note: Callable[[str], None] | None = None,
    dim: int | None = None,
) -> Report:
    """Score colembed's search on a labelled set (labelled.py's layouts); `model`: a model folder,
    a registry name or a loaded model. One Row per (variant, budget, mode), the reference first.
    `dim`: every setting's vectors truncated to their first `dim` components (`colembed.load`'s;
    a loaded model carries its own)."""
    from ..index.store import check_mode

    if dim is not None and hasattr(model, "embed_pages"):
        raise ValueError("dim= applies to a model folder or name; load the model with dim= instead")

    if k < 1:
        raise ValueError(f"k must be >= 1, not {k}")
    for mode in modes:
        check_mode(mode)
    labelled = read_labelled_set(dataset, split)
    scored = _scored_queries(labelled, dataset)
    reference = Setting(BASE_VARIANT, budgets[0], "exact")
    settings = [reference] + [
        s
        for s in (Setting(v, b, m) for v in variants for b in budgets for m in modes)
        if s != reference
    ]
    if work is None:
        with tempfile.TemporaryDirectory(prefix="colembed-eval-") as tmp:
            return _run(labelled, scored, model, settings, k, Path(tmp), progress, note, dim)
    return _run(
        labelled,
        scored,
        model,
        settings,
        k,
        _owned_work_folder(Path(work), dataset),
        progress,
        note,
        dim,
    )


def _scored_queries(labelled: LabelledSet, dataset) -> dict[str, dict[str, float]]:
    for qid in labelled.qrels:
        if qid not in labelled.queries:
            raise LabelledSetError(
                f"{dataset}: the labels name query id {qid!r}, which the queries do not have"
            )
    scored = {
        qid: labels
        for qid, labels in labelled.qrels.items()
        if any(grade > 0 for grade in labels.values())
    }
    if not scored:
        raise LabelledSetError(f"{dataset}: no query has a relevant label (a score above 0)")
    return scored


def _owned_work_folder(work: Path, dataset) -> Path:
    work = work.expanduser().resolve()
    marker = work / MARKER
    stamp = {"dataset": str(Path(dataset).expanduser().resolve())}
    if work.exists() and any(work.iterdir()):
        if not marker.is_file():
            raise LabelledSetError(
                f"{work}: exists and was not made by colembed eval (no "
                f"{MARKER}); give a new or empty folder"
            )
        try:
            owner = json.loads(marker.read_text())
        except (OSError, ValueError):
            owner = None
        if owner != stamp:
            raise LabelledSetError(
                f"{work}: holds the evaluation of another dataset "
                f"({owner}); give a new or empty folder"
            )
        return work
    work.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps(stamp))
    return work


def _write_corpus_images(labelled: LabelledSet, folder: Path) -> dict[tuple[Path, int], str]:
    """The Parquet corpus's images as files named by row order; (file, 1) -> corpus id."""
    from PIL import Image, UnidentifiedImageError

    folder.mkdir(exist_ok=True)
    pages: dict[tuple[Path, int], str] = {}
    seen: set[str] = set()
    for n, item in enumerate(labelled.corpus_images or (), 1):
        if item.id in seen:
            raise LabelledSetError(f"{item.where}: corpus id {item.id!r} given twice")
        seen.add(item.id)
        try:
            with Image.open(BytesIO(item.data)) as image:
                kind = (image.format or "").lower()
        except (UnidentifiedImageError, OSError) as e:
            raise LabelledSetError(f"{item.where}: column 'image' is not an image ({e})") from None
        suffix = {"jpeg": ".jpg", "png": ".png", "tiff": ".tiff", "webp": ".webp"}.get(kind)
        if suffix is None:
            raise LabelledSetError(
                f"{item.where}: column 'image' is {kind or 'unknown'}, not PNG, JPEG, TIFF or WebP"
            )
        path = folder / f"page-{n:06d}{suffix}"
        if not path.is_file() or path.read_bytes() != item.data:
            path.write_bytes(item.data)
        pages[(path.resolve(), 1)] = item.id
    return pages


def _folder_page_ids(index, folder: Path) -> dict[tuple[Path, int], str]:
    """A corpus folder's ids: the file name without extension for a one-page file,
    `<name>#<page>` for each page of a longer one."""
    pages: dict[tuple[Path, int], str] = {}
    owner: dict[str, str] = {}
    for path, stored in index.metadata([folder]).items():
        stem = Path(path).stem
        if stem in owner:
            raise LabelledSetError(
                f"{folder}: {owner[stem]} and {path} have the same corpus id "
                f"{stem!r} (a corpus id is a file's name without extension)"
            )
        owner[stem] = path
        for page in stored:
            pages[(Path(path), page)] = stem if len(stored) == 1 else f"{stem}#{page}"
    return pages


def _index_folder(work: Path, setting: Setting, dim: int | None = None) -> Path:
    budget = "model" if setting.max_image_tokens is None else str(setting.max_image_tokens)
    width = "" if dim is None else f"-dim{dim}"  # a kept --work folder holds one index per width
    return work / re.sub(r"[^A-Za-z0-9_.-]", "_", f"index-{setting.variant}-{budget}{width}")


def _run(labelled, scored, model, settings, k, work, progress, note, dim=None) -> Report:
    from ..index import Index

    say = note or (lambda _: None)
    fixed_pages = labelled.corpus_pages
    if labelled.corpus_images is not None:
        fixed_pages = _write_corpus_images(labelled, work / "corpus")
    files = (
        [labelled.corpus_folder]
        if labelled.corpus_folder is not None
        else sorted({path for path, _ in fixed_pages})
    )
    qids = list(scored)
    texts = [labelled.queries[q] for q in qids]
    rankings: dict[Setting, dict[str, list[str]]] = {}
    pages = fixed_pages
    for variant, budget in dict.fromkeys((s.variant, s.max_image_tokens) for s in settings):
        kwargs = (
            {}
            if hasattr(model, "embed_pages")
            else {"variant": variant, "max_image_tokens": budget, "dim": dim}
        )
        folder = _index_folder(work, Setting(variant, budget, ""), dim)
        say(f"indexing the corpus for {variant}, {budget or 'the model`s'} image tokens: {folder}")
        with Index(folder, model=model, **kwargs) as index:
            result = index.add(files, progress=progress)
            if not result.ok:
                bad = "; ".join(f"{r.path}: {r.reason}" for r in result.failed)
                raise LabelledSetError(f"corpus pages that cannot be indexed: {bad}")
            if labelled.corpus_folder is not None:
                pages = _folder_page_ids(index, labelled.corpus_folder.resolve())
            for s in settings:
                if (s.variant, s.max_image_tokens) != (variant, budget):
                    continue
                found = index.search(texts, k=k, mode=s.mode)
                rankings[s] = {
                    qid: [pages.get((Path(h.file), h.page), f"{h.file}#{h.page}") for h in hits]
                    for qid, hits in zip(qids, found)
                }
    known = set(pages.values())
    report = Report(
        labelled.name,
        k,
        len(qids),
        len(labelled.queries) - len(qids),
        len(pages),
        sum(
            1
            for labels in scored.values()
            for cid, grade in labels.items()
            if grade > 0 and cid not in known
        ),
    )
    reference = rankings[settings[0]]
    for s in settings:
        ranked = rankings[s]
        mean = lambda f: sum(f(ranked[q], scored[q], k) for q in qids) / len(qids)  # noqa: E731
        report.rows.append(
            Row(
                s.variant,
                s.max_image_tokens,
                s.mode,
                mean(ndcg_at_k),
                mean(recall_at_k),
                mean(mrr_at_k),
                sum(bool(ranked[q]) and ranked[q][:1] == reference[q][:1] for q in qids)
                / len(qids),
                sum(overlap_at_k(ranked[q], reference[q], k) for q in qids) / len(qids),
                reference=s == settings[0],
            )
        )
        report.rankings[s.label] = ranked
    return report
