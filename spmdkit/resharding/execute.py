"""Reshard execution: run a :class:`~spmdkit.resharding.plan.ReshardPlan` on a ``jax.Array``.

Each step of a plan runs as one ``jax.shard_map`` collective (``all_gather``,
``psum``, ``psum_scatter``, ``all_to_all``) or local op (a slice, keeping the
value on one rank), so the compiled HLO has exactly the planned collectives;
:func:`spmdkit.verification.hlo.check_plan` checks that.

* :func:`reshard` reads the source layout from the array, plans and runs.
* :func:`run_plan` runs a given plan (eager arrays or tracers);
  :func:`step_fn` is one step's per-device function, for callers that run steps
  inside their own ``shard_map`` (``spmdkit.compile`` reduces a contraction's
  partial result where it is computed).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from spmdkit.errors import ReshardError
from spmdkit.resharding.plan import Collective, ReshardPlan, plan_reshard
from spmdkit.spec import MeshLike, TensorSpec, axis_sizes
from spmdkit.state import cached
from spmdkit.util import as_unreduced
from spmdkit.vma import shard_map

__all__ = ["empty_array", "permute_pairs", "reshard", "run_plan", "step_fn"]


def _is_tracer(x: Any) -> bool:
    return isinstance(x, jax.core.Tracer)


def _mesh_signature(mesh: MeshLike) -> tuple:
    return tuple(axis_sizes(mesh).items())


def _source_mesh(x: Any) -> tuple[Any, MeshLike | None]:
    """``x``'s sharding and the mesh it lives on (None when unsharded)."""
    sharding = jax.typeof(x).sharding if _is_tracer(x) else getattr(x, "sharding", None)
    src_mesh = sharding.mesh if isinstance(sharding, NamedSharding) else None
    if src_mesh is not None and not src_mesh.axis_names:
        src_mesh = None  # traced without a mesh: an unsharded value
    return sharding, src_mesh


def _target_mesh(
    x: Any, dst: Any, mesh: MeshLike | None, src_mesh: MeshLike | None
) -> tuple[Any, MeshLike]:
    """The target layout without its mesh, and the one mesh that ``x``, ``dst``
    and ``mesh=`` agree on."""
    if isinstance(dst, NamedSharding):
        if mesh is not None and _mesh_signature(mesh) != _mesh_signature(dst.mesh):
            raise ReshardError(
                op="reshard",
                must="mesh= agrees with the target NamedSharding's mesh",
                given=f"{_mesh_signature(mesh)} vs {_mesh_signature(dst.mesh)}",
                fix="drop mesh= or pass the same mesh",
            )
        mesh, dst = dst.mesh, dst.spec
    if mesh is None:
        mesh = src_mesh
    if mesh is None:
        raise ReshardError(
            op="reshard",
            must="a mesh is known (from x, a NamedSharding target, or mesh=)",
            given=f"an unsharded value of shape {tuple(x.shape)} and a {type(dst).__name__}",
            fix="pass mesh=... or a NamedSharding",
        )
    _check_same_mesh(x, src_mesh, mesh)
    return dst, mesh


def _check_same_mesh(x: Any, src_mesh: MeshLike | None, mesh: MeshLike) -> None:
    if src_mesh is None:
        return
    if _mesh_signature(src_mesh) != _mesh_signature(mesh):
        raise ReshardError(
            op="reshard",
            must="x lives on the target mesh",
            given=f"x on {_mesh_signature(src_mesh)}, target {_mesh_signature(mesh)}",
            fix="jax.device_put x onto the target mesh first",
        )
    if (
        isinstance(src_mesh, Mesh)
        and isinstance(mesh, Mesh)
        and src_mesh.devices.tolist() != mesh.devices.tolist()
    ):
        raise ReshardError(
            op="reshard",
            must="x lives on the target mesh's devices, in the same order",
            given=f"x on devices {src_mesh.device_ids.tolist()}, target {mesh.device_ids.tolist()}",
            fix="jax.device_put x onto the target mesh first",
        )
    if _is_tracer(x) and any(t != AxisType.Explicit for t in src_mesh.axis_types):
        raise ReshardError(
            op="reshard",
            must="inside jit, x's layout is part of its type (Explicit mesh axes)",
            given=f"a traced value on a mesh with axis types {src_mesh.axis_types}",
            fix="build the mesh with sk.make_mesh (Explicit axes) or call reshard outside jit",
        )


