"""Small helpers every stage shares: formatting, FLOP counting, device peaks, tree paths,
hashable attributes.

One definition each, so that every table spmdkit prints uses the same units and
every cost model counts a matmul the same way.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from spmdkit.state import register_cache

__all__ = [
    "CONTRACTIONS",
    "as_unreduced",
    "H100_BF16_PEAK_FLOPS",
    "USER_PACKAGES",
    "contraction_flops",
    "divisors",
    "fmt_bytes",
    "fmt_time",
    "freeze",
    "gc_paused",
    "is_own_source",
    "path_str",
]

#: Dense bf16 peak of one H100 SXM (FLOP/s): the default compute speed of the
#: cost models (``Topology.peak_flops`` overrides it).
H100_BF16_PEAK_FLOPS = 989e12

#: The primitives :func:`contraction_flops` counts: matmuls, convolutions and
#: grouped GEMMs (``lax.ragged_dot``).
CONTRACTIONS = frozenset({"dot_general", "conv_general_dilated", "ragged_dot_general"})


def fmt_bytes(n: float) -> str:
    """``512 B``, ``8.0 KiB``, ``1.5 GiB``… (binary units).

    Example::

        >>> fmt_bytes(8192)
        '8.0 KiB'
    """
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def fmt_time(t: float) -> str:
    """``13.1 ns``, ``29.0 µs``, ``1.25 ms``, ``2.40 s``.

    Example::

        >>> fmt_time(2.9e-5)
        '29.0 µs'
    """
    if t >= 1:
        return f"{t:.2f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.2f} ms"
    if t >= 1e-6 or t == 0:
        return f"{t * 1e6:.1f} µs"
    return f"{t * 1e9:.1f} ns"


def contraction_flops(
    prim: str,
    params: Mapping[str, Any],
    lhs_shape: Sequence[int],
    rhs_shape: Sequence[int],
    out_shape: Sequence[int],
) -> float:
    """FLOPs (two per multiply-add) of a ``dot_general``, ``conv_general_dilated`` or
    ``ragged_dot_general`` (a grouped GEMM).

    Shapes may be global or per-device; the count is for the shapes given. A
    grouped GEMM multiplies each row by one group's weights, so it counts as the
    dense matmul of one group: ``2·m·k·n`` for ``lhs [m, k]``, ``rhs [g, k, n]``
    (the forward and the lhs cotangent), and ``2·m·k·n`` for its rhs cotangent
    ``[m, k] × [m, n] -> [g, k, n]`` too (each row's outer product is added to one
    group's): the group dim of the output is not multiplied. Any other primitive
    counts 0 here (callers price elementwise work themselves).

    Example::

        >>> dn = (((1,), (0,)), ((), ()))
        >>> contraction_flops("dot_general", {"dimension_numbers": dn}, (4, 8), (8, 2), (4, 2))
        128.0
        >>> rdn = jax.lax.RaggedDotDimensionNumbers((((1,), (1,)), ((), ())), (0,), (0,))
        >>> params = {"ragged_dot_dimension_numbers": rdn}
        >>> contraction_flops("ragged_dot_general", params, (4, 8), (3, 8, 2), (4, 2))
        128.0
    """
    if prim == "dot_general":
        (lhs_contract, _), _ = params["dimension_numbers"]
        k = math.prod(lhs_shape[d] for d in lhs_contract)
        return 2.0 * math.prod(out_shape) * k
    if prim == "ragged_dot_general":
        dn = params["ragged_dot_dimension_numbers"]
        (lhs_contract, _), _ = dn.dot_dimension_numbers
        k = math.prod(lhs_shape[d] for d in lhs_contract)
        # ragged contracting dim: the output leads with the group dim, one group per row
        grouped = any(d in lhs_contract for d in dn.lhs_ragged_dimensions)
        return 2.0 * math.prod(out_shape[1:] if grouped else out_shape) * k
    if prim == "conv_general_dilated":
        rhs_spec = params["dimension_numbers"].rhs_spec
        per_output = math.prod(rhs_shape[d] for d in rhs_spec[1:])  # in-features x window
        return 2.0 * math.prod(out_shape) * per_output
    return 0.0


def _key_name(k: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def path_str(keypath: tuple) -> str:
    """A ``"/"``-joined path from a jax key path, dropping Variable ``value`` leaves.

    Example::

        >>> path_str((DictKey("w1"), DictKey("kernel"), GetAttrKey("value")))
        'w1/kernel'
    """
    names = [_key_name(k) for k in keypath]
    while names and names[-1] in ("value", "raw_value"):
        names.pop()
    return "/".join(names)


def freeze(value: Any) -> Any:
    """``value`` as a hashable cache key: mappings become sorted ``(key, value)``
    tuples and lists become tuples, recursively.

    Raises:
      TypeError: a leaf is not hashable (callers then skip their cache).

    Example::

        >>> freeze({"axis": [0, 1], "eps": 1e-6})
        (('axis', (0, 1)), ('eps', 1e-06))
    """
    if isinstance(value, Mapping):
        return tuple(sorted((k, freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v) for v in value)
    hash(value)
    return value


def as_unreduced(y: Any, spec: Any) -> Any:
    """A local value typed as holding the pending sums of ``spec`` (a ``TensorSpec``),
    inside a ``shard_map`` that checks types (``check_vma``): jax 0.11+ refuses an
    ``unreduced`` out-spec for a result not typed unreduced. A value the same on
    every device of an axis is first made varying over it (each device's piece of
    the sum)."""
    axes = tuple(a for a, _ in spec.partial)
    if not axes:
        return y
    import jax  # only inside shard_map bodies; util stays import-light

    mat = getattr(jax.typeof(y), "mat", None)
    varying = getattr(mat, "varying", frozenset())
    same = tuple(a for a in axes if a not in varying)
    if same:
        y = jax.lax.pcast(y, same, to="varying")
    return jax.lax.pcast(y, axes, to="unreduced")


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending (``[]`` for ``n < 1``).

    Example:
        >>> divisors(63)
        [1, 3, 7, 9, 21, 63]
    """
    small = [d for d in range(1, math.isqrt(max(n, 0)) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused for the block, then as it was.

    For work that allocates millions of small objects kept in memos (the
    planner's analytic search): each collection of an older generation walks
    every object that survived the younger ones, so collecting while they
    accumulate costs a large share of the work and finds nothing (they hold no
    cycles). Reference counting still frees what the block drops.

    Example:
        >>> with gc_paused():
        ...     costs = {i: (i, i * 2.0) for i in range(1000)}
        >>> len(costs)
        1000
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


#: spmdkit's packages whose code is an example, read as a user's: the reference
#: models (``spmdkit.models``, the repository's ``models/``).
USER_PACKAGES = ("spmdkit.models",)
_own_dirs_cache: dict[int, tuple[tuple[str, ...], tuple[str, ...]]] = register_cache(
    {},
    module=__name__,
    name="_own_dirs_cache",
    why="the directories of spmdkit's imported packages, keyed by how many modules "
    "are imported (is_own_source runs on every traced frame)",
)


def _own_dirs() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The directories of spmdkit's own packages and of its user-like ones, from
    the imported ``spmdkit`` packages' ``__path__`` (``spmdkit.rules`` lies in
    the repository's ``rules/``, not under ``spmdkit/``)."""
    # keyed by how many modules are imported: reading sys.modules whole on every
    # traced frame cost more than a millisecond a call, and spmdkit's packages are
    # only ever added to it
    key = len(sys.modules)
    if key not in _own_dirs_cache:
        mods = [(n, m) for n, m in list(sys.modules.items()) if n.partition(".")[0] == "spmdkit"]
        own: set[str] = set()
        user: set[str] = set()
        for name, mod in mods:
            users = any(name == u or name.startswith(u + ".") for u in USER_PACKAGES)
            for d in getattr(mod, "__path__", None) or ():
                (user if users else own).add(os.path.abspath(d) + os.sep)
        _own_dirs_cache.clear()
        _own_dirs_cache[key] = (tuple(sorted(own)), tuple(sorted(user)))
    return _own_dirs_cache[key]


def is_own_source(where: str) -> bool:
    """Whether ``where`` (a file path, or a ``file:line (function)`` frame) is
    spmdkit's own code: a module of an ``spmdkit`` package, decided by package
    (``spmdkit.rules`` in ``rules/`` is spmdkit's; the reference models in
    ``spmdkit.models`` are examples, read as a user's code).

    Example::

        >>> import spmdkit.rules.matmul as m
        >>> is_own_source(m.__file__), is_own_source("/home/me/train.py:3 (main)")
        (True, False)
    """
    if not where:
        return False
    path = where if os.path.isabs(where) else os.path.abspath(where)
    own, user = _own_dirs()
    if any(path.startswith(d) for d in user):
        return False
    return any(path.startswith(d) for d in own)
