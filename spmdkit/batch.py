"""Batch trees and micro-batches: what a step's batch is, and how it splits.

A batch is any tree of dicts, lists, tuples (named or not) and dataclass
instances. Its *tensor* leaves (numeric or bool arrays, python and numpy
numbers, ``jax.ShapeDtypeStruct`` s) are what a compiled step computes with;
every other leaf (strings, bytes, ``None``, python objects, lists of those,
numpy arrays of strings) is *non-tensor*.

At a step's boundary (``sk.jit``, :func:`spmdkit.introspect.describe`, ``train``) a
batch with non-tensor leaves travels as one :class:`Batch` node: its tensor
leaves are the node's children, keyed by their path (``"inp/x"``, so plans
find their fields by name), and everything else is the node's static part, a
:class:`BatchSkeleton` that compares *by structure*, never by value. A batch
whose example ids change every step therefore compiles once; the step is traced
with the non-tensor values of the batch it was first called with, which is all a
compiled program can ever see of them (compute with arrays, keep ids for
logging). :func:`as_tree` gives the user's tree back before the loss runs.

Micro-batches (gradient accumulation, pipelining) are split here and nowhere
else: :func:`split_rows` gives micro-batch ``i`` the rows ``i, i+n, i+2n, ...``
of every tensor leaf's leading (batch) dim, so a batch sharded on that dim stays
sharded on each micro-batch's rows with no data moved (a contiguous split would
move rows). :func:`microbatches` splits a whole batch tree: 0-d tensors reach
every micro-batch whole, and a non-tensor sequence with one item per example is
split the same way (item ``i`` of micro-batch ``j`` is example ``j + i·n``);
:func:`stack_rows` splits a plain pytree of arrays (the pipeline's micro-batches).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.tree_util import DictKey

from spmdkit.errors import SpmdError

__all__ = [
    "Batch",
    "BatchError",
    "BatchSkeleton",
    "Microbatches",
    "PerMicrobatch",
    "as_traced",
    "as_tree",
    "is_array_field",
    "is_tensor",
    "map_leaves",
    "microbatches",
    "split_batch",
    "split_rows",
    "stack_rows",
]


class BatchError(SpmdError, ValueError):
    """A batch does not split into the micro-batches asked for.

    Broken example: ``microbatches({"x": jnp.ones((6, 2))}, 4)`` (6 rows, 4 micro-batches).
    """


def is_array_field(value: Any) -> bool:
    """Whether a batch leaf is a numeric or bool array (numpy or jax): what a
    loader turns into a global array.

    Example::

        >>> is_array_field(np.ones(3)), is_array_field(["a", "b"])
        (True, False)
    """
    if isinstance(value, jax.Array):
        return True
    return isinstance(value, np.ndarray) and value.dtype.kind in "biufc"


def is_tensor(value: Any) -> bool:
    """Whether a batch leaf is traced by a compiled step: an array field, a
    ``jax.ShapeDtypeStruct``, or a python or numpy number (as ``jax.jit`` traces
    them); strings, ``None`` and other objects are not.

    Example::

        >>> is_tensor(np.ones(2)), is_tensor(0.5), is_tensor("ex0")
        (True, True, False)
    """
    if is_array_field(value) or isinstance(value, jax.ShapeDtypeStruct):
        return True
    if isinstance(value, np.generic):
        return value.dtype.kind in "biufc"
    return isinstance(value, bool | int | float | complex)


class PerMicrobatch(tuple):
    """An example-aligned non-tensor field split into micro-batches: item ``i``
    is micro-batch ``i``'s share (:func:`microbatches`).

    Example::

        >>> PerMicrobatch((["a", "c"], ["b", "d"]))[1]
        ['b', 'd']
    """

    __slots__ = ()


# -- batch trees ------------------------------------------------------------------


def _is_dataclass_instance(v: Any) -> bool:
    return dataclasses.is_dataclass(v) and not isinstance(v, type)


def _children(v: Any) -> list[tuple[Any, Any]] | None:
    """``(key, child)`` pairs of a container, or ``None`` for a leaf."""
    if isinstance(v, Mapping):
        return list(v.items())
    if isinstance(v, list | tuple) and not isinstance(v, PerMicrobatch):
        return list(enumerate(v))
    if _is_dataclass_instance(v):
        return [(f.name, getattr(v, f.name)) for f in dataclasses.fields(v)]
    return None


def _rebuild(v: Any, items: list[tuple[Any, Any]]) -> Any:
    if isinstance(v, Mapping):
        try:
            return type(v)(items)
        except TypeError:
            return dict(items)
    if isinstance(v, list):
        return [x for _, x in items]
    if isinstance(v, tuple):
        values = [x for _, x in items]
        return type(v)(*values) if hasattr(v, "_fields") else type(v)(values)
    out = copy.copy(v)  # a dataclass: frozen ones too, and fields with init=False
    for name, x in items:
        object.__setattr__(out, name, x)
    return out


def _has(v: Any, is_leaf: Callable[[Any], bool]) -> bool:
    if is_leaf(v):
        return True
    kids = _children(v)
    return kids is not None and any(_has(x, is_leaf) for _, x in kids)


def map_leaves(
    fn: Callable[[tuple, Any], Any],
    batch: Any,
    *,
    is_leaf: Callable[[Any], bool] = is_array_field,
    path: tuple = (),
) -> Any:
    """Rebuild a batch tree with ``fn(path, value)`` applied to its leaves.

    A leaf is a value ``is_leaf`` accepts (array fields by default), a list or
    tuple holding none of them (a list of strings is one leaf, handed to ``fn``
    whole), or any other non-container value. Dicts and dataclass instances are
    always walked, lists and tuples (named or not) when they hold leaves; a
    subtree that ``fn`` leaves unchanged keeps its identity.

    Example::

        >>> map_leaves(lambda p, v: v * 2 if is_array_field(v) else v,
        ...            {"img": {"pix": np.ones(2)}, "ids": ["a"]})["img"]["pix"]
        array([2., 2.])
    """
    walked = isinstance(batch, Mapping) or _is_dataclass_instance(batch)
    if is_leaf(batch) or (not walked and not _has(batch, is_leaf)):
        return fn(path, batch)
    kids = _children(batch) or []
    new = [(k, map_leaves(fn, x, is_leaf=is_leaf, path=(*path, k))) for k, x in kids]
    if all(a is b for (_, a), (_, b) in zip(kids, new, strict=True)):
        return batch
    return _rebuild(batch, new)


def path_name(path: tuple) -> str:
    """A batch leaf's path as ``"/"``-joined keys (``"inp/x"``; ``"<batch>"`` for the root)."""
    return "/".join(str(k) for k in path) or "<batch>"


