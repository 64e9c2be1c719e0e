"""Propagating the regions of :mod:`spmdkit.region`: a composite op laid out whole.

A forward region (``spmdkit_op``) is propagated with the op's forward rule, a
grad region (``spmdkit_op_grad``) with its grad rule, and each of the rule's
strategies is priced — the operand reshards plus the op's own collectives — unless
the caller fixed one (``strategy=`` on the op, or ``propagate(strategies=)``):
the cheapest wins, bytes first, ties to the rule's first (reference) strategy.

The region's implementation (the rule's ``shard_map`` program, see
:func:`spmdkit.local.shard_program`) takes whole inputs and resolves pending
reductions on its outputs inside, so a region's required inputs and its
outputs are never partial: a partial operand is resolved before it (a priced
reshard), and the all-reduce of a partial result is one of the region's own
collectives. A grad region recomputes the forward (see :mod:`spmdkit.region`),
so its own collectives are the forward's plus the grad's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from spmdkit.inference import infer_forward
from spmdkit.propagation.pricing import Pricer
from spmdkit.propagation.primitives import RULE_ERRORS
from spmdkit.region import FORWARD, GRAD, grad_inference, region_attrs
from spmdkit.registry import get_rule
from spmdkit.resharding import Collective
from spmdkit.rule import RuleContext, op_collective
from spmdkit.spec import MeshLike, TensorSpec, axis_sizes

__all__ = ["RegionAnswer", "region_answer", "region_layouts"]


class RegionAnswer(NamedTuple):
    """A region's layouts under one strategy.

    Attributes:
      attrs: the op attributes, ``strategy`` included.
      required: the operands' layouts (never partial).
      outputs: the results' layouts (never partial).
      collectives: the region's own collectives (the rule's, plus the
        all-reduces of results the rule leaves partial).
    """

    attrs: dict[str, Any]
    required: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    collectives: tuple[Collective, ...]


def _resolves(
    outs: Sequence[TensorSpec], mesh: MeshLike, op: str
) -> tuple[list[TensorSpec], list[Collective]]:
    """The outputs with their pending reductions resolved inside the region, and
    those all-reduces (one per output and reduce op)."""
    ctx = RuleContext(op=op, axis_sizes=axis_sizes(mesh), attrs={})
    whole, coll = [], []
    for o in outs:
        by_op: dict[str, list[str]] = {}
        for a, r in o.partial:
            by_op.setdefault(r, []).append(a)
        for r, axes in by_op.items():
            payload = o.local_bytes(mesh)
            coll.append(op_collective(ctx, "all_reduce", axes, payload, reduce_op=r))
        whole.append(o.without_partial())
    return whole, coll


def region_layouts(
    prim: str,
    params: Mapping[str, Any],
    attrs: Mapping[str, Any],
    specs: Sequence[TensorSpec],
    mesh: MeshLike,
) -> RegionAnswer:
    """The layouts of one region equation for operand ``specs`` and ``attrs``.

    Raises:
      SpmdError: the rule does not fit the operands.
    """
    op = params["op"]
    plain = tuple(s.without_partial() for s in specs)
    if prim == FORWARD:
        res = infer_forward(op, *plain, mesh=mesh, **attrs)
        outs, coll = _resolves(res.outputs, mesh, op)
        return RegionAnswer(dict(attrs), tuple(res.inputs), tuple(outs), (*res.collectives, *coll))
    diff = tuple(params["diff"])
    g, f = grad_inference(op, attrs, plain, diff, mesh)
    grads = [o for o, on in zip(g.outputs, diff, strict=True) if on]
    outs, coll = _resolves(grads, mesh, op)
    req = (*g.inputs, *g.out_grads)
    own = (*f.collectives, *g.collectives, *coll)
    return RegionAnswer(dict(attrs), req, tuple(outs), own)


def _cost(pricer: Pricer, given: Sequence[TensorSpec], ans: RegionAnswer) -> tuple[int, float]:
    nbytes, t = pricer.price(given, ans.required, ans.outputs)
    return (
        nbytes + sum(c.payload_bytes for c in ans.collectives),
        t + sum(c.time_s for c in ans.collectives),
    )


def region_answer(
    prim: str,
    params: Mapping[str, Any],
    specs: Sequence[TensorSpec],
    pricer: Pricer,
    fixed: str | None = None,
) -> RegionAnswer | None:
    """The cheapest of the op's strategies for a region equation (``fixed``, or
    the ``strategy`` the call carries, when given); None when no strategy fits."""
    if prim not in (FORWARD, GRAD):
        raise ValueError(f"{prim!r} is not a region primitive")
    attrs = region_attrs(params)
    chosen = attrs.get("strategy") or fixed
    names = (chosen,) if chosen else get_rule(params["op"]).strategies
    best: tuple[tuple[int, float], RegionAnswer] | None = None
    for name in names:
        try:
            ans = region_layouts(prim, params, {**attrs, "strategy": name}, specs, pricer.mesh)
        except RULE_ERRORS:
            continue
        cost = _cost(pricer, specs, ans)
        if best is None or cost < best[0]:
            best = (cost, ans)
    return None if best is None else best[1]
