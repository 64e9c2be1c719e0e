"""Primitive → rule: which rule (and attributes) a jaxpr equation propagates with.

:func:`to_rule` maps an equation to a registered rule's name and attributes
(``dot_general``, ``add``, ``reduce_sum``…; ``sk.register_primitive`` adds a
mapping, held by the registry). Where the registry has no rule of that name, :func:`builtin_forward`
has small built-in fallbacks: identity-like primitives, elementwise primitives
the library does not register, cumulative ops, argmax/argmin, sort, top_k, rev,
``conv_general_dilated`` and scatter / scatter-add. :func:`index_parallel` and
:func:`with_masked_lookup` make a gather from a table sharded over the indexed
dim the masked local lookup XLA emits.

A registered rule always wins over a built-in of the same name: the engine asks
the registry first, and there are no built-ins for registered names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from spmdkit.engine.factor import Notation
from spmdkit.engine.factor_rule import FactorRule
from spmdkit.engine.registry import primitive_converter
from spmdkit.engine.rule import RuleContext
from spmdkit.errors import SpmdError
from spmdkit.spec import MeshLike, TensorSpec, axis_sizes

__all__ = [
    "GENERATORS",
    "REDUCERS",
    "RULE_ERRORS",
    "builtin_forward",
    "drop_axes",
    "index_parallel",
    "to_rule",
    "with_masked_lookup",
]

#: What a rule (or a built-in) raises on an equation it does not fit: the
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
    }
)
_RENAMES = {"add_any": "add"}


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


# -- built-in rules for primitives the library does not cover ---------------------


def _dummy(*xs: Any, **_: Any) -> Any:
    return xs[0]


def _eltwise_notation(shapes: Any, **_: Any) -> str:
    from spmdkit.rules.elementwise import broadcast_notation  # the rule library loads late

    return broadcast_notation(shapes)


def _keep_notation(
    shapes: Any,
    *,
    replicate: tuple[int, ...] = (),
    drop: tuple[int, ...] = (),
    reduce: str | None = None,
    **_: Any,
) -> Notation:
    """All operands share one factor per dim; ``replicate`` dims unsharded; ``drop``
    dims vanish from the (single) output."""
    ranks = {len(s) for s in shapes}
    if len(ranks) != 1:
        raise NotImplementedError(f"operands of different ranks {sorted(ranks)}")
    (rank,) = ranks
    fs = tuple(f"d{i}" for i in range(rank))
    outs = tuple(f for i, f in enumerate(fs) if i not in drop)
    need = frozenset(fs[i] for i in (*replicate, *drop))
    return Notation(tuple(fs for _ in shapes), (outs,), need, reduce)


def _builtin(name: str, notation: Any, policy: str, **kw: Any) -> FactorRule:
    return FactorRule(name, notation, impl=_dummy, partial=policy, **kw)


# Elementwise primitives no registered rule covers (the registered ones, ``add``,
# ``exp``, ``select_n``…, propagate with their own rules): treated as nonlinear.
_ELTWISE_NONE = frozenset(
    {
        "acos",
        "acosh",
        "asin",
        "asinh",
        "atan",
        "atanh",
        "bitcast_convert_type",
        "cbrt",
        "ceil",
        "clamp",
        "conj",
        "cosh",
        "digamma",
        "erf_inv",
        "erfc",
        "exp2",
        "floor",
        "igamma",
        "imag",
        "is_finite",
        "lgamma",
        "nextafter",
        "population_count",
        "real",
        "rem",
        "round",
        "shift_left",
        "shift_right_arithmetic",
        "shift_right_logical",
        "sinh",
        "tan",
        "threefry2x32",
        "xor",
    }
)
# device_put: a move between memory kinds inside a step (optimizer offload) keeps
# the layout (one operand per equation, as spmdkit.recipe.to_memory binds it)
_IDENTITY = frozenset(
    {
        "copy",
        "copy_p",
        "device_put",
        "stop_gradient",
        "reduce_precision",
        "pvary",
        "optimization_barrier",
    }
)
_ELTWISE_RULE = _builtin("elementwise", _eltwise_notation, "NONE")
_IDENTITY_RULE = _builtin("identity", _eltwise_notation, "LINEAR")
_KEEP_RULE = _builtin("keep", _keep_notation, "NONE")
_KEEP_LINEAR_RULE = _builtin("keep_linear", _keep_notation, "LINEAR")
_REDUCE_RULE = _builtin("reduce", _keep_notation, "NONE", reduce=None)


def _builtin_for(name: str, eqn: Any, n_in: int) -> tuple[FactorRule, dict] | None:
    p = eqn.params
    if name in _IDENTITY and n_in == 1:
        return _IDENTITY_RULE, {}
    if name in _ELTWISE_NONE and len(eqn.outvars) == 1:
        return _ELTWISE_RULE, {}
    if name in ("cumsum", "cumlogsumexp", "cummax", "cummin", "cumprod"):
        rule = _KEEP_LINEAR_RULE if name == "cumsum" else _KEEP_RULE
        return rule, {"replicate": (int(p["axis"]),)}
    if name in ("argmax", "argmin"):
        return _REDUCE_RULE, {"drop": tuple(int(a) for a in p["axes"])}
    if name == "sort" and len(eqn.outvars) == n_in:
        return _KEEP_RULE, {"replicate": (int(p["dimension"]),), "_multi": True}
    if name == "top_k" and n_in == 1:
        # XLA partitions its TopK custom call by gathering the whole operand (even a
        # batch dim sharded elsewhere): predict exactly that
        rank = len(eqn.invars[0].aval.shape)
        return _KEEP_RULE, {"replicate": tuple(range(rank)), "_fan": True}
    if name == "rev" and n_in == 1:  # a reversed dim moves whole: keep it unsharded
        return _KEEP_LINEAR_RULE, {"replicate": tuple(int(d) for d in p["dimensions"])}
    return None


def _factor_forward(
    rule: FactorRule,
    attrs: dict,
    specs: tuple[TensorSpec, ...],
    mesh: MeshLike,
    out_dtypes: Sequence[Any],
    out_shapes: Sequence[tuple[int, ...]],
) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """``_multi``: output i takes input i's layout (sort); ``_fan``: every output
    takes the single input's layout with its own shape (top_k)."""
    attrs = dict(attrs)
    multi = attrs.pop("_multi", False)
    fan = attrs.pop("_fan", False)
    ctx = RuleContext(op=rule.name, axis_sizes=axis_sizes(mesh), attrs=attrs)
    ans = rule.forward(ctx, specs)
    outs = ans.outputs
    if multi:
        outs = tuple(s.without_partial() for s in ans.inputs)
    if fan:
        base = ans.inputs[0].without_partial()
        outs = tuple(base.replace(shape=tuple(shape)) for shape in out_shapes)
    outs = tuple(o.replace(dtype=d) for o, d in zip(outs, out_dtypes, strict=True))
    return ans.inputs, outs


