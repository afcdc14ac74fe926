"""Judging a variant against fp32: per-token cosine and top-1 agreement on clear winners.

Both halves of a gate run through the colembed runtime on the staged folder, exactly as users
would load the variant:
- cosine: every token of every item of the gate set (`gate_items`), which samples the input
  space users send: queries from one token to the model's bound (dynamic activation ranges grow
  with length: whatever holds at 20 tokens says little about 779), pages from the smallest to
  the full image-token budget and at extreme aspect ratios, and mixed batches (a batch's items
  share a run, and with per-tensor activation scales one scale). Figures per item (by name), per
  length bucket, and overall mean and min (a NaN or an overflow anywhere fails it); the gate
  holds every bucket's mean and every token's minimum, and names the worst item;
- ranking: `RANKING_PAGES` generated pages and, as queries, a perturbed copy of each page (noise,
  brightness), embedded by the same graphs. The set is built so that fp32 has clear winners:
  each query's own page must beat the runner-up by `CLEAR_SPREADS` standard deviations of the
  other pages' scores under fp32 (`clear_winners`), and only such queries count. A variant agrees
  on a query when its top-1 page is fp32's. A real page-to-query set (text queries) needs trained
  weights to have winners at all; this one does not, and it runs both graphs (pages go through
  the text graph too). Fewer than `MIN_CLEAR_QUERIES` clear winners: the export is refused with
  what fp32 did on the set (`unjudgeable_ranking`), since no variant's ranking can be judged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from colembed.errors import ExportError
from colembed.layout import BASE_VARIANT

RANKING_PAGES = 24
# width, height: one grid for all pages, fast at any width: 4 x 5 image tokens at ColQwen2's
# 28-pixel tokens; ColQwen3 (32-pixel tokens, at least 64) resizes it up to 8 x 9.
RANKING_SIZE = (112, 140)
# A clear winner: fp32's own page beats the runner-up by this many standard deviations of the
# other pages' scores. Measured against the spread, not the score: every score holds a part all
# pages get alike (prompt tokens, a checkpoint's common direction), so a relative margin refuses
# real winners on checkpoints whose tokens are alike (docs/reference-colqwen3.md, "Why the
# ranking gate refused it before").
CLEAR_SPREADS = 3.0
MIN_CLEAR_QUERIES = 16
# One sentence repeated to reach a length (a 221-token query of one sentence x 8 once broke int8).
GATE_SENTENCE = "Net revenue in the northern region grew by 12% while operating costs fell. "
CALIBRATION_SENTENCE = "Which table lists the quarterly figures for each product line? "
GATE_QUERY_LENGTHS = (64, 221, 450)  # plus 1 word, the sample queries and the bound itself
# What queries are made of beyond words: a variant's error follows the kind of token (digits,
# spaces and punctuation excite other channels than words), so the gate holds every kind
# (`colembed.fidelity.token_class`), each a query of its own, and a numbers sentence at length.
TOKEN_CLASS_QUERIES = (
    (
        "digits and numbers",
        "0 1 2 3 4 5 6 7 8 9 10 42 100 1999 2023 2024 3.14 0.5% -7 +12 1/2 "
        "3:45 07:30 1,000 12,345.67 €9.99 $1.2M ¥500 £3 2e-5 XII ½ ¾ ٣ ३ 四",
    ),
    (
        "amounts and references",
        "Invoice INV-2024-00317 of 14 March 2024 totals $48,250.00 (VAT "
        "20%: $9,650.00); see Table 7, row 12, column B3 and Figure 2.1 on p. 45.",
    ),
    (
        "punctuation and symbols",
        "( ) [ ] { } < > . , ; : ! ? ' \" ` ~ @ # $ % ^ & * _ - + = | \\ / "
        "— – … « » ‘ ’ “ ” • · § ¶ © ® ™ ° ± × ÷ → ≤ ≥ ≠ ∑ √ ∞ µ €",
    ),
    ("whitespace forms", "a  b   c\tdone\n\nnext\u00a0line\u2003em\u3000wide \r\n end    "),
    (
        "several scripts",
        "Résumé naïve façade; Привет, как дела? Καλημέρα κόσμε; مرحبا بالعالم; "
        "שלום עולם; नमस्ते दुनिया; 你好，世界；こんにちは世界；안녕하세요 세계; สวัสดีชาวโลก",
    ),
    (
        "code",
        "def total(rows): return sum(r['amount'] for r in rows if r.get('paid'))  # SELECT "
        "id, SUM(x) FROM t WHERE y >= 10 GROUP BY id;",
    ),
    (
        "table",
        "| Quarter | Revenue | Margin |\n|---|---:|---:|\n| Q1 2023 | 1,204.5 | 12.3% |\n"
        "| Q2 2023 | 1,387.0 | 13.1% |\n| Total | 2,591.5 | 12.7% |",
    ),
)
# Numbers at length: activation ranges grow with length, and digits are where they break first.
NUMBERS_SENTENCE = "Table 4 lists 2,517 units sold in Q3 2022 at $18.40 each (up 7.5% on 2021). "
NUMBERS_QUERY_LENGTH = 221
# Token sequences drawn from the whole vocabulary (specials excluded), at these lengths.
VOCABULARY_QUERY_LENGTHS = (16, 64, 221)
VOCABULARY_SEED = 11
QUERY_BUCKETS = (
    16,
    64,
    256,
)  # upper bounds of the query-length buckets; the last runs to the bound
PAGE_BUCKETS = (64, 256)  # upper bounds of the page image-token buckets; the last to the budget
# How the gate loads each model: sizes checked (the files were just written), and no CPU memory
# arena, which would keep each session's high-water mark after the run that set it, so both
# sessions would hold their largest runs' memory at once (docs/variants.md, "The variant step's
# memory").
GATE_LOAD = {"verify": False, "cpu_mem_arena": False}
# Session config of every gate session and of the calibration run, under each variant's own
# (GATE_SESSION_CONFIG): no weight prepacking. A prepacked session holds a packed anonymous copy
# of each GEMM weight, the whole graph's weights (fp32's gate load was the largest anonymous peak
# of an export); unpacked, the weights stay the external-data file's mapped pages, which the kernel
# drops under memory pressure. The check's sessions run so too (pipeline/verify.py): its figures
# are a user's session's within fp32 rounding, so the gates' verdicts are the same.
GATE_UNPACKED = {"session.disable_prepacking": "1"}
# Variants whose gate sessions prepack as users' do: onnxruntime's MatMulNBits (int4) computes
# from its packed weights in another way than from the unpacked ones (the tiny fixture's figures
# ~2e-5 apart, past what a user's load reproduces: test_variants.py), and its packed copy is of
# 4-bit weights, not the fp32 model.
GATE_PREPACKED = frozenset({"int4"})
# onnxruntime session config of each variant's gate sessions, on top of GATE_LOAD. fp16: keep the
# weights fp16 in memory, each cast to fp32 when its MatMul runs, instead of folded into fp32
# initializers at load (which made an fp16 session hold the fp32 weights' size). The cast is
# exact, so the verdicts are the same (tests/export/variants/test_gate_memory.py;
# benchmarks/results/export/export-variants-2b.md).
GATE_SESSION_CONFIG: dict[str, dict[str, str]] = {
    "fp16": {
        "optimization.disable_specified_optimizers": "FuseFp16InitializerToFp32NodeTransformer"
    },
}
# onnxruntime's node order in each variant's gate sessions (colembed.sessions.Session). fp16: the
# priority-based order runs each weight's fp32 cast just before the MatMul that reads it, where
# the default order runs most casts at the start of a run and holds them all at once. The order
# changes when a node runs, not what it computes (tests/export/variants/test_gate_memory.py;
# docs/variants.md, "The variant step's memory").
GATE_EXECUTION_ORDER: dict[str, str] = {"fp16": "priority"}
BUCKET_LABELS = {"query": "queries", "page": "pages"}
# glibc: every block of at least this many bytes gets its own mapping, handed back when freed.
# glibc's default threshold grows with the largest block freed (up to 32 MB), after which freed
# activations fragment the heap over a run's layers; a fixed threshold cuts a run's transient
# peak (docs/variants.md, "The variant step's memory").
GATE_MMAP_THRESHOLD = 1 << 20


def token_cosines(got: Sequence[np.ndarray], want: Sequence[np.ndarray]) -> np.ndarray:
    """Per-token cosine similarity between two lists of (tokens, dim) arrays (all tokens, flat)."""
    values = []
    for i, (a, b) in enumerate(zip(got, want)):
        if a.shape != b.shape:
            raise ExportError(f"item {i}: variant gives shape {a.shape}, fp32 {b.shape}")
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        norms = np.linalg.norm(a64, axis=1) * np.linalg.norm(b64, axis=1)
        values.append(np.sum(a64 * b64, axis=1) / np.maximum(norms, 1e-30))
    return np.concatenate(values) if values else np.zeros(0)


def repeated(sentence: str, tokens: int, count: Any) -> str:
    """`sentence` repeated until `count(text)` (tokens with the query prefix and suffix) reaches
    `tokens`; a longer target than the bound is cut there by the runtime."""
    import warnings

    from colembed.errors import QueryTruncatedWarning

    text = sentence
    with warnings.catch_warnings():  # counting past the bound is the point here
        warnings.simplefilter("ignore", QueryTruncatedWarning)
        while count(text) < tokens and len(text) < 40 * tokens:
            text += sentence
    return text


def gate_queries(model: Any) -> list[tuple[str, str]]:
    """(name, text) of the gate's queries: one word, the sample queries, one query per kind of
    token (`TOKEN_CLASS_QUERIES`), token sequences from the whole vocabulary, a numbers sentence
    at length, repeated sentences of ~64, 221 and 450 tokens and one at the model's bound
    (`max_query_tokens`)."""
    from ..pipeline.verify import SAMPLE_QUERIES

    encoder = model.text_encoder
    count, bound = encoder.count_query_tokens, encoder.max_query_tokens
    found = [("one word", "invoice")]
    found += [(f"sample query {i}", q) for i, q in enumerate(SAMPLE_QUERIES)]
    found += list(TOKEN_CLASS_QUERIES)
    found += vocabulary_queries(encoder)
    if NUMBERS_QUERY_LENGTH < bound:
        found.append(
            (
                f"numbers sentence repeated to {NUMBERS_QUERY_LENGTH} tokens",
                repeated(NUMBERS_SENTENCE, NUMBERS_QUERY_LENGTH, count),
            )
        )
    # the last three: the longest, run together in one mixed batch (_embed_gate_set)
    for tokens in (*[t for t in GATE_QUERY_LENGTHS if t < bound], bound):
        found.append(
            (f"sentence repeated to {tokens} tokens", repeated(GATE_SENTENCE, tokens, count))
        )
    return found


def vocabulary_queries(encoder: Any) -> list[tuple[str, str]]:
    """Texts of `VOCABULARY_QUERY_LENGTHS` ids drawn uniformly from the tokenizer's whole
    vocabulary (special tokens excluded), decoded: rare words, other scripts, byte pieces."""
    rng = np.random.default_rng(VOCABULARY_SEED)
    size = encoder.vocabulary_size
    found = []
    for tokens in VOCABULARY_QUERY_LENGTHS:
        ids: list[int] = []
        while len(ids) < tokens:
            drawn = rng.integers(0, size, tokens)
            ids += [
                int(i) for i, (_, special) in zip(drawn, encoder.token_texts(drawn)) if not special
            ]
        found.append((f"{tokens} tokens drawn from the vocabulary", encoder.decode(ids[:tokens])))
    return found


def query_token_classes(encoder: Any, text: str) -> tuple[list[str], list[str]]:
    """(each token's text, each token's class) of the query `text` as the model sees it
    (prefix and augmentation tokens included, cut at the bound): one per embedding row."""
    import warnings

    from colembed.errors import QueryTruncatedWarning
    from colembed.fidelity import token_class

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", QueryTruncatedWarning)
        ids = encoder.encode_queries([text])[0]
    texts = encoder.token_texts(ids)
    return [t for t, _ in texts], [token_class(t, special=special) for t, special in texts]


def gate_pages(model: Any) -> list[tuple[str, Any]]:
    """(name, image) of the gate's pages: the sample pages, the smallest page (below the minimum
    pixel budget), a full-budget page (a letter page scaled to the image-token budget), a wide
    and a tall strip (aspect ratio 50), a blank page and a photo-like one."""
    from PIL import Image, ImageDraw

    from ..pipeline.verify import sample_pages

    rng = np.random.default_rng(7)
    found = [(f"sample page {i} {p.size[0]}x{p.size[1]}", p) for i, p in enumerate(sample_pages())]
    found.append(
        ("smallest page 20x20", Image.fromarray(rng.integers(0, 256, (20, 20, 3), np.uint8)))
    )
    letter = Image.new("RGB", (1700, 2200), "white")
    draw = ImageDraw.Draw(letter)
    for row in range(40):
        y = 80 + row * 50
        draw.rectangle([100, y, 100 + int(rng.integers(300, 1500)), y + 18], fill=(25, 25, 25))
    letter.paste(Image.fromarray(rng.integers(0, 256, (500, 700, 3), np.uint8)), (900, 1200))
    found.append(("full-budget letter page 1700x2200", letter))
    found.append(
        ("wide strip 2000x40", Image.fromarray(rng.integers(0, 256, (40, 2000, 3), np.uint8)))
    )
    found.append(
        ("tall strip 40x2000", Image.fromarray(rng.integers(0, 256, (2000, 40, 3), np.uint8)))
    )
    found.append(("blank page 280x364", Image.new("RGB", (280, 364), "white")))
    smooth = Image.fromarray(rng.integers(0, 256, (9, 7, 3), np.uint8)).resize(
        (280, 364), Image.BICUBIC
    )
    grain = np.asarray(smooth, np.float32) + rng.normal(0, 12, (364, 280, 3))
    found.append(
        ("photo-like page 280x364", Image.fromarray(np.clip(grain, 0, 255).astype(np.uint8)))
    )
    return found


def bucket_name(kind: str, tokens: int) -> str:
    edges = QUERY_BUCKETS if kind == "query" else PAGE_BUCKETS
    low = 1
    for high in edges:
        if tokens <= high:
            return f"{BUCKET_LABELS[kind]} {low}-{high} tokens"
        low = high + 1
    return f"{BUCKET_LABELS[kind]} {low}+ tokens"


def item_figures(items: Sequence[tuple[str, str, int, np.ndarray, np.ndarray]]) -> dict[str, Any]:
    """Per item (name, kind, bucket tokens, got, want) and per bucket: mean and min cosine; the
    worst item by name."""
    per_item: dict[str, Any] = {}
    buckets: dict[str, list[np.ndarray]] = {}
    for name, kind, tokens, got, want in items:
        cos = token_cosines([got], [want])
        per_item[name] = {
            "kind": kind,
            "tokens": int(got.shape[0]),
            "bucket_tokens": int(tokens),
            "mean": float(cos.mean()),
            "min": float(cos.min()),
        }
        buckets.setdefault(bucket_name(kind, tokens), []).append(cos)
    worst = min(per_item, key=lambda n: per_item[n]["min"]) if per_item else None
    return {
        "items": per_item,
        "buckets": {
            b: {
                "mean": float(np.concatenate(c).mean()),
                "min": float(np.concatenate(c).min()),
                "items": len(c),
                "tokens": int(sum(x.size for x in c)),
            }
            for b, c in sorted(buckets.items())
        },
        "worst_item": worst,
    }


def cosine_figures(got_pages, want_pages, got_queries, want_queries) -> dict[str, Any]:
    pages = token_cosines(got_pages, want_pages)
    queries = token_cosines(got_queries, want_queries)
    both = np.concatenate([pages, queries])
    broken = sum(int((~np.isfinite(a).all(axis=1)).sum()) for a in [*got_pages, *got_queries])
    return {
        "non_finite_tokens": broken,
        "mean_cosine": float(both.mean()),
        "min_cosine": float(both.min()),
        "pages_mean_cosine": float(pages.mean()),
        "pages_min_cosine": float(pages.min()),
        "queries_mean_cosine": float(queries.mean()),
        "queries_min_cosine": float(queries.min()),
        "finite": bool(np.isfinite(both).all()),
        "tokens": int(both.size),
    }


def ranking_set(pages: int = RANKING_PAGES, seed: int = 0) -> tuple[list[Any], list[Any]]:
    """(pages, queries): smooth random colour fields with shapes, and a perturbed copy of each."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    width, height = RANKING_SIZE
    out_pages, out_queries = [], []
    for _ in range(pages):
        coarse = rng.integers(0, 256, (height // 14, width // 14, 3), dtype=np.uint8)
        page = Image.fromarray(coarse).resize((width, height), Image.BILINEAR)
        draw = ImageDraw.Draw(page)
        for _ in range(3):
            x, y = int(rng.integers(0, width - 30)), int(rng.integers(0, height - 30))
            draw.rectangle(
                [x, y, x + 28, y + 28], fill=tuple(int(c) for c in rng.integers(0, 256, 3))
            )
        noisy = np.asarray(page, np.float32) * rng.uniform(0.9, 1.1) + rng.normal(
            0, 6, (height, width, 3)
        )
        out_pages.append(page)
        out_queries.append(Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8)))
    return out_pages, out_queries


