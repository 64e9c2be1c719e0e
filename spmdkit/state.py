"""Everything spmdkit keeps between calls, listed in one place.

The rule registry is spmdkit's only *configuration* held by the process (what
``sk.register_rule`` and ``sk.register_primitive`` add). Besides it the package
keeps two more kinds of state, and each piece is registered here by the module
that owns it, at import, so the list is complete by construction
(``tests/test_state.py`` scans the source for a ``ContextVar``, a cached function
or a module-level memo that is not registered, and fails on one):

* **caches**: memos of pure functions (reshard plans, rule inferences, traced
  regions, compiled runners, link costs...). Dropping one changes no result,
  only the time the next call takes. :func:`clear_caches` (``sk.clear_caches``)
  empties every one of them, e.g. between benchmark runs or to free the
  compiled programs they hold.
* **context variables**: what a ``with`` block hands the code traced inside it
  (the sequence order a context-parallel loss runs in), or a list that the code
  traced inside appends to, read when the block ends (the recipes a step ran,
  the pipelines a step traced). Each is set and reset by its owner's context
  manager, so none outlives its block; :func:`held` says who sets and who reads
  each.

``held()`` lists all of them as :class:`Held` values; docs/architecture.md prints
the same list ("What is global").

This module is base vocabulary: it imports nothing from spmdkit.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

__all__ = [
    "Held",
    "KINDS",
    "cached",
    "clear_caches",
    "held",
    "register_cache",
    "register_context",
    "register_registry",
    "table",
]

#: What a piece of state is: a memo (cleared by :func:`clear_caches`), a context
#: variable (scoped by its owner's ``with`` block), or the rule registry's tables.
KINDS = ("cache", "context", "registry")

F = TypeVar("F", bound=Callable[..., Any])
C = TypeVar("C")


@dataclass(frozen=True)
class Held:
    """One piece of state the process keeps between calls.

    Attributes:
      module: the module that owns it (``"spmdkit.resharding.plan"``).
      name: its name there (``"_plan_cached"``).
      kind: ``"cache"``, ``"context"`` or ``"registry"`` (:data:`KINDS`).
      why: what it keeps, and why keeping it is safe.
      set_by: for a context variable, what sets it (its owner's context manager).
      read_by: for a context variable, what reads it.
      clear: empties a cache (``None`` for the other kinds).
    """

    module: str
    name: str
    kind: Literal["cache", "context", "registry"]
    why: str
    set_by: str = ""
    read_by: str = ""
    clear: Callable[[], None] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Held.kind must be one of {KINDS}; given {self.kind!r}")
        if not self.why:
            raise ValueError(f"{self.module}.{self.name}: say why it is kept (why=...)")

    @property
    def where(self) -> str:
        """``module.name``."""
        return f"{self.module}.{self.name}"


_HELD: dict[str, Held] = {}


def _add(entry: Held) -> None:
    # a reload of the owning module registers its new objects under the same name
    _HELD[entry.where] = entry


def cached(*, why: str, maxsize: int | None = 512) -> Callable[[F], F]:
    """``functools.lru_cache(maxsize)`` that lists the cache here.

    Args:
      why: what the cache keeps and why dropping it changes no result.
      maxsize: as ``functools.lru_cache``'s (``None``: unbounded, ``functools.cache``).

    Example::

        >>> @cached(why="link speeds by level", maxsize=4096)
        ... def _link(level: int) -> float: ...
    """

    def wrap(fn: F) -> F:
        memo = functools.lru_cache(maxsize=maxsize)(fn)
        _add(Held(fn.__module__, fn.__qualname__, "cache", why, clear=memo.cache_clear))
        return memo  # type: ignore[return-value]

    return wrap


def register_cache(memo: C, *, module: str, name: str, why: str) -> C:
    """List a module-level memo (a dict, set or ``OrderedDict`` with ``clear()``);
    returns it, so a module writes ``_MEMO = register_cache({}, module=__name__,
    name="_MEMO", why=...)``."""
    clear = getattr(memo, "clear", None)
    if not callable(clear):
        raise TypeError(f"register_cache: {module}.{name} has no clear(); given {type(memo)}")
    _add(Held(module, name, "cache", why, clear=clear))
    return memo


def register_context(
    var: contextvars.ContextVar, *, module: str, name: str, set_by: str, read_by: str, why: str
) -> contextvars.ContextVar:
    """List a context variable: who sets it (a context manager that resets it on
    exit) and who reads it; returns it."""
    _add(Held(module, name, "context", why, set_by=set_by, read_by=read_by))
    return var


def register_registry(module: str, names: Sequence[str], *, why: str) -> None:
    """List the module-level names that hold the rule registry (what users
    register; never cleared here: ``sk.unregister_rule`` / ``unregister_primitive``)."""
    for name in names:
        _add(Held(module, name, "registry", why))


def held(kind: str | None = None) -> tuple[Held, ...]:
    """Every piece of state registered so far (by the modules imported), sorted by
    ``module.name``; ``kind`` keeps one kind (:data:`KINDS`)."""
    if kind is not None and kind not in KINDS:
        raise ValueError(f"held(kind=...) must be one of {KINDS}; given {kind!r}")
    return tuple(h for _, h in sorted(_HELD.items()) if kind is None or h.kind == kind)


def clear_caches() -> int:
    """Empty every cache spmdkit keeps (:func:`held` ``("cache")``); the registry
    and the context variables are left alone. The next call recomputes what it
    needs, with the same result. Returns how many caches were cleared.

    Example::

        >>> import spmdkit as sk
        >>> sk.clear_caches() > 0
        True
    """
    caches = held("cache")
    for h in caches:
        if h.clear is not None:  # every cache is registered with its clear
            h.clear()
    return len(caches)


def table() -> str:
    """The markdown table docs/architecture.md prints under "What is global": one
    row per piece of state registered so far."""
    groups: dict[tuple[str, str, str], list[Held]] = {}
    for h in held():  # one row for the names of one registry, say
        groups.setdefault((h.module, h.kind, h.why), []).append(h)
    rows = ["| where | kind | what it keeps |", "|---|---|---|"]
    for (module, kind, why), hs in groups.items():
        where = ", ".join(
            f"`{module}.{h.name}`" if i == 0 else f"`.{h.name}`" for i, h in enumerate(hs)
        )
        what = (
            why if kind != "context" else f"{why} Set by {hs[0].set_by}; read by {hs[0].read_by}."
        )
        rows.append(f"| {where} | {kind} | {what} |")
    return "\n".join(rows)