class _Slot(int):
    """Where the i-th tensor leaf goes back into a :class:`BatchSkeleton`."""

    __slots__ = ()


def _slotted(
    batch: Any, is_leaf: Callable[[Any], bool], name: Callable[[tuple], str]
) -> tuple[Any, list[Any], list[str]]:
    """``batch`` with each leaf ``is_leaf`` picks replaced by its :class:`_Slot`, the
    leaves in slot order, and each leaf's path named by ``name``."""
    leaves: list[Any] = []
    names: list[str] = []

    def take(path: tuple, v: Any) -> Any:
        if is_leaf(v):
            leaves.append(v)
            names.append(name(path))
            return _Slot(len(leaves) - 1)
        return v

    return map_leaves(take, batch, is_leaf=is_leaf), leaves, names


def _structure(v: Any) -> Any:
    """A hashable key equal for batches of the same structure, whatever their
    non-tensor values (a list's length counts, a string's does not)."""
    if isinstance(v, _Slot):
        return ("slot", int(v))
    kids = _children(v)
    if kids is not None:
        return (type(v).__qualname__, tuple((k, _structure(x)) for k, x in kids))
    if isinstance(v, PerMicrobatch):
        return ("micro", len(v), tuple(_structure(x) for x in v[:1]))
    if isinstance(v, np.ndarray):
        return ("ndarray", v.dtype.kind, v.shape)
    return (type(v).__qualname__,)


