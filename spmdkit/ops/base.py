"""The machinery every rule-enforcing op shares: :func:`apply_rule`.

An op is a registered rule applied to arrays:

1. the mesh and the input specs are read from the arrays (their
   ``NamedSharding``; inside ``jit`` the layout is part of the type under
   Explicit axes), or taken from ``in_specs=``;
2. :func:`spmdkit.infer_forward` answers with the required input specs, the
   output specs and the op's own collectives;
3. each input is moved to its required spec with :func:`spmdkit.reshard`
   (exactly the planned collectives) — under Auto axes inside ``jit``, where a
   tracer has no layout, the ``shard_map`` in_specs constrain it and XLA moves it;
4. the rule's :meth:`~spmdkit.engine.rule.Rule.local_fn` runs under ``shard_map``
   (:func:`spmdkit.engine.local.shard_program`), partial outputs are all-reduced in
   the same program, and the outputs leave with the rule's layout.

Where no layout can be known yet — traced arguments on a mesh with Auto axes
and no ``in_specs``, or traced arguments with no mesh at all (the planner's
abstract trace) — the op is traced as a region (:mod:`spmdkit.engine.region`): one
named equation the planner propagates with the rule and ``sk.jit``'s replay
runs with the planned specs.

``jax.grad`` differentiates through all of it (shard_map and the reshard
collectives transpose to their duals); a rule whose backward must move less
than autodiff would gives its local function a ``jax.custom_vjp``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from spmdkit.engine.inference import InferenceResult, infer_forward
from spmdkit.engine.local import shard_program
from spmdkit.engine.region import region_call
from spmdkit.engine.registry import get_rule
from spmdkit.engine.rule import without_strategy
from spmdkit.errors import SpecError
from spmdkit.resharding import empty_array, reshard
from spmdkit.spec import MeshLike, TensorSpec
from spmdkit.state import cached
from spmdkit.util import freeze

__all__ = ["apply_rule", "input_spec", "find_mesh"]


def _is_tracer(x: Any) -> bool:
    return isinstance(x, jax.core.Tracer)


def _sharding(x: Any) -> Any:
    if _is_tracer(x):
        return jax.typeof(x).sharding
    return getattr(x, "sharding", None)


def find_mesh(op: str, args: Sequence[Any], mesh: MeshLike | None) -> MeshLike:
    """The mesh an op runs on: ``mesh=``, else the arrays' mesh, else the context mesh.

    Raises:
      SpecError: no mesh can be found, or the arrays live on different meshes.
    """
    if mesh is not None:
        return mesh
    found: list[MeshLike] = []
    for a in args:
        s = _sharding(a)
        if isinstance(s, NamedSharding) and s.mesh.axis_names:
            found.append(s.mesh)
    concrete = [m for m in found if isinstance(m, Mesh)]
    pick = concrete[0] if concrete else (found[0] if found else None)
    if pick is None:
        ctx = jax.sharding.get_abstract_mesh()
        if ctx is not None and ctx.axis_names:
            pick = ctx
    if pick is None:
        raise SpecError(
            op=op,
            must="the op knows its mesh",
            given="arrays without a NamedSharding and no mesh context",
            fix="pass mesh=..., place the arrays with jax.device_put(x, NamedSharding(mesh, "
            "P(...))), or call inside `with jax.set_mesh(mesh):`",
        )
    names = tuple(pick.axis_names)
    for m in found:
        if tuple(m.axis_names) != names or tuple(m.axis_sizes) != tuple(pick.axis_sizes):
            raise SpecError(
                op=op,
                must="all array arguments live on one mesh",
                given=f"meshes {dict(zip(names, pick.axis_sizes, strict=True))} and "
                f"{dict(zip(m.axis_names, m.axis_sizes, strict=True))}",
                fix="jax.device_put the arguments onto the same mesh",
            )
    return pick


def _explicit(mesh: MeshLike) -> bool:
    return all(t == AxisType.Explicit for t in mesh.axis_types)


def input_spec(op: str, i: int, x: Any, given: Any, mesh: MeshLike) -> TensorSpec:
    """The spec of argument ``i``: from ``in_specs`` when given, else from its layout.

    Raises:
      SpecError: a traced argument under Auto mesh axes (its layout is not known
        while tracing) and no ``in_specs`` entry for it.
    """
    if given is not None:
        spec = given if isinstance(given, TensorSpec) else TensorSpec(x.shape, given)
        if spec.shape != tuple(x.shape):
            raise SpecError(
                op=op,
                must="in_specs entries have their argument's shape",
                given=f"argument {i} of shape {tuple(x.shape)}, spec {spec}",
                fix="build the TensorSpec with the argument's shape, or pass a PartitionSpec",
            )
        return spec.replace(dtype=x.dtype)
    sharding = _sharding(x)
    if _is_tracer(x) and not _explicit(mesh):
        raise SpecError(
            op=op,
            must="the layout of every traced argument is known",
            given=f"argument {i} ({jax.typeof(x)}) traced on a mesh with Auto axes, "
            "where a tracer carries no layout",
            fix="pass in_specs=(P(...), ...) for the arguments, or use Explicit axes "
            "(sk.make_mesh)",
        )
    if isinstance(sharding, NamedSharding) and sharding.mesh.axis_names:
        return TensorSpec.from_sharding(x.shape, sharding, dtype=x.dtype)
    return TensorSpec(x.shape, dtype=x.dtype)


def _layout_unknown(op: str, arrays: Sequence[Any], mesh: MeshLike | None) -> bool:
    """True when some argument is traced and its layout cannot be read: no mesh at
    all, or a mesh with Auto axes (the region case, see the module docstring)."""
    if not any(_is_tracer(x) for x in arrays):
        return False
    try:
        found = find_mesh(op, arrays, mesh)
    except SpecError:
        return True
    return not _explicit(found)


def _region(op: str, arrays: Sequence[Any], attrs: dict[str, Any]) -> Any:
    """The op as a region, after the rule has checked the shapes and attributes."""
    specs = [TensorSpec(x.shape, dtype=x.dtype) for x in arrays]
    infer_forward(op, *specs, mesh=_NO_AXES, **attrs)  # raises the rule's typed errors
    return region_call(op, arrays, attrs)


_NO_AXES = jax.sharding.AbstractMesh((), ())


def _place(x: Any, dst: TensorSpec, mesh: MeshLike) -> Any:
    if _is_tracer(x):
        if _explicit(mesh):
            return reshard(x, dst, mesh=mesh)
        return x  # Auto axes: shard_map's in_specs constrain it; XLA moves it
    if not isinstance(x, jax.Array) or not isinstance(_sharding(x), NamedSharding):
        x = jax.device_put(jnp.asarray(x), NamedSharding(mesh, P()))
    return reshard(x, dst, mesh=mesh)


def apply_rule(
    op: str,
    *args: Any,
    mesh: MeshLike | None = None,
    in_specs: Sequence[Any] | None = None,
    return_result: bool = False,
    **attrs: Any,
) -> Any:
    """Run the registered rule ``op`` on arrays: reshard, local computation, outputs.

    Args:
      op: a registered op whose rule governs the call.
      *args: the op's array operands (jax arrays, tracers, numpy arrays).
      mesh: the mesh (default: the arrays' mesh, else the ``jax.set_mesh`` context).
      in_specs: per argument, a ``PartitionSpec`` or ``TensorSpec`` giving its
        layout, or ``None`` to read it from the argument; needed for traced
        arguments on meshes with Auto axes.
      return_result: also return the :class:`~spmdkit.InferenceResult`.
      **attrs: the op's attributes (``strategy=`` picks one of the rule's strategies).

    Returns:
      The output (or a tuple of outputs), laid out as the rule claims with the
      pending reductions resolved; with ``return_result``, ``(outputs, result)``.

    Traced arguments whose layout is unknown (Auto axes and no ``in_specs``, or
    no mesh) make the call a region (module docstring): the planner lays it out.

    Raises:
      SpecError: no mesh, arrays on different meshes, or an unknown layout.
      ShardingConflictError: the rule rejects the shapes or attributes, or a
        required layout does not divide evenly.
    """
    rule = get_rule(op)
    arrays = [a if isinstance(a, jax.Array) or _is_tracer(a) else jnp.asarray(a) for a in args]
    if in_specs is None and not return_result and _layout_unknown(op, arrays, mesh):
        return _region(op, arrays, attrs)
    mesh = find_mesh(op, arrays, mesh)
    given = list(in_specs) if in_specs is not None else [None] * len(arrays)
    if len(given) != len(arrays):
        raise SpecError(
            op=op,
            must="one in_specs entry per argument",
            given=f"{len(given)} entries for {len(arrays)} arguments",
            fix="pass None for arguments whose layout should be read from the array",
        )
    specs = [
        input_spec(op, i, x, g, mesh) for i, (x, g) in enumerate(zip(arrays, given, strict=True))
    ]
    res: InferenceResult = infer_forward(op, *specs, mesh=mesh, **attrs)
    if any(math.prod(x.shape) == 0 for x in arrays):
        empty = _zero_size_outputs(rule, res, arrays, specs, attrs, mesh)
        if empty is not None:
            return (
                (empty[0] if len(empty) == 1 else empty, res)
                if return_result
                else (empty[0] if len(empty) == 1 else empty)
            )
    moved = [_place(x, r, mesh) for x, r in zip(arrays, res.inputs, strict=True)]
    if any(_is_tracer(x) for x in moved):
        outs = shard_program(rule, res, attrs, mesh)(*moved)
    else:  # eager call: one compiled program per layout, not one dispatch per primitive
        outs = _jitted(rule, res, freeze(attrs), mesh)(*moved)
    out = outs[0] if len(outs) == 1 else tuple(outs)
    return (out, res) if return_result else out


def _zero_size_outputs(
    rule: Any,
    res: InferenceResult,
    arrays: list[Any],
    specs: list[TensorSpec],
    attrs: dict[str, Any],
    mesh: MeshLike,
) -> tuple[Any, ...] | None:
    """The outputs of an op with a zero-size input, computed without a collective
    (collectives on empty operands do not even lower), or ``None`` when the general
    path must run (a non-empty input can give a non-empty output: ``index_put`` with
    no indices returns ``x``).

    Zero-size outputs are made empty in the rule's layouts. When every input is
    zero-size, the outputs depend on shapes only (a mean over no examples), so
    the unsharded op runs on the empty inputs and its result is laid out as the
    rule says."""
    outs = [o.without_partial() for o in res.outputs]
    if all(math.prod(o.shape) == 0 for o in outs):
        kw = without_strategy(attrs)
        dtypes = [
            y.dtype
            for y in jax.tree.leaves(
                jax.eval_shape(
                    lambda *xs: rule.impl(*xs, **kw),
                    *[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in arrays],
                ),
            )
        ]
        like = (arrays[0], specs[0])
        return tuple(empty_array(o, d, mesh, like=like) for o, d in zip(outs, dtypes, strict=True))
    if not all(math.prod(x.shape) == 0 for x in arrays):
        return None
    values = rule.impl(*[jnp.zeros(x.shape, x.dtype) for x in arrays], **without_strategy(attrs))
    values = values if isinstance(values, tuple | list) else (values,)
    return tuple(_place(jnp.asarray(v), o, mesh) for v, o in zip(values, outs, strict=True))


@cached(maxsize=256, why="the jitted shard_map program of one rule answer on one mesh.")
def _jitted(rule: Any, res: InferenceResult, attrs: Any, mesh: MeshLike) -> Any:
    return jax.jit(shard_program(rule, res, dict(attrs), mesh))