def _target_spec(x: Any, src: TensorSpec, dst: Any) -> TensorSpec:
    """The target as a TensorSpec of ``x``'s shape and dtype."""
    if isinstance(dst, TensorSpec):
        if dst.shape != src.shape:
            raise ReshardError(
                op="reshard",
                must="the target spec has x's shape",
                given=f"x {src}, target {dst}",
                fix="build the target TensorSpec with x.shape",
            )
        return dst if dst.dtype is not None else dst.replace(dtype=x.dtype)
    if isinstance(dst, P):
        return TensorSpec(x.shape, dst, dtype=x.dtype)
    raise ReshardError(
        op="reshard",
        must="the target is a TensorSpec, PartitionSpec or NamedSharding",
        given=type(dst).__name__,
        fix="pass e.g. P('x', None)",
    )


def _resolve(
    x: jax.Array, dst: Any, mesh: MeshLike | None
) -> tuple[TensorSpec, TensorSpec, MeshLike, jax.Array]:
    """Source spec, target spec, mesh to run on, and ``x`` placed on that mesh."""
    traced = _is_tracer(x)
    sharding, src_mesh = _source_mesh(x)
    dst, mesh = _target_mesh(x, dst, mesh, src_mesh)
    src = (
        TensorSpec.from_sharding(x.shape, sharding, dtype=x.dtype)
        if src_mesh is not None
        else TensorSpec(x.shape, dtype=x.dtype)
    )
    dst_spec = _target_spec(x, src, dst)
    if not traced and not isinstance(mesh, Mesh):
        if not isinstance(src_mesh, Mesh):
            raise ReshardError(
                op="reshard",
                must="outside jit, a concrete Mesh (with devices) is known",
                given=f"an AbstractMesh {_mesh_signature(mesh)}",
                fix="pass the jax.sharding.Mesh the array should live on",
            )
        mesh = src_mesh
    if src_mesh is None and not traced:
        x = jax.device_put(x, NamedSharding(mesh, P()))
    return src, dst_spec, mesh, x


def _check_executable(spec: TensorSpec, mesh: MeshLike, which: str) -> None:
    sizes = axis_sizes(mesh)
    for d, (s, axes) in enumerate(zip(spec.shape, spec.dims, strict=True)):
        n = math.prod(sizes[a] for a in axes)
        if s % n:
            raise ReshardError(
                op="reshard",
                must="every sharded dim of a JAX array divides evenly over its axes",
                given=f"{which} {spec}: dim {d} of size {s} over {axes} = {n} devices",
                fix=f"pad dim {d} to a multiple of {n} (e.g. {-(-s // n) * n}) "
                "or shard it over fewer devices",
            )
    bad = {a: op for a, op in spec.partial if op != "sum"}
    if bad:
        raise ReshardError(
            op="reshard",
            must="JAX arrays hold only sum-partial (unreduced) values",
            given=f"{which} {spec} with {bad}",
            fix="plan it with plan_reshard, or resolve the partial axes to sum first",
        )
    if spec.partial and any(t != AxisType.Explicit for t in mesh.axis_types):
        raise ReshardError(
            op="reshard",
            must="sum-partial (unreduced) arrays live on meshes with Explicit axes",
            given=f"{which} {spec} on axis types {mesh.axis_types}",
            fix="build the mesh with sk.make_mesh (Explicit axes by default)",
        )


def step_fn(step: Collective) -> Callable[[jax.Array], jax.Array]:
    """The per-device function of one plan step, to call inside ``shard_map``.

    It maps the local block before the step to the local block after it, with
    the step's collective over its mesh axes (a group of one device moves
    nothing). ``to_partial`` keeps the value on the group's first device and
    zeros elsewhere (the identity of a sum).

    Example::

        >>> plan = plan_reshard(TensorSpec((8, 4), P("x")), TensorSpec((8, 4)), mesh)
        >>> f = step_fn(plan.steps[0])      # all_gather over "x" along dim 0
        >>> jax.shard_map(f, mesh=mesh, in_specs=P("x"), out_specs=P())(x)
    """
    kind, axes = step.kind, step.axes
    name = axes if len(axes) > 1 else axes[0]
    if step.group_size == 1:
        return lambda y: y
    if kind == "collective_permute":
        return _permute_fn(step)
    if kind == "all_gather":
        return lambda y: jax.lax.all_gather(y, name, axis=step.dim, tiled=True)
    if kind == "all_reduce":
        return lambda y: jax.lax.psum(y, name)
    if kind == "reduce_scatter":
        return lambda y: jax.lax.psum_scatter(y, name, scatter_dimension=step.dim, tiled=True)
    if kind == "all_to_all":
        return lambda y: jax.lax.all_to_all(
            y, name, split_axis=step.dst_dim, concat_axis=step.dim, tiled=True
        )
    if kind == "slice":

        def take(y):
            size = y.shape[step.dim] // step.group_size
            start = jax.lax.axis_index(name) * size
            return jax.lax.dynamic_slice_in_dim(y, start, size, axis=step.dim)

        return take

    def keep_on_first(y):  # to_partial(sum): one rank keeps the value, the rest hold 0
        first = jax.lax.axis_index(name) == 0
        return jnp.where(first, y, jnp.zeros_like(y))

    return keep_on_first


