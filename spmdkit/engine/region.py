"""Composite ops as named regions of a jaxpr: what the planner sees of ``spmdkit.ops``.

An op of :mod:`spmdkit.ops` called where its inputs have no known layout (inside
a trace on a mesh with Auto axes and no ``in_specs``, or with no mesh at all, as
under the planner's abstract trace) cannot pick its reshards yet. It is traced
as a *region* instead: one equation of the primitive ``spmdkit_op`` whose
parameters name the op and its attributes, wrapped in a ``jax.custom_vjp`` whose
backward pass is one equation of ``spmdkit_op_grad`` (the primal inputs and the
output cotangents in, the input cotangents out). Propagation applies the op's
forward rule to the first and its grad rule to the second, whole, and searches
the op's strategies; ``sk.jit``'s enforced replay runs the rule's ``shard_map``
program for each region with the planned specs.

Everywhere else a region computes the op's unsharded reference (``rule.impl``):
compiled by plain ``jax.jit`` it lowers to that computation and XLA partitions
it, so a model calling ``spmdkit.ops`` also runs without spmdkit's planner.

The grad region recomputes the forward from its primal inputs (no residuals
cross the region boundary, so nothing of unknown layout does): like a remat
region, its cost is the forward's FLOPs and own collectives again plus the
backward's, and :func:`grad_collectives` prices exactly that. A rule whose
forward's collectives are too dear to rerun (``moe_experts``' token exchanges)
names residuals to keep instead (:meth:`~spmdkit.engine.rule.Rule.kept_dtypes`):
the forward region returns them after its outputs, as empty stand-ins in the
traced step (their size depends on the layout, unknown until planned), and the
replayed forward program returns the real local pieces stacked over the axes
they vary over, which the grad region's program reads
(:class:`~spmdkit.engine.rule.KeptResiduals`). A layout that keeps nothing
returns the stand-ins, and its grad region recomputes.

The kept residuals are local pieces, right only on the layout they were made
under: a grad region planned on another layout would read another device's
buffers (equal shapes) or fail deep in tracing (unequal ones). The replay
pairs each grad region with the forward region that kept its residuals (by
dataflow, through the layer scans) and :func:`check_kept` refuses a pair whose
layouts differ (:func:`kept_layout`).

Example::

    >>> x = jax.ShapeDtypeStruct((8, 16), "float32")
    >>> jaxpr = jax.make_jaxpr(lambda x: region_call("rms_norm", (x,), {}))(x)
    >>> [e.primitive.name for e in jaxpr.jaxpr.eqns]
    ['custom_vjp_call']
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.interpreters import batching, mlir

from spmdkit.engine.inference import InferenceResult, infer_forward, infer_grad
from spmdkit.engine.local import (
    kept_forward_program,
    kept_spec,
    local_context,
    resolve_partials,
    shard_program,
)
from spmdkit.engine.registry import get_rule, register_primitive
from spmdkit.engine.rule import KeptResiduals, LocalContext, without_strategy
from spmdkit.errors import ShardingConflictError
from spmdkit.kernels import recording_visits
from spmdkit.spec import MeshLike, TensorSpec, axis_sizes
from spmdkit.state import cached
from spmdkit.util import as_unreduced, freeze
from spmdkit.vma import shard_map

__all__ = [
    "FORWARD",
    "GRAD",
    "KEPT_NOTHING",
    "REGIONS",
    "KeptLayout",
    "check_kept",
    "forward_fn",
    "grad_fn",
    "grad_inference",
    "kept_avals",
    "kept_dtypes",
    "kept_layout",
    "region_attrs",
    "region_call",
    "region_jaxpr",
    "region_program",
    "scatters",
]

#: Primitive names of the forward and the grad region.
FORWARD = "spmdkit_op"
GRAD = "spmdkit_op_grad"
REGIONS = frozenset({FORWARD, GRAD})

_forward_p = jax.extend.core.Primitive(FORWARD)
_forward_p.multiple_results = True
_grad_p = jax.extend.core.Primitive(GRAD)
_grad_p.multiple_results = True


def region_attrs(params: Mapping[str, Any]) -> dict[str, Any]:
    """The op attributes a region equation carries (``strategy`` only when the
    caller fixed one; otherwise the planner searches it)."""
    return dict(params["attrs"])


def kept_dtypes(op: str, dtypes: Sequence[Any]) -> tuple[Any, ...]:
    """The dtypes of the residuals a forward region of ``op`` on operands of
    ``dtypes`` passes its grad region (:meth:`~spmdkit.engine.rule.Rule.kept_dtypes`;
    module docstring)."""
    return tuple(np.dtype(d) for d in get_rule(op).kept_dtypes(tuple(dtypes)))


def _outputs_fn(op: str, attrs: Mapping[str, Any]) -> Callable[..., tuple[Any, ...]]:
    impl = get_rule(op).impl
    kw = without_strategy(attrs)

    def run(*xs: Any) -> tuple[Any, ...]:
        ys = impl(*xs, **kw)
        return tuple(ys) if isinstance(ys, (tuple, list)) else (ys,)

    return run


def forward_fn(op: str, attrs: Mapping[str, Any]) -> Callable[..., tuple[Any, ...]]:
    """The op's unsharded computation as a function returning a tuple of outputs,
    followed by its kept residuals' empty stand-ins (:func:`kept_dtypes`)."""
    outputs = _outputs_fn(op, attrs)

    def run(*xs: Any) -> tuple[Any, ...]:
        kept = kept_dtypes(op, [x.dtype for x in xs])
        return (*outputs(*xs), *(jnp.zeros((0,), d) for d in kept))

    return run


