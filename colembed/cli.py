"""The `colembed` command. `print` lives here and nowhere else in the package.

colembed export SOURCE --out DIR     checkpoint -> verified model folder (needs the export extra)
colembed demo [--out DIR]            offline end-to-end run on a tiny RANDOM-WEIGHT model
colembed info DIR                    what a model folder holds
colembed check-variant DIR --variant V --queries FILE --pages DIR
                                     a variant against fp32 on your own data
colembed index PATH... --db DIR      index PDFs and images (resumable; needs the index extra)
colembed search "question" --db DIR  the best pages, with --maps DIR similarity overlays
colembed doctor DIR                  where the graphs run here, and parity with CPU fp32
colembed serve --db DIR              HTTP API and search page (needs the serve extra)
colembed eval DATASET --model M      nDCG@k, recall@k, MRR@k on a labelled set (BEIR, ViDoRe)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import unicodedata
from pathlib import Path

from .errors import ColembedError
from .layout import BASE_VARIANT

EXPORT_EXTRA_HINT = (
    "this command needs the export extra (torch, transformers, onnx): "
    "pip install 'colembed[export]'  (to skip a CUDA download, first install a "
    "CPU torch: pip install torch --index-url "
    "https://download.pytorch.org/whl/cpu; leave torchvision out: one that does "
    "not match the torch build fails to import and breaks transformers' image "
    "processing)"
)


def _import_export_package():
    try:
        import onnx  # noqa: F401
        import torch  # noqa: F401
        import transformers  # noqa: F401

        import colembed_export.pipeline.exporter as exporter
    except ImportError as e:
        raise SystemExit(f"colembed: {EXPORT_EXTRA_HINT}\n  ({e})") from None
    return exporter


def _progress(message: str) -> None:
    print(f"[colembed] {message}", file=sys.stderr, flush=True)


def _cmd_export(args) -> int:
    exporter = _import_export_package()
    # Options left unset take the exporter's defaults (colembed_export/constants.py).
    given = {
        k: getattr(args, k)
        for k in ("opset", "tolerance", "feature_tolerance")
        if getattr(args, k) is not None
    }
    report = exporter.export_model(
        args.source,
        args.out,
        revision=args.revision,
        name=args.name,
        **given,
        check=not args.no_check,
        overwrite=args.overwrite,
        random_weights=args.random_weights,
        external_data={"auto": None, "always": True, "never": False}[args.external_data],
        variants=tuple(v for v in (args.variant or "").split(",") if v),
        int8_weight_passes=args.int8_weight_passes,
        progress=_progress,
        base=args.base,
        max_memory=args.max_memory,
    )
    check = report.check.get(BASE_VARIANT)
    if check:
        print(
            f"check passed: max abs diff {check['max_abs_diff']:.2e} <= {check['tolerance']:.0e} "
            f"per token, image features within {check['max_relative_feature_diff']:.1e} of "
            f"their scale, over {check['pages']} pages and {check['queries']} queries"
        )
    from colembed_export.variants.write import summary

    for name, figures in report.check.items():
        if name != BASE_VARIANT:
            print(summary(name, figures))
    print(f"model folder: {report.folder}")
    return 0


def _cmd_demo(args) -> int:
    _import_export_package()
    from colembed_export.pipeline.demo import run_demo

    run_demo(Path(args.out), progress=_progress)
    return 0


def _cmd_info(args) -> int:
    from .manifest import read_manifest

    manifest = read_manifest(Path(args.folder))
    summary = {
        "model": manifest.model.to_dict(),
        "family": manifest.family,
        "vision_attention": manifest.vision_attention.to_dict(),
        "embedding_dim": manifest.embedding_dim,
        "variants": {v: {r: g.file for r, g in gs.items()} for v, gs in manifest.variants.items()},
        "scorer": manifest.scorer.file if manifest.scorer else None,
        "max_pixels": manifest.preprocess.max_pixels,
        "checks": {name: check.to_dict() for name, check in manifest.checks.items()},
        "versions": dict(manifest.versions),
    }
    print(json.dumps(summary, indent=2))
    return 0


def _check_queries(path: str) -> list[str]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"--queries {path}: cannot read it as UTF-8 text ({e})") from None
    queries = [line.strip() for line in text.splitlines() if line.strip()]
    if not queries:
        raise UsageError(f"--queries {path}: no queries (one per line)")
    return queries


def _check_pages(path: str, limit: int, max_pixels: int) -> tuple[list, list[str]]:
    """Up to `limit` page images from the documents under `path`, by the index's own reader."""
    try:
        from .index.sources import Document, discover
    except ImportError as e:
        raise SystemExit(f"colembed: {INDEX_EXTRA_HINT}\n  ({e})") from None
    from .index.errors import SourceError

    found = discover([path])
    for missing, reason in found.missing:
        raise UsageError(f"--pages {missing}: {reason}")
    images, names = [], []
    for document in found.documents:
        try:
            with Document(document, max_pixels=max_pixels) as doc:
                for number, image in doc.iter_pages(range(1, doc.pages + 1)):
                    if len(images) >= limit:
                        return images, names
                    images.append(image)
                    names.append(f"{document.name} page {number}")
        except SourceError as e:
            print(f"skipped: {_shown(str(e))}", file=sys.stderr)
    if not images:
        raise UsageError(f"--pages {path}: no readable PDF or image pages")
    return images, names


