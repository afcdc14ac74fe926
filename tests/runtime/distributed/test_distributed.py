"""colembed.distributed on a real local Ray cluster (started once for the module: 2 CPUs, a small
object store, no dashboard), against a single-process `colembed.Index` run over the same files
with the same exported tiny model.

Three Ray jobs in all (each costs ~15 s here, mostly worker and actor start-up):
- Parquet, 2 actors, with a corrupt PDF among the documents and one actor process made to exit
  on its second embedded batch (`crash_once`: real code in `PageEmbedder`, not a mock);
- a Qdrant Edge folder (the driver as its one writer), 2 actors, the documents read through a
  pyarrow filesystem (the path a bucket takes: each file copied to a temporary file to render);
- the same Edge folder again through `colembed index --ray`: everything is skipped.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import ray
from colembed.distributed import ParquetTarget, QdrantTarget, index_with_ray, read_points
from colembed.index.schema import pooled_vectors
from colembed.model import PageLayout
from tests.fixtures.documents import good_folder, write_pdf

pytestmark = pytest.mark.heavy("ray")

OBJECT_STORE_BYTES = 300 * 2**20
CORRUPT = "corrupt.pdf"


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    ray.init(
        num_cpus=2,
        object_store_memory=OBJECT_STORE_BYTES,
        include_dashboard=False,
        log_to_driver=False,
    )
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def documents(tmp_path_factory):
    """Good documents (14 pages in 5 files) and a corrupt PDF."""
    folder = tmp_path_factory.mktemp("ray-docs") / "docs"
    pages = good_folder(folder)
    write_pdf(folder / "long.pdf", [f"long {i}" for i in range(7)])
    (folder / CORRUPT).write_bytes(b"%PDF-1.7\n this is not a PDF body\n")
    return folder, sum(pages.values()) + 7


@pytest.fixture(scope="module")
def single(documents, exported_tiny, tmp_path_factory):
    """The single-process run: colembed.Index into a Qdrant Edge folder."""
    import colembed

    with colembed.Index(
        tmp_path_factory.mktemp("single") / "db", model=exported_tiny.folder
    ) as index:
        result = index.add([documents[0]])
        payloads = dict(index.store.payloads())
        vectors = index.store.page_vectors(list(payloads))
    return result, payloads, vectors


@pytest.fixture(scope="module")
def parquet_job(documents, exported_tiny, tmp_path_factory):
    work = tmp_path_factory.mktemp("parquet-job")
    marker = work / "crashed"
    result = index_with_ray(
        [str(documents[0])],
        ParquetTarget(str(work / "pages")),
        model=exported_tiny.folder,
        actors=2,
        batch_size=2,
        crash_once=(str(marker), 2),
        progress=False,
    )
    return result, work / "pages", marker


@pytest.fixture(scope="module")
def edge_job(documents, exported_tiny, tmp_path_factory):
    import pyarrow.fs as pafs

    db = tmp_path_factory.mktemp("edge-job") / "db"
    result = index_with_ray(
        [str(documents[0].resolve())],
        QdrantTarget(str(db)),
        model=exported_tiny.folder,
        actors=2,
        batch_size=3,
        progress=False,
        filesystem=pafs.LocalFileSystem(),
    )
    return result, db


def _edge_contents(db):
    from colembed.index.backends import open_store

    store = open_store(db)
    try:
        payloads = dict(store.payloads())
        return payloads, store.page_vectors(list(payloads))
    finally:
        store.close()


def test_parquet_pages_equal_the_single_process_run_bit_for_bit(parquet_job, single):
    """Same ids and payloads (but the schema: a Parquet row carries rows / cols, schema 2, the
    single run's Edge folder does not, schema 3); the float32 page vectors, stored as the single
    run stores them (float16), are its vectors bit for bit; rows/cols are the schema's pooling of
    them."""
    _, single_payloads, single_vectors = single
    points = read_points(str(parquet_job[1]))
    assert set(points) == set(single_payloads)
    for pid, point in points.items():
        assert (point.payload["schema"], single_payloads[pid]["schema"]) == (2, 3)
        assert point.payload == dict(single_payloads[pid], schema=2)
        page = point.vectors["page"]
        stored = page.astype(np.float16).astype(np.float32)
        assert stored.tobytes() == single_vectors[pid].tobytes(), point.payload["path"]
        layout = PageLayout(*point.payload["grid"], point.payload["image_start"], len(page), 28)
        rows, cols = pooled_vectors(page, layout)
        assert rows.tobytes() == point.vectors["rows"].tobytes()
        assert cols.tobytes() == point.vectors["cols"].tobytes()


def test_parquet_vectors_are_the_models_float32_vectors(parquet_job, tiny_model):
    """The float32 vectors themselves equal the single-process runtime's, page for page."""
    from colembed.index.sources import Document

    model = tiny_model
    points = read_points(str(parquet_job[1]))
    for point in points.values():
        with Document(point.payload["path"], max_pixels=model.config.max_pixels) as doc:
            image = doc.render(point.payload["page"])
        ((vectors, _),) = model.embed_pages([image])
        assert vectors.tobytes() == point.vectors["page"].tobytes()


def test_a_killed_actor_still_leaves_every_page_written_once(parquet_job, documents):
    import pyarrow.parquet as pq

    result, folder, marker = parquet_job
    assert marker.exists()  # an actor did exit mid-job
    ids = [
        i
        for part in sorted(folder.glob("part-*.parquet"))
        for i in pq.read_table(part, columns=["id"])["id"].to_pylist()
    ]
    assert len(ids) == len(set(ids)) == documents[1] == result.pages_added
    assert not [p for p in folder.iterdir() if p.name.startswith(".")]  # no temporary parts


def test_a_corrupt_pdf_is_recorded_and_the_rest_indexed(parquet_job, single):
    result = parquet_job[0]
    assert [(f.path.rsplit("/", 1)[-1], "PDF" in f.reason) for f in result.failed] == [
        (CORRUPT, True)
    ]
    assert sorted((f.path, f.pages) for f in result.added) == sorted(
        (f.path, f.pages) for f in single[0].added
    )


def test_the_qdrant_sink_holds_what_the_single_process_index_holds(edge_job, single):
    result, _ = edge_job
    assert [f.path.rsplit("/", 1)[-1] for f in result.failed] == [CORRUPT]
    _, single_payloads, single_vectors = single
    payloads, vectors = _edge_contents(edge_job[1])
    assert payloads == single_payloads
    assert {pid: v.tobytes() for pid, v in vectors.items()} == {
        pid: v.tobytes() for pid, v in single_vectors.items()
    }


def test_the_cli_rerun_skips_everything(edge_job, documents, exported_tiny, capsys):
    from colembed.cli import main

    before = _edge_contents(edge_job[1])[0]
    code = main(
        [
            "index",
            str(documents[0]),
            "--ray",
            "--db",
            str(edge_job[1]),
            "--model",
            str(exported_tiny.folder),
            "--actors",
            "2",
            "--json",
        ]
    )
    report = json.loads(capsys.readouterr().out)
    assert code == 1  # the corrupt PDF is still reported
    assert report["added"] == [] and len(report["skipped"]) == 5
    assert [f["path"].rsplit("/", 1)[-1] for f in report["failed"]] == [CORRUPT]
    assert _edge_contents(edge_job[1])[0] == before


def test_the_server_writer_stores_what_the_single_process_index_holds(
    documents, exported_tiny, single, tmp_path
):
    """The stages without Ray (render + embed in the actor, a server writer) into qdrant-client's
    local mode, the stand-in for a Qdrant server: the same ids, payloads and (float16-stored)
    vectors."""
    from colembed.distributed.pipeline import model_identity
    from colembed.distributed.stages import PageEmbedder
    from colembed.distributed.targets import StoreWriter
    from colembed.index.backends import open_store

    folder = exported_tiny.folder
    embedder = PageEmbedder(
        str(folder), model_identity(folder, "fp32"), load_options=dict(variant="fp32"), batch_size=2
    )
    batches = list(embedder({"path": np.array([str(documents[0] / "report.pdf")], dtype=object)}))
    assert [len(b["id"]) for b in batches] == [2, 1, 1]  # 3 pages, 2 at a time; the file's end
    points = {k: sum((b[k] for b in batches), []) for k in batches[0]}
    writer = StoreWriter(
        location=str(tmp_path / "local"),
        url=None,
        api_key=None,
        collection=None,
        local=True,
        dim=embedder.model.embedding_size,
    )
    summary = writer({k: np.array(v, dtype=object) for k, v in points.items()})
    writer.store.close()
    assert summary["status"] == ["page"] * 3 + ["file"]
    store = open_store(tmp_path / "local", local=True)
    try:
        payloads = dict(store.payloads())
        vectors = store.page_vectors(list(payloads))
    finally:
        store.close()
    _, single_payloads, single_vectors = single
    assert payloads == {pid: single_payloads[pid] for pid in payloads} and len(payloads) == 3
    for pid, v in vectors.items():  # float16 storage either way: rounding is idempotent
        assert v.astype(np.float16).astype(np.float32).tobytes() == single_vectors[pid].tobytes()


# ------------------------------------------------------------------- bad pages: the same outcome
def test_bad_pages_give_the_same_result_and_points_as_index_add(exported_tiny, tmp_path):
    """A TIFF whose page 3 is damaged (its other pages decode), a corrupt PDF and a good one:
    the Ray job and `Index.add` report the same files in the same words and store the same
    points (before the change, the Ray job dropped the TIFF's later pages and its file report
    differed); a re-run retries only the bad page and changes nothing."""
    import colembed
    from tests.fixtures.documents import tiff_with_a_bad_page as _tiff_with_a_bad_page

    docs = tmp_path / "docs"
    docs.mkdir()
    _tiff_with_a_bad_page(docs / "scan.tiff", 5, bad=3)
    write_pdf(docs / "memo.pdf", ["memo 1", "memo 2"])
    (docs / CORRUPT).write_bytes(b"%PDF-1.7\n this is not a PDF body\n")
    with colembed.Index(tmp_path / "single", model=exported_tiny.folder) as index:
        single = index.add([docs], progress=False)
        single_payloads = dict(index.store.payloads())
        single_vectors = index.store.page_vectors(list(single_payloads))
    ray_result = index_with_ray(
        [str(docs)],
        QdrantTarget(str(tmp_path / "ray")),
        model=exported_tiny.folder,
        actors=1,
        batch_size=2,
        progress=False,
    )
    assert ray_result == single and not single.ok
    assert [r.pages for r in single.failed] == [0, 4]  # corrupt.pdf, then scan.tiff: 4 of 5
    assert single.failed[1].reason.startswith("page 3 of 5: cannot decode image")
    payloads, vectors = _edge_contents(tmp_path / "ray")
    assert payloads == single_payloads and len(payloads) == 6
    for pid, v in vectors.items():  # float16 storage either way
        np.testing.assert_allclose(v, single_vectors[pid], atol=2e-3)
    again = index_with_ray(
        [str(docs)], QdrantTarget(str(tmp_path / "ray")), model=exported_tiny.folder, progress=False
    )
    assert [(r.path, r.reason) for r in again.failed] == [(r.path, r.reason) for r in single.failed]
    assert again.failed[1].pages == 0 and _edge_contents(tmp_path / "ray")[0] == payloads


def test_a_truncated_run_stamps_its_dim_and_refuses_another(exported_tiny, tmp_path):
    """`dim=` reaches the actors (their vectors are the model's at that width, renormalised) and
    the pages' identity; a later run at another width is refused before any page is embedded."""
    import colembed
    from colembed.index import ModelMismatchError

    (tmp_path / "docs").mkdir()
    pdf = write_pdf(tmp_path / "docs" / "a.pdf", ["truncated"])
    db = tmp_path / "db"
    result = index_with_ray(
        [str(pdf)], QdrantTarget(str(db)), model=exported_tiny.folder, dim=16, progress=False
    )
    assert result.pages_added == 1
    payloads, vectors = _edge_contents(db)
    [(pid, payload)] = payloads.items()
    assert payload["dim"] == 16
    with colembed.Index(tmp_path / "single", model=exported_tiny.folder, dim=16) as index:
        index.add([pdf])
        single = index.store.page_vectors([pid])[pid]
    assert vectors[pid].shape[1] == 16
    np.testing.assert_array_equal(vectors[pid], single)
    with pytest.raises(ModelMismatchError, match="dim: the index has 16, this run 8"):
        index_with_ray(
            [str(pdf)], QdrantTarget(str(db)), model=exported_tiny.folder, dim=8, progress=False
        )
