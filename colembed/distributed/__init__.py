"""Index PDFs and images on a Ray cluster: the single-machine index's job, spread over nodes.

    from colembed.distributed import QdrantTarget, ParquetTarget, index_with_ray
    result = index_with_ray(["s3://bucket/reports/"], QdrantTarget(url="http://qdrant:6333"),
                            model="/shared/colqwen2-onnx", actors=8, address="auto")

The `ray` extra (`pip install 'colembed[ray]'`). Same collection schema, point ids and payload
as `colembed.Index` (`index/schema.py`), same vectors bit for bit, same resumability: pages the
target holds are skipped, writes are idempotent by id, a bad document is reported, not fatal.
Nothing outside this package imports Ray. `pipeline.py` is the job, `stages.py` the work of each
stage, `targets.py` the Qdrant and Parquet sinks. docs/distributed.md: running and sizing it.
"""

from __future__ import annotations

from typing import Any, Iterable

from .targets import ParquetTarget, QdrantTarget, read_points

__all__ = ["ParquetTarget", "QdrantTarget", "index_with_ray", "read_points"]


def index_with_ray(
    paths: Iterable[str],
    target,
    *,
    model,
    address: str | None = None,
    progress: bool = True,
    **options: Any,
):
    """`pipeline.run` on the Ray cluster this process is connected to, else on the one at
    `address` ("auto": the cluster this node belongs to; None or "local": a local Ray started
    and shut down here). Options: actors, batch_size, cpus_per_actor, providers, variant,
    max_image_tokens, dim, dpi, filesystem (pyarrow), writers, actor_options (Ray actor options, e.g.
    resources). `progress`: Ray Data's progress reports on stderr."""
    import ray

    from .pipeline import run

    started = not ray.is_initialized()
    if started:
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = progress
    try:
        return run(paths, target, model=model, **options)
    finally:
        if started:
            ray.shutdown()