def _cmd_check_variant(args) -> int:
    from .fidelity import check_variant
    from .manifest import read_manifest

    if args.max_pages < 1:
        raise UsageError("--max-pages must be at least 1")
    folder = Path(args.folder).expanduser()
    if not folder.is_dir():
        from .registry import resolve_model_folder

        folder = resolve_model_folder(args.folder)
    manifest = read_manifest(folder)
    if args.variant not in manifest.variants or args.variant == BASE_VARIANT:
        raise UsageError(
            f"{args.variant!r} is not a variant of {folder} (it holds "
            f"{sorted(v for v in manifest.variants if v != BASE_VARIANT)})"
        )
    queries = _check_queries(args.queries)
    pages, names = _check_pages(args.pages, args.max_pages, manifest.preprocess.max_pixels)
    report = check_variant(folder, args.variant, queries, pages, page_names=names)
    worst = min([r["min"] for r in report["queries"] + report["pages"]], default=1.0)
    if args.json:
        print(json.dumps(report, indent=2, ensure_ascii=False))
    else:
        _print_variant_check(report)
    failed = args.fail_below is not None and not worst >= args.fail_below
    if failed:
        print(
            f"colembed check-variant: a token's cosine to fp32 is {worst:.5f}, below "
            f"--fail-below {args.fail_below}",
            file=sys.stderr,
        )
    return EXIT_FAILED if failed else EXIT_OK


def _print_variant_check(report: dict) -> None:
    from .fidelity import describe_token

    for kind in ("queries", "pages"):
        rows = report[kind]
        low = min(rows, key=lambda r: r["min"])
        mean = sum(r["mean"] * r["tokens"] for r in rows) / max(1, sum(r["tokens"] for r in rows))
        print(
            f"{kind}: {len(rows)}, mean token cosine {mean:.5f}, worst {low['min']:.5f} "
            f"({_shown(low['item'])})"
        )
    print("query tokens by kind:")
    for kind, row in report["token_classes"].items():
        print(
            f"  {kind:<26} {row['tokens']:>6} tokens  mean {row['mean']:.5f}  min "
            f"{row['min']:.5f}  worst {_shown(repr(row['worst']['text']))} in "
            f"{row['worst']['item']}"
        )
    print(f"worst query {_shown(describe_token(report['worst_token']))}")
    ranking = report["ranking"]
    if ranking["top1_agreement"] is not None:
        print(
            f"ranking against fp32 over {ranking['queries']} queries x {ranking['pages']} pages: "
            f"top-1 agreement {ranking['top1_agreement']:.3f}, top-{ranking['k']} overlap "
            f"{ranking['topk_overlap']:.3f}"
        )


INDEX_EXTRA_HINT = (
    "this command needs the index extra (qdrant-edge-py, qdrant-client, pypdfium2, "
    "tqdm): pip install 'colembed[index]'"
)

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
RESUME_HINT = (
    "interrupted: the pages stored so far are kept; resume by re-running the same "
    "command (stored pages are not embedded again)"
)


def _shown(text: object) -> str:
    """`text` for a terminal line: control and format characters (a newline in a file name that
    would forge a result line, ESC sequences, bidi overrides, line separators) written as Python
    escapes (`\\n`, `\\x1b`, `\\u202e`); everything else as it is. JSON output is left exact."""
    return "".join(
        repr(ch)[1:-1] if unicodedata.category(ch) in _UNSHOWN else ch for ch in str(text)
    )


_UNSHOWN = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs"})


class UsageError(Exception):
    """A command line that cannot mean anything: exit code 2, as argparse's own errors."""


def _open_index(args, *, create: bool, store_opener=None):
    try:
        from .index import Index
    except ImportError as e:
        raise SystemExit(f"colembed: {INDEX_EXTRA_HINT}\n  ({e})") from None
    if (args.db is None) == (args.qdrant_url is None):
        raise UsageError("give exactly one of --db DIR or --qdrant-url URL")
    api_key = args.qdrant_api_key or os.environ.get("QDRANT_API_KEY")
    return Index(
        args.db,
        model=args.model,
        url=args.qdrant_url,
        api_key=api_key,
        collection=args.collection,
        variant=args.variant,
        max_image_tokens=args.max_image_tokens,
        dim=args.dim,
        create=create,
        source=getattr(args, "source", None),
        pool_factor=getattr(args, "pool_factor", None),
        store_opener=store_opener,
        providers=args.providers,
    )