def maxsim(queries: Sequence[np.ndarray], pages: Sequence[np.ndarray]) -> np.ndarray:
    """(queries, pages) exact MaxSim scores, by colembed's own scorer."""
    from colembed.scoring import score

    return np.asarray(score(list(queries), list(pages)))


def ranking_leads(scores: np.ndarray) -> np.ndarray:
    """Per query: its own page's (the diagonal's) lead over the runner-up, in standard deviations
    of the other pages' scores (inf when they are all equal and the own page is ahead; negative
    when another page wins). Unchanged by a constant added to, or a positive factor on, a query's
    scores: the part every page gets alike does not count (`CLEAR_SPREADS`)."""
    scores = np.asarray(scores, np.float64)
    own = np.diag(scores)
    others = scores.copy()
    np.fill_diagonal(others, np.nan)
    lead = own - np.nanmax(others, axis=1)
    spread = np.nanstd(others, axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(
            spread > 0,
            lead / np.where(spread > 0, spread, 1.0),
            np.where(lead > 0, np.inf, -np.inf),
        )


def clear_winners(scores: np.ndarray, spreads: float = CLEAR_SPREADS) -> np.ndarray:
    """Indices of the queries whose own page (the diagonal) leads by `spreads` (`ranking_leads`)."""
    return np.flatnonzero(ranking_leads(scores) >= spreads)


def unjudgeable_ranking(scores: np.ndarray) -> str:
    """Why fp32's `scores` on the ranking set leave no variant's ranking to judge (the refusal)."""
    leads = ranking_leads(scores)
    first, clear = int((leads > 0).sum()), clear_winners(scores).size
    why = (
        "the fp32 graphs do not tell these pages apart (most queries' own page does not even win)"
        if first < leads.size / 2
        else "the own pages win, but not clear of the other pages' spread"
    )
    return (
        f"the ranking set has {clear} clear-winner queries under fp32 (< {MIN_CLEAR_QUERIES}): "
        f"{first} of {leads.size} perturbed page copies rank their own page first, {clear} by "
        f">= {CLEAR_SPREADS:g} standard deviations of the other pages' scores (median lead "
        f"{float(np.median(leads)):.2f}); {why}, so no variant's ranking can be judged on "
        "this checkpoint"
    )


def top1_agreement(
    scores: np.ndarray, fp32_scores: np.ndarray, queries: np.ndarray
) -> dict[str, Any]:
    agree = scores[queries].argmax(axis=1) == fp32_scores[queries].argmax(axis=1)
    return {
        "top1_agreement": float(agree.mean()) if agree.size else 0.0,
        "queries": int(agree.size),
        "clear_spreads": CLEAR_SPREADS,
    }


def embed_ranking_set(model: Any, pages: Sequence[Any], queries: Sequence[Any]) -> np.ndarray:
    """MaxSim scores of the perturbed copies (as queries) against the pages, by `model`."""
    batch = len(pages)
    return maxsim(
        model.embed_images(queries, batch_size=batch), model.embed_images(pages, batch_size=batch)
    )


def mixed_page_batches(tokens: Sequence[int]) -> list[list[int]]:
    """The gate's mixed page batches (indices into the pages): the longest page with the
    shortest, the second longest with the second shortest, and so on (an odd page joins the last
    pair). Every page shares a run with a page of another length, the full-budget page with the
    smallest (the most padding, and with per-tensor activation scales the widest spread of
    ranges in one run); a batch pads to its longest page, so pairs hold ~2/N of what one batch of
    all N pages held (docs/variants.md, "The variant step's memory")."""
    order = sorted(range(len(tokens)), key=lambda i: (tokens[i], i))
    batches = [[order[-1 - k], order[k]] for k in range(len(order) // 2)]
    if len(order) % 2:
        middle = order[len(order) // 2]
        if batches:
            batches[-1].append(middle)
        else:
            batches.append([middle])
    return batches


def _embed_gate_set(
    model: Any, queries: Sequence[tuple[str, str]], pages: Sequence[tuple[str, Any]]
) -> dict[str, list[np.ndarray]]:
    """The gate set's vectors by `model`: every item alone, then the mixed batches (the pages in
    pairs of unlike lengths, `mixed_page_batches`; the three longest queries, of similar lengths,
    in one call)."""
    import warnings

    from colembed.errors import QueryTruncatedWarning

    texts = [q for _, q in queries]
    images = [p for _, p in pages]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", QueryTruncatedWarning)
        alone_queries = [model.embed_queries([t])[0] for t in texts]
        mixed_queries = model.embed_queries(texts[-3:], batch_size=3)
    alone_pages = [model.embed_images([p], batch_size=1)[0] for p in images]
    mixed_pages: list[Any] = [None] * len(images)
    for batch in mixed_page_batches([len(v) for v in alone_pages]):
        for i, vectors in zip(
            batch, model.embed_images([images[i] for i in batch], batch_size=len(batch))
        ):
            mixed_pages[i] = vectors
    return {
        "queries": alone_queries,
        "pages": alone_pages,
        "mixed_queries": mixed_queries,
        "mixed_pages": mixed_pages,
    }


def _gate_items(queries, pages, got, want) -> list[tuple[str, str, int, np.ndarray, np.ndarray]]:
    """(name, kind, tokens for the bucket, got, want); mixed-batch items are judged against fp32
    run alone (a batch must not change an item's vectors)."""
    items = []
    for (name, _), g, w in zip(queries, got["queries"], want["queries"]):
        items.append((f"query: {name}", "query", w.shape[0], g, w))
    for (name, _), g, w in zip(queries[-3:], got["mixed_queries"], want["queries"][-3:]):
        items.append((f"query in a mixed batch: {name}", "query", w.shape[0], g, w))
    image_tokens = [w.shape[0] for w in want["pages"]]
    for (name, _), g, w, n in zip(pages, got["pages"], want["pages"], image_tokens):
        items.append((f"page: {name}", "page", n, g, w))
    for (name, _), g, w, n in zip(pages, got["mixed_pages"], want["pages"], image_tokens):
        items.append((f"page in a mixed batch: {name}", "page", n, g, w))
    return items


def query_class_figures(
    reference: Fp32Reference, got: dict[str, list[np.ndarray]]
) -> dict[str, Any]:
    """Per token class over the gate's queries, alone and in the mixed batch
    (`colembed.fidelity.class_figures`): each class's mean and min, and the worst token by text."""
    from colembed.fidelity import class_figures, token_cosines as row_cosines

    names = [name for name, _ in reference.queries]
    want, tokens = reference.want["queries"], reference.query_tokens
    items = [
        (f"query: {n}", row_cosines(g, w), *t)
        for n, g, w, t in zip(names, got["queries"], want, tokens)
    ]
    items += [
        (f"query in a mixed batch: {n}", row_cosines(g, w), *t)
        for n, g, w, t in zip(names[-3:], got["mixed_queries"], want[-3:], tokens[-3:])
    ]
    return class_figures(items)


def map_large_blocks(threshold: int = GATE_MMAP_THRESHOLD) -> bool:
    """glibc's mallopt(M_MMAP_THRESHOLD, `threshold`) for this process (GATE_MMAP_THRESHOLD);
    False where there is no glibc (other C libraries, other systems): nothing changes there."""
    from ..measure import glibc_function

    mallopt = glibc_function("mallopt")
    return bool(mallopt is not None and mallopt(-3, int(threshold)))  # -3: M_MMAP_THRESHOLD


def gate_model(folder: Any, variant: str) -> Any:
    """`variant` of the staged folder as the gate runs it: the colembed runtime, loaded with
    GATE_LOAD and the variant's GATE_SESSION_CONFIG and GATE_EXECUTION_ORDER; the OpenVINO
    variants on OpenVINO, at their own inference precision."""
    import colembed
    from colembed.sessions import OPENVINO_VARIANTS

    if variant in OPENVINO_VARIANTS:
        return colembed.load(folder, variant=variant, providers="openvino", verify=False)
    return colembed.load(
        folder,
        variant=variant,
        **GATE_LOAD,
        session_config={
            **({} if variant in GATE_PREPACKED else GATE_UNPACKED),
            **GATE_SESSION_CONFIG.get(variant, {}),
        },
        execution_order=GATE_EXECUTION_ORDER.get(variant, "default"),
    )


def ran_on(model: Any) -> dict[str, Any]:
    """Where a gate ran a variant: its providers and, on OpenVINO, the release, the precision the
    plugin compiled (a bf16 request runs f32 on a CPU without bf16 arithmetic: such a check says
    nothing about bf16) and this CPU (the manifest keeps it with the variant's figures)."""
    from colembed.provider_choice import cpu_signature

    facts: dict[str, Any] = {"providers": list(model.providers), "cpu": cpu_signature()}
    session = model._sessions["text"]
    if getattr(session, "precision", None) is not None:
        from colembed.openvino_runtime import openvino_facts

        facts.update(openvino_facts())
        facts["precision_compiled"] = {role: s.precision for role, s in model._sessions.items()}
    return facts


@dataclass
class Fp32Reference:
    """What fp32 gave on the gate set, which every variant (and every attempt at one) is judged
    against: the gate's queries and pages, fp32's vectors for them, its ranking-set scores and
    the clear-winner queries among them (of `ranking`: the ranking set's pages and queries)."""

    queries: list[tuple[str, str]]
    pages: list[tuple[str, Any]]
    want: dict[str, list[np.ndarray]]
    ranking: tuple[list[Any], list[Any]]
    scores: np.ndarray
    clear: np.ndarray
    # per gate query: (its tokens' texts, their classes), one per embedding row
    query_tokens: list[tuple[list[str], list[str]]] = field(default_factory=list)


def fp32_reference(folder: Any, *, step: Any = None) -> Fp32Reference:
    """Run the gate set through the staged folder's fp32 graphs (loaded as the gate loads every
    model, freed after); refuse when the ranking set has too few clear winners to judge by."""
    import contextlib

    from ..measure import release_memory

    step = step or (lambda name: contextlib.nullcontext())
    map_large_blocks()
    rank_pages, rank_queries = ranking_set()
    with step("variants: gate set through fp32"):
        with step("variants: gate set through fp32: load"):
            reference = gate_model(folder, BASE_VARIANT)
        with step("variants: gate set through fp32: run"):
            queries, pages = gate_queries(reference), gate_pages(reference)
            query_tokens = [
                query_token_classes(reference.text_encoder, text) for _, text in queries
            ]
            want = _embed_gate_set(reference, queries, pages)
            fp32_scores = embed_ranking_set(reference, rank_pages, rank_queries)
        del reference
        release_memory()
    clear = clear_winners(fp32_scores)
    if clear.size < MIN_CLEAR_QUERIES:
        raise ExportError(unjudgeable_ranking(fp32_scores))
    return Fp32Reference(
        queries=queries,
        pages=pages,
        want=want,
        ranking=(rank_pages, rank_queries),
        scores=fp32_scores,
        clear=clear,
        query_tokens=query_tokens,
    )


def refusal_lines(name: str, figures: dict[str, Any], recipe: str | None = None) -> list[str]:
    """One line per gate miss recorded in `figures["misses"]` (evaluate_variants), each with the
    variant's overall figures, its worst item by name and, when given, the recipe judged."""
    worst = figures["worst_item"]
    made = f"; {recipe}" if recipe else ""
    return [
        f"{name}: {miss} (mean {figures['mean_cosine']:.5f}, min {figures['min_cosine']:.5f} "
        f"over {figures['tokens']} tokens; worst item {worst!r}: min "
        f"{figures['items'][worst]['min']:.5f}{made})"
        for miss in figures.get("misses", [])
    ]


def evaluate_variants(
    folder: Any,
    names: Sequence[str],
    gates: dict[str, Any],
    measured: dict[str, dict[str, Any]] | None = None,
    *,
    step: Any = None,
    reference: Fp32Reference | None = None,
) -> tuple[dict[str, Any], list[str]]:
    """Load each variant from `folder` and judge it against fp32 (`reference`, else run here:
    `fp32_reference`); returns ({variant: figures}, gate misses). A refused variant's figures
    hold its misses (`misses`). `measured` adds what each variant's recipes measured while
    writing it (gated too). `step(name)` (a context manager factory, the exporter's StepMeter)
    wraps each model's run."""
    import contextlib

    from ..measure import release_memory

    step = step or (lambda name: contextlib.nullcontext())
    if reference is None:
        reference = fp32_reference(folder, step=step)
    map_large_blocks()
    queries, pages, want = reference.queries, reference.pages, reference.want
    rank_pages, rank_queries = reference.ranking
    results: dict[str, Any] = {}
    failures: list[str] = []
    for name in names:
        with step(f"variants: gate set through {name}"):
            with step(f"variants: gate set through {name}: load"):
                model = gate_model(folder, name)
                where = ran_on(model)
            with step(f"variants: gate set through {name}: run"):
                got = _embed_gate_set(model, queries, pages)
                scores = embed_ranking_set(model, rank_pages, rank_queries)
            del model
            release_memory()
            figures = cosine_figures(
                got["pages"] + got["mixed_pages"],
                want["pages"] * 2,
                got["queries"] + got["mixed_queries"],
                want["queries"] + want["queries"][-3:],
            )
            figures.update(item_figures(_gate_items(queries, pages, got, want)))
            figures.update(query_class_figures(reference, got))
            figures["ranking"] = top1_agreement(scores, reference.scores, reference.clear)
        figures.update(
            {
                **(measured or {}).get(name, {}),
                "gate": gates[name].to_dict(),
                "pages": len(pages),
                "queries": len(queries),
                "ran_on": where,
            }
        )
        misses = gates[name].misses(figures)
        if misses:
            figures["misses"] = misses
        results[name] = figures
        failures += refusal_lines(name, figures)
    return results, failures


def recording_feeds(runtime: Any) -> dict[str, list[dict[str, np.ndarray]]]:
    """Make `runtime` (a loaded colembed model) record what it feeds its graphs: the returned
    {role: [feeds, ...]} fills with one dict per graph run, in order, as the runtime embeds.

    The runtime builds feeds from its contracts (prompts, padding, positions); recording them at
    the session boundary gives exactly what the graphs see, for calibration and for benchmarks
    that rerun a graph's inside on its real inputs, without rebuilding any feed by hand."""
    recorded: dict[str, list[dict[str, np.ndarray]]] = {}
    for role, session in runtime._sessions.items():
        recorded[role] = []

        def run(feeds, run_options=None, _run=session.run, _into=recorded[role]):
            _into.append(dict(feeds))
            return _run(feeds, run_options)

        session.run = run
    return recorded


def calibration_feeds(folder: Any) -> dict[str, list[dict[str, np.ndarray]]]:
    """The fp32 graphs' feeds for the sample pages and queries, per role (for smoothing)."""
    import colembed

    from ..pipeline.verify import SAMPLE_QUERIES, sample_pages

    runtime = colembed.load(folder, verify=False, session_config=GATE_UNPACKED)
    recorded = recording_feeds(runtime)
    import warnings

    from colembed.errors import QueryTruncatedWarning

    runtime.embed_images(sample_pages() + ranking_set(4, seed=1)[0])
    runtime.embed_queries(list(SAMPLE_QUERIES))
    # A long query of another sentence than the gate's: activation profiles of text tokens at
    # length, which pages (image tokens) do not show.
    encoder = runtime.text_encoder
    long_query = repeated(
        CALIBRATION_SENTENCE, encoder.max_query_tokens // 2, encoder.count_query_tokens
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", QueryTruncatedWarning)
        runtime.embed_queries([long_query])
    return recorded
