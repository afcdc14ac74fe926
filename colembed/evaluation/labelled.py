"""Reading a labelled set from local files, checked row by row (the files come from outside).

Two layouts, told apart by what the folder holds:

- **BEIR-style**: `queries.jsonl` (one `{"_id": ..., "text": ...}` a line), `qrels/<split>.tsv`
  (a header line, then `query-id <tab> corpus-id <tab> score`), and the corpus as either
  - a folder `corpus/` of PDFs and images: a file's corpus id is its name without the extension
    for a one-page file, `<name>#<page>` (1-based) for each page of a multi-page PDF or TIFF; or
  - `corpus.jsonl`: `{"_id": ..., "file": "relative/path.pdf", "page": 3}` a line (`page`
    defaults to 1): the mapping from corpus id to an indexed page, for any file names.
- **ViDoRe / MTEB page retrieval** (a Hugging Face dataset folder, as `huggingface-cli download
  --repo-type dataset` leaves it): Parquet files under `corpus/`, `queries/` and `qrels/`,
  of the split asked for when file names carry one (`test-00000-of-00001.parquet`). Columns:
  corpus `corpus-id` + `image` (ViDoRe v2 / MTEB spelling) or `corpus_id` + `image` (ViDoRe v3);
  queries `query-id` / `query_id` + `query`; qrels `query-id` / `query_id`, `corpus-id` /
  `corpus_id`, `score`. `image` is the dataset's image feature (a struct with `bytes`) or bytes.

Relevance: a score above 0 is relevant, its value the graded gain; rows of score 0 are judged
non-relevant. Anything malformed is refused with `LabelledSetError` naming the file, the row
(1-based, the header is row 1 of a TSV) and the column.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from ..errors import ColembedError

ID_SPELLINGS = {"query": ("query-id", "query_id"), "corpus": ("corpus-id", "corpus_id")}
PARQUET_PARTS = ("corpus", "queries", "qrels")


class LabelledSetError(ColembedError, ValueError):
    """A labelled set that cannot be read: names the file, the row and the column."""


@dataclass(frozen=True)
class CorpusImage:
    """One corpus page given as image bytes (a Parquet row)."""

    id: str
    data: bytes
    where: str  # file and row, for errors


@dataclass
class LabelledSet:
    """Queries (id -> text), their labels (query id -> corpus id -> grade), and the corpus as
    one of: a folder of documents, explicit (file, page) -> id pairs, or images to write out."""

    name: str
    queries: dict[str, str]
    qrels: dict[str, dict[str, float]]
    corpus_folder: Path | None = None
    corpus_pages: dict[tuple[Path, int], str] = field(default_factory=dict)
    corpus_images: Iterator[CorpusImage] | None = None


def read_labelled_set(folder: str | Path, split: str = "test") -> LabelledSet:
    root = Path(folder).expanduser()
    if not root.is_dir():
        raise LabelledSetError(
            f"{root}: not a folder (a BEIR-style or ViDoRe / MTEB dataset folder is expected)"
        )
    if (root / "queries.jsonl").is_file():
        return _read_beir(root, split)
    if all(_parquet_files(root, part, split) for part in PARQUET_PARTS):
        return _read_parquet_set(root, split)
    raise LabelledSetError(
        f"{root}: neither a BEIR-style folder (queries.jsonl, qrels/{split}.tsv, corpus/ or "
        "corpus.jsonl) nor a ViDoRe / MTEB dataset folder (Parquet under corpus/, queries/, "
        "qrels/)"
    )


# ------------------------------------------------------------------------------------- BEIR
def _jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise LabelledSetError(f"{path} line {n}: not JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise LabelledSetError(f"{path} line {n}: not a JSON object")
            yield n, row


def _text_field(row: dict, key: str, where: str) -> str:
    value = row.get(key)
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or not value.strip():
        raise LabelledSetError(f"{where}: column {key!r} missing or not a non-empty string")
    return value


def _read_beir(root: Path, split: str) -> LabelledSet:
    path = root / "queries.jsonl"
    queries: dict[str, str] = {}
    for n, row in _jsonl(path):
        qid = _text_field(row, "_id", f"{path} line {n}")
        if qid in queries:
            raise LabelledSetError(f"{path} line {n}: query id {qid!r} given twice")
        queries[qid] = _text_field(row, "text", f"{path} line {n}")
    qrels = _read_qrels_tsv(root / "qrels" / f"{split}.tsv")
    labelled = LabelledSet(root.name, queries, qrels)
    if (root / "corpus.jsonl").is_file():
        labelled.corpus_pages = _read_corpus_jsonl(root, root / "corpus.jsonl")
    elif (root / "corpus").is_dir():
        labelled.corpus_folder = root / "corpus"
    else:
        raise LabelledSetError(
            f"{root}: no corpus (a corpus/ folder of documents, or "
            "corpus.jsonl naming each page's file)"
        )
    return labelled


def _read_qrels_tsv(path: Path) -> dict[str, dict[str, float]]:
    if not path.is_file():
        raise LabelledSetError(f"{path}: missing (the labels: query-id, corpus-id, score)")
    qrels: dict[str, dict[str, float]] = {}
    with path.open(encoding="utf-8", newline="") as f:
        for n, row in enumerate(csv.reader(f, delimiter="\t"), 1):
            if n == 1 or not row or not "".join(row).strip():
                continue  # the header
            if len(row) != 3:
                raise LabelledSetError(
                    f"{path} row {n}: {len(row)} columns, not 3 (query-id, corpus-id, score)"
                )
            qid, cid, score = (cell.strip() for cell in row)
            if not qid or not cid:
                raise LabelledSetError(
                    f"{path} row {n}: empty {'query-id' if not qid else 'corpus-id'}"
                )
            qrels.setdefault(qid, {})[cid] = _score(score, f"{path} row {n}")
    return qrels


def _score(value: Any, where: str) -> float:
    try:
        score = float(value)
    except (TypeError, ValueError):
        score = math.nan
    if isinstance(value, bool) or not math.isfinite(score):
        raise LabelledSetError(f"{where}: column 'score' is {value!r}, not a finite number")
    return score


def _read_corpus_jsonl(root: Path, path: Path) -> dict[tuple[Path, int], str]:
    pages: dict[tuple[Path, int], str] = {}
    ids: set[str] = set()
    for n, row in _jsonl(path):
        where = f"{path} line {n}"
        cid = _text_field(row, "_id", where)
        file = (root / _text_field(row, "file", where)).resolve()
        if not file.is_file():
            raise LabelledSetError(f"{where}: column 'file': {file} is not a file")
        page = row.get("page", 1)
        if not isinstance(page, int) or isinstance(page, bool) or page < 1:
            raise LabelledSetError(f"{where}: column 'page' is {page!r}, not a page number >= 1")
        if cid in ids or (file, page) in pages:
            raise LabelledSetError(f"{where}: corpus id {cid!r} or its page given twice")
        ids.add(cid)
        pages[(file, page)] = cid
    return pages


# ------------------------------------------------------------------------- ViDoRe / MTEB Parquet
def _parquet_files(root: Path, part: str, split: str) -> list[Path]:
    files = sorted((root / part).rglob("*.parquet")) if (root / part).is_dir() else []
    of_split = [f for f in files if f.name.startswith(f"{split}-") or f.stem == split]
    return of_split or files


def _column(names: list[str], spellings: tuple[str, ...], path: Path) -> str:
    for name in spellings:
        if name in names:
            return name
    raise LabelledSetError(
        f"{path}: no column {' or '.join(repr(s) for s in spellings)} (columns: {', '.join(names)})"
    )


def _rows(path: Path, columns: list[tuple[str, ...]]) -> Iterator[tuple[int, list[Any]]]:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
        raise LabelledSetError(f"{path}: not a Parquet file ({e})") from None
    names = [_column(parquet.schema_arrow.names, spellings, path) for spellings in columns]
    n = 0
    for batch in parquet.iter_batches(batch_size=64, columns=names):
        cols = [batch.column(name).to_pylist() for name in names]
        for values in zip(*cols):
            n += 1
            yield n, list(values)


def _parquet_id(value: Any, where: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, str)) or str(value).strip() == "":
        raise LabelledSetError(f"{where}: {value!r} is not an id (a string or an integer)")
    return str(value)


def _read_parquet_set(root: Path, split: str) -> LabelledSet:
    queries: dict[str, str] = {}
    for path in _parquet_files(root, "queries", split):
        for n, (qid, text) in _rows(path, [ID_SPELLINGS["query"], ("query",)]):
            where = f"{path} row {n}"
            qid = _parquet_id(qid, f"{where}, column query id")
            if not isinstance(text, str) or not text.strip():
                raise LabelledSetError(f"{where}: column 'query' is not a non-empty string")
            queries[qid] = text
    qrels: dict[str, dict[str, float]] = {}
    for path in _parquet_files(root, "qrels", split):
        for n, (qid, cid, score) in _rows(
            path, [ID_SPELLINGS["query"], ID_SPELLINGS["corpus"], ("score",)]
        ):
            where = f"{path} row {n}"
            qrels.setdefault(_parquet_id(qid, f"{where}, column query id"), {})[
                _parquet_id(cid, f"{where}, column corpus id")
            ] = _score(score, where)
    return LabelledSet(
        root.name,
        queries,
        qrels,
        corpus_images=_corpus_images(_parquet_files(root, "corpus", split)),
    )


def _corpus_images(files: list[Path]) -> Iterator[CorpusImage]:
    for path in files:
        for n, (cid, image) in _rows(path, [ID_SPELLINGS["corpus"], ("image",)]):
            where = f"{path} row {n}"
            data = image.get("bytes") if isinstance(image, dict) else image
            if not isinstance(data, bytes) or not data:
                raise LabelledSetError(f"{where}: column 'image' holds no image bytes")
            yield CorpusImage(_parquet_id(cid, f"{where}, column corpus id"), data, where)
