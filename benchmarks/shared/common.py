"""What the benchmarks share: machine facts, the documents they embed, subprocess runners, tables.

- machine facts: `machine.py` (CPU, instruction sets, load, versions, command), re-exported here so
  a benchmark needs one import;
- documents: a letter page at 150 dpi (1275x1650 px -> 744 image tokens under ColQwen2's bound), the
  same page at a token budget, 20 report-style queries, `QUERY_WORDS` (a vocabulary for queries of
  any length) and `make_pdfs` (multi-page PDFs of text lines, what `colembed index` reads). They
  model what a retrieval user sends (text-heavy scanned pages, a chart; short questions and keyword
  queries); they do not model photos, very long queries or other languages;
- models: `BENCH_WORKDIR` (where benchmark checkpoints and exports are cached between runs) and
  `tiny_folder` (the tiny random-weight model, exported once);
- `run_json_subprocess`: one job in a fresh interpreter (its own peak RSS), answer on a RESULT line;
- `Worker`: a long-lived interpreter that answers JSON commands line by line, so two runtimes (two
  versions of colembed, or colembed and torch) stay loaded side by side and one driver can time them
  interleaved (A B A B ...) on the same machine state;
- `markdown_table`, `timed`, `median_seconds`, `spread`, `load_caveat`, `load_line`: the table and timing conventions;
- `results_markdown`, `write_results`: a results file pair (NAME.md with the machine header,
  NAME.json with the machine facts), written the same way by every benchmark that uses them;
  `report_results`: the page printed and, given a path, the pair written; `write_note`: the pair
  from a run's own dict (its "machine" inside) and its page.

Imports only the standard library at module level (the documents import numpy and PIL when made).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

HERE = Path(__file__).resolve().parents[1]  # the benchmarks folder

from benchmarks.shared.machine import load_average, machine_info, markdown_header, rss_mib  # noqa: E402,F401

LETTER_150DPI = (1275, 1650)  # width, height in pixels: 8.5 x 11 in at 150 dpi
BUDGET_TOKENS = 256
QUERIES = [
    "What was the total revenue in the third quarter?",
    "Which region reported the highest growth?",
    "operating margin 2023",
    "Who signed the audit report?",
    "List the risks related to currency exchange rates",
    "How many employees work in research and development?",
    "capital expenditure forecast",
    "What is the dividend per share?",
    "Describe the supply chain disruptions mentioned in the report",
    "net income",
    "Where is the company headquartered?",
    "What does the chart on page two show?",
    "energy consumption per unit of output",
    "Which subsidiaries were sold during the year?",
    "What are the main product lines?",
    "tax rate reconciliation",
    "When does the credit facility mature?",
    "How did inventory levels change?",
    "customer concentration risk",
    "What accounting standards were adopted?",
]
QUERY_WORDS = "what was the total revenue growth of the company in 2023 by region".split()
# checkpoints and exports the benchmarks build are cached here (bench_embed.py's --workdir default)
BENCH_WORKDIR = Path(
    os.environ.get("COLEMBED_BENCH_DIR", Path.home() / ".cache" / "colembed-bench")
)
# The environment every benchmark subprocess gets: no tokenizer threads competing with the
# measured ones, no network look-ups by transformers.
SUBPROCESS_ENV = {
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}


# ------------------------------------------------------------------------------------ documents
def letter_page():
    """A letter-size page at 150 dpi with lines of text and a chart, deterministic."""
    import numpy as np
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(7)
    width, height = LETTER_150DPI
    page = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(page)
    draw.text((90, 80), "Annual report 2023 - consolidated results", fill="black")
    for row in range(60):
        y = 140 + row * 22
        words = " ".join(rng.choice(QUERIES[row % len(QUERIES)].split(), 6))
        draw.text((90, y), words, fill=(30, 30, 30))
    for bar in range(8):
        h = int(rng.integers(40, 300))
        draw.rectangle([700 + bar * 55, 1500 - h, 740 + bar * 55, 1500], fill=(40, 90, 160))
    return page


def image_tokens(page, config) -> int:
    """Image tokens of a page under the model's own bound (`config`: its PreprocessConfig;
    ColQwen2 was trained with at most 768)."""
    from colembed.preprocess.images import smart_resize

    f = config.resize_factor
    h, w = smart_resize(
        page.height,
        page.width,
        factor=f,
        min_pixels=config.min_pixels,
        max_pixels=config.max_pixels,
    )
    return (h // f) * (w // f)


def budget_page(page, tokens: int, config):
    """The page resized as a `tokens` budget resizes it (`config.with_max_image_tokens(tokens)`),
    so a model with its default bound processes exactly the budgeted grid."""
    from PIL import Image

    from colembed.preprocess.images import smart_resize

    budget = config.with_max_image_tokens(tokens)
    h, w = smart_resize(
        page.height,
        page.width,
        factor=budget.resize_factor,
        min_pixels=budget.min_pixels,
        max_pixels=budget.max_pixels,
    )
    return page.resize((w, h), Image.BICUBIC)


def make_pdfs(folder: Path, files: int, pages: int) -> None:
    """`files` PDFs `doc{f}.pdf` of `pages` letter pages at 150 dpi, 40 lines of text each (the
    text is rendered as an image: a scanned document, what the index's render thread reads)."""
    from PIL import Image, ImageDraw

    folder.mkdir(parents=True, exist_ok=True)
    for f in range(files):
        images = []
        for p in range(pages):
            im = Image.new("RGB", LETTER_150DPI, "white")
            draw = ImageDraw.Draw(im)
            for line in range(40):
                draw.text(
                    (100, 100 + 36 * line), f"file {f} page {p} line {line} " * 4, fill="black"
                )
            images.append(im)
        images[0].save(
            folder / f"doc{f}.pdf", save_all=True, append_images=images[1:], resolution=150
        )


# ------------------------------------------------------------------------------------ models
def tiny_folder(work: Path) -> Path:
    """The tiny random-weight model, exported into `work` on first use (needs the export extra),
    in a child process so that torch never counts in this process's RSS."""
    folder = work / "tiny"
    if not (folder / "colembed_manifest.json").is_file():
        script = (
            "import sys; from pathlib import Path\n"
            "from colembed_export.pipeline.exporter import export_model\n"
            "from colembed_export.testing.tiny_qwen2 import build_checkpoint\n"
            "w = Path(sys.argv[1])\n"
            "export_model(build_checkpoint(w / 'checkpoint', 'tiny', seed=0), w / 'tiny')\n"
        )
        subprocess.run([sys.executable, "-c", script, str(work)], check=True)
    return folder


# ------------------------------------------------------------------------------------ timing
def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def median_seconds(fn: Callable[[], Any], rounds: int, *, warm_up: bool = False) -> float:
    """Median wall seconds of `rounds` calls of `fn`, after one untimed call with `warm_up`."""
    if warm_up:
        fn()
    return statistics.median([timed(fn) for _ in range(rounds)])


def spread(values: Sequence[float]) -> dict[str, float]:
    """median, min, max and the relative half-range (max - min) / 2 / median of `values`."""
    med = statistics.median(values)
    return {
        "median": med,
        "min": min(values),
        "max": max(values),
        "half_range": (max(values) - min(values)) / 2 / med if med else 0.0,
        "n": len(values),
    }


def load_caveat(results: dict) -> str:
    """Say that absolute times are inflated only when the load average (`results["load_before"]`,
    `["load_after"]`, from `load_average()`) shows other work ran."""
    loads = [max(results.get(key) or [0.0]) for key in ("load_before", "load_after")]
    if max(loads) <= 0.75 * (os.cpu_count() or 1):
        return " (a quiet machine)."
    return (
        " (other processes held the cores during the run: absolute times are inflated and "
        "matter less than the ratios between rows of one table)."
    )


def load_line(results: dict) -> str:
    """The results' header line on machine load: the load averages before and after the run,
    this machine's core count and `load_caveat`, so a reader weighs the times against them."""
    return (
        f"Load average before / after: {results.get('load_before')} / "
        f"{results.get('load_after')} on {os.cpu_count()} cores" + load_caveat(results)
    )


# ------------------------------------------------------------------------------------ processes
def run_json_subprocess(
    argv: Sequence[str],
    *,
    timeout: float,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
) -> dict[str, Any]:
    """Run `argv` in a fresh process; its answer is the last stdout line starting with RESULT
    (JSON). A crash or a missing answer is returned as {"error": ...} with stderr's tail."""
    proc = subprocess.run(
        list(argv),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=dict(os.environ, **SUBPROCESS_ENV, **(env or {})),
    )
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    return {"error": f"exit {proc.returncode}: {proc.stderr[-2000:]}"}


class Worker:
    """A long-lived Python process answering one JSON command per line (`serve` is its loop).

    The driver sends {"op": ..., ...} and reads back one JSON line: the handler's return value, or
    {"error": ...}. Between commands the worker blocks on stdin, so it uses no CPU while another
    worker is being timed (colembed's sessions do not spin; torch's threads sleep).
    """

    def __init__(
        self,
        label: str,
        argv: Sequence[str],
        *,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
    ) -> None:
        self.label = label
        self.proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=None,
            text=True,
            bufsize=1,
            cwd=cwd,
            env=dict(os.environ, **SUBPROCESS_ENV, **(env or {})),
        )

    def call(self, op: str, **args: Any) -> dict[str, Any]:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"worker {self.label} exited ({self.proc.wait()}) during {op}")
            if line.startswith("ANSWER "):
                answer = json.loads(line[len("ANSWER ") :])
                if "error" in answer:
                    raise RuntimeError(f"worker {self.label}, {op}: {answer['error']}")
                return answer

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("quit")
            except (RuntimeError, BrokenPipeError, OSError):
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def __enter__(self) -> "Worker":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def serve(handlers: dict[str, Callable[..., dict[str, Any]]]) -> int:
    """The worker's loop: one JSON command per stdin line, one `ANSWER {json}` line per command
    (other output of the libraries goes to stdout too, so answers are tagged)."""
    import traceback

    for line in sys.stdin:
        command = json.loads(line)
        op = command.pop("op")
        if op == "quit":
            print("ANSWER {}", flush=True)
            return 0
        try:
            answer = handlers[op](**command)
        except Exception as e:  # noqa: BLE001  (the driver reports it; the worker serves on)
            answer = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"}
        print("ANSWER " + json.dumps(answer), flush=True)
    return 0