def _print_added(result, total, args, where: str = "") -> None:
    """`colembed index`'s report, with or without --ray: one JSON shape, one summary line."""
    if args.json:
        print(json.dumps(dict(result.to_dict(), pages=total), indent=2))
        return
    for report in result.failed:
        print(f"failed: {_shown(report.path)}: {_shown(report.reason)}", file=sys.stderr)
    if not args.quiet:
        for report in result.skipped:
            if report.reason != "already indexed":
                print(f"skipped: {_shown(report.path)}: {_shown(report.reason)}", file=sys.stderr)
    reused = sum(r.reused for r in result.added)
    print(
        f"added {result.pages_added} page(s) from {len(result.added)} file(s){where}"
        + (f" ({reused} copied from identical content, not embedded)" if reused else "")
        + f"; {len(result.skipped)} skipped, {len(result.failed)} failed"
        + (
            f", {sum(r.pages for r in result.removed)} page(s) of vanished files pruned"
            if args.prune
            else ""
        )
        + (f"; the index holds {total} page(s)" if total is not None else "")
    )


def _cmd_index(args) -> int:
    if (args.meta or args.meta_file) and (args.ray is not None or args.from_parquet):
        raise UsageError(
            "--meta and --meta-file apply to `colembed index PATH...` "
            "(set metadata afterwards with `colembed meta`)"
        )
    if args.ray is not None:
        return _cmd_index_ray(args)
    if args.actors is not None or args.parquet is not None:
        raise UsageError("--actors and --parquet need --ray")
    if args.from_parquet:
        return _cmd_index_parquet(args)
    metadata, table = _index_metadata(args)
    with _open_index(args, create=True) as index:
        result = index.add(
            args.paths,
            dpi=args.dpi,
            prune=args.prune,
            batch_size=args.batch_size,
            progress=False if args.quiet or args.json else None,
            metadata=metadata,
        )
        total = len(index)
    _print_added(result, total, args)
    unused = table.unused() if table is not None else []
    if unused and not args.json:
        print(
            f"warning: {len(unused)} row(s) of {_shown(str(table.source))} name no file "
            f"indexed by this run: {', '.join(_shown(u) for u in unused[:5])}"
            + (" ..." if len(unused) > 5 else ""),
            file=sys.stderr,
        )
    return EXIT_OK if result.ok else EXIT_FAILED


def _index_metadata(args):
    """(`Index.add`'s `metadata=`, the metadata table or None) of `--meta` (every file's) and
    `--meta-file` (each row its file's, over `--meta`); the table is read and checked whole
    before the index opens."""
    fixed = _assignments(args.meta) if args.meta else None
    if not args.meta_file:
        return fixed, None
    from .index.metadata import MetadataTable, check_metadata, merged

    table = MetadataTable.read(args.meta_file)
    base = check_metadata(fixed) if fixed else {}

    def of_path(path: str):
        row = table(path)
        return merged(base, row) if row is not None else (dict(base) or None)

    return of_path, table


def _cmd_index_parquet(args) -> int:
    """`colembed index --from-parquet DIR --db DB`: store what a Ray job's Parquet target wrote."""
    from .index.embedded import open_for_embedded, parquet_dim, parquet_points

    if args.paths or args.prune:
        raise UsageError("--from-parquet takes no PATH and no --prune")
    if args.pool_factor is not None:
        raise UsageError(
            "--from-parquet stores the rows' vectors as they are, at their own "
            "pool factor: --pool-factor does not apply"
        )
    points = parquet_points(args.from_parquet)
    if args.db is not None:
        open_for_embedded(args.db, parquet_dim(points))
    with _open_index(args, create=False) as index:
        stored = index.add_embedded(points)
        total = len(index)
    if args.json:
        print(json.dumps({"added_pages": stored, "pages": total}))
    else:
        print(f"stored {stored} page(s) from {args.from_parquet}; the index holds {total} page(s)")
    return EXIT_OK


RAY_EXTRA_HINT = "--ray needs the ray extra (Ray Data, pyarrow): pip install 'colembed[ray]'"


