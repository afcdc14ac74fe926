"""Index folders of PDFs and images in Qdrant, search them, show why a page matched.

`Index` (index.py) is the API; `store.Store` is the only surface that talks to Qdrant, implemented
by `edge.py` (Qdrant Edge, embedded: the default) and `server.py` (qdrant-client), opened by
`backends.open_store`. Nothing else in colembed imports a Qdrant client. `records.py` holds what
an indexing run decides (model identity, page payload, stale pages, file reports), shared with
colembed.distributed; `errors.py` every error the index raises. Needs the `index` extra
(qdrant-edge-py, qdrant-client, pypdfium2, tqdm).
"""

from __future__ import annotations

from .backends import open_store, upgrade_index
from .errors import (
    DiskFullError,
    IndexBusyError,
    IndexNotFoundError,
    ModelMismatchError,
    OldIndexWarning,
    SourceError,
    StoreError,
)
from .index import Hit, Index
from .maps import SimilarityMap
from .metadata import MetadataError, MetadataTable
from .records import AddResult, FileReport, ModelIdentity
from .store import DEFAULT_SEARCH_MODE, SEARCH_MODES

__all__ = [
    "AddResult",
    "DEFAULT_SEARCH_MODE",
    "DiskFullError",
    "FileReport",
    "Hit",
    "Index",
    "IndexBusyError",
    "IndexNotFoundError",
    "ModelIdentity",
    "MetadataError",
    "MetadataTable",
    "ModelMismatchError",
    "OldIndexWarning",
    "SEARCH_MODES",
    "SimilarityMap",
    "SourceError",
    "StoreError",
    "open_store",
    "upgrade_index",
]
