"""A griffe extension for the API reference (``mkdocs.yml``): docstrings here are
written with Sphinx roles (``:func:`jit```, ``:class:`~spmdkit.Plan```), which
Markdown would print as written; they render as the code they name."""

from __future__ import annotations

import re
from typing import Any

import griffe

#: ``:role:`target``` or ``:role:`~a.b.target``` (``~``: show the last name only).
ROLE = re.compile(r":(?:func|class|meth|mod|data|attr|exc|obj):`(~?)([^`]+)`")


def _code(m: re.Match) -> str:
    target = m.group(2)
    return f"`{target.rsplit('.', 1)[-1] if m.group(1) else target}`"


class SphinxRoles(griffe.Extension):
    """Rewrites each object's docstring as it is loaded."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        """Replace the Sphinx roles of ``obj``'s docstring by inline code."""
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(_code, obj.docstring.value)