def grad_fn(
    op: str, attrs: Mapping[str, Any], diff: Sequence[bool]
) -> Callable[..., tuple[Any, ...]]:
    """``(*primal inputs, *kept residuals, *output cotangents) -> cotangents of the
    differentiable inputs``, by autodiff of the unsharded computation (which reads
    no residual)."""
    fwd = _outputs_fn(op, attrs)
    n = len(diff)

    def run(*args: Any) -> tuple[Any, ...]:
        xs = args[:n]
        cts = args[n + len(kept_dtypes(op, [x.dtype for x in xs])) :]

        def f(*d: Any) -> tuple[Any, ...]:
            it = iter(d)
            return fwd(*(next(it) if on else x for x, on in zip(xs, diff, strict=True)))

        _, vjp = jax.vjp(f, *(x for x, on in zip(xs, diff, strict=True) if on))
        return tuple(vjp(tuple(cts)))

    return run


@cached(maxsize=1024, why="the shapes a region's rule is traced at.")
def _shapes(
    op: str,
    attrs: Any,
    diff: tuple[bool, ...] | None,
    sig: tuple[tuple[Any, Any], ...],
    rule_id: int,
) -> tuple[tuple[Any, Any], ...]:
    """(shape, dtype) of each result of the forward (``diff`` None) or grad region
    of ``op`` (its rule's ``id``: a rule registered again under the name asks
    again) on operands of shapes and dtypes ``sig``. Memoized: every bind of a
    region while a step is traced asks (each layer's attention alike), and the
    answer is ``jax.eval_shape`` of the op's implementation (of its VJP for a
    grad region), a trace of its own."""
    fn = forward_fn(op, dict(attrs)) if diff is None else grad_fn(op, dict(attrs), diff)
    args = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in sig]
    return tuple((o.shape, o.dtype) for o in jax.eval_shape(fn, *args))


def _abstract(
    avals: Sequence[Any], op: str, attrs: Any, diff: tuple[bool, ...] | None
) -> list[Any]:
    sig = tuple((tuple(a.shape), np.dtype(a.dtype)) for a in avals)
    out = _shapes(op, attrs, diff, sig, id(get_rule(op)))
    return [jax.core.ShapedArray(shape, dtype) for shape, dtype in out]


def _forward_abstract(*avals: Any, op: str, attrs: Any) -> list[Any]:
    return _abstract(avals, op, attrs, None)


