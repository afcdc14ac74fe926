"""The `colembed` command. `print` lives here and nowhere else in the package.

    colembed export SOURCE --out DIR     checkpoint -> verified model folder (needs the export extra)
    colembed demo [--out DIR]            offline end-to-end run on a tiny RANDOM-WEIGHT model
    colembed info DIR                    what a model folder holds
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .errors import ColembedError

EXPORT_EXTRA_HINT = ("this command needs the export extra (torch, transformers, onnx): "
                     "pip install 'colembed[export]'  (on these machines: pip install torch==2.13.0 "
                     "first; never torchvision)")


def _import_export_package():
    try:
        import onnx  # noqa: F401
        import torch  # noqa: F401
        import transformers  # noqa: F401

        import colembed_export.exporter as exporter
    except ImportError as e:
        raise SystemExit(f"colembed: {EXPORT_EXTRA_HINT}\n  ({e})") from None
    return exporter


def _progress(message: str) -> None:
    print(f"[colembed] {message}", file=sys.stderr, flush=True)


def _cmd_export(args) -> int:
    exporter = _import_export_package()
    # Options left unset take the exporter's defaults (colembed_export/constants.py).
    given = {k: getattr(args, k) for k in ("opset", "tolerance", "feature_tolerance")
             if getattr(args, k) is not None}
    report = exporter.export_model(
        args.source, args.out, revision=args.revision, name=args.name, **given,
        check=not args.no_check, overwrite=args.overwrite, random_weights=args.random_weights,
        external_data={"auto": None, "always": True, "never": False}[args.external_data],
        variants=tuple(v for v in (args.variant or "").split(",") if v),
        progress=_progress,
    )
    check = report.check.get("fp32")
    if check:
        print(f"check passed: max abs diff {check['max_abs_diff']:.2e} <= {check['tolerance']:.0e} "
              f"per token, image features within {check['max_relative_feature_diff']:.1e} of "
              f"their scale, over {check['pages']} pages and {check['queries']} queries")
    for name, figures in report.check.items():
        if name != "fp32":
            print(f"{name}: per-token cosine to fp32 mean {figures['mean_cosine']:.5f}, "
                  f"min {figures['min_cosine']:.5f}")
    print(f"model folder: {report.folder}")
    return 0


def _cmd_demo(args) -> int:
    _import_export_package()
    from colembed_export.demo import run_demo

    run_demo(Path(args.out), overwrite=True, progress=_progress)
    return 0


def _cmd_info(args) -> int:
    from .manifest import read_manifest

    manifest = read_manifest(Path(args.folder))
    summary = {
        "model": manifest.model,
        "embedding_dim": manifest.embedding_dim,
        "variants": {v: {r: g.file for r, g in gs.items()} for v, gs in manifest.variants.items()},
        "scorer": manifest.scorer.file if manifest.scorer else None,
        "max_pixels": manifest.preprocess.get("max_pixels"),
        "checks": manifest.checks,
        "versions": manifest.versions,
    }
    print(json.dumps(summary, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="colembed", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    export = sub.add_parser("export", help="export a ColQwen2 checkpoint to a colembed model folder")
    export.add_argument("source", help="checkpoint folder or Hugging Face repo id "
                                       "(transformers format, e.g. vidore/colqwen2-v1.0-hf)")
    export.add_argument("--out", required=True, help="destination model folder")
    export.add_argument("--revision", help="hub revision (branch, tag or commit)")
    export.add_argument("--name", help="model name recorded in the manifest (default: folder name)")
    export.add_argument("--opset", type=int, help="ONNX opset (default: the exporter's)")
    export.add_argument("--tolerance", type=float,
                        help="max abs difference per token of the final embeddings allowed by the "
                             "check (default: the exporter's)")
    export.add_argument("--feature-tolerance", type=float,
                        help="max abs difference of the image features relative to their largest "
                             "value allowed by the check (default: the exporter's)")
    export.add_argument("--no-check", action="store_true",
                        help="skip the onnxruntime-vs-torch check (not recommended)")
    export.add_argument("--overwrite", action="store_true",
                        help="replace a colembed export of a different model (nothing but a "
                             "colembed export is ever replaced)")
    export.add_argument("--random-weights", action="store_true",
                        help="record in the manifest that the checkpoint has random weights "
                             "(test and benchmark builds)")
    export.add_argument("--external-data", choices=("auto", "always", "never"), default="auto",
                        help="weights in a separate .onnx_data file (auto: when over 1 GiB)")
    export.add_argument("--variant", default="",
                        help="extra variants to derive and check against fp32, comma separated "
                             "(int8, int4, fp16); fp32 is always written")
    export.set_defaults(func=_cmd_export)

    demo = sub.add_parser("demo", help="offline run on a tiny random-weight model built here")
    demo.add_argument("--out", default="demo_out", help="working folder (default ./demo_out)")
    demo.set_defaults(func=_cmd_demo)

    info = sub.add_parser("info", help="describe a model folder")
    info.add_argument("folder")
    info.set_defaults(func=_cmd_info)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ColembedError as e:
        print(f"colembed: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