def _cmd_index_ray(args) -> int:
    """`colembed index --ray [ADDRESS]`: the same job on a Ray cluster (colembed.distributed)."""
    if args.model is None or args.prune:
        raise UsageError("--ray needs --model (a folder every node reads) and has no --prune")
    if args.pool_factor is not None:
        raise UsageError(
            "--ray writes pages at the target index's own pool factor; create a "
            "pooled index with `colembed index --pool-factor N` first"
        )
    if sum(x is not None for x in (args.db, args.qdrant_url, args.parquet)) != 1:
        raise UsageError("give exactly one of --db DIR, --qdrant-url URL, --parquet DIR")
    try:
        from .distributed import ParquetTarget, QdrantTarget, index_with_ray, pipeline  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"colembed: {RAY_EXTRA_HINT}\n  ({e})") from None
    target = (
        ParquetTarget(args.parquet)
        if args.parquet
        else QdrantTarget(
            args.db,
            url=args.qdrant_url,
            collection=args.collection,
            api_key=args.qdrant_api_key or os.environ.get("QDRANT_API_KEY"),
        )
    )
    result = index_with_ray(
        args.paths,
        target,
        model=args.model,
        address=args.ray,
        actors=args.actors or 1,
        batch_size=args.batch_size,
        variant=args.variant,
        max_image_tokens=args.max_image_tokens,
        dim=args.dim,
        providers=args.providers,
        dpi=args.dpi,
        source=args.source,
        progress=not (args.quiet or args.json),
    )
    total = None
    if not args.parquet:  # the pages the collection holds now (the store alone: no model)
        from .index import open_store

        store = open_store(
            args.db,
            url=args.qdrant_url,
            collection=args.collection,
            api_key=args.qdrant_api_key or os.environ.get("QDRANT_API_KEY"),
            create=False,
        )
        try:
            total = store.count()
        finally:
            store.close()
    _print_added(result, total, args, where=" on Ray")
    return EXIT_OK if result.ok else EXIT_FAILED


RAY_ADDRESS_WORDS = ("auto", "local")


def _is_ray_address(value: str) -> bool:
    """What `--ray VALUE` takes as a cluster address (else VALUE is the first PATH)."""
    return (
        value in RAY_ADDRESS_WORDS
        or "://" in value
        or re.fullmatch(r"[\w.\-]+:\d+", value) is not None
    )


def _ray_options(parser: argparse.ArgumentParser) -> None:
    ray = parser.add_argument_group("on a Ray cluster (the ray extra; docs/distributed.md)")
    ray.add_argument(
        "--ray",
        nargs="?",
        const="local",
        metavar="ADDRESS",
        help="run the job on Ray Data: the cluster at ADDRESS ('auto': the one this "
        "node is in; host:port or ray://...), or a local Ray started for the "
        "job; a value that is not an address is a PATH",
    )
    ray.add_argument("--actors", type=_positive_int, help="model actors (default 1)")
    ray.add_argument("--parquet", metavar="DIR", help="write Parquet (one row per page) instead")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def _assignments(items: list[str]) -> dict:
    """`--meta key=value` / `--set key=value` as a dict (metadata.parse_assignment)."""
    from .index.metadata import parse_assignment

    return dict(parse_assignment(item) for item in items)


def _cmd_search(args) -> int:
    with _open_index(args, create=False) as index:
        results = index.search(
            args.queries,
            k=args.k,
            mode=args.mode,
            explain=bool(args.maps),
            where=args.where or None,
        )
        written = _write_maps(index, results, Path(args.maps)) if args.maps else {}
        empty = len(index) == 0
    if args.json:
        print(
            json.dumps(
                [
                    {
                        "query": q,
                        "hits": [
                            {
                                "rank": r,
                                "score": h.score,
                                "file": h.file,
                                "page": h.page,
                                "metadata": h.metadata,
                                "text": h.text,
                                "text_truncated": h.text_truncated,
                                "map": written.get((qi, r)),
                            }
                            for r, h in enumerate(hits, 1)
                        ],
                    }
                    for qi, (q, hits) in enumerate(zip(args.queries, results))
                ],
                indent=2,
            )
        )
        return EXIT_OK
    for qi, (query, hits) in enumerate(zip(args.queries, results)):
        print(f"query: {_shown(query)}")
        print(f"{'rank':>4}  {'score':>8}  {'page':>4}  file")
        for rank, hit in enumerate(hits, 1):
            meta = (
                "  " + " ".join(f"{k}={v}" for k, v in hit.metadata.items()) if hit.metadata else ""
            )
            print(f"{rank:>4}  {hit.score:>8.3f}  {hit.page:>4}  {_shown(hit.file + meta)}")
        if not hits:
            print("  (the index is empty)" if empty else "  (no page found)")
    if written and not args.quiet:
        print(f"similarity maps: {len(written)} PNG file(s) in {args.maps}")
    return EXIT_OK


def _cmd_meta(args) -> int:
    """`colembed meta PATH... --db DIR [--set k=v] [--unset k] [--replace]`: show or change the
    metadata of indexed files without embedding anything."""
    update = _assignments(args.set or [])
    update.update({key: None for key in args.unset or []})
    with _open_index(args, create=False) as index:
        changed = (
            index.set_metadata(args.paths, update, replace=args.replace, pages=args.page or None)
            if update or args.replace
            else None
        )
        stored = index.metadata(args.paths)
    if args.json:
        print(
            json.dumps(
                {
                    "changed_pages": changed,
                    "files": {
                        path: {str(n): meta for n, meta in pages.items()}
                        for path, pages in stored.items()
                    },
                },
                indent=2,
            )
        )
        return EXIT_OK
    if changed is not None:
        print(f"metadata changed on {changed} page(s)")
    for path, pages in stored.items():
        values = {json.dumps(meta, sort_keys=True) for meta in pages.values()}
        if len(values) == 1:
            print(f"{path}: {values.pop()}")
        else:
            for n, meta in pages.items():
                print(f"{path} page {n}: {json.dumps(meta, sort_keys=True)}")
    if not stored:
        print("no indexed file under the paths given")
        return EXIT_FAILED
    return EXIT_OK