def builtin_forward(
    eqn: Any,
    specs: tuple[TensorSpec, ...],
    out_shapes: Sequence[tuple[int, ...]],
    out_dtypes: Sequence[Any],
    mesh: MeshLike,
) -> tuple[str, dict, tuple[TensorSpec, ...], tuple[TensorSpec, ...]] | None:
    """(op, attrs, required inputs, outputs) from a built-in fallback; None when
    there is none for the primitive or it does not fit the equation."""
    name = eqn.primitive.name
    try:
        if name == "conv_general_dilated" and len(specs) == 2:
            req, outs = _conv(eqn.params, specs, out_shapes[0], out_dtypes[0])
            return name, {}, req, outs
        if name in ("scatter-add", "scatter") and len(specs) == 3:
            req, outs = _scatter(name, eqn.params, specs, out_dtypes[0])
            return name, {}, req, outs
        built = _builtin_for(name, eqn, len(specs))
        if built is None:
            return None
        rule, attrs = built
        req, outs = _factor_forward(rule, attrs, specs, mesh, out_dtypes, out_shapes)
    except RULE_ERRORS:
        return None
    if [o.shape for o in outs] != list(out_shapes):
        return None
    return rule.name, {k: v for k, v in attrs.items() if k[0] != "_"}, req, outs