class BatchSkeleton:
    """A batch with its tensor leaves taken out: the static part of a compiled step.

    Hashable and compared by structure (containers, keys, list lengths, leaf
    types), never by the non-tensor values, so a step compiled for one batch
    serves every batch shaped like it (module docstring).

    Attributes:
      tree: the batch with :class:`int` slot markers where the tensors were.
      paths: each slot's path name (``"inp/x"``), in slot order.
      per_micro: whether some leaf is a :class:`PerMicrobatch`.
    """

    def __init__(self, tree: Any, paths: Sequence[str] = ()) -> None:
        self.tree = tree
        self.paths = tuple(paths)
        self.per_micro = _has(tree, lambda v: isinstance(v, PerMicrobatch))
        self._key = (_structure(tree), self.paths)
        self._hash = hash(self._key)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BatchSkeleton) and self._key == other._key

    def __repr__(self) -> str:
        return f"BatchSkeleton({', '.join(self.paths)})"

    def fill(self, leaves: Sequence[Any], *, micro: int | None = None) -> Any:
        """The batch with ``leaves`` put back; with ``micro=i`` each
        :class:`PerMicrobatch` leaf is replaced by its ``i``-th item."""

        def put(_: tuple, v: Any) -> Any:
            if isinstance(v, _Slot):
                return leaves[int(v)]
            if micro is not None and isinstance(v, PerMicrobatch):
                return v[micro]
            return v

        return map_leaves(put, self.tree, is_leaf=lambda v: isinstance(v, _Slot | PerMicrobatch))


def split_batch(
    batch: Any, *, is_leaf: Callable[[Any], bool] = is_array_field
) -> tuple[list[Any], BatchSkeleton]:
    """Split a batch into its ``is_leaf`` leaves (in walk order) and the rest.

    Example::

        >>> leaves, skel = split_batch({"x": np.ones(2), "ids": ["a", "b"]})
        >>> len(leaves), skel.fill(leaves)["ids"], skel.paths
        (1, ['a', 'b'], ('x',))
    """
    tree, leaves, paths = _slotted(batch, is_leaf, path_name)
    return leaves, BatchSkeleton(tree, paths)


# -- a batch at a step's boundary -------------------------------------------------


class Batch:
    """A batch tree as a compiled step carries it (module docstring): a pytree
    node whose children are the tensor leaves, keyed by path name, and whose
    static part is the :class:`BatchSkeleton`.

    Attributes:
      leaves: the tensor leaves, in slot order.
      skeleton: everything else.
    """

    __slots__ = ("leaves", "skeleton")

    def __init__(self, leaves: Sequence[Any], skeleton: BatchSkeleton) -> None:
        self.leaves = tuple(leaves)
        self.skeleton = skeleton

    def tree(self) -> Any:
        """The batch as the user wrote it."""
        return self.skeleton.fill(self.leaves)

    def __repr__(self) -> str:
        return f"Batch({self.skeleton.paths})"


def _flatten(b: Batch) -> tuple[list[tuple[DictKey, Any]], BatchSkeleton]:
    return [(DictKey(p), x) for p, x in zip(b.skeleton.paths, b.leaves, strict=True)], b.skeleton


jax.tree_util.register_pytree_with_keys(
    Batch, _flatten, lambda skeleton, leaves: Batch(leaves, skeleton)
)


def as_traced(batch: Any) -> Any:
    """``batch`` as a compiled step takes it: a :class:`Batch` node when it holds
    non-tensor leaves (or containers jax does not know, like dataclasses), the
    batch itself otherwise.

    Example::

        >>> b = as_traced({"x": np.ones(2), "ids": ["a", "b"]})
        >>> jax.tree_util.tree_flatten_with_path(b)[0][0][0]
        (DictKey(key='x'),)
    """
    if isinstance(batch, Batch) or all(is_tensor(x) for x in jax.tree.leaves(batch)):
        return batch
    leaves, skeleton = split_batch(batch, is_leaf=is_tensor)
    return Batch(leaves, skeleton)


def as_tree(batch: Any) -> Any:
    """The user's batch tree from what :func:`as_traced` made (anything else as is)."""
    return batch.tree() if isinstance(batch, Batch) else batch


# -- micro-batches ----------------------------------------------------------------


