"""TensorSpec: how one tensor is laid out over a mesh.

A spec holds, for every dim of a tensor, the mesh axes that shard it (major to
minor, as in ``P(("data", "fsdp"), None)``), plus *partial* axes: mesh axes over
which the value is a pending reduction (``sum``, ``avg``, ``max`` or ``min``).
Sum-partial is what JAX calls ``unreduced``.

Several partial axes reduce in the order listed (sorted by axis name). sum and
avg commute with each other; max and min commute with neither, so rules never
mix them with other ops on one tensor.

Invariants (checked on construction): a mesh axis appears at most once in a
tensor, and is never both sharding and partial; reduce ops come from
:data:`REDUCE_OPS`. Given ``mesh=``, axis names are checked against it too.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from spmdkit.errors import DuplicateAxisError, PartialConflictError, SpecError, UnknownAxisError
from spmdkit.state import register_cache

__all__ = ["REDUCE_OPS", "TensorSpec", "MeshLike", "axis_sizes"]

#: Reduce ops a partial axis may carry.
REDUCE_OPS = ("sum", "avg", "max", "min")

MeshLike = Mesh | AbstractMesh

_DTYPE_SHORT = {
    "float32": "f32",
    "float64": "f64",
    "float16": "f16",
    "bfloat16": "bf16",
    "int32": "i32",
    "int64": "i64",
    "int16": "i16",
    "int8": "i8",
    "uint8": "u8",
    "uint32": "u32",
    "bool": "bool",
}


def axis_sizes(mesh: MeshLike) -> dict[str, int]:
    """Mesh axis name → size, in mesh order, for a ``Mesh`` or ``AbstractMesh``
    (a fresh dict; the pairs are kept per mesh object: propagation asks for them
    hundreds of thousands of times)."""
    hit = _SIZES.get(id(mesh))
    if hit is not None and hit[0] is mesh:
        return dict(hit[1])
    pairs = tuple(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    if len(_SIZES) >= 64:
        _SIZES.clear()
    _SIZES[id(mesh)] = (mesh, pairs)  # the mesh held: its id is not reused meanwhile
    return dict(pairs)


#: :func:`axis_sizes`' pairs per mesh object (meshes are immutable), by ``id``:
#: comparing two equal meshes compares their devices.
_SIZES: dict[int, tuple[Any, tuple[tuple[str, int], ...]]] = register_cache(
    {}, module=__name__, name="_SIZES", why="a mesh's axis sizes, by mesh object."
)


def _normalize_entry(entry: Any, where: str) -> tuple[str, ...]:
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    if isinstance(entry, (tuple, list)):
        out = []
        for a in entry:
            if not isinstance(a, str):
                raise SpecError(
                    op="TensorSpec",
                    must="each dim entry is None, an axis name or a tuple of axis names",
                    given=f"{entry!r} at {where}",
                    fix="write P('data', None) or P(('data', 'fsdp'), None)",
                )
            out.append(a)
        return tuple(out)
    if entry is P.UNCONSTRAINED:
        raise SpecError(
            op="TensorSpec",
            must="every dim has a definite layout",
            given=f"P.UNCONSTRAINED at {where}",
            fix="use None (replicated) or name the axes; leave unconstrained dims to the planner",
        )
    raise SpecError(
        op="TensorSpec",
        must="each dim entry is None, an axis name or a tuple of axis names",
        given=f"{entry!r} at {where}",
        fix="write P('data', None) or P(('data', 'fsdp'), None)",
    )


def _normalize_partial(partial: Any) -> dict[str, str]:
    if partial is None:
        return {}
    if isinstance(partial, str):
        return {partial: "sum"}
    if isinstance(partial, Mapping):
        return {str(k): str(v) for k, v in partial.items()}
    if isinstance(partial, Iterable):
        out: dict[str, str] = {}
        for item in partial:
            if isinstance(item, str):
                out[item] = "sum"
            elif isinstance(item, tuple) and len(item) == 2:
                out[str(item[0])] = str(item[1])
            else:
                raise PartialConflictError(
                    op="TensorSpec",
                    must="partial is a mapping axis → reduce op, or axis names (sum)",
                    given=repr(partial),
                    fix="write partial={'x': 'max'} or partial=('x',)",
                )
        return out
    raise PartialConflictError(
        op="TensorSpec",
        must="partial is a mapping axis → reduce op, or axis names (sum)",
        given=repr(partial),
        fix="write partial={'x': 'max'} or partial=('x',)",
    )


class TensorSpec:
    """Shape (+ optional dtype), per-dim mesh axes, and partial axes of one tensor.

    Frozen and hashable; validated when built. Prints like ``jax.typeof``:
    ``f32[64@y,32@x]`` and, for partial axes, ``f32[64,32]{sum:x}``.

    Args:
      shape: the global shape.
      spec: per-dim layout: a ``PartitionSpec`` (its ``unreduced`` axes become
        sum-partial), or a sequence of entries (``None``, an axis, a tuple of
        axes). Shorter than the rank → the remaining dims are replicated.
        ``None`` → fully replicated.
      partial: axes holding a pending reduction: ``{"x": "max"}``, or axis
        names meaning ``sum``.
      dtype: optional dtype (anything ``np.dtype`` takes).
      mesh: optional mesh to check axis names against.

    Example::

        >>> TensorSpec((64, 32), P("y", "x"), dtype="float32")
        f32[64@y,32@x]
        >>> TensorSpec((64, 32), partial={"x": "max"})
        [64,32]{max:x}
    """

    __slots__ = ("_hash", "dims", "dtype", "partial", "shape")

    shape: tuple[int, ...]
    dims: tuple[tuple[str, ...], ...]
    partial: tuple[tuple[str, str], ...]
    dtype: np.dtype | None

    def __init__(
        self,
        shape: Iterable[int],
        spec: P | Iterable[Any] | None = None,
        *,
        partial: Mapping[str, str] | Iterable[str] | str | None = None,
        dtype: Any = None,
        mesh: MeshLike | None = None,
    ) -> None:
        shape_t = _check_shape(shape)
        part = _normalize_partial(partial)
        entries = _entries(spec, part)
        if len(entries) > len(shape_t):
            raise SpecError(
                op="TensorSpec",
                must="the spec has at most one entry per dim",
                given=f"{len(entries)} entries for shape {shape_t}",
                fix="drop the extra entries or fix the shape",
            )
        dims = tuple(_normalize_entry(e, f"dim {i}") for i, e in enumerate(entries))
        dims = dims + ((),) * (len(shape_t) - len(dims))
        _check_axes(shape_t, dims, part)
        object.__setattr__(self, "shape", shape_t)
        object.__setattr__(self, "dims", dims)
        object.__setattr__(self, "partial", tuple(sorted(part.items())))
        object.__setattr__(self, "dtype", None if dtype is None else np.dtype(dtype))
        object.__setattr__(self, "_hash", hash((shape_t, dims, self.partial, self.dtype)))
        if mesh is not None:
            self.validate(mesh)

    # -- value semantics -------------------------------------------------
    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"TensorSpec is frozen; use .replace({name}=...)")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TensorSpec):
            return NotImplemented
        return (
            self.shape == other.shape
            and self.dims == other.dims
            and self.partial == other.partial
            and self.dtype == other.dtype
        )

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):
        return (_rebuild_spec, (self.shape, self.dims, dict(self.partial), self.dtype))

    def __repr__(self) -> str:
        text = _fmt(self.shape, self.dims)
        if self.dtype is not None:
            name = self.dtype.name
            text = _DTYPE_SHORT.get(name, name) + text
        if self.partial:
            text += "{" + ",".join(f"{op}:{a}" for a, op in self.partial) + "}"
        return text

    __str__ = __repr__

    # -- queries ---------------------------------------------------------
    @property
    def ndim(self) -> int:
        """Number of dims."""
        return len(self.shape)

    @property
    def partial_ops(self) -> dict[str, str]:
        """Partial axis → reduce op."""
        return dict(self.partial)

    @property
    def sharding_axes(self) -> tuple[str, ...]:
        """Every mesh axis that shards some dim, in dim order."""
        return tuple(a for axes in self.dims for a in axes)

    @property
    def used_axes(self) -> frozenset[str]:
        """Axes that shard a dim or are partial."""
        return frozenset(self.sharding_axes) | frozenset(a for a, _ in self.partial)

    @property
    def is_replicated(self) -> bool:
        """True when no dim is sharded and nothing is partial."""
        return not self.sharding_axes and not self.partial

    @property
    def size(self) -> int:
        """Number of elements of the global tensor."""
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        """Bytes per element (4 when the dtype is unknown)."""
        return 4 if self.dtype is None else self.dtype.itemsize

    def validate(self, mesh: MeshLike, *, op: str = "TensorSpec") -> TensorSpec:
        """Check axis names against ``mesh``; returns ``self``.

        Raises:
          UnknownAxisError: an axis is not a mesh axis.
        """
        sizes = axis_sizes(mesh)
        for a in self.used_axes:
            if a not in sizes:
                near = difflib.get_close_matches(a, list(sizes), n=1)
                raise UnknownAxisError(
                    op=op,
                    must=f"every axis is a mesh axis of {tuple(sizes)}",
                    given=f"{a!r} in {self}",
                    fix=(f"did you mean {near[0]!r}? " if near else "")
                    + "rename the axis or build the mesh with it",
                )
        return self

    def shards(self, dim: int, mesh: MeshLike) -> int:
        """How many pieces dim ``dim`` is cut into on ``mesh``."""
        sizes = axis_sizes(mesh)
        return math.prod(sizes[a] for a in self.dims[dim])

    def local_shape(self, mesh: MeshLike) -> tuple[int, ...]:
        """Per-device shape; uneven dims are padded up (ceil), as XLA pads them."""
        return tuple(-(-s // self.shards(d, mesh)) for d, s in enumerate(self.shape))

    def local_bytes(self, mesh: MeshLike) -> int:
        """Bytes per device (padded local shape × itemsize)."""
        return math.prod(self.local_shape(mesh)) * self.itemsize

    def is_even(self, mesh: MeshLike) -> bool:
        """True when every sharded dim divides evenly over its axes."""
        return all(s % self.shards(d, mesh) == 0 for d, s in enumerate(self.shape))

    # -- building --------------------------------------------------------
    def replace(self, **changes: Any) -> TensorSpec:
        """A copy with ``shape``, ``dims`` (or ``spec``), ``partial`` or ``dtype`` replaced."""
        shape = changes.pop("shape", self.shape)
        spec = changes.pop("spec", None)
        dims = changes.pop("dims", self.dims if spec is None else spec)
        partial = changes.pop("partial", dict(self.partial))
        dtype = changes.pop("dtype", self.dtype)
        if changes:
            raise TypeError(f"TensorSpec.replace got unknown fields {sorted(changes)}")
        return TensorSpec(shape, dims, partial=partial, dtype=dtype)

    def without_partial(self) -> TensorSpec:
        """The same layout with every pending reduction resolved (replicated there)."""
        return self.replace(partial={}) if self.partial else self

    # -- JAX interop -----------------------------------------------------
    def to_partition_spec(self) -> P:
        """The ``PartitionSpec``; sum-partial axes become ``unreduced``.

        Raises:
          SpecError: an avg/max/min partial axis, which ``PartitionSpec`` cannot hold.
        """
        bad = {a: op for a, op in self.partial if op != "sum"}
        if bad:
            raise SpecError(
                op="TensorSpec.to_partition_spec",
                must="only sum-partial axes map to PartitionSpec (as unreduced)",
                given=f"{self} with {bad}",
                fix="resolve the partial axes first (sk.plan_reshard to a non-partial spec)",
            )
        entries = [None if not axes else axes[0] if len(axes) == 1 else axes for axes in self.dims]
        while entries and entries[-1] is None:
            entries.pop()
        unreduced = frozenset(a for a, _ in self.partial)
        return P(*entries, unreduced=unreduced) if unreduced else P(*entries)

    def to_named_sharding(self, mesh: MeshLike) -> NamedSharding:
        """``NamedSharding(mesh, self.to_partition_spec())`` after checking axis names."""
        self.validate(mesh, op="TensorSpec.to_named_sharding")
        return NamedSharding(mesh, self.to_partition_spec())

    def to_shape_dtype_struct(self, mesh: MeshLike | None = None) -> jax.ShapeDtypeStruct:
        """A ``jax.ShapeDtypeStruct`` (with a ``NamedSharding`` when ``mesh`` is given)."""
        dtype = self.dtype if self.dtype is not None else np.dtype("float32")
        sharding = None if mesh is None else self.to_named_sharding(mesh)
        return jax.ShapeDtypeStruct(self.shape, dtype, sharding=sharding)

    @classmethod
    def from_sharding(
        cls, shape: Iterable[int], sharding: NamedSharding, *, dtype: Any = None
    ) -> TensorSpec:
        """Build from a ``NamedSharding`` (unreduced axes → sum-partial)."""
        if not isinstance(sharding, NamedSharding):
            raise SpecError(
                op="TensorSpec.from_sharding",
                must="the sharding is a NamedSharding",
                given=type(sharding).__name__,
                fix="build a NamedSharding(mesh, PartitionSpec(...)), or reshard the value first",
            )
        return cls(shape, sharding.spec, dtype=dtype, mesh=sharding.mesh)

    @classmethod
    def from_value(cls, x: Any) -> TensorSpec:
        """Build from a ``jax.Array`` or ``jax.ShapeDtypeStruct`` carrying a NamedSharding.

        A value without a ``NamedSharding`` (e.g. a single-device array) is replicated.
        """
        sharding = getattr(x, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return cls.from_sharding(x.shape, sharding, dtype=x.dtype)
        return cls(x.shape, dtype=x.dtype)


def _rebuild_spec(shape, dims, partial, dtype):
    return TensorSpec(shape, dims, partial=partial, dtype=dtype)


def _fmt(shape: tuple[int, ...], dims: tuple[tuple[str, ...], ...]) -> str:
    parts = []
    for s, axes in zip(shape, dims, strict=True):
        if not axes:
            parts.append(str(s))
        elif len(axes) == 1:
            parts.append(f"{s}@{axes[0]}")
        else:
            parts.append(f"{s}@({','.join(axes)})")
    return "[" + ",".join(parts) + "]"


def _check_shape(shape: Iterable[int]) -> tuple[int, ...]:
    try:
        shape_t = tuple(int(s) for s in shape)
    except TypeError as e:
        raise SpecError(
            op="TensorSpec",
            must="shape is a sequence of ints",
            given=repr(shape),
            fix="pass e.g. (64, 32)",
        ) from e
    if any(s < 0 for s in shape_t):
        raise SpecError(
            op="TensorSpec",
            must="dims are non-negative",
            given=str(shape_t),
            fix="pass the tensor's real shape",
        )
    return shape_t


def _entries(spec: P | Iterable[Any] | None, part: dict[str, str]) -> tuple[Any, ...]:
    """The per-dim entries of ``spec``; a PartitionSpec's unreduced axes join ``part``
    as sum-partial."""
    if spec is None:
        return ()
    if not isinstance(spec, P):
        return tuple(spec)
    for ax in spec.unreduced:
        if ax in part and part[ax] != "sum":
            raise PartialConflictError(
                op="TensorSpec",
                must="an axis has one reduce op",
                given=f"{ax!r} unreduced (sum) in the PartitionSpec and {part[ax]!r} in partial=",
                fix="name the axis in one place only",
            )
        part[ax] = "sum"
    return tuple(spec.partitions)


def _check_axes(
    shape: tuple[int, ...], dims: tuple[tuple[str, ...], ...], part: Mapping[str, str]
) -> None:
    """A mesh axis shards one dim once, or is partial with a known op, never both."""
    seen: dict[str, int] = {}
    for d, axes in enumerate(dims):
        for a in axes:
            if a in seen:
                raise DuplicateAxisError(
                    op="TensorSpec",
                    must="a mesh axis shards at most one dim of a tensor, once",
                    given=f"axis {a!r} on dim {seen[a]} and dim {d} of {_fmt(shape, dims)}",
                    fix=f"keep {a!r} on one dim and use another axis for the other",
                )
            seen[a] = d
    for a, op in part.items():
        if op not in REDUCE_OPS:
            raise PartialConflictError(
                op="TensorSpec",
                must=f"partial reduce ops are one of {REDUCE_OPS}",
                given=f"{a!r}: {op!r}",
                fix="use 'sum', 'avg', 'max' or 'min'",
            )
        if a in seen:
            raise PartialConflictError(
                op="TensorSpec",
                must="an axis is never both sharding a dim and partial",
                given=f"axis {a!r} shards dim {seen[a]} and is partial ({op})",
                fix=f"drop {a!r} from the dims or from partial=",
            )