# ------------------------------------------------------------------------------------ tables
def markdown_table(
    headers: Sequence[str], rows: Sequence[Sequence[Any]], align_right_from: int = 1
) -> list[str]:
    """A markdown table: `headers`, then `rows` (cells str()-ed); columns from
    `align_right_from` on are right-aligned (numbers)."""
    out = [
        "| " + " | ".join(headers) + " |",
        "|"
        + "|".join("---" if i < align_right_from else "---:" for i in range(len(headers)))
        + "|",
    ]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return out


def results_markdown(title: str, info: dict[str, Any], body: Sequence[str]) -> str:
    """A results page: `# title`, the machine header (`markdown_header(info)`: command, machine,
    instruction sets, date, load), then `body`'s lines; ends with one newline."""
    return "\n".join([f"# {title}", "", markdown_header(info), "", *body]).rstrip("\n") + "\n"


def write_note(stem: str | Path, results: dict[str, Any], text: str, *, echo: bool = True) -> None:
    """A run's result note: `stem`.json (`results`, the run's dict with its "machine" facts) and
    `stem`.md (`text`, ending in one newline), `text` printed too unless not `echo`; `stem` is the
    path without extension (benchmarks/results/<suite>/NAME). One home for the pair's shape, so a
    results file always carries the machine facts its figures were taken on."""
    text = text.rstrip("\n") + "\n"
    Path(f"{stem}.md").write_text(text)
    Path(f"{stem}.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    if echo:
        print(text, end="")


def write_results(stem: str | Path, text: str, info: dict[str, Any], data: dict[str, Any]) -> None:
    """`write_note` of `data` with the machine facts `info` (from `machine_info`), not printed;
    `text` from `results_markdown`."""
    write_note(stem, {"machine": info, **data}, text, echo=False)


def report_results(
    title: str,
    info: dict[str, Any],
    body: Sequence[str],
    stem: str | Path | None,
    data: dict[str, Any],
) -> str:
    """A run's results page (`results_markdown`) printed and, with a `stem`, written with `data`
    as the file pair (`write_results`); returns the page."""
    text = results_markdown(title, info, body)
    print(text)
    if stem:
        write_results(stem, text, info, data)
    return text