def _cmd_upgrade(args) -> int:
    """`colembed upgrade --db DIR`: rewrite an index folder of an older schema at this one."""
    try:
        from .index.index import upgrade_with_progress
    except ImportError as e:
        raise SystemExit(f"colembed: {INDEX_EXTRA_HINT}\n  ({e})") from None
    done = upgrade_with_progress(args.db, progress=False if args.quiet else None)
    print(f"{args.db}: {done.describe()}")
    return EXIT_OK


def _write_maps(index, results, folder: Path) -> dict:
    """One overlay PNG per hit; never replaces an existing file (a free name is chosen)."""
    written = {}
    for qi, hits in enumerate(results, 1):
        for rank, hit in enumerate(hits, 1):
            stem = f"q{qi}-rank{rank}-{Path(hit.file).stem}-p{hit.page}"
            path, n = folder / f"{stem}.png", 1
            while path.exists():
                n += 1
                path = folder / f"{stem}-{n}.png"
            try:
                written[(qi, rank)] = str(index.save_map(hit, path))
            except ColembedError as e:
                print(
                    f"no map for {_shown(hit.file)} page {hit.page}: {_shown(e)}", file=sys.stderr
                )
    return written


def _index_options(parser: argparse.ArgumentParser) -> None:
    where = parser.add_argument_group("where the index lives")
    where.add_argument("--db", help="index folder (Qdrant Edge, embedded; created if new)")
    where.add_argument("--qdrant-url", help="a Qdrant server instead of a folder")
    where.add_argument("--qdrant-api-key", help="API key for --qdrant-url (or $QDRANT_API_KEY)")
    where.add_argument("--collection", help="collection name on the server (default colembed)")
    model = parser.add_argument_group("model")
    model.add_argument(
        "--model", help="model folder or name (default: the one the index was built with)"
    )
    model.add_argument(
        "--variant", help=f"graph variant (default: the index's, {BASE_VARIANT} for a new one)"
    )
    model.add_argument(
        "--max-image-tokens",
        type=_positive_int,
        help="image tokens per page (default: the index's, the model's for a new one)",
    )
    model.add_argument(
        "--dim",
        type=_positive_int,
        help="keep each vector's first DIM components, renormalised (default: the index's, the "
        "model's full width for a new one); only for models trained with Matryoshka losses",
    )
    model.add_argument(
        "--providers",
        help="where the model runs: cpu (default), openvino (the "
        "openvino extra; its variants only), directml, auto",
    )
    _output_options(parser)


def _output_options(parser: argparse.ArgumentParser) -> None:
    """--json and --quiet, as every command that reports progress and a result takes them."""
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--quiet", action="store_true", help="no progress bar or notes")


