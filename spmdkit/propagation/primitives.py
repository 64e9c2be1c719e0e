"""Primitive → rule: which rule (and attributes) a jaxpr equation propagates with.

:func:`to_rule` maps an equation to a registered rule's name and attributes
(``dot_general``, ``add``, ``reduce_sum``…; ``sk.register_primitive`` adds a
mapping, held by the registry). Every primitive the propagator lays out goes
through the registered rule of its name (``cumsum``, ``floor``, ``top_k``,
``conv_general_dilated``, ``scatter-add``…: ``spmdkit rules`` lists them, the rule
sweep checks them); there are no built-in layouts. :func:`index_parallel` and
:func:`with_masked_lookup` make a gather from a table sharded over the indexed
dim the masked local lookup XLA emits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from spmdkit.engine.registry import primitive_converter
from spmdkit.errors import SpmdError
from spmdkit.spec import TensorSpec

__all__ = [
    "GENERATORS",
    "LOOKUP_MODES",
    "REDUCERS",
    "RULE_ERRORS",
    "drop_axes",
    "grouped_groups_split",
    "grouped_partial",
    "index_parallel",
    "lookup_dims",
    "no_op_reshard",
    "sharded_bits",
    "to_rule",
    "with_masked_lookup",
]

#: What a rule (or a converter) raises on an equation it does not fit: the
#: equation then falls back to replicated, warned and counted, never a crash.
#: Anything else raised inside a rule is a bug in the rule and surfaces.
RULE_ERRORS = (SpmdError, NotImplementedError)

#: Reduction primitives: their ``axes`` parameter is the rules' ``axis``.
REDUCERS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod"})

#: Primitives that make new values from keys or nothing: any layout is as cheap.
GENERATORS = frozenset(
    {
        "iota",
        "random_bits",
        "random_fold_in",
        "random_seed",
        "random_split",
        "random_unwrap",
        "random_wrap",
        "rng_bit_generator",
        "rng_uniform",
    }
)

# Parameters that say nothing about layouts, dropped before a rule sees them.
_IGNORED_PARAMS = frozenset(
    {
        "sharding",
        "out_sharding",
        "precision",
        "preferred_element_type",
        "out_dtype",
        "accumulation_type",
        "algorithm",
        "transpose_algorithm",
        "weak_type",
        "update_jaxpr",
        "update_consts",
    }
)
_RENAMES = {"add_any": "add"}


def no_op_reshard(eqn: Any) -> bool:
    """Whether ``eqn`` is a ``reshard`` to a mesh whose axes are all Auto: jax
    lowers it to nothing (no sharding constraint), so XLA lays the value out as
    its neighbours want. ``jax.random``'s samplers end in one (``out_sharding=``
    the input's type's sharding, flax's ``Dropout``); propagation passes the
    layout through it rather than pinning it replicated."""
    if eqn.primitive.name != "reshard":
        return False
    mesh = getattr(eqn.params.get("dst_sharding"), "mesh", None)
    return bool(getattr(mesh, "are_all_axes_auto", False))


def sharded_bits(eqn: Any) -> bool:
    """Whether a generator equation may make its result in any layout at no cost.

    True but for ``random_bits`` from a key that is not threefry with
    ``jax_threefry_partitionable`` on (its default from jax 0.5): there each bit is a
    function of the key and its own index, so XLA computes a device's block of
    bits alone, and the values do not depend on the layout. The older threefry
    (and ``rbg`` keys) make the bits as a whole: laid out sharded, XLA moves them
    with all-gathers and permutes, so propagation makes them replicated and the
    consumer slices."""
    if eqn.primitive.name != "random_bits":
        return True
    impl = getattr(getattr(eqn.invars[0].aval.dtype, "_impl", None), "name", None)
    return impl == "threefry2x32" and bool(jax.config.jax_threefry_partitionable)


def to_rule(eqn: Any) -> tuple[str, dict] | None:
    """(rule name, attributes) for an equation; None when a registered converter
    says it has none (or does not fit it)."""
    try:
        return _to_rule_unchecked(eqn)
    except RULE_ERRORS:  # a converter that does not fit the equation: no rule
        return None


def _to_rule_unchecked(eqn: Any) -> tuple[str, dict] | None:
    name = eqn.primitive.name
    conv = primitive_converter(name)
    if conv is not None:
        return conv(eqn)
    params = eqn.params
    if name in REDUCERS:
        return name, {"axis": tuple(params["axes"])}
    if name == "dot_general":
        (lc, rc), (lb, rb) = params["dimension_numbers"]
        dn = ((tuple(lc), tuple(rc)), (tuple(lb), tuple(rb)))
        return name, {"dimension_numbers": dn}
    if name == "convert_element_type":
        return name, {"new_dtype": np.dtype(params["new_dtype"]).name}
    if name == "integer_pow":
        return name, {"y": int(params["y"])}
    attrs = {k: v for k, v in params.items() if k not in _IGNORED_PARAMS}
    return _RENAMES.get(name, name), attrs


# -- a gather from a table sharded over the indexed dim ------------------------------


def drop_axes(s: TensorSpec, axes: set[str] | None) -> TensorSpec:
    """``s`` without the given sharding axes (None: all of them); partials stay."""
    if axes is None:
        return s.replace(dims=())
    dims = tuple(tuple(a for a in d if a not in axes) for d in s.dims)
    return s if dims == s.dims else s.replace(dims=dims)


#: Gather modes whose masked lookup the replay runs per device (every mode jax has
#: but one-hot, which is not a lookup of rows).
LOOKUP_MODES = frozenset(
    {
        jax.lax.GatherScatterMode.CLIP,
        jax.lax.GatherScatterMode.FILL_OR_DROP,
        jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS,
    }
)


def lookup_dims(eqn: Any, operand: TensorSpec) -> dict[int, tuple[str, ...]]:
    """A gather's operand dims it indexes point-wise (slice size 1) that ``operand``
    shards → their axes: where a device looks up its own block of rows with a
    mask, its result a partial sum over those axes (empty: none)."""
    dn = eqn.params["dimension_numbers"]
    sizes = eqn.params["slice_sizes"]
    return {
        d: tuple(operand.dims[d])
        for d in dn.start_index_map
        if sizes[d] == 1 and d < len(operand.dims) and operand.dims[d]
    }


def grouped_partial(eqn: Any, rhs: TensorSpec | None, out: TensorSpec | None) -> bool:
    """Whether a grouped GEMM (``ragged_dot_general`` with its rows ragged) leaves
    its result sum-partial over axes that split its groups (expert parallel), alone
    or with others (a contracted dim split: the experts' width). The enforced
    replay runs it per device with the rule's local computation (its groups
    padded by two empty ones, the local group sizes computed on each device from
    the replicated global ones, :mod:`spmdkit.rules.ragged`) and reduces the
    result as the plan does. Left to XLA, the partitioned lowering of the
    primitive gathers the group ends it splits with the groups (an ``s32[g]``
    all-gather per equation on XLA:CPU up to jaxlib 0.10, which no plan
    predicts), and a result partial over two factors is reduced once per factor,
    each time whole, where the plan reduces it once over all the axes."""
    if eqn is None or eqn.primitive.name != "ragged_dot_general" or rhs is None or out is None:
        return False
    group = tuple(eqn.params["ragged_dot_dimension_numbers"].rhs_group_dimensions)
    if len(group) != 1 or not out.partial:
        return False
    axes = {a for a, op in out.partial if op == "sum"}
    return bool(axes & set(rhs.dims[group[0]]))


def grouped_groups_split(eqn: Any, out: TensorSpec | None) -> bool:
    """Whether a ragged contraction (``ragged_dot_general`` with a contracted dim
    ragged: a grouped GEMM's weight cotangent ``[G, …]``) makes its result split
    over its groups and whole otherwise (each device the products of its own
    experts). The enforced replay runs it per device with the rule's local
    computation, as :func:`grouped_partial`'s: left to XLA, the partitioned
    lowering gathers the group ends it splits with the groups."""
    if eqn is None or eqn.primitive.name != "ragged_dot_general" or out is None:
        return False
    dims = eqn.params["ragged_dot_dimension_numbers"]
    if tuple(dims.rhs_group_dimensions) or out.partial or not out.dims:
        return False
    (contracting, _), _ = dims.dot_dimension_numbers
    ragged = tuple(dims.lhs_ragged_dimensions)
    return len(ragged) == 1 and ragged[0] in tuple(contracting) and bool(out.dims[0])


def index_parallel(
    eqn: Any, specs: Sequence[TensorSpec]
) -> tuple[tuple[TensorSpec, ...], set[str]] | None:
    """For a gather whose operand is sharded on a dim it indexes point-wise (an
    embedding table over the vocabulary): (the specs with those axes taken off the
    operand, the axes). XLA looks up locally with a mask and leaves the result
    sum-partial over those axes; None when the operand is not so sharded."""
    if len(specs) != 2:
        return None
    x = specs[0]
    axes = {a for d in lookup_dims(eqn, x).values() for a in d}
    if not axes or any(a in specs[1].sharding_axes for a in axes):
        return None
    return (drop_axes(x, axes), specs[1]), axes


def with_masked_lookup(res: Any, x: TensorSpec, axes: set[str]) -> Any:
    """``res`` (a gather's rule answer without ``axes`` on the operand) as the
    masked local lookup: the operand keeps ``axes`` and the result is sum-partial
    over them; the rule's answer when the result is sharded over them already."""
    out = res.outputs[0]
    if any(a in out.sharding_axes for a in axes) or any(a in dict(x.partial) for a in axes):
        return res
    req_x = res.inputs[0]
    kept = req_x.replace(
        dims=tuple(
            tuple(a for a in g if a in axes) + tuple(r)
            for g, r in zip(x.dims, req_x.dims, strict=True)
        )
    )
    try:
        new_out = out.replace(partial={**dict(out.partial), **dict.fromkeys(sorted(axes), "sum")})
    except SpmdError:
        return res
    return dataclasses.replace(res, inputs=(kept, *res.inputs[1:]), outputs=(new_out,))
