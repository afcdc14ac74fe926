"""bench_embed's figures and tables: FLOP/s, peak fractions and speed-ups derived from the
workers' timings, the accuracy of each variant against colembed fp32, the `--profile` split and
the markdown of results/embed/embed*.md."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parents[1]  # the benchmarks folder

from benchmarks.shared.common import BUDGET_TOKENS, LETTER_150DPI, markdown_header  # noqa: E402
from benchmarks.embed.worker import QUANTISED_GEMM_OPS  # noqa: E402
from benchmarks.shared.flops import Shapes, page_flops, text_flops  # noqa: E402

from colembed.layout import BASE_VARIANT, MANIFEST_NAME, TOKENIZER_FILE  # noqa: E402


def folder_bytes(folder: Path, variant: str) -> int:
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    files = {
        f for g in manifest["variants"][variant].values() for f in (g["file"], g["data_file"]) if f
    }
    return sum((folder / f).stat().st_size for f in files | {TOKENIZER_FILE})


def derive(
    rows: dict[str, dict], shapes: Shapes, peaks: dict, folder: Path, checkpoint: Path
) -> None:
    """Add FLOP/s, peak fractions, speed-ups and memory ratios to each runtime's figures."""
    torch_row = rows.get("torch", {})
    for name, r in rows.items():
        if "error" in r:
            continue
        page = page_flops(shapes, r["letter_image_tokens"], r["letter_rows"])
        r["pages_per_s"] = 1 / r["page_s"]["median"]
        budget = r.get("budget_page_s")  # absent with --no-budget-page
        r["budget_pages_per_s"] = budget and 1 / budget["median"]
        r["queries_per_s_batch16"] = 16 / r["batch16_s"]["median"]
        r["page_gflops"] = page["total"] / r["page_s"]["median"] / 1e9
        r["page_flops"] = page
        r["page_fraction_fp32_peak"] = r["page_gflops"] / peaks["fp32_gflops"]
        r["page_fraction_int8_peak"] = r["page_gflops"] / peaks["int8_gops"]
        query_flops = sum(text_flops(shapes, n) for n in r["query_rows"])
        r["batch16_gflops"] = query_flops / r["batch16_s"]["median"] / 1e9
        r["load_peak_over_base_mib"] = r["peak_rss_load_mib"] - r["rss_base_mib"]
        size = (
            folder_bytes(folder, r["variant"])
            if r["runtime"] == "colembed"
            else sum(p.stat().st_size for p in checkpoint.glob("*.safetensors"))
        )
        r["files_mib"] = size / 2**20
        r["load_rss_over_files"] = r["load_peak_over_base_mib"] / r["files_mib"]
        bf16 = rows.get("torch-bf16", {})
        if bf16 and "error" not in bf16 and r["runtime"] == "colembed":
            r["speedup_vs_torch_bf16"] = {
                "pages": r["pages_per_s"] / bf16["pages_per_s"],
                "query_latency": bf16["query_latency_s"]["median"] / r["query_latency_s"]["median"],
            }
        if torch_row and "error" not in torch_row and name != "torch":
            r["speedup_vs_torch"] = {
                "pages": r["pages_per_s"] / torch_row["pages_per_s"],
                "budget_pages": r["budget_pages_per_s"]
                and torch_row["budget_pages_per_s"]
                and r["budget_pages_per_s"] / torch_row["budget_pages_per_s"],
                "query_latency": torch_row["query_latency_s"]["median"]
                / r["query_latency_s"]["median"],
                "batch16": r["queries_per_s_batch16"] / torch_row["queries_per_s_batch16"],
            }
        split = time_split(r, peaks)
        if split:
            r["time_split"] = split


