"""Which store backs an index: `open_store` picks the implementation, `upgrade_index` rewrites an
old Edge folder.

Its own module because the implementations (`edge.py`, `server.py`) import the interface
(`store.py`): a factory importing them from the interface's module would make an import circle.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from .store import Store


def open_store(
    location: str | os.PathLike | None = None,
    *,
    url: str | None = None,
    api_key: str | None = None,
    dim: int | None = None,
    collection: str | None = None,
    local: bool = False,
    create: bool = True,
    edge_store: Callable[..., Store] | None = None,
) -> Store:
    """An embedded Qdrant Edge store in the folder `location` (default), a Qdrant server at `url`,
    or qdrant-client's local mode in the folder `location` (`local=True`: slow, for checks).
    A new collection is created only with `create` and a `dim`; otherwise a missing one raises
    `IndexNotFoundError` (search and reopening never create an index). `edge_store(folder, dim=)`
    opens an Edge folder instead of `EdgeStore` (the server's `ChildStore`: in a child process)."""
    if url is not None:
        from .server import ServerStore

        return ServerStore(
            url=url, api_key=api_key, dim=dim if create else None, collection=collection
        )
    if location is None:
        raise ValueError("give a folder for the index or a Qdrant server url")
    if local:
        from .server import ServerStore

        return ServerStore(path=Path(location), dim=dim if create else None, collection=collection)
    if edge_store is None:
        from .edge import EdgeStore

        edge_store = EdgeStore
    return edge_store(Path(location), dim=dim if create else None)


def upgrade_index(location: str | os.PathLike, progress: Callable[[int, int], None] | None = None):
    """Bring a Qdrant Edge index folder up to date from its stored vectors, in place
    (`edge.upgrade_index`: an older schema rewritten, a stale token table rebuilt, a mostly-dead
    one compacted); returns `edge.Upgraded` (false when it was already current).
    `progress(pages_done, total)` is called as it goes."""
    from .edge import upgrade_index as upgrade_edge

    return upgrade_edge(Path(location), progress)
