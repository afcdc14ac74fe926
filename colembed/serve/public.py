"""Messages as clients see them: no absolute server path in any error body or job report.

A reason written for the server's own log (a decoder's `cannot identify image file
'/srv/docs/bad.png'`, a store error naming the index folder) is shown with every path it names
in the roots' naming (`root/relative/path` inside a root, `Roots.display`): the paths the caller
knows the message is about and any other absolute path in the text (quoted or not); a path
outside every root is shown by its last component (also on a server without roots, whose hits
show stored paths: an error names the file, not the server's layout). The full message still
goes to the server's log.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Iterable

from .roots import Roots

# An absolute path in free text (POSIX `/a/b` or Windows `C:\a\b`): quoted, whatever it holds,
# or bare (not inside a word, a relative path or a URL), up to a space, quote, comma, semicolon,
# closing bracket, or a final colon or full stop.
_QUOTED = r"""(?P<q>['"])(?P<quoted>(?:/|[A-Za-z]:[\\/])(?:(?!(?P=q)).)*)(?P=q)"""
_BARE = r"""(?<![\w.~/\\:%-])(?P<bare>(?:/|[A-Za-z]:[\\/])[^\s'",;)\]}]*[^\s'",;:)\]}.])"""


def public_message(text: str, roots: Roots, paths: Iterable[str | os.PathLike] = ()) -> str:
    """`text` with every absolute path in it replaced by how `roots` shows it, in one pass (a
    replacement is never looked at again)."""
    known = {
        form
        for p in paths
        for form in (str(Path(p)), str(Path(p).resolve()))
        if os.path.isabs(form)
    }
    alternatives = [_QUOTED, _BARE]
    if known:
        alternatives.insert(
            0,
            "(?P<known>{})".format(
                "|".join(re.escape(k) for k in sorted(known, key=len, reverse=True))
            ),
        )

    def shown(match: re.Match) -> str:
        groups = match.groupdict()
        if groups.get("known"):
            return _shown(groups["known"], roots)
        if groups["quoted"]:
            return groups["q"] + _shown(groups["quoted"], roots) + groups["q"]
        return _shown(groups["bare"], roots)

    return re.sub("|".join(alternatives), shown, text, flags=re.DOTALL)


def _shown(path: str, roots: Roots) -> str:
    """An absolute path as clients see it: `root/relative` inside a root, else its last
    component."""
    shown = roots.display(path)
    if not os.path.isabs(shown):
        return shown
    return re.split(r"[\\/]", path.rstrip("\\/"))[-1] or "/"