def _grad_abstract(*avals: Any, op: str, attrs: Any, diff: tuple[bool, ...]) -> list[Any]:
    # the grad region's results are the cotangents of its differentiable primal
    # inputs, which ``jax.vjp`` gives in the primals' shapes and (inexact) dtypes:
    # read off the operands, not from a trace of the op's forward and VJP
    xs = avals[: len(diff)]
    if len(xs) == len(diff) and all(
        jnp.issubdtype(x.dtype, jnp.inexact) for x, on in zip(xs, diff, strict=True) if on
    ):
        return [
            jax.core.ShapedArray(tuple(x.shape), np.dtype(x.dtype))
            for x, on in zip(xs, diff, strict=True)
            if on
        ]
    return _abstract(avals, op, attrs, tuple(diff))


def _forward_impl(*xs: Any, op: str, attrs: Any) -> list[Any]:
    return list(forward_fn(op, dict(attrs))(*xs))


def _grad_impl(*xs: Any, op: str, attrs: Any, diff: tuple[bool, ...]) -> list[Any]:
    return list(grad_fn(op, dict(attrs), diff)(*xs))


def _forward_batch(args: Sequence[Any], dims: Sequence[Any], *, op: str, attrs: Any) -> Any:
    """Under ``vmap`` the region gives way to the batched unsharded computation."""
    outs = jax.vmap(forward_fn(op, dict(attrs)), in_axes=tuple(dims))(*args)
    return list(outs), [0] * len(outs)


def _grad_batch(
    args: Sequence[Any], dims: Sequence[Any], *, op: str, attrs: Any, diff: tuple[bool, ...]
) -> Any:
    outs = jax.vmap(grad_fn(op, dict(attrs), diff), in_axes=tuple(dims))(*args)
    return list(outs), [0] * len(outs)


_forward_p.def_abstract_eval(_forward_abstract)
_forward_p.def_impl(_forward_impl)
_grad_p.def_abstract_eval(_grad_abstract)
_grad_p.def_impl(_grad_impl)
mlir.register_lowering(_forward_p, mlir.lower_fun(_forward_impl, multiple_results=True))
mlir.register_lowering(_grad_p, mlir.lower_fun(_grad_impl, multiple_results=True))


def _region_body(eqn: Any) -> Any:
    """The unsharded computation a region equation runs, as a jaxpr of its operands
    (what a pipeline stage runs: :func:`spmdkit.pipeline.rows.mixed_rows` looks inside)."""
    p = eqn.params
    if eqn.primitive.name == FORWARD:
        fn = forward_fn(p["op"], dict(p["attrs"]))
    else:
        fn = grad_fn(p["op"], dict(p["attrs"]), p["diff"])
    args = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.invars]
    return jax.make_jaxpr(fn)(*args)


register_primitive(FORWARD, body=_region_body)
register_primitive(GRAD, body=_region_body)
batching.primitive_batchers[_forward_p] = _forward_batch
batching.primitive_batchers[_grad_p] = _grad_batch


def _differentiable(x: Any) -> bool:
    return bool(jnp.issubdtype(x.dtype, jnp.inexact))


def kept_name(op: str) -> str:
    """The ``checkpoint_name`` tag of the residuals ``op``'s forward region keeps
    for its grad region (``"moe_experts"``: the exchanged buffers), which a remat
    policy keeps to run the backward without rerunning the forward region."""
    return op