def time_split(r: dict[str, Any], peaks: dict[str, Any]) -> dict[str, Any] | None:
    """Where a profiled page's time went, and the int8 bound: the page's x torch if every
    quantised GEMM ran at the measured int8 peak and everything else took what it took (the fp32
    kernels, the runtime between kernels, host preprocessing). A target above the bound cannot be
    met by faster GEMMs; only the rest can move it."""
    prof = r.get("profile")
    if not prof:
        return None
    kernels = list(prof["kernels"].values())
    graphs = sum(k["run_s"] for k in kernels)
    by_op: dict[str, float] = {}
    for k in kernels:
        for op, seconds in k["by_op"].items():
            by_op[op] = by_op.get(op, 0.0) + seconds
    quantised = sum(v for op, v in by_op.items() if op in QUANTISED_GEMM_OPS)
    fp32_ops = {op: v for op, v in by_op.items() if op not in QUANTISED_GEMM_OPS}
    page = prof["host_s"] + graphs
    split = {
        "page_s": page,
        "host_s": prof["host_s"],
        "graphs_s": graphs,
        "quantised_gemm_s": quantised,
        "fp32_kernels_s": sum(fp32_ops.values()),
        "between_kernels_s": graphs - sum(by_op.values()),
        "fp32_by_op": dict(sorted(fp32_ops.items(), key=lambda kv: -kv[1])),
    }
    if quantised:
        near = prof.get("peaks", peaks)
        int8_peak, fp32_peak = near["int8_gops"] * 1e9, near["fp32_gflops"] * 1e9
        gemm_ops, attention = r["page_flops"]["weight_gemms"], r["page_flops"]["attention"]
        split["quantised_gemm_fraction_int8_peak"] = gemm_ops / quantised / int8_peak
        split["bound_page_fraction"] = (page - quantised + gemm_ops / int8_peak) / page
        # no cost but the matrix products, each at its peak: what no kernel work can beat
        split["light_page_fraction"] = (gemm_ops / int8_peak + attention / fp32_peak) / page
        pages = r.get("speedup_vs_torch", {}).get("pages")
        if pages:
            split["bound_x_torch"] = pages / split["bound_page_fraction"]
            split["light_x_torch"] = pages / split["light_page_fraction"]
    return split


def accuracy(work: Path, names: list[str]) -> dict[str, Any]:
    """Each variant's embeddings vs colembed fp32's (and fp32 vs torch on the letter page)."""
    import numpy as np

    from colembed_export.variants.gates import cosine_figures
    from benchmarks.shared.retrieval import maxsim_scores, topk_agreement

    def load(name):
        path = work / f"emb-{name}.npz"
        if not path.is_file():
            return None
        data = np.load(path)
        group = (  # noqa: E731
            lambda prefix: [
                data[k]
                for k in sorted(
                    (k for k in data.files if k.startswith(prefix) and k[len(prefix) :].isdigit()),
                    key=lambda k: int(k[len(prefix) :]),
                )
            ]
        )
        return {"letter": data["letter"], "q": group("q"), "rp": group("rp"), "rq": group("rq")}

    ref = load(BASE_VARIANT)
    out: dict[str, Any] = {}
    if ref is None:
        return out
    fp32_scores = maxsim_scores(ref["rq"], ref["rp"]) if ref["rp"] else None
    for name in names:
        got = load(name)
        if got is None:
            continue
        figures = cosine_figures(
            [got["letter"], *got["rp"]],
            [ref["letter"], *ref["rp"]],
            got["q"] + got["rq"],
            ref["q"] + ref["rq"],
        )
        if fp32_scores is not None:
            figures["top5"] = topk_agreement(
                maxsim_scores(got["rq"], got["rp"]), fp32_scores, k=5, tie=0.005
            )
        out[name] = figures
    return out


def fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def markdown(results: dict[str, Any]) -> str:
    rows, peaks, m = results["runtimes"], results["peaks"], results["machine"]
    s = results["setting"]
    # the letter page's image tokens as measured: 744 for 28-px tokens, ColQwen3's 32-px tokens
    # under its 1280-token bound give another count
    letter = next(
        (r["letter_image_tokens"] for r in rows.values() if "letter_image_tokens" in r), "?"
    )
    lines = [
        f"# Embedding benchmark ({s['vision_depth']} vision + {s['text_layers']} language layers, "
        f"{s['model']})",
        "",
        markdown_header(m),
        f"- threads: {s['threads']} (intra-op = physical cores); fp32 GEMM peak "
        f"{peaks['fp32_gflops']:.0f} GFLOP/s ({peaks['fp32_how']}); int8 peak "
        f"{peaks['int8_gops']:.0f} GOP/s ({peaks['int8_how']})",
        f"- page: letter at 150 dpi ({LETTER_150DPI[0]}x{LETTER_150DPI[1]} px -> {letter} image "
        f"tokens) and the same page at a {BUDGET_TOKENS}-token budget; batch 1, end to end "
        "(preprocessing included); medians",
        "",
        f"| runtime | pages/s {letter} tok | pages/s {BUDGET_TOKENS} tok | query p50 ms | "
        "query p90 ms | queries/s @16 | page GFLOP/s | % fp32 peak | % int8 peak | x torch pages | "
        "x torch q-latency | x torch q/s@16 | x torch-bf16 pages | x torch-bf16 q-latency | "
        "files MiB | load peak RSS MiB (x files) | embed peak RSS MiB | load s |",
        "|" + "---|" * 18,
    ]
    for name, r in rows.items():
        if "error" in r:
            lines.append(f"| {name} | error: {r['error'][:80]!r} |")
            continue
        sp = r.get("speedup_vs_torch", {})
        sb = r.get("speedup_vs_torch_bf16", {})
        lines.append(
            f"| {name} | {fmt(r['pages_per_s'], '.3f')} | {fmt(r['budget_pages_per_s'], '.3f')} | "
            f"{r['query_latency_s']['median'] * 1e3:.0f} | {r['query_latency_s']['p90'] * 1e3:.0f} | "
            f"{r['queries_per_s_batch16']:.1f} | {r['page_gflops']:.0f} | "
            f"{100 * r['page_fraction_fp32_peak']:.0f}% | "
            f"{100 * r['page_fraction_int8_peak']:.0f}% | {fmt(sp.get('pages'))} | "
            f"{fmt(sp.get('query_latency'))} | {fmt(sp.get('batch16'))} | "
            f"{fmt(sb.get('pages'))} | {fmt(sb.get('query_latency'))} | {r['files_mib']:.0f} | "
            f"{r['load_peak_over_base_mib']:.0f} ({r['load_rss_over_files']:.2f}x) | "
            f"{r['peak_rss_embed_mib']:.0f} | {r['load_s']:.1f} |"
        )
    for name, message in results.get("gate_misses", {}).items():
        lines.append(
            f"| {name} | not written: export gate missed ({message.splitlines()[-1].strip()}) |"
        )
    acc = results.get("accuracy", {})
    if acc:
        pages = s.get("retrieval_pages", 100)
        retrieval = (
            f"{pages}-page synthetic retrieval set with 20 queries" if pages else "no retrieval set"
        )
        lines += [
            "",
            f"Accuracy against colembed fp32 (letter page, 16 queries, {retrieval}; random "
            "weights: necessary, not sufficient)",
            "",
            "| variant | mean token cosine | min token cosine | top-5 same set | "
            "top-5 within 0.5% ties | gate |",
            "|---|---|---|---|---|---|",
        ]
        from colembed_export.variants.recipes import GATES

        for name, a in acc.items():
            # the fp16 peak is measured at export: judged in the exporter's gate table below
            gate = GATES.get(name) and dataclasses.replace(GATES[name], fp16_peak=None)
            ok = "-" if gate is None else ("pass" if not gate.misses(a) else "MISS")
            lines.append(
                f"| {name} | {a['mean_cosine']:.5f} | {a['min_cosine']:.5f} | "
                + (
                    f"{100 * a['top5']['same_set']:.0f}% | {100 * a['top5']['within_ties']:.0f}% "
                    if "top5" in a
                    else "- | - "
                )
                + f"| {ok} |"
            )
    lines += target_markdown(rows)
    lines += compiled_markdown(rows)
    lines += split_markdown(rows)
    lines += gate_markdown(results.get("gates", {}))
    opt = results.get("optimiser")
    if opt and "error" not in opt:
        lines += [
            "",
            "onnxruntime transformer optimiser on the fp32 graphs "
            f"({opt['vision']['tokens']} image tokens):",
            "",
            "| graph | fusions fired | op delta (optimiser) | op delta (session level ALL) | "
            "graph s exported -> optimised |",
            "|---|---|---|---|---|",
        ]
        for role in ("vision", "text"):
            o = opt[role]
            lines.append(
                f"| {role} ({o['model_type']}) | {o['fusions']} | "
                f"{o['op_delta_transformer_optimiser']} | {o['op_delta_ort_session_all']} | "
                f"{o['graph_s']['exported']:.3f} -> "
                f"{o['graph_s']['transformer_optimiser']:.3f} |"
            )
    return "\n".join(lines) + "\n"


# Speed targets against the torch reference, per page (744 image tokens), in the same run.
TARGETS = {BASE_VARIANT: 1.0, "int8": 2.5}
# ... and against torch bf16 SDPA (pages, single-query latency), the full-depth targets of the
# reduced-precision variants
TARGETS_VS_BF16 = {name: (1.5, 2.0) for name in ("int8", "openvino-bf16", "openvino-int8")}