def _add_index_commands(sub) -> None:
    index = sub.add_parser("index", help="index PDFs and images (files or folders) for search")
    index.add_argument("paths", nargs="*", metavar="PATH")
    index.add_argument(
        "--from-parquet",
        metavar="DIR",
        help="store the pages a Ray job's Parquet target wrote (no model needed)",
    )
    index.add_argument(
        "--dpi",
        type=float,
        help="render PDFs at this dpi (default: the index's; "
        "a new one: at the model's pixel budget)",
    )
    index.add_argument(
        "--prune",
        action="store_true",
        help="drop pages of files that no longer exist under the PATHs given "
        "(pages this --source wrote; never under a PATH that is missing)",
    )
    index.add_argument(
        "--source",
        help="the name this machine writes as (default: "
        "$COLEMBED_SOURCE, else the host name); replacing changed "
        "files and --prune touch only this source's pages",
    )
    index.add_argument(
        "--batch-size", type=_positive_int, default=4, help="pages per model call (default 4)"
    )
    index.add_argument(
        "--meta",
        action="append",
        metavar="KEY=VALUE",
        help="metadata stored with every page of the files given (repeatable; a "
        "number, true/false or text; filter with search --where)",
    )
    index.add_argument(
        "--meta-file",
        metavar="FILE",
        help="metadata per file from a metadata.jsonl / metadata.csv (Hugging Face "
        "datasets' image-folder layout: a file_name column, relative to the "
        "file's folder, and one column a key); its values win over --meta's",
    )
    index.add_argument(
        "--pool-factor",
        type=_positive_int,
        help="store each page's image tokens hierarchically pooled to 1/N as many "
        "(smaller index, some recall lost: docs/index.md); a new index only, "
        "default: the index's own, 1 (no pooling) for a new one",
    )
    _index_options(index)
    _ray_options(index)
    index.set_defaults(func=_cmd_index)

    search = sub.add_parser("search", help="the best pages for a question")
    search.add_argument("queries", nargs="+", metavar="QUESTION")
    search.add_argument("-k", type=_positive_int, default=5, help="pages per question (default 5)")
    search.add_argument(
        "--mode",
        choices=("two-stage", "exact", "hybrid"),
        default="two-stage",
        help="two-stage: cheap candidates + exact rerank (default); exact: full "
        "scan; hybrid: two-stage fused with BM25 over the pages' text "
        "(exact identifiers)",
    )
    search.add_argument("--maps", metavar="DIR", help="write a similarity overlay PNG per hit here")
    search.add_argument(
        "--where",
        action="append",
        metavar="COND",
        help="only pages meeting this condition (repeatable, all hold): "
        "key=value, key!=value, key>=n, key<n, 'key in a,b', page=2..5, "
        "folder=DIR, file=PATH, path=GLOB (docs/search.md#filters)",
    )
    _index_options(search)
    search.set_defaults(func=_cmd_search)

    meta = sub.add_parser(
        "meta", help="show or change the metadata of indexed files (nothing is embedded again)"
    )
    meta.add_argument("paths", nargs="+", metavar="PATH", help="indexed files or folders")
    meta.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="set a key (repeatable; merged into what the pages hold)",
    )
    meta.add_argument("--unset", action="append", metavar="KEY", help="remove a key (repeatable)")
    meta.add_argument(
        "--replace",
        action="store_true",
        help="replace the pages' metadata by the --set keys instead of merging",
    )
    meta.add_argument(
        "--page",
        action="append",
        type=_positive_int,
        metavar="N",
        help="only this page of each file (repeatable)",
    )
    _index_options(meta)
    meta.set_defaults(func=_cmd_meta)

    upgrade = sub.add_parser(
        "upgrade",
        help="rewrite an index folder written by an older colembed "
        "at the current schema (faster search, less disk; no "
        "page is embedded again)",
    )
    upgrade.add_argument("--db", required=True, help="the index folder (Qdrant Edge)")
    upgrade.add_argument("--quiet", action="store_true", help="no progress bar")
    upgrade.set_defaults(func=_cmd_upgrade)


SERVE_EXTRA_HINT = (
    "this command needs the serve extra (fastapi, uvicorn, python-multipart) and "
    "the index extra: pip install 'colembed[serve]'"
)


def _cmd_serve(args) -> int:
    """`colembed serve`: one process holding the model and the index (docs/serve.md)."""
    try:
        import uvicorn  # noqa: F401

        from .serve.app import Settings
        from .serve.hosts import AllowedHosts
        from .serve.limits import Limits
        from .serve.roots import Roots, parse_roots
        from .serve.run import API_KEY_ENV, check_exposure, serve
        from .serve.store_process import open_store_in_child
    except ImportError as e:
        raise SystemExit(f"colembed: {SERVE_EXTRA_HINT}\n  ({e})") from None
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    try:  # a command line that cannot be served: usage errors, before loading anything
        check_exposure(args.host, api_key, args.insecure)
        roots = Roots(parse_roots(args.allow_root or []))
        AllowedHosts(args.host, args.allowed_host or [])  # each --allowed-host parses
    except ColembedError as e:
        raise UsageError(str(e)) from None
    limits = Limits(**{name: getattr(args, name) for name in Limits.__dataclass_fields__})
    settings = Settings(
        api_key=api_key,
        cors_origins=args.cors_origin or [],
        host=args.host,
        allowed_hosts=args.allowed_host or [],
        roots=roots,
        limits=limits,
        workers=args.workers,
        queue=args.queue,
        render_workers=args.render_workers,
        max_queued_jobs=args.max_queued_jobs,
    )
    # an empty index is filled by jobs; a folder's store runs in a child process
    # (serve/store_process.py: an Edge search holds the GIL, the event loop must not wait)
    opener = None if args.store_in_process else open_store_in_child
    with _open_index(args, create=True, store_opener=opener) as index:
        serve(
            index,
            settings,
            host=args.host,
            port=args.port,
            insecure=args.insecure,
            log_level="warning" if args.quiet else "info",
        )
    return 0


def _add_serve_command(sub) -> None:
    from .serve.options import add_serve_options

    serve = sub.add_parser("serve", help="HTTP API (/v1) and a search page (/) over one index")
    add_serve_options(serve)
    _index_options(serve)
    serve.set_defaults(func=_cmd_serve)


def _cmd_doctor(args) -> int:
    from .doctor import run_doctor

    if args.measure:
        from .doctor import measure

        found = measure(Path(args.folder), threads=args.threads)
        print(json.dumps(found, indent=2))
        for key, label in (("fastest", "fastest here"), ("fastest_exact", "fastest exact")):
            row = found[key]
            fidelity = row["fidelity_vs_cpu_fp32"]
            print(
                f"{label}: {row['variant']} on {row['provider']}: page {row['page_s']:.3f} s, "
                f"query {row['query_s'] * 1e3:.0f} ms; vs CPU fp32 min token cosine "
                f"{fidelity['min_token_cosine']:.5f}, max abs diff {fidelity['max_abs_diff']:.2e}"
            )
        print(
            f'providers="auto" will use {found["fastest_exact"]["provider"]} for this folder here'
        )
        return 0
    report = run_doctor(Path(args.folder), providers=args.providers, variant=args.variant)
    print(json.dumps(report, indent=2))
    first = report["requested_providers"][0]
    off = {
        role: r["off_first_provider"]
        for role, r in report["placement"].items()
        if r["off_first_provider"]
    }
    parity = report["parity_vs_cpu_fp32"]
    print(
        f"variant {report['variant']} on {first}: "
        + ("every node placed there" if not off else f"nodes elsewhere: {off}")
        + f"; vs CPU fp32 max abs diff {parity['max_abs_diff']:.2e}, "
        f"min token cosine {parity['min_token_cosine']:.5f}"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="colembed", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    export = sub.add_parser(
        "export",
        help="export a ColQwen2 or ColQwen2.5 checkpoint (or LoRA adapter) to a colembed model folder",
    )
    export.add_argument(
        "source",
        help="checkpoint folder or Hugging Face repo id: transformers "
        "format (e.g. vidore/colqwen2-v1.0-hf), colpali-engine's "
        "ColQwen2.5 layout, or a LoRA adapter over one",
    )
    export.add_argument("--out", required=True, help="destination model folder")
    export.add_argument("--revision", help="hub revision (branch, tag or commit)")
    export.add_argument(
        "--base",
        help="base checkpoint folder of a PEFT LoRA adapter SOURCE "
        "(default: the adapter's base_model_name_or_path)",
    )
    export.add_argument("--name", help="model name recorded in the manifest (default: folder name)")
    export.add_argument("--opset", type=int, help="ONNX opset (default: the exporter's)")
    export.add_argument(
        "--tolerance",
        type=float,
        help="max abs difference per token of the final embeddings allowed by the "
        "check (default: the exporter's)",
    )
    export.add_argument(
        "--feature-tolerance",
        type=float,
        help="max abs difference of the image features relative to their largest "
        "value allowed by the check (default: the exporter's)",
    )
    export.add_argument(
        "--no-check",
        action="store_true",
        help="skip the onnxruntime-vs-torch check (not recommended)",
    )
    export.add_argument(
        "--max-memory",
        type=float,
        metavar="GB",
        help="refuse, before any work, an export whose plan (printed first: each step's "
        "expected peak) needs more than GB (default: refuse only when the graphs alone exceed "
        "the memory available now; warn for a check or variant step over it)",
    )
    export.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a colembed export of a different model (nothing but a "
        "colembed export is ever replaced)",
    )
    export.add_argument(
        "--random-weights",
        action="store_true",
        help="record in the manifest that the checkpoint has random weights "
        "(test and benchmark builds)",
    )
    export.add_argument(
        "--external-data",
        choices=("auto", "always", "never"),
        default="auto",
        help="weights in a separate .onnx_data file (auto: when over 1 GiB)",
    )
    export.add_argument(
        "--variant",
        default="",
        help="extra variants to derive and check against fp32, comma separated "
        "(int8, int4, fp16); fp32 is always written. int8 gets one int8 "
        "code per weight, or two when the gate refuses one (slower, closer "
        "to fp32)",
    )
    export.add_argument(
        "--int8-weight-passes",
        type=int,
        choices=(1, 2),
        help="int8 codes per weight, forced: 1 (refused if the gate refuses it) "
        "or 2 (default: 1, then 2 when the gate refuses 1)",
    )
    export.set_defaults(func=_cmd_export)

    demo = sub.add_parser(
        "demo",
        help="offline run on a tiny random-weight model built here: "
        "export, index PDFs and images, search, similarity maps",
    )
    demo.add_argument(
        "--out",
        default="demo_out",
        help="working folder (default ./demo_out); must be new, empty, or a "
        "previous demo's (never a folder with your files)",
    )
    demo.set_defaults(func=_cmd_demo)

    info = sub.add_parser("info", help="describe a model folder")
    info.add_argument("folder")
    info.set_defaults(func=_cmd_info)

    check = sub.add_parser(
        "check-variant",
        help="a variant against fp32 on your own queries and pages: worst token "
        "cosine per item and per kind of token, ranking agreement",
    )
    check.add_argument("folder", help="model folder (or a model name colembed knows)")
    check.add_argument("--variant", required=True, help="the variant to check (int8, int4, fp16)")
    check.add_argument(
        "--queries", required=True, help="UTF-8 text file, one query per line (blank lines skipped)"
    )
    check.add_argument(
        "--pages",
        required=True,
        help="a folder (or file) of PDFs and images; needs the index extra",
    )
    check.add_argument(
        "--max-pages",
        type=int,
        default=50,
        help="pages to render at most, in file order (default 50)",
    )
    check.add_argument(
        "--fail-below",
        type=float,
        metavar="COSINE",
        help="exit 1 when any token's cosine to fp32 is below COSINE",
    )
    check.add_argument("--json", action="store_true", help="the whole report as JSON")
    check.set_defaults(func=_cmd_check_variant)
    _add_index_commands(sub)

    doctor = sub.add_parser(
        "doctor",
        help="check node placement on this machine's providers and parity against CPU fp32",
    )
    doctor.add_argument("folder")
    doctor.add_argument(
        "--providers",
        default="auto",
        help="auto (DirectML when available), cpu, directml, openvino, ... (default auto)",
    )
    doctor.add_argument(
        "--variant",
        help="variant to check (default: fp16 on DirectML, openvino on OpenVINO, else fp32)",
    )
    doctor.add_argument(
        "--measure",
        action="store_true",
        help="time every variant on every provider that runs it here, with its "
        'fidelity to CPU fp32; name the fastest, and let providers="auto" '
        "use the fastest exact one for this folder",
    )
    doctor.add_argument(
        "--threads", type=_positive_int, help="threads for --measure (default: physical cores)"
    )
    doctor.set_defaults(func=_cmd_doctor)
    _add_serve_command(sub)
    _add_eval_command(sub)
    return parser


def _cmd_eval(args) -> int:
    """`colembed eval DATASET --model M`: search quality on a labelled set (docs/eval.md)."""
    try:
        from .evaluation.run import DEFAULT_MODES, evaluate
    except ImportError as e:
        raise SystemExit(f"colembed: {INDEX_EXTRA_HINT}\n  ({e})") from None
    report = evaluate(
        args.dataset,
        args.model,
        variants=args.variant or [BASE_VARIANT],
        budgets=args.max_image_tokens or [None],
        modes=args.mode or DEFAULT_MODES,
        k=args.k,
        split=args.split,
        work=args.work,
        dim=args.dim,
        progress=False if args.quiet or args.json else None,
        note=None if args.quiet or args.json else _progress,
    )
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
        return EXIT_OK
    print(
        f"{report.dataset}: {report.queries} queries scored ({report.skipped_queries} without "
        f"a relevant label left out), {report.corpus_pages} corpus pages, "
        f"{report.unknown_labels} relevant label(s) naming no corpus page"
    )
    print(report.table())
    return EXIT_OK


def _add_eval_command(sub) -> None:
    ev = sub.add_parser(
        "eval",
        help="nDCG@k, recall@k and MRR@k of search on a labelled set "
        "(BEIR-style or ViDoRe / MTEB Parquet folder), per mode, "
        "variant and image-token budget",
    )
    ev.add_argument("dataset", help="the labelled set's folder (docs/eval.md: layouts)")
    ev.add_argument("--model", required=True, help="model folder or name")
    ev.add_argument(
        "--variant", action="append", help=f"graph variant (repeatable; default {BASE_VARIANT})"
    )
    ev.add_argument(
        "--max-image-tokens",
        type=_positive_int,
        action="append",
        help="image-token budget (repeatable; default: the model's)",
    )
    ev.add_argument(
        "--dim",
        type=_positive_int,
        help="keep each vector's first DIM components, renormalised (default: the model's "
        "full width); only for models trained with Matryoshka losses",
    )
    ev.add_argument(
        "--mode",
        action="append",
        choices=("two-stage", "exact", "hybrid"),
        help="search mode (repeatable; default all three)",
    )
    ev.add_argument(
        "-k", type=_positive_int, default=10, help="cut-off of the metrics (default 10)"
    )
    ev.add_argument("--split", default="test", help="the labels' split (default test)")
    ev.add_argument(
        "--work",
        help="folder for the run's indexes, kept and reused (default: a "
        "temporary folder, removed at the end)",
    )
    _output_options(ev)
    ev.set_defaults(func=_cmd_eval)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "index":
        if args.ray is not None and not _is_ray_address(args.ray):
            args.paths.insert(0, args.ray)  # `--ray docs/`: a path, not an address
            args.ray = "local"
        if not args.paths and not args.from_parquet:
            parser.error("index: give at least one PATH (or --from-parquet DIR)")
    return args


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 done, 1 a runtime failure (an error, or files that failed), 2 a usage error,
    130 interrupted (Ctrl-C: what was stored is kept)."""
    args = _parse(argv)
    try:
        return args.func(args)
    except UsageError as e:
        print(f"colembed {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except ColembedError as e:
        print(f"colembed: error: {e}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print(
            f"\ncolembed: {RESUME_HINT}" if args.command == "index" else "\ncolembed: interrupted",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    raise SystemExit(main())