def _scatter(
    name: str, p: Mapping, specs: tuple[TensorSpec, ...], out_dtype: Any
) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """scatter / scatter-add (operand, indices, updates): the indexed operand dims
    replicated; window dims and batching dims (``take_along_axis``) shared by
    operand, updates (and indices), taking the operand's axes, else the updates',
    else (batching dims) the indices'; the updates' other scatter dims keep their
    axes — for scatter-add each device adds its own updates, so the result is
    sum-partial over those axes (the operand joins as partial for free); plain
    scatter gathers them instead."""
    dn = p["dimension_numbers"]
    o, idx, u = specs
    indexed = set(dn.scatter_dims_to_operand_dims)
    o_batch = tuple(getattr(dn, "operand_batching_dims", ()))
    i_batch = tuple(getattr(dn, "scatter_indices_batching_dims", ()))
    windowed = [
        d for d in range(o.ndim) if d not in set(dn.inserted_window_dims) and d not in o_batch
    ]
    link = dict(zip(windowed, dn.update_window_dims, strict=True))  # operand dim -> update dim
    scatter_dims = [k for k in range(u.ndim) if k not in set(dn.update_window_dims)]
    idx_dims = list(range(idx.ndim - 1))  # the last indices dim holds the index vectors
    upd_of_idx = dict(zip(idx_dims, scatter_dims, strict=True))
    idx_of_upd = {k: i for i, k in upd_of_idx.items()}
    idx_of_batch = dict(zip(o_batch, i_batch, strict=True))
    for od, idim in idx_of_batch.items():
        link[od] = upd_of_idx[idim]
    out_dims: list[tuple[str, ...]] = []
    used: set[str] = set()
    for d in range(o.ndim):
        axes: tuple[str, ...] = ()
        w = link.get(d)
        if d not in indexed:
            if o.dims[d]:
                axes = o.dims[d]
            elif w is not None and u.shape[w] == o.shape[d] and u.dims[w]:
                axes = u.dims[w]
            elif d in idx_of_batch and idx.shape[idx_of_batch[d]] == o.shape[d]:
                axes = idx.dims[idx_of_batch[d]]  # sharded labels: scatter locally
        axes = tuple(a for a in axes if a not in used)
        used.update(axes)
        out_dims.append(axes)
    u_dims: list[tuple[str, ...]] = [() for _ in range(u.ndim)]
    i_dims: list[tuple[str, ...]] = [() for _ in range(idx.ndim)]
    for d, w in link.items():
        if u.shape[w] == o.shape[d]:
            u_dims[w] = out_dims[d]
            if w in idx_of_upd:
                i_dims[idx_of_upd[w]] = out_dims[d]
    partial: dict[str, str] = {}
    if name == "scatter-add":
        linked = set(link.values())
        for k in scatter_dims:
            if k in linked:
                continue
            axes = tuple(a for a in u.dims[k] if a not in used)
            used.update(axes)
            u_dims[k] = axes
            if k in idx_of_upd:
                i_dims[idx_of_upd[k]] = axes
            partial.update({a: "sum" for a in axes})
    req = (
        TensorSpec(o.shape, out_dims, partial=partial, dtype=o.dtype),
        TensorSpec(idx.shape, i_dims, dtype=idx.dtype),
        TensorSpec(u.shape, u_dims, dtype=u.dtype),
    )
    out = TensorSpec(o.shape, out_dims, partial=partial, dtype=out_dtype)
    return req, (out,)


def _conv(
    p: Mapping, specs: tuple[TensorSpec, ...], out_shape: tuple, out_dtype: Any
) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """conv_general_dilated like a matmul: the lhs batch dim and the rhs output-feature
    dim pass to the output, the input-feature dims contract (sum-partial when both
    operands shard them alike); spatial dims replicated (halos are not modelled);
    grouped convolutions keep features replicated."""
    lhs, rhs = specs
    dn = p["dimension_numbers"]
    lb, lf = dn.lhs_spec[:2]
    ro, ri = dn.rhs_spec[:2]
    ob, of = dn.out_spec[:2]
    grouped = p.get("feature_group_count", 1) != 1 or p.get("batch_group_count", 1) != 1
    used: set[str] = set()

    def take(axes: tuple[str, ...]) -> tuple[str, ...]:
        got = tuple(a for a in axes if a not in used)
        used.update(got)
        return got

    b = take(lhs.dims[lb])
    k = () if grouped else take(lhs.dims[lf] or rhs.dims[ri])
    o = () if grouped else take(rhs.dims[ro])
    ld = [() for _ in lhs.shape]
    rd = [() for _ in rhs.shape]
    od = [() for _ in out_shape]
    ld[lb], ld[lf], rd[ri], rd[ro] = b, k, k, o
    od[ob], od[of] = b, o
    req = (
        TensorSpec(lhs.shape, ld, dtype=lhs.dtype),
        TensorSpec(rhs.shape, rd, dtype=rhs.dtype),
    )
    out = TensorSpec(out_shape, od, partial={a: "sum" for a in k}, dtype=out_dtype)
    return req, (out,)


# -- a gather from a table sharded over the indexed dim ------------------------------


def drop_axes(s: TensorSpec, axes: set[str] | None) -> TensorSpec:
    """``s`` without the given sharding axes (None: all of them); partials stay."""
    if axes is None:
        return s.replace(dims=())
    return s.replace(dims=tuple(tuple(a for a in d if a not in axes) for d in s.dims))


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
    dn = eqn.params["dimension_numbers"]
    sizes = eqn.params["slice_sizes"]
    axes: set[str] = set()
    for d in dn.start_index_map:
        if sizes[d] == 1 and d < len(x.dims):
            axes.update(x.dims[d])
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