def target_markdown(rows: dict[str, dict[str, Any]]) -> list[str]:
    """Each target variant's page speed-up over torch against its target."""
    lines = []
    for name, target in TARGETS.items():
        ratio = rows.get(name, {}).get("speedup_vs_torch", {}).get("pages")
        if ratio is not None:
            lines.append(
                f"{name} {ratio:.2f}x torch per page (target >= {target}x: "
                f"{'met' if ratio >= target else 'MISSED'})"
            )
    for name, (pages, query) in TARGETS_VS_BF16.items():
        ratio = rows.get(name, {}).get("speedup_vs_torch_bf16")
        if ratio:
            met = ratio["pages"] >= pages and ratio["query_latency"] >= query
            lines.append(
                f"{name} {ratio['pages']:.2f}x torch bf16 per page, "
                f"{ratio['query_latency']:.2f}x per query (target >= {pages}x / "
                f">= {query}x: {'met' if met else 'MISSED'})"
            )
    return ["", "Targets: " + "; ".join(lines)] if lines else []


def compiled_markdown(rows: dict[str, dict[str, Any]]) -> list[str]:
    """What OpenVINO compiled for each OpenVINO row (its compiled models' properties, not the
    hints asked for: a bf16 request compiles f32 on a CPU without bf16 arithmetic)."""
    lines = []
    for name, r in rows.items():
        compiled = r.get("openvino_compiled")
        if compiled:
            roles = ", ".join(
                f"{role} {p['INFERENCE_PRECISION_HINT']} ({p['EXECUTION_MODE_HINT']}, "
                f"dynamic quantisation group {p.get('DYNAMIC_QUANTIZATION_GROUP_SIZE', '-')})"
                for role, p in compiled.items()
            )
            lines.append(f"{name}: {roles}")
    return (
        ["", "OpenVINO compiled (inference precision, execution mode): " + "; ".join(lines)]
        if lines
        else []
    )


def split_markdown(rows: dict[str, dict[str, Any]]) -> list[str]:
    """The `--profile` table: one profiled letter page per variant, and the int8 bound."""
    split = {name: r["time_split"] for name, r in rows.items() if r.get("time_split")}
    if not split:
        return []
    lines = [
        "",
        "Where a letter page's time goes (`--profile`: onnxruntime's profiler on the page's "
        "own feeds, one run after a warm-up; seconds)",
        "",
        "| runtime | page | host (preprocessing, Python) | quantised GEMMs (% of int8 peak) | "
        "fp32 kernels: largest op types | between kernels | bound x torch | "
        "light x torch |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, t in split.items():
        top = ", ".join(f"{op} {v:.2f}" for op, v in list(t["fp32_by_op"].items())[:6])
        gemms = (
            f"{t['quantised_gemm_s']:.2f} ({100 * t['quantised_gemm_fraction_int8_peak']:.0f}%)"
            if t["quantised_gemm_s"]
            else "-"
        )
        lines.append(
            f"| {name} | {t['page_s']:.2f} | {t['host_s']:.2f} | {gemms} | "
            f"{t['fp32_kernels_s']:.2f}: {top} | {t['between_kernels_s']:.2f} | "
            f"{fmt(t.get('bound_x_torch'))} | {fmt(t.get('light_x_torch'))} |"
        )
    lines += [
        "",
        "bound x torch: the page's x torch if every quantised GEMM ran at the int8 peak "
        "(measured beside the profile) and everything else took what it took here; light x "
        "torch: if the page cost nothing but its weight GEMMs at the int8 peak and its "
        "attention products at the fp32 peak.",
    ]
    return lines


def gate_markdown(gates: dict[str, dict[str, Any]]) -> list[str]:
    """The exporter's variant gates per checkpoint: per-token cosine to fp32 over its sample pages
    and queries, top-1 agreement on its clear-winner ranking set (colembed_export.variants.gates)."""
    if not gates:
        return []
    labels = sorted(
        {label for per in gates.values() for label in per},
        key=lambda label: label != "random weights",
    )
    lines = [
        "",
        "Variant gates as the exporter checked them (per-token cosine to fp32, mean / min; "
        "top-1 agreement on the clear-winner ranking set)",
        "",
        "| variant | "
        + " | ".join(f"{x}: mean / min cosine | {x}: top-1 | {x}: gate" for x in labels)
        + " |",
        "|---|" + "---|---|---|" * len(labels),
    ]
    for name, per in gates.items():
        cells = []
        for label in labels:
            f = per.get(label)
            if f is None:
                cells += ["-", "-", "-"]
                continue
            from colembed_export.variants.recipes import GATES

            ok = "pass" if not GATES[name].misses(f) else "MISS"
            cells += [
                f"{f['mean_cosine']:.5f} / {f['min_cosine']:.5f}",
                f"{100 * f['ranking']['top1_agreement']:.0f}% of {f['ranking']['queries']}",
                ok,
            ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines
