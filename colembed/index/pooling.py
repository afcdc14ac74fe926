"""Index-time compression: hierarchical token pooling of a page's image tokens (opt-in).

What it is: colpali-engine's `HierarchicalTokenPooler` semantics, torch-free. A page's tokens
are clustered by Ward linkage, where each token is described by its row of cosine distances
to every token of the page (`1 - X Xᵀ`, Euclidean between those rows: what colpali-engine hands
`scipy.cluster.hierarchy.linkage`); the tree is cut into at most `max(tokens // pool_factor, 1)`
clusters (`fcluster(..., criterion="maxclust")`), and each cluster becomes the mean of its tokens,
L2-renormalised, in cluster order. colpali-engine's README reports pool factor 3 keeping 97.8% of
nDCG on ViDoRe; what it costs on colembed's benchmark sets is in benchmarks/results/ (docs/index.md
links it).

Which tokens: colpali-engine's pooler protects none (it pools every row it is given). colembed
gives it the page's image tokens only and keeps the prompt rows (the same few on every page)
unchanged, so every stored page still holds them and the rows / cols / mean vectors, computed
from the unpooled page (schema.make_point), are those of an unpooled index.

Why the distances are computed here and not by `linkage(distances, metric="euclidean")`: that
runs scipy's `pdist` over n rows of n distances each (n³/2 work in a plain loop, n ~ 750), while
the same distances follow from the dim-wide vectors in two matmuls (`1 - X Xᵀ` has rank
<= dim + 1: |d_i - d_j|² = (x_i - x_j)ᵀ XᵀX (x_i - x_j)): n² x dim work, in BLAS. They agree to rounding
(float64 here; colpali-engine's similarities are float32), so the clusters are the same unless two
merge costs tie within ~1e-7 (tests/runtime/index/test_pooling.py compares with colpali-engine itself).

Which token went into which cluster is kept (`encode_clusters`, a compact payload string) so a
similarity map of a pooled page still covers its grid (`Index.explain_page`, maps.py).
The pool factor is part of an index's identity (records.ModelIdentity): pages pooled differently
never mix. scipy is imported on first use (the index extra), never by `import colembed`.
"""

from __future__ import annotations

import base64

import numpy as np

from ..blas import one_thread

DEFAULT_POOL_FACTOR = 1  # no pooling; the measured trade-off of 2 and 3: docs/index.md
CLUSTERS_FIELD = "token_clusters"  # payload: per image token (grid order), its pooled row


def check_pool_factor(pool_factor) -> int:
    """The pool factor as an int >= 1, or ValueError saying what it is."""
    if (
        isinstance(pool_factor, bool)
        or not isinstance(pool_factor, (int, np.integer))
        or pool_factor < 1
    ):
        raise ValueError(
            f"pool factor must be an integer >= 1 (1: no pooling), got {pool_factor!r}"
        )
    return int(pool_factor)


def ward_clusters(tokens: np.ndarray, max_clusters: int) -> np.ndarray:
    """Per token, its cluster (0-based, consecutive, in fcluster's order): Ward linkage over the
    rows of the page's cosine-distance matrix, cut into at most `max_clusters`."""
    from scipy.cluster.hierarchy import fcluster, linkage
    from scipy.spatial.distance import squareform

    x = np.asarray(tokens, dtype=np.float64)
    gram = x @ (x.T @ x) @ x.T  # dot products of the rows of XXᵀ (the ones of 1 - XXᵀ cancel)
    sq = np.diag(gram)
    d2 = np.maximum(sq[:, None] + sq[None, :] - 2.0 * gram, 0.0)
    d = np.sqrt((d2 + d2.T) * 0.5)
    np.fill_diagonal(d, 0.0)
    z = linkage(squareform(d, checks=False), method="ward")
    labels = fcluster(z, t=max_clusters, criterion="maxclust") - 1
    _, dense = np.unique(labels, return_inverse=True)
    return dense.astype(np.int64)


def pool_tokens(tokens: np.ndarray, pool_factor: int) -> tuple[np.ndarray, np.ndarray]:
    """(pooled, clusters): the hierarchical pooling of `tokens` (n, dim) into at most
    `max(n // pool_factor, 1)` unit rows, and per input token the index of its pooled row.
    Pool factor 1 (or a single token) returns the tokens unchanged."""
    pool_factor = check_pool_factor(pool_factor)
    x = np.asarray(tokens, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"tokens must be (n, dim), got shape {x.shape}")
    if pool_factor == 1 or len(x) < 2:
        return x, np.arange(len(x), dtype=np.int64)
    with one_thread():  # a page's products: run beside the embedding, not sharing its cores
        clusters = ward_clusters(x, max(len(x) // pool_factor, 1))
    count = int(clusters.max()) + 1
    member = (clusters[None, :] == np.arange(count)[:, None]).astype(np.float32)
    means = (member @ x) / member.sum(axis=1, keepdims=True)
    norms = np.linalg.norm(means, axis=1, keepdims=True)
    return (means / np.maximum(norms, 1e-12)).astype(np.float32), clusters


def pool_page(vectors: np.ndarray, layout, pool_factor: int) -> tuple[np.ndarray, np.ndarray]:
    """(stored rows, clusters): the page's rows with its image tokens pooled (the prompt rows
    before and after kept as they are), and per image token its pooled row (0-based within the
    pooled image rows)."""
    image = vectors[layout.image_rows]
    pooled, clusters = pool_tokens(image, pool_factor)
    rows = np.concatenate(
        [vectors[: layout.image_start], pooled, vectors[layout.image_rows.stop :]]
    ).astype(np.float32)
    return rows, clusters


def encode_clusters(clusters: np.ndarray) -> str:
    """Per-token cluster indices as a compact payload string (uint16 little-endian, base64):
    ~2 KB a page instead of a list of ~750 ints in every payload scroll."""
    return base64.b64encode(np.asarray(clusters, dtype="<u2").tobytes()).decode("ascii")


def decode_clusters(text: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(text), dtype="<u2").astype(np.int64)


def image_row_count(payload: dict) -> int:
    """How many stored rows of a page are its image tokens (pooled or not)."""
    if payload.get(CLUSTERS_FIELD):
        return int(decode_clusters(payload[CLUSTERS_FIELD]).max()) + 1
    rows, cols = payload["grid"]
    return int(rows) * int(cols)
