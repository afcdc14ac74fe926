"""Index folders of PDFs and images in Qdrant, search them, show why a page matched.

`Index` (index.py) is the API; `store.Store` is the only surface that talks to Qdrant, implemented
by `edge.py` (Qdrant Edge, embedded: the default) and `server.py` (qdrant-client). Nothing else in
colembed imports a Qdrant client. Needs the `index` extra (qdrant-edge-py, qdrant-client, pypdfium2,
tqdm).
"""

from __future__ import annotations

from .index import Hit, Index
from .ingest import AddResult, FileReport
from .lock import IndexBusyError
from .maps import SimilarityMap
from .store import (DEFAULT_SEARCH_MODE, SEARCH_MODES, ModelMismatchError, OldIndexWarning,
                    StoreError, upgrade_index)

__all__ = ["AddResult", "DEFAULT_SEARCH_MODE", "FileReport", "Hit", "Index", "IndexBusyError",
           "ModelMismatchError", "OldIndexWarning",
           "SEARCH_MODES", "SimilarityMap", "StoreError", "upgrade_index"]