def permute_pairs(
    step: Collective, sizes: dict[str, int]
) -> tuple[list[tuple[int, int]], list[tuple[int, ...]]]:
    """A ``collective_permute`` step's ``(source, target)`` pairs over its group
    (devices numbered row-major over ``step.axes``, as ``ppermute`` numbers
    them), and per source the index of the target block it sends within its own
    block, per dim. A device that holds the block it needs keeps it (sends it to
    itself); the others take the holders of their block's source block in order.

    Example::

        >>> step = plan_reshard(TensorSpec((8,), P("a")), TensorSpec((8,), P("b")),
        ...                     abstract_mesh(a=2, b=2)).steps[0]
        >>> permute_pairs(step, {"a": 2, "b": 2})[0]
        [(0, 0), (2, 1), (1, 2), (3, 3)]
    """
    before, after = step.layouts
    axes = step.axes
    coords = list(itertools.product(*(range(sizes[a]) for a in axes)))

    def blocks(dims: tuple[tuple[str, ...], ...], c: tuple[int, ...]) -> tuple[int, ...]:
        at = dict(zip(axes, c, strict=True))
        out = []
        for d in dims:
            b = 0
            for a in d:
                b = b * sizes[a] + at[a]
            out.append(b)
        return tuple(out)

    split = [
        math.prod(sizes[a] for a in t) // math.prod(sizes[a] for a in b)
        for b, t in zip(before, after, strict=True)
    ]
    held = [blocks(before, c) for c in coords]
    need = [blocks(after, c) for c in coords]
    src_of = [tuple(n // k for n, k in zip(w, split, strict=True)) for w in need]
    source: dict[int, int] = {t: t for t in range(len(coords)) if held[t] == src_of[t]}
    free: dict[tuple[int, ...], list[int]] = {}
    for s in range(len(coords)):
        if s not in source.values():
            free.setdefault(held[s], []).append(s)
    for t in range(len(coords)):
        if t not in source:
            source[t] = free[src_of[t]].pop(0)
    piece: list[tuple[int, ...]] = [()] * len(coords)
    for t, s in source.items():
        piece[s] = tuple(n % k for n, k in zip(need[t], split, strict=True))
    return sorted(((s, t) for t, s in source.items()), key=lambda p: p[1]), piece


def _permute_fn(step: Collective) -> Callable[[jax.Array], jax.Array]:
    """The per-device function of a ``collective_permute`` step: the piece of the
    local block the device sends (:func:`permute_pairs`), passed to its target."""
    axes = step.axes

    def move(y: jax.Array) -> jax.Array:
        sizes = {a: jax.lax.axis_size(a) for a in axes}
        pairs, piece = permute_pairs(step, sizes)
        before, after = step.layouts
        split = [
            math.prod(sizes[a] for a in t) // math.prod(sizes[a] for a in b)
            for b, t in zip(before, after, strict=True)
        ]
        size = [n // k for n, k in zip(y.shape, split, strict=True)]
        me = 0
        for a in axes:
            me = me * sizes[a] + jax.lax.axis_index(a)
        table = jnp.asarray(np.asarray(piece, np.int32).reshape(len(piece), y.ndim))
        starts = [table[me, d] * size[d] for d in range(y.ndim)]
        block = jax.lax.dynamic_slice(y, starts, size)
        return jax.lax.ppermute(block, axes if len(axes) > 1 else axes[0], perm=pairs)

    return move


def run_plan(x: jax.Array, plan: ReshardPlan, mesh: MeshLike) -> jax.Array:
    """Run ``plan``'s steps on ``x`` (laid out as ``plan.src``), one ``shard_map`` each.

    No checks and no jit: ``x`` must already have ``plan.src``'s layout on
    ``mesh`` (use :func:`reshard` for a checked, compiled move). Works on arrays
    and on tracers inside ``jax.jit``.

    Example::

        >>> plan = plan_reshard(TensorSpec((8, 4), P("x")), TensorSpec((8, 4)), mesh)
        >>> jax.jit(lambda x: run_plan(x, plan, mesh))(x).sharding.spec
        PartitionSpec()
    """
    specs = plan.specs
    for step, before, after in zip(plan.steps, specs[:-1], specs[1:], strict=True):
        x = shard_map(
            step_fn(step),
            mesh=mesh,
            in_specs=before.to_partition_spec(),
            out_specs=after.to_partition_spec(),
            check_vma=False,
        )(x)
    return x


@cached(maxsize=512, why="the compiled runner of one reshard plan on one mesh.")
def _compiled_runner(plan: ReshardPlan, mesh: Mesh):
    return jax.jit(functools.partial(run_plan, plan=plan, mesh=mesh))


def reshard(
    x: jax.Array,
    dst: TensorSpec | P | NamedSharding,
    *,
    mesh: MeshLike | None = None,
) -> jax.Array:
    """Move ``x`` to the layout ``dst`` by running :func:`plan_reshard`'s steps.

    The source layout is read from ``x`` (sum-partial when its spec has
    ``unreduced`` axes). Each step runs as one ``jax.shard_map`` collective, so
    the compiled program has exactly the planned collectives. Works eagerly and
    inside ``jax.jit`` (there the mesh axes must be Explicit, so that ``x``'s
    layout is known). An unsharded ``x`` is first placed replicated on the mesh.

    Args:
      x: the array (or a tracer of one).
      dst: target layout: a ``TensorSpec`` (shape must match), a
        ``PartitionSpec``, or a ``NamedSharding`` (which also names the mesh).
      mesh: the mesh, when neither ``x`` nor ``dst`` carries one.

    Returns:
      ``x`` with the layout ``dst`` (``x`` itself when nothing changes). A zero-size
      ``x`` moves no data and runs no collective, whatever the two layouts.

    Raises:
      ReshardError: a dim does not divide evenly over its axes (JAX arrays hold no
        padded shards), an avg/max/min partial target, a partial target on a
        non-Explicit mesh, a shape mismatch, or meshes that disagree.
      UnknownAxisError: ``dst`` names an axis the mesh does not have.

    Example::

        >>> mesh = sk.make_mesh(x=4)
        >>> y = reshard(jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("x"))), P())
        >>> y.sharding.spec
        PartitionSpec()
    """
    src, dst_spec, mesh, x = _resolve(x, dst, mesh)
    dst_spec.validate(mesh, op="reshard")
    _check_executable(src, mesh, "source")
    _check_executable(dst_spec, mesh, "target")
    plan = plan_reshard(src, dst_spec, mesh)
    if plan.is_noop:
        return x
    if math.prod(x.shape) == 0:  # no data to move: every block is empty, whatever the layout
        return empty_array(dst_spec, x.dtype, mesh, like=(x, src))
    if _is_tracer(x):
        return run_plan(x, plan, mesh)
    return _compiled_runner(plan, mesh)(x)


def empty_array(
    spec: TensorSpec, dtype: Any, mesh: MeshLike, *, like: tuple[Any, TensorSpec] | None = None
) -> Any:
    """A zero-size array of ``spec``'s shape laid out by ``spec``, made without any
    collective (collectives on empty operands do not even lower).

    Outside ``jit`` every device's block is made from an empty host array, so the
    shards have their right (empty) shapes. Inside ``jit`` pass ``like=(x, x_spec)``,
    a traced operand and its layout: each device then makes its block in a
    ``shard_map`` over ``x`` (which fixes the program's devices; nothing of ``x``
    is read).

    Example::

        >>> empty_array(TensorSpec((0, 8), P(None, "x")), jnp.float32, mesh).shape
        (0, 8)
    """
    pspec = spec.to_partition_spec()
    traced = like is not None and _is_tracer(like[0])
    if not traced and isinstance(mesh, Mesh) and not spec.partial:
        host = np.zeros(spec.shape, dtype)
        return jax.make_array_from_callback(
            spec.shape, NamedSharding(mesh, pspec), lambda index: host[index]
        )
    sizes = axis_sizes(mesh)
    dims = zip(spec.shape, spec.dims, strict=True)
    block = tuple(s // math.prod(sizes[a] for a in axes) for s, axes in dims)
    x, x_spec = like if like is not None else (jnp.zeros(()), TensorSpec(()))
    make = shard_map(
        # the block depends on x (a sum over its empty block, 0): a program whose
        # outputs use no input loses its devices when jit lowers it
        # (typed unreduced where the target is sum-partial: jax 0.11+ compiles no
        # unreduced result from an untyped one)
        lambda y: as_unreduced(jnp.zeros(block, dtype) + jnp.sum(y).astype(dtype), spec),
        mesh=mesh,
        in_specs=x_spec.without_partial().to_partition_spec(),
        out_specs=pspec,
        check_vma=bool(spec.partial),
    )
    if traced:
        return make(x)
    try:
        return jax.jit(make)(x)
    except jax.errors.JaxRuntimeError as e:
        if "unreduced" not in str(e):
            raise
        # jax 0.11+ compiles no zero-size unreduced result (jax.device_put fails too)
        raise ReshardError(
            op="reshard",
            must="an empty array can be made sum-partial outside jit on this jax",
            given=f"a zero-size {spec} on jax {jax.__version__}, which refuses to "
            "compile an empty unreduced result",
            fix="reshard it to the layout without the pending sum (an empty array has "
            "nothing to sum), or inside jax.jit",
        ) from None