def split_rows(
    x: Any, n: int, *, where: str = "batch", op: str = "micro-batches", error: type = BatchError
) -> Any:
    """One tensor ``[B, ...]`` as ``[n, B/n, ...]``: micro-batch ``i`` takes rows
    ``i, i+n, i+2n, ...`` (module docstring).

    Raises:
      BatchError (or ``error``): ``B`` does not divide into ``n``.

    Example::

        >>> split_rows(jnp.arange(4), 2)
        Array([[0, 2],
               [1, 3]], dtype=int32)
    """
    shape = tuple(np.shape(x))
    if not shape or shape[0] % n:
        raise error(
            op=op,
            must="every batch leaf's leading (batch) dim divides into the micro-batches",
            given=f"{where}: shape {shape}, microbatches={n}",
            fix=f"use a batch size that is a multiple of {n}, or fewer micro-batches",
        )
    return jnp.swapaxes(jnp.reshape(x, (shape[0] // n, n, *shape[1:])), 0, 1)


def stack_rows(batch: Any, n: int, *, op: str = "micro-batches", error: type = BatchError) -> Any:
    """Every array leaf of a pytree split by :func:`split_rows` (``[n, B/n, ...]``)."""

    def one(kp: tuple, x: Any) -> Any:
        return split_rows(x, n, where=f"batch{jax.tree_util.keystr(kp)}", op=op, error=error)

    return jax.tree_util.tree_map_with_path(one, batch)


def _keystr(path: tuple) -> str:
    return "batch" + "".join(f"[{k!r}]" for k in path)


@dataclass(frozen=True)
class Microbatches:
    """A batch split into ``n`` micro-batches (:func:`microbatches`).

    Attributes:
      n: the number of micro-batches.
      stacked: the split tensor leaves, each ``[n, B/n, ...]``.
      skeleton: the batch with slots for its tensor leaves; example-aligned
        non-tensor fields as :class:`PerMicrobatch`.
      split: the slot of each stacked leaf.
      whole: slot → a 0-d tensor every micro-batch takes whole.
    """

    n: int
    stacked: tuple
    skeleton: BatchSkeleton
    split: tuple[int, ...]
    whole: Mapping[int, Any]

    @property
    def unrolled(self) -> bool:
        """Whether the micro-batches differ in static values (split non-tensor
        fields): a loop over them must then be a python loop, not a scan."""
        return self.skeleton.per_micro

    def batch(self, i: Any, rows: Sequence[Any]) -> Any:
        """Micro-batch ``i`` from its rows of each stacked leaf (``i`` a python int
        when :attr:`unrolled`)."""
        leaves = dict(self.whole)
        leaves.update(zip(self.split, rows, strict=True))
        return self.skeleton.fill(
            [leaves[s] for s in range(len(leaves))], micro=i if self.unrolled else None
        )

    def rows(self, i: int) -> list[Any]:
        """Micro-batch ``i``'s rows of each stacked leaf."""
        return [x[i] for x in self.stacked]


def microbatches(
    batch: Any, n: int, *, op: str = "micro-batches", error: type = BatchError
) -> Microbatches:
    """Split a batch tree into ``n`` micro-batches (module docstring).

    Raises:
      BatchError (or ``error``): a tensor's leading dim does not divide into ``n``.

    Example::

        >>> mb = microbatches({"x": jnp.arange(4), "ids": ["a", "b", "c", "d"]}, 2)
        >>> mb.batch(1, mb.rows(1))
        {'x': Array([1, 3], dtype=int32), 'ids': ['b', 'd']}
    """
    tree, leaves, where = _slotted(as_tree(batch), is_tensor, _keystr)
    split = tuple(i for i, x in enumerate(leaves) if np.ndim(x) > 0)
    stacked = tuple(split_rows(leaves[i], n, where=where[i], op=op, error=error) for i in split)
    rows = {int(np.shape(leaves[i])[0]) for i in split}

    def per_example(_: tuple, v: Any) -> Any:
        aligned = (isinstance(v, list | tuple) and not hasattr(v, "_fields")) or (
            isinstance(v, np.ndarray) and v.ndim > 0
        )
        if aligned and len(rows) == 1 and len(v) in rows and not isinstance(v, _Slot):
            return PerMicrobatch(v[i::n] for i in range(n))
        return v

    tree = map_leaves(per_example, tree, is_leaf=lambda v: isinstance(v, _Slot))
    whole = {i: x for i, x in enumerate(leaves) if np.ndim(x) == 0}
    return Microbatches(n, stacked, BatchSkeleton(tree), split, whole)