def region_call(op: str, args: Sequence[Any], attrs: Mapping[str, Any]) -> Any:
    """Trace ``op(*args, **attrs)`` as a forward region with a grad region for its VJP.

    Args:
      op: a registered op.
      args: its array operands (tracers or arrays).
      attrs: its attributes; leave ``strategy`` out to let the planner choose.

    Returns:
      The output, or a tuple of outputs, as the op's ``impl`` returns them.
    """
    frozen = freeze(dict(attrs))
    diff = tuple(_differentiable(x) for x in args)
    n_kept = len(kept_dtypes(op, [jnp.result_type(x) for x in args]))

    def bound(xs: tuple[Any, ...]) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        outs = tuple(_forward_p.bind(*xs, op=op, attrs=frozen))
        cut = len(outs) - n_kept
        return outs[:cut], outs[cut:]

    @jax.custom_vjp
    def region(*xs: Any) -> tuple[Any, ...]:
        return bound(xs)[0]

    def fwd(*xs: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        outs, kept = bound(xs)
        # tagged: a remat policy that keeps them (KEPT_NAMES) skips the forward's rerun
        kept = tuple(checkpoint_name(k, kept_name(op)) for k in kept)
        return outs, (xs, kept)

    def bwd(res: tuple[Any, ...], cts: tuple[Any, ...]) -> tuple[Any, ...]:
        xs, kept = res
        grads = iter(_grad_p.bind(*xs, *kept, *cts, op=op, attrs=frozen, diff=diff))
        return tuple(next(grads) if on else None for on in diff)

    region.defvjp(fwd, bwd)
    outs = region(*args)
    return outs[0] if len(outs) == 1 else outs


def grad_inference(
    op: str,
    attrs: Mapping[str, Any],
    specs: Sequence[TensorSpec],
    diff: Sequence[bool],
    mesh: MeshLike,
) -> tuple[InferenceResult, InferenceResult]:
    """The grad rule's answer for a grad region's operands ``(*inputs, *kept
    residuals, *cotangents)``, and the forward answer the region recomputes on the
    grad's required inputs."""
    n = len(diff)
    cts = specs[n + len(kept_dtypes(op, [s.dtype for s in specs[:n]])) :]
    g = infer_grad(op, *specs[:n], out_grads=tuple(cts), mesh=mesh, **attrs)
    f = infer_forward(op, *g.inputs, mesh=mesh, **attrs)
    return g, f


def _runnable(specs: Sequence[TensorSpec | None], mesh: MeshLike) -> bool:
    return all(s is not None and not s.partial and s.is_even(mesh) for s in specs)


def region_program(
    prim: str,
    params: Mapping[str, Any],
    attrs: Mapping[str, Any],
    required: Sequence[TensorSpec | None],
    produced: Sequence[TensorSpec | None],
    mesh: MeshLike,
) -> Callable[..., tuple[Any, ...]] | None:
    """The rule's ``shard_map`` program for a region equation laid out as planned.

    Args:
      prim: :data:`FORWARD` or :data:`GRAD`.
      params: the equation's parameters.
      attrs: the attributes propagation chose (``strategy`` included).
      required: the operands' planned layouts.
      produced: the results' planned layouts.
      mesh: the mesh (Auto axes: the program runs inside ``jit``).

    Returns:
      A function of the operands returning the results in ``produced``'s layouts,
      with exactly the rule's collectives (a grad region: the recomputed
      forward's and the grad's, and the all-reduce of cotangents the grad rule
      leaves partial); None when the layouts cannot run under ``shard_map``
      (an uneven block or a pending reduction) or the rule now answers otherwise:
      then the caller binds the region as it is and XLA partitions it.
    """
    if not _runnable((*required, *produced), mesh):
        return None
    op, rule = params["op"], get_rule(params["op"])
    if prim == FORWARD:
        res = infer_forward(op, *required, mesh=mesh, **attrs)
        if tuple(res.inputs) != tuple(required):
            return None
        m = len(res.outputs)
        # a pending sum planned reduce-scattered onto a dim (the sequence split
        # kept after a vocab-parallel lookup: spmdkit.propagation.contest)
        onto = produced[:m] if scatters(res.outputs, produced[:m]) else None
        n_kept = len(kept_dtypes(op, [s.dtype for s in required]))
        if not n_kept:
            return shard_program(rule, res, attrs, mesh, onto)
        kept = rule.kept_residuals(local_context(rule, res, attrs, mesh))
        if kept is not None:
            return kept_forward_program(rule, res, kept, mesh, onto)
        program = shard_program(rule, res, attrs, mesh, onto)
        empty = [s.dtype for s in produced[m:]]  # the layout keeps nothing: stand-ins

        def run(*xs: Any) -> tuple[Any, ...]:
            return (*program(*xs), *(jnp.zeros((0,), d) for d in empty))

        return run
    diff = tuple(params["diff"])
    n = len(diff)
    n_kept = len(kept_dtypes(op, [s.dtype for s in required[:n]]))
    xs, cts = required[:n], required[n + n_kept :]
    g = infer_grad(op, *xs, out_grads=tuple(cts), mesh=mesh, **attrs)
    if (*g.inputs, *g.out_grads) != (*xs, *cts):
        return None
    lctx = LocalContext(op, dict(attrs), g.inputs, g.forward_outputs, axis_sizes(mesh))
    kept = rule.kept_residuals(lctx) if n_kept else None
    if kept is not None:
        return _kept_grad_program(kept, diff, xs, cts, produced, mesh)
    # the forward's collectives: its rule's own, and the all-reduce of a pending sum
    forward = infer_forward(op, *g.inputs, mesh=mesh, **attrs)
    talks = bool(forward.collectives) or any(o.partial for o in lctx.outputs)
    program = _grad_program(
        rule.local_fn(lctx),
        lctx.outputs,
        diff,
        (*xs, *cts),
        produced,
        mesh,
        barrier=talks,
    )
    if not n_kept:
        return program
    return lambda *a: program(*a[:n], *a[n + n_kept :])  # the residuals unread


def kept_avals(
    params: Mapping[str, Any],
    attrs: Mapping[str, Any],
    required: Sequence[TensorSpec],
    mesh: MeshLike,
) -> list[jax.ShapeDtypeStruct] | None:
    """The kept residuals a grad region's program reads at its planned layouts
    (``required``: its operands'), as the forward region's program passes them:
    each a global array of its local pieces stacked over the axes it varies over
    (:func:`~spmdkit.engine.local.kept_spec`); None where the region keeps none
    at that layout (its operands there are the empty stand-ins)."""
    op, rule = params["op"], get_rule(params["op"])
    n = len(params["diff"])
    n_kept = len(kept_dtypes(op, [s.dtype for s in required[:n]]))
    if not n_kept:
        return None
    sizes = axis_sizes(mesh)
    g = infer_grad(op, *required[:n], out_grads=tuple(required[n + n_kept :]), mesh=mesh, **attrs)
    lctx = LocalContext(op, dict(attrs), g.inputs, g.forward_outputs, sizes)
    kept = rule.kept_residuals(lctx)
    if kept is None:
        return None
    return [
        jax.ShapeDtypeStruct((int(np.prod([sizes[a] for a in axes])), *shape), dtype)
        for shape, dtype, axes in zip(kept.shapes, kept.dtypes, kept.axes, strict=True)
    ]


@dataclass(frozen=True)
class KeptLayout:
    """The layout kept residuals are made under (a forward region) or read under
    (a grad region): two regions pass them right only when these are equal.

    Attributes:
      op: the op.
      facts: the rule's :attr:`~spmdkit.engine.rule.KeptResiduals.layout` (the
        mesh axes of its factors the residuals depend on, its strategy).
      shapes: each residual's global shape as the regions pass it (its local
        pieces stacked on dim 0, :func:`~spmdkit.engine.local.kept_spec`).
      dtypes: each residual's dtype name.
      axes: the mesh axes each residual varies over (dim 0's split).
    """

    op: str
    facts: tuple[tuple[str, Any], ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    axes: tuple[tuple[str, ...], ...]

    def describe(self) -> str:
        """One line: the facts, then each residual's shape and axes."""
        facts = ", ".join(f"{k} {v}" for k, v in self.facts)
        kept = ", ".join(
            f"{d}{list(s)} over {a}"
            for s, d, a in zip(self.shapes, self.dtypes, self.axes, strict=True)
        )
        return f"{facts}; residuals {kept}"


#: What a forward region that keeps no residuals at its layout passes (the empty
#: stand-ins), for :func:`check_kept`.
KEPT_NOTHING = "kept nothing"


def _layout_of(op: str, kept: KeptResiduals, sizes: Mapping[str, int]) -> KeptLayout:
    return KeptLayout(
        op,
        tuple(kept.layout),
        tuple(
            (int(np.prod([sizes[a] for a in axes])), *shape)
            for shape, axes in zip(kept.shapes, kept.axes, strict=True)
        ),
        tuple(np.dtype(d).name for d in kept.dtypes),
        tuple(tuple(a) for a in kept.axes),
    )


def kept_layout(
    prim: str,
    params: Mapping[str, Any],
    attrs: Mapping[str, Any],
    required: Sequence[TensorSpec | None],
    produced: Sequence[TensorSpec | None],
    mesh: MeshLike,
) -> KeptLayout | None:
    """The layout under which a region equation laid out as planned keeps its
    residuals (:data:`FORWARD`) or reads them (:data:`GRAD`), as
    :func:`region_program` builds its program; None where it keeps or reads none
    (the op keeps nothing, the layout exchanges nothing, or the program is not
    the rule's: the region runs unsharded, passing the stand-ins or ignoring them).
    """
    op, rule = params["op"], get_rule(params["op"])
    if not _runnable((*required, *produced), mesh):
        return None
    sizes = axis_sizes(mesh)
    if prim == FORWARD:
        if not kept_dtypes(op, [s.dtype for s in required]):
            return None
        res = infer_forward(op, *required, mesh=mesh, **attrs)
        if tuple(res.inputs) != tuple(required):
            return None
        kept = rule.kept_residuals(local_context(rule, res, attrs, mesh))
        return None if kept is None else _layout_of(op, kept, sizes)
    n = len(params["diff"])
    n_kept = len(kept_dtypes(op, [s.dtype for s in required[:n]]))
    if not n_kept:
        return None
    xs, cts = required[:n], required[n + n_kept :]
    g = infer_grad(op, *xs, out_grads=tuple(cts), mesh=mesh, **attrs)
    if (*g.inputs, *g.out_grads) != (*xs, *cts):
        return None
    kept = rule.kept_residuals(LocalContext(op, dict(attrs), g.inputs, g.forward_outputs, sizes))
    return None if kept is None else _layout_of(op, kept, sizes)


def check_kept(
    op: str,
    made: KeptLayout | str | None,
    read: KeptLayout | None,
    shapes: Sequence[tuple[int, ...]],
) -> None:
    """Refuse a grad region that would read kept residuals made under another layout.

    Args:
      op: the op.
      made: the layout the forward region kept them under (:func:`kept_layout`),
        :data:`KEPT_NOTHING` for a forward that passed the empty stand-ins, or
        None where the pairing is not known (only the shapes are compared then).
      read: the layout the grad region's program reads them under; None: it
        reads none (it recomputes the forward), and any pairing is fine.
      shapes: the shapes of the residual values the grad region is given.

    Raises:
      ShardingConflictError: the layouts differ: the grad would read another
        device's buffers (equal shapes, other axes) or not fit them.
    """
    if read is None:
        return
    fix = (
        "plan the grad region on its forward region's layout: pin the op's operands "
        "(in_specs, or the same logical rules on both passes), or pass "
        f"{op}(..., strategy=) so both passes run one strategy"
    )
    must = (
        "a grad region reads the residuals its forward region kept on the layout they "
        "were kept under"
    )
    if made == KEPT_NOTHING:
        raise ShardingConflictError(
            op=op,
            must=must,
            given=f"the forward region kept none (its layout keeps none, or it ran "
            f"unsharded); the grad region reads {read.describe()}",
            fix=fix,
        )
    if isinstance(made, KeptLayout):
        if made != read:
            raise ShardingConflictError(
                op=op,
                must=must,
                given=f"kept under {made.describe()}; read under {read.describe()}",
                fix=fix,
            )
        return
    got = tuple(tuple(int(d) for d in s) for s in shapes)
    if got != read.shapes:
        raise ShardingConflictError(
            op=op,
            must=must + f" (the shapes {list(read.shapes)} its layout reads)",
            given=f"residuals of shapes {list(got)}; the grad region reads {read.describe()}",
            fix=fix,
        )


def region_jaxpr(
    prim: str,
    params: Mapping[str, Any],
    attrs: Mapping[str, Any],
    required: Sequence[TensorSpec | None],
    produced: Sequence[TensorSpec | None],
    mesh: MeshLike,
) -> jax.extend.core.ClosedJaxpr | None:
    """:func:`region_program` traced at its planned layouts on ``mesh``'s axes made
    Auto (a jaxpr of one ``shard_map`` equation), or None where it returns None.

    Memoized per op, attributes, layouts and mesh: propagation reads a program's
    collectives and memory from it, and ``sk.jit``'s enforced replay binds the
    same jaxpr (:func:`jax.extend.core.jaxpr_as_fun`), so each program is traced
    from Python once, not again in the replay and once more per layer that runs it.

    Traced each time, and not kept, for an unhashable attribute and inside
    :func:`~spmdkit.kernels.record_visits` (the attention kernels' callbacks
    append to that block's list: a program traced before has none, or another
    block's).

    Raises:
      SpmdError: the rule does not fit the layouts (as :func:`region_program`).
    """
    try:
        frozen = freeze(dict(attrs))
    except TypeError:
        frozen = None
    if frozen is None or recording_visits():
        key = (prim, params["op"], params.get("diff"), tuple(dict(attrs).items()))
        return _region_jaxpr.__wrapped__(key, tuple(required), tuple(produced), mesh)
    key = (prim, params["op"], params.get("diff"), frozen)
    return _region_jaxpr(key, tuple(required), tuple(produced), mesh)


@cached(
    maxsize=512,
    why="regions' shard_map programs traced at planned layouts (propagation reads "
    "them, the enforced replay binds them).",
)
def _region_jaxpr(
    key: tuple,
    required: tuple[TensorSpec | None, ...],
    produced: tuple[TensorSpec | None, ...],
    mesh: MeshLike,
) -> jax.extend.core.ClosedJaxpr | None:
    prim, op, diff, attrs = key
    # the device kind kept, so the jaxpr's mesh is the one a replay on ``mesh``
    # (Auto axes, set with jax.set_mesh) runs under
    device = getattr(getattr(mesh, "abstract_mesh", mesh), "abstract_device", None)
    auto = jax.sharding.AbstractMesh(
        tuple(mesh.axis_sizes),
        tuple(mesh.axis_names),
        axis_types=(jax.sharding.AxisType.Auto,) * len(mesh.axis_names),
        abstract_device=device,
    )
    params = {"op": op, "diff": diff}
    run = region_program(prim, params, dict(attrs), required, produced, auto)
    if run is None:
        return None
    args = [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in required]
    kept = kept_avals(params, dict(attrs), required, auto) if prim == GRAD else None
    if kept is not None:  # the residuals as the forward region's program passes them
        n = len(diff)
        args[n : n + len(kept)] = kept
    with jax.sharding.use_abstract_mesh(auto):  # whatever mesh the caller set
        return jax.make_jaxpr(run)(*args)


def _grad_program(
    local: Callable[..., Any],
    outputs: Sequence[TensorSpec],
    diff: tuple[bool, ...],
    required: Sequence[TensorSpec],
    produced: Sequence[TensorSpec],
    mesh: MeshLike,
    *,
    barrier: bool,
) -> Callable[..., tuple[Any, ...]]:
    """A grad region's program that recomputes the forward (``local``, whose
    results are ``outputs``) from its inputs; ``barrier``: pass the inputs through
    an optimization barrier first (a forward that runs collectives)."""
    n = len(diff)

    def forward(*ins: Any) -> tuple[Any, ...]:
        ys = local(*ins)
        ys = tuple(ys) if isinstance(ys, (tuple, list)) else (ys,)
        # the forward's pending reductions, resolved as the forward region does:
        # their transposes route each cotangent to the pieces (XLA drops the
        # forward all-reduce itself, whose value the backward does not read)
        return tuple(resolve_partials(y, o) for y, o in zip(ys, outputs, strict=True))

    def body(*args: Any) -> tuple[Any, ...]:
        xs, cts = args[:n], args[n:]
        # the barrier keeps XLA from merging the recomputed forward's collectives
        # with the forward region's: the grad region's collectives are the same
        # whether or not the forward ran in the same program (a scanned or remat
        # model recomputes them anyway). XLA:CPU up to jaxlib 0.10 drops the
        # barrier before its CSE and merges them all the same
        # (spmdkit.versions.cse_merges_through_barriers, which the prediction reads).
        # A forward without collectives has nothing to keep apart: with no barrier
        # XLA merges its recomputation with the forward region's computation, as
        # it does in the unsharded region (a program XLA:CPU also builds faster)
        if barrier:
            xs = tuple(jax.lax.optimization_barrier(x) for x in xs)

        def f(*d: Any) -> tuple[Any, ...]:
            it = iter(d)
            return forward(*(next(it) if on else x for x, on in zip(xs, diff, strict=True)))

        # shard_map's autodiff sums the cotangent of an input over the axes it is
        # invariant on: that is the grad rule's partial sum over those axes
        _, vjp = jax.vjp(f, *(x for x, on in zip(xs, diff, strict=True) if on))
        grads = vjp(tuple(cts))
        return tuple(as_unreduced(g, s) for g, s in zip(grads, produced, strict=True))

    return shard_map(
        body,
        mesh=mesh,
        in_specs=tuple(s.to_partition_spec() for s in required),
        out_specs=tuple(s.to_partition_spec() for s in produced),
    )


def _kept_grad_program(
    kept: Any,
    diff: tuple[bool, ...],
    xs: Sequence[TensorSpec],
    cts: Sequence[TensorSpec],
    produced: Sequence[TensorSpec],
    mesh: MeshLike,
) -> Callable[..., tuple[Any, ...]]:
    """A grad region's program that reads the residuals its forward region kept
    (``kept``: the rule's :class:`~spmdkit.engine.rule.KeptResiduals`) instead of
    recomputing the forward: ``(*inputs, *residuals, *cotangents)``."""
    n, n_kept = len(diff), len(kept.axes)

    def body(*args: Any) -> tuple[Any, ...]:
        # the barrier as _grad_program's: what the backward recomputes from the
        # inputs (a rule's gathers of the weights) is the grad region's own
        ins = tuple(jax.lax.optimization_barrier(x) for x in args[:n])
        res = tuple(r[0] for r in args[n : n + n_kept])
        grads = kept.backward(*ins, *res, *args[n + n_kept :])
        return tuple(as_unreduced(g, s) for g, s in zip(grads, produced, strict=True))

    return shard_map(
        body,
        mesh=mesh,
        in_specs=(
            *(s.to_partition_spec() for s in xs),
            *(kept_spec(a) for a in kept.axes),
            *(s.to_partition_spec() for s in cts),
        ),
        out_specs=tuple(s.to_partition_spec() for s in produced),
    )


def scatters(outs: Sequence[TensorSpec], produced: Sequence[TensorSpec]) -> bool:
    """Whether ``produced`` is ``outs`` with some pending sums reduce-scattered:
    each dim keeps its axes, followed by sum-partial axes of the output only."""
    if len(outs) != len(produced):
        return False
    moved = False
    for o, p in zip(outs, produced, strict=True):
        sums = {a for a, r in o.partial if r == "sum"} - set(o.sharding_axes)
        dims = o.dims + ((),) * (len(p.dims) - len(o.dims))
        for d, q in zip(dims, p.dims, strict=True):
            if tuple(q[: len(d)]) != tuple(d) or not set(q[len(d) :]) <= sums:
                return False
            moved = moved or len(q) > len(d)
    return moved
