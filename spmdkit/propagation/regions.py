"""Propagating the regions of :mod:`spmdkit.engine.region`: a composite op laid out whole.

A forward region (``spmdkit_op``) is propagated with the op's forward rule, a
grad region (``spmdkit_op_grad``) with its grad rule, and each of the rule's
strategies is priced — the operand reshards plus the op's own collectives — unless
the caller fixed one (``strategy=`` on the op, or ``propagate(strategies=)``):
the cheapest wins, bytes first, ties to the rule's first (reference) strategy.

The region's implementation (the rule's ``shard_map`` program, see
:func:`spmdkit.engine.local.shard_program`) takes whole inputs and resolves pending
reductions on its outputs inside, so a region's required inputs and its
outputs are never partial: a partial operand is resolved before it (a priced
reshard), and the all-reduce of a partial result is one of the region's own
collectives. A grad region recomputes the forward (see :mod:`spmdkit.engine.region`),
so its own collectives are the forward's plus the grad's.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from spmdkit import jaxprs
from spmdkit.engine.inference import infer_forward
from spmdkit.engine.region import (
    FORWARD,
    GRAD,
    grad_inference,
    kept_avals,
    kept_dtypes,
    region_attrs,
    region_jaxpr,
    scatters,
)
from spmdkit.engine.registry import get_rule
from spmdkit.engine.rule import RuleContext, op_collective
from spmdkit.propagation.contest import contested, settled, stays
from spmdkit.propagation.cse import ValueNumbers
from spmdkit.propagation.graph import FlatProgram
from spmdkit.propagation.memory import fused_values, program_temp_bytes
from spmdkit.propagation.pricing import Pricer, charged_bytes, on_link
from spmdkit.propagation.primitives import RULE_ERRORS
from spmdkit.resharding import Collective
from spmdkit.spec import MeshLike, TensorSpec, axis_sizes
from spmdkit.state import cached, register_cache
from spmdkit.util import freeze

__all__ = [
    "MANUAL_COLLECTIVES",
    "CandidateLayout",
    "RegionAnswer",
    "region_answer",
    "region_input_collectives",
    "region_layouts",
    "cheapest_candidate",
    "region_loop_buffer_bytes",
    "region_program",
    "region_residual_bytes",
    "region_temp_parts",
    "region_unread_inputs",
]

#: Collective primitives of a ``shard_map`` body: name → (kind, which side's
#: buffer is the per-device payload, reduce op).
MANUAL_COLLECTIVES: dict[str, tuple[str, str, str | None]] = {
    "psum": ("all_reduce", "in", "sum"),
    "psum_invariant": ("all_reduce", "in", "sum"),
    "pmax": ("all_reduce", "in", "max"),
    "pmin": ("all_reduce", "in", "min"),
    "all_gather": ("all_gather", "out", None),
    "reduce_scatter": ("reduce_scatter", "in", "sum"),
    "all_to_all": ("all_to_all", "in", None),
    "ppermute": ("collective_permute", "in", None),
}


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
    outs: Sequence[TensorSpec],
    mesh: MeshLike,
    op: str,
    onto: Mapping[str, tuple[int, int]] | None = None,
) -> tuple[list[TensorSpec], list[Collective]]:
    """The outputs with their pending reductions resolved inside the region, and
    those collectives: a pending sum over an axis of ``onto`` (axis → (dim, size):
    the sequence dim an activation gave the axis up from) reduce-scattered onto
    that dim of the output where it has that size (:func:`scattered_onto`), the
    others all-reduced (one per output and reduce op)."""
    ctx = RuleContext(op=op, axis_sizes=axis_sizes(mesh), attrs={})
    whole, coll = [], []
    for o in outs:
        target = scattered_onto(o, onto or {}, mesh)
        spread = [a for a in target.sharding_axes if a not in o.sharding_axes]
        if spread:
            coll.append(
                op_collective(ctx, "reduce_scatter", spread, o.local_bytes(mesh), reduce_op="sum")
            )
        rest = (
            o.replace(dims=target.dims, partial={a: r for a, r in o.partial if a not in spread})
            if spread
            else o
        )
        by_op: dict[str, list[str]] = {}
        for a, r in rest.partial:
            by_op.setdefault(r, []).append(a)
        for r, axes in by_op.items():
            payload = rest.local_bytes(mesh)
            coll.append(op_collective(ctx, "all_reduce", axes, payload, reduce_op=r))
        whole.append(target)
    return whole, coll


def scattered_onto(
    out: TensorSpec, onto: Mapping[str, tuple[int, int]], mesh: MeshLike
) -> TensorSpec:
    """``out`` with its pending sums resolved, each over an axis of ``onto`` (axis →
    (dim, size)) laid onto that dim where the output's dim has that size, the axis
    shards no other dim and the dim divides (a reduce-scatter: Megatron-LM's
    sequence parallelism after a vocab-parallel lookup); the rest replicated."""
    if not any(r == "sum" and a in onto for a, r in out.partial):
        return out.without_partial()  # nothing to lay onto a dim (most regions)
    sizes = axis_sizes(mesh)
    dims = [tuple(d) for d in out.dims] + [()] * (len(out.shape) - len(out.dims))
    used = set(out.sharding_axes)
    for a, r in out.partial:
        if r != "sum" or a not in onto or a in used:
            continue
        j, n = onto[a]
        if j >= len(out.shape) or out.shape[j] != n:
            continue
        block = math.prod(sizes[x] for x in dims[j]) * sizes[a]
        if out.shape[j] % block:
            continue
        dims[j] = (*dims[j], a)
        used.add(a)
    return TensorSpec(out.shape, [d or None for d in dims], dtype=out.dtype)


class CandidateLayout(NamedTuple):
    """A region's layouts under one strategy, its own collectives found on asking
    (a grad region's trace its replayed program: :func:`region_answer` asks only
    for the strategies that can still win)."""

    attrs: dict[str, Any]
    required: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    own: Callable[[], tuple[Collective, ...]]

    def answer(self) -> RegionAnswer:
        return RegionAnswer(self.attrs, self.required, self.outputs, self.own())


def region_layouts(
    prim: str,
    params: Mapping[str, Any],
    attrs: Mapping[str, Any],
    specs: Sequence[TensorSpec],
    mesh: MeshLike,
    onto: Mapping[str, tuple[int, int]] | None = None,
    produced: Sequence[TensorSpec] | None = None,
) -> RegionAnswer:
    """The layouts of one region equation for operand ``specs`` and ``attrs``
    (``onto``: a forward region's pending sums to reduce-scatter, :func:`_resolves`;
    or ``produced``: the results as planned, where they reduce-scatter some).

    Raises:
      SpmdError: the rule does not fit the operands.
    """
    return _layout(prim, params, attrs, specs, mesh, onto, produced).answer()


def _layout(
    prim: str,
    params: Mapping[str, Any],
    attrs: Mapping[str, Any],
    specs: Sequence[TensorSpec],
    mesh: MeshLike,
    onto: Mapping[str, tuple[int, int]] | None = None,
    produced: Sequence[TensorSpec] | None = None,
) -> CandidateLayout:
    """:func:`region_layouts`' layouts, its collectives left to ask for."""
    op = params["op"]
    plain = tuple(s.without_partial() for s in specs)
    if prim == FORWARD:
        res = infer_forward(op, *plain, mesh=mesh, **attrs)
        produced = None if produced is None else produced[: len(res.outputs)]
        if produced is not None and scatters(res.outputs, produced):
            onto = {
                a: (j, o.shape[j])
                for o, q in zip(res.outputs, produced, strict=True)
                for j, d in enumerate(q.dims)
                for a in d
                if a not in o.sharding_axes
            }
        outs, coll = _resolves(res.outputs, mesh, op, onto)
        own = (*res.collectives, *coll)
        kept = _kept(op, [s.dtype for s in plain])
        return CandidateLayout(dict(attrs), tuple(res.inputs), (*outs, *kept), lambda: own)
    diff = tuple(params["diff"])
    g, f = grad_inference(op, attrs, plain, diff, mesh)
    grads = [o for o, on in zip(g.outputs, diff, strict=True) if on]
    outs, coll = _resolves(grads, mesh, op)
    req = (*g.inputs, *_kept(op, [s.dtype for s in plain[: len(diff)]]), *g.out_grads)

    def traced() -> tuple[Collective, ...]:
        facts = region_program(prim, params, attrs, req, tuple(outs), mesh)
        if facts is None:
            return (*f.collectives, *g.collectives, *coll)
        # what the replayed program runs: the recomputed forward's collectives
        # its backward reads, and the backward's (a grad rule may already count
        # the forward's, as attention's gathers of K/V)
        ctx = RuleContext(op=op, axis_sizes=axis_sizes(mesh), attrs={})
        routed = _routed(*f.collectives, *g.collectives)
        return tuple(
            op_collective(
                ctx, kind, axes, nbytes, reduce_op=r, routed_bytes=routed.get((kind, axes, nbytes))
            )
            for kind, axes, r, nbytes in facts.collectives
        )

    return CandidateLayout(dict(attrs), req, tuple(outs), traced)


def _routed(*rule: Collective) -> dict[tuple, int]:
    """(kind, axes, payload) → routed bytes of the rule's padded all-to-alls
    (``Collective.routed_bytes``), for the same collectives traced in a grad
    region's program."""
    return {
        (c.kind, c.axes, c.payload_bytes): c.routed_bytes
        for c in rule
        if c.routed_bytes is not None
    }


def _kept(op: str, dtypes: Sequence[Any]) -> tuple[TensorSpec, ...]:
    """The layouts of the residuals a forward region of ``op`` keeps for its grad
    region (:func:`~spmdkit.engine.region.kept_dtypes`): empty stand-ins, each held
    whole (their size is the layout's, known only in the program:
    :func:`region_residual_bytes` counts them)."""
    return tuple(TensorSpec((0,), dtype=d) for d in kept_dtypes(op, dtypes))


#: (mesh, topology, region, operand layouts, strategy, flags) -> region_answer's
#: answer: the propagations of a plan's candidates ask about the same regions at
#: the same layouts again and again.
_ANSWERS: dict[tuple, Any] = register_cache(
    {},
    module=__name__,
    name="_ANSWERS",
    why="the cheapest layout of a region per (mesh, topology, op, operand layouts, flags).",
)
_MISS = object()


def region_answer(
    prim: str,
    params: Mapping[str, Any],
    specs: Sequence[TensorSpec],
    pricer: Pricer,
    fixed: str | None = None,
    still: Sequence[bool] = (),
    seq_axes: frozenset[str] = frozenset(),
    weight: Sequence[bool] = (),
) -> RegionAnswer | None:
    """The cheapest way to lay out a region equation; None when no strategy fits.

    Each of the op's strategies (``fixed``, or the ``strategy`` the call carries,
    when given) is asked about the operands as given, about them with one
    operand replicated (a rule resolves a conflict between operands — labels
    sequence-sharded, logits vocab-sharded over the same axis — its own way, and
    moving the small operand can be much cheaper), and with the other operands
    giving up the axes of the activations (``still``: operands computed from the
    batch). As for any equation (:mod:`spmdkit.propagation.choose`), activations
    stay put: where some answer keeps every activation's sharding, only those
    compete (a weight is all-gathered, as in FSDP, rather than the batch
    gathered; on the sequence axes ``seq_axes`` a weight (``weight``: computed
    from the parameters alone) holds, the weight stays and the activations are
    gathered, :mod:`spmdkit.propagation.contest`; where no answer keeps the
    weights', those that keep the activations' compete). Ties go to the operands
    as given, then to the rule's first strategy. The chosen strategy is named by
    what it does (:meth:`~spmdkit.engine.rule.Rule.named_strategy`) where the
    strategy of that name lays the region out identically.
    """
    if prim not in (FORWARD, GRAD):
        raise ValueError(f"{prim!r} is not a region primitive")
    specs, still, weight = tuple(specs), tuple(still), tuple(weight)
    try:
        key = (
            pricer.key,
            pricer.mesh,
            prim,
            params["op"],
            id(get_rule(params["op"])),
            params["attrs"],
            params.get("diff"),
            specs,
            fixed,
            still,
            seq_axes,
            weight,
        )
        hit = _ANSWERS.get(key, _MISS)
    except TypeError:  # unhashable attributes: no caching
        key, hit = None, _MISS
    if hit is _MISS:
        hit = _region_answer(prim, params, specs, pricer, fixed, still, seq_axes, weight)
        if key is not None:
            if len(_ANSWERS) > 16384:
                _ANSWERS.clear()
            _ANSWERS[key] = hit
    # a copy of the attributes: the caller's answer is its own
    return None if hit is None else hit._replace(attrs=dict(hit.attrs))


def _region_answer(
    prim: str,
    params: Mapping[str, Any],
    specs: tuple[TensorSpec, ...],
    pricer: Pricer,
    fixed: str | None,
    still: tuple[bool, ...],
    seq_axes: frozenset[str],
    weight: tuple[bool, ...],
) -> RegionAnswer | None:
    """:func:`region_answer`, not memoized."""
    attrs = region_attrs(params)
    chosen = attrs.get("strategy") or fixed
    names = (chosen,) if chosen else get_rule(params["op"]).strategies
    act = [i for i, m in enumerate(still) if m and any(specs[i].dims)]
    flags = [i in act for i in range(len(specs))]
    heavy = tuple(weight) + (False,) * (len(specs) - len(weight))
    axes = contested(specs, flags, seq_axes, heavy)
    found: list[tuple[tuple[int, float], int, CandidateLayout, tuple[TensorSpec, ...]]] = []
    for given in _candidates(specs, flags, axes, heavy):
        onto = _given_up(specs, flags, axes, given) if prim == FORWARD else {}
        for name in names:
            try:
                lay = _layout(prim, params, {**attrs, "strategy": name}, given, pricer.mesh, onto)
            except RULE_ERRORS:
                continue
            # 2: activations and weights keep theirs; 1: the activations do
            kept = stays(specs, flags, axes, lay.required, heavy) + stays(
                specs, flags, axes, lay.required
            )
            # the operands' reshards (priced from the operands as given)
            found.append((pricer.price(specs, lay.required, lay.outputs), kept, lay, given))
    best_kept = max((kept for _, kept, _, _ in found), default=0)
    if best_kept:
        found = [f for f in found if f[1] == best_kept]
    best = cheapest_candidate([(moves, lay, given) for moves, _, lay, given in found], pricer)
    if best is None:
        return None
    ans, given = best
    return ans if chosen else _named(prim, params, ans, given, pricer.mesh)


def cheapest_candidate(
    found: Sequence[tuple[tuple[int, float], CandidateLayout, tuple[TensorSpec, ...]]],
    pricer: Pricer | None = None,
) -> tuple[RegionAnswer, tuple[TensorSpec, ...]] | None:
    """The candidate of least cost, bytes first (its operands' reshards, then
    its own collectives), the first of equal costs. Own collectives only add
    to a cost, so candidates are asked for theirs in order of their reshards'
    cost, and not at all once that alone is above the best so far: a losing
    grad region's program is not traced. With ``pricer``, an own collective
    costs what its link carries on the pricer's topology
    (:func:`~spmdkit.propagation.pricing.on_link`: the routed experts' padded
    all-to-all sends only its routed rows where the backend has a ragged one)."""
    best: tuple[tuple[int, float], int, RegionAnswer, tuple[TensorSpec, ...]] | None = None
    order = sorted(range(len(found)), key=lambda i: (found[i][0], i))
    for i in order:
        (nbytes, t), lay, given = found[i]
        if best is not None and ((nbytes, t), i) > (best[0], best[1]):
            break  # costs at least its reshards': neither it nor a later one wins
        try:
            own = lay.own()
        except RULE_ERRORS:
            continue
        if pricer is not None:
            own = tuple(on_link(c, pricer.mesh, pricer.topology) for c in own)
            sent = sum(charged_bytes(c, pricer.mesh, pricer.topology) for c in own)
        else:
            sent = sum(c.payload_bytes for c in own)
        cost = (nbytes + sent, t + sum(c.time_s for c in own))
        if best is None or (cost, i) < (best[0], best[1]):
            best = (cost, i, RegionAnswer(lay.attrs, lay.required, lay.outputs, own), given)
    return None if best is None else (best[2], best[3])


def _given_up(
    specs: Sequence[TensorSpec],
    act: Sequence[bool],
    axes: frozenset[str],
    given: Sequence[TensorSpec],
) -> dict[str, tuple[int, int]]:
    """The contested sequence ``axes`` the activations (``act``) give up in
    ``given``: axis → (the dim it sharded, that dim's size). A forward region lays
    its results back onto them (a reduce-scatter, where the result is sum-partial
    over the axis), so the sequence split holds between tensor-parallel ops."""
    out: dict[str, tuple[int, int]] = {}
    for s, g, a in zip(specs, given, act, strict=True):
        if not a:
            continue
        for j, d in enumerate(s.dims):
            kept = g.dims[j] if j < len(g.dims) else ()
            for x in d:
                if x in axes and x not in kept:
                    out.setdefault(x, (j, s.shape[j]))
    return out


def _candidates(
    specs: Sequence[TensorSpec],
    act: Sequence[bool],
    axes: frozenset[str],
    heavy: Sequence[bool],
) -> list[tuple[TensorSpec, ...]]:
    """The operands as given, with each laid-out operand replicated, and with the
    contests between activations (``act``) and weights settled (the weights giving
    up the activations' axes but the contested sequence ``axes``, which the
    activations give up: :func:`~spmdkit.propagation.contest.settled`)."""
    out = [tuple(specs)]
    for i, s in enumerate(specs):
        if any(s.dims) or s.partial:
            out.append((*specs[:i], TensorSpec(s.shape, dtype=s.dtype), *specs[i + 1 :]))
    if any(act) and not all(act):
        out.append(settled(specs, act, axes, heavy))
    return out


def _named(
    prim: str,
    params: Mapping[str, Any],
    ans: RegionAnswer,
    given: Sequence[TensorSpec],
    mesh: MeshLike,
) -> RegionAnswer:
    op = params["op"]
    ctx = RuleContext(op=op, axis_sizes=axis_sizes(mesh), attrs=ans.attrs)
    name = get_rule(op).named_strategy(ctx, ans.required)
    if name == ans.attrs["strategy"]:
        return ans
    try:
        other = _layout(
            prim, params, {**ans.attrs, "strategy": name}, given, mesh, produced=ans.outputs
        )
        # the collectives (a grad region's traced program) only where the layouts agree
        if (other.required, other.outputs) != (ans.required, ans.outputs):
            return ans
        own = other.own()
    except RULE_ERRORS:
        return ans
    same = own == ans.collectives
    return RegionAnswer(other.attrs, other.required, other.outputs, own) if same else ans


class _Facts:
    """What one device does inside a region's replayed program (its dead values
    dropped): the collectives it runs, on its operands too, and the operands it
    never reads, read off the traced body at once (pricing a strategy needs
    them); the memory it holds (temporaries, what a grad region holds from the
    forward pass, its loop buffers) measured on first read and kept, since only a
    memory estimate asks (``sk.jit`` runs a step without one)."""

    def __init__(self, prim: str, n_diff: int, body: Any, mesh: MeshLike, kept: int = 0) -> None:
        prog = FlatProgram()
        graph = prog.graph(body)[0]
        _drop_dead(graph)
        read = set(graph.outvars).union(*(node.ins for node in graph.nodes))
        self.collectives: tuple[tuple[str, tuple[str, ...], str | None, int], ...] = tuple(
            _collectives(graph.nodes, mesh)
        )
        self.on_inputs: tuple[tuple[int, str, tuple[str, ...], int], ...] = tuple(
            _on_inputs(graph, mesh)
        )
        self.unread = frozenset(i for i, v in enumerate(graph.invars) if v not in read)
        self._grad = prim == GRAD
        self._n = n_diff
        self._body, self._graph, self._prog = body, graph, prog
        self._temps: dict[tuple[bool, bool], tuple[int, ...]] = {}
        self._residuals: dict[bool, int] = {}
        self._kept = kept

    def temp_parts(self, *, duplicate: bool, cpu: bool) -> tuple[int, ...]:
        """The sizes of the buffers live at the peak of the body's temporaries (as
        :func:`~spmdkit.propagation.memory.program_temp_bytes` finds it), each a
        buffer XLA places on its own."""
        key = (duplicate, cpu)
        if key not in self._temps:
            parts: list[int] = []
            program_temp_bytes(self._body, duplicate=duplicate, cpu=cpu, parts=parts)
            self._temps[key] = tuple(parts)
        return self._temps[key]

    def residual_bytes(self, *, duplicate: bool) -> int:
        """A grad region's bytes held from the forward pass: the residuals its forward
        region kept (``kept``: their stand-ins in the traced step hold nothing) and
        what XLA runs of it in the forward pass (:func:`_residual_bytes`); 0 for a
        forward region."""
        if not self._grad:
            return 0
        if duplicate not in self._residuals:
            fused = fused_values(self._graph, self._prog, duplicate=duplicate)
            self._residuals[duplicate] = self._kept + _residual_bytes(
                self._graph, self._n, fused, self._prog
            )
        return self._residuals[duplicate]

    @functools.cached_property
    def loop_buffer_bytes(self) -> int:
        """A grad region's zero-filled loop buffers (:func:`_loop_buffer_bytes`); 0
        for a forward region."""
        return _loop_buffer_bytes(self._graph, self._n, self._prog) if self._grad else 0


def region_temp_parts(
    prim: str,
    params: Mapping[str, Any],
    attrs: Mapping[str, Any],
    required: Sequence[TensorSpec],
    produced: Sequence[TensorSpec],
    mesh: MeshLike,
    *,
    duplicate: bool = True,
    cpu: bool = False,
) -> tuple[int, ...]:
    """What one device holds inside a region while it runs, besides its operands
    and results: the temporaries of the ``shard_map`` program the replay runs
    (:func:`spmdkit.engine.region.region_program`) at the planned layouts, a grad
    region's recomputed forward included (``duplicate``, ``cpu``: as
    :func:`~spmdkit.propagation.memory.liveness`), as the sizes of the buffers live
    at their peak (each one XLA places on its own). () where the replay binds the
    region unsharded instead (an uneven or partial layout: XLA partitions it)."""
    facts = region_program(prim, params, attrs, required, produced, mesh)
    return () if facts is None else facts.temp_parts(duplicate=duplicate, cpu=cpu)


def region_program(
    prim: str,
    params: Mapping[str, Any],
    attrs: Mapping[str, Any],
    required: Sequence[TensorSpec],
    produced: Sequence[TensorSpec],
    mesh: MeshLike,
) -> _Facts | None:
    """The facts of a region's ``shard_map`` program at one layout (its own
    collectives, temporaries, residuals), traced once per layout and memoized;
    None where the strategy cannot run at that layout."""
    key = (prim, params["op"], params["attrs"], params.get("diff"), freeze(dict(attrs)))
    return _traced(key, tuple(required), tuple(produced), mesh)


@cached(
    maxsize=512, why="a region's shard_map program traced at one layout (jaxprs of pure functions)."
)
def _traced(
    key: tuple,
    required: tuple[TensorSpec, ...],
    produced: tuple[TensorSpec, ...],
    mesh: MeshLike,
) -> _Facts | None:
    """The replayed program of a region, traced at its planned layouts (None when
    the replay binds the region unsharded). Dead values are dropped first, as
    XLA does: a grad region's recomputed forward all-reduce that only resolved
    the forward's result is never run."""
    prim, op, frozen, diff, attrs = key
    params = {"op": op, "attrs": frozen, "diff": diff}
    # traced on Auto axes: only the body's local shapes and collectives are read
    try:
        outer = region_jaxpr(prim, params, dict(attrs), required, produced, mesh)
    except RULE_ERRORS:
        return None
    if outer is None:
        return None
    body = _shard_map_body(outer.jaxpr)
    if body is None:
        return None
    kept = kept_avals(params, dict(attrs), required, mesh) if prim == GRAD else None
    held = sum(math.prod(a.shape[1:]) * np.dtype(a.dtype).itemsize for a in kept or ())
    return _Facts(prim, len(diff or ()), body, mesh, held)


def _residual_bytes(graph: Any, n: int, fused: set[int], prog: FlatProgram) -> int:
    """Bytes of the values a grad region's program computes from its primal
    inputs alone (its first ``n`` operands) that the cotangent's side reads: XLA
    schedules that part as soon as the inputs exist, in the forward pass, and
    holds those values until the backward reaches the region (residuals in all
    but name). Values XLA fuses into their readers are recomputed there, not held;
    values it computes twice (two backward loops' copies of the gathered K/V laid
    out alike) are held once (:class:`~spmdkit.propagation.cse.ValueNumbers`);
    broadcast constants are loop buffers (:func:`_loop_buffer_bytes`)."""
    numbers = ValueNumbers(prog.values)
    for node in graph.nodes:
        numbers.merge(node, [None] * len(node.ins), [None] * len(node.outs), None)
    const = _constants(graph, prog)
    late = set(graph.invars[n:])
    early: dict[int, int] = {}
    passed = set(graph.invars[:n])
    for node in graph.nodes:
        if any(v in late for v in node.ins):
            late.update(node.outs)
            continue
        through = node.prim == "optimization_barrier" or all(v in passed for v in node.ins)
        for o in node.outs:
            if through and node.prim in ("optimization_barrier", "pvary"):
                passed.add(o)
            else:
                early[o] = _nbytes(o, node)
    read = {v for node in graph.nodes if any(o in late for o in node.outs) for v in node.ins}
    held = {
        numbers.of(v): b
        for v, b in early.items()
        if v in read and v not in fused and v not in const
    }
    return sum(held.values())


def _constants(graph: Any, prog: FlatProgram) -> set[int]:
    """Ids of the constants of ``graph`` and of the values made from them alone
    (a broadcast zero fill, varying or not)."""
    const = prog.const_ids()
    for node in graph.nodes:
        if node.ins and not node.subs and all(v in const for v in node.ins):
            const.update(node.outs)
    return const


def _loop_buffer_bytes(graph: Any, n: int, prog: FlatProgram) -> int:
    """Bytes of the buffers a grad region's backward loops (the scans that read the
    cotangent, past its first ``n`` operands) start from constants: the stacked
    results of each (XLA fills its while loop's output buffer from zeros) and
    the carries it starts from a broadcast constant (a kernel's zeroed
    gradient accumulators). XLA copies each into a buffer of the loop's own,
    and its scheduler makes those copies, which wait for nothing, at the start
    of the program around the region."""
    late = set(graph.invars[n:])
    const = _constants(graph, prog)
    total = 0
    for node in graph.nodes:
        if not any(v in late for v in node.ins):
            continue
        late.update(node.outs)
        if node.prim != "scan":
            continue
        loop = jaxprs.scan(node.eqn)
        carry = node.ins[loop.num_consts : loop.num_consts + loop.num_carry]
        made = [o for o, v in zip(node.outs[: loop.num_carry], carry, strict=True) if v in const]
        for o in made + node.outs[loop.num_carry :]:
            total += _nbytes(o, node)
    return total


def _nbytes(vid: int, node: Any) -> int:
    var = node.eqn.outvars[node.outs.index(vid)]
    return math.prod(var.aval.shape) * np.dtype(var.aval.dtype).itemsize


def _on_inputs(graph: Any, mesh: MeshLike) -> list[tuple[int, str, tuple[str, ...], int]]:
    """(operand position, kind, axes, payload) of the collectives the program runs
    on an operand as it enters (through the optimization barrier, if any)."""
    origin = {v: i for i, v in enumerate(graph.invars)}
    out = []
    for node in graph.nodes:
        if node.prim == "optimization_barrier":
            pairs = zip(node.ins, node.outs, strict=True)
            origin.update({o: origin[v] for v, o in pairs if v in origin})
        elif node.prim in MANUAL_COLLECTIVES and node.ins and node.ins[0] in origin:
            for kind, axes, _, nbytes in _collectives([node], mesh):
                out.append((origin[node.ins[0]], kind, axes, nbytes))
    return out


def region_loop_buffer_bytes(
    prim: str,
    params: Mapping[str, Any],
    attrs: Mapping[str, Any],
    required: Sequence[TensorSpec],
    produced: Sequence[TensorSpec],
    mesh: MeshLike,
) -> int:
    """Per device, the bytes of a grad region's zero-filled loop buffers (its
    backward loops' stacked results and constant-started carries: ``gather_kv``
    attention's K/V gradient blocks and query-gradient accumulators), which XLA
    makes at the start of the program around the region and holds until the
    region runs (measured on XLA:CPU, in a micro-batch loop's body and at the
    top level). 0 for a forward region, or where the replay binds the region
    unsharded."""
    facts = region_program(prim, params, attrs, required, produced, mesh)
    return 0 if facts is None else facts.loop_buffer_bytes


def region_input_collectives(
    prim: str,
    params: Mapping[str, Any],
    attrs: Mapping[str, Any],
    required: Sequence[TensorSpec],
    produced: Sequence[TensorSpec],
    mesh: MeshLike,
) -> tuple[tuple[int, str, tuple[str, ...], int], ...]:
    """The collectives a region's replayed program runs on its operands as they
    enter: ``(operand position, kind, axes, per-device payload)`` (attention's
    all-gathers of K and V). A grad region recomputes its forward, so it runs
    the forward region's again on the same values; XLA computes such an
    identical collective once (see :class:`~spmdkit.propagation.records.Recorder`).
    """
    facts = region_program(prim, params, attrs, required, produced, mesh)
    return () if facts is None else facts.on_inputs


def region_unread_inputs(
    prim: str,
    params: Mapping[str, Any],
    attrs: Mapping[str, Any],
    required: Sequence[TensorSpec],
    produced: Sequence[TensorSpec],
    mesh: MeshLike,
) -> frozenset[int]:
    """Operand positions a region's replayed program never reads once its dead
    values are dropped (an embedding grad region's table: its gradient needs only
    the ids and the cotangent). XLA drops the move of such an operand with the
    program's unread input, so it is not priced."""
    facts = region_program(prim, params, attrs, required, produced, mesh)
    return frozenset() if facts is None else facts.unread


def _drop_dead(graph: Any) -> None:
    """Drop the nodes whose results nobody reads, collectives included: their
    named-axis effect only says which mesh axes they talk over (XLA removes an
    unread all-reduce like any dead value)."""
    live = set(graph.outvars)
    keep = []
    for node in reversed(graph.nodes):
        effects = getattr(node.eqn, "effects", None) or ()
        named = all(type(e).__name__ == "NamedAxisEffect" for e in effects)
        if not named or any(o in live for o in node.outs):
            keep.append(node)
            live.update(node.ins)
            for sub in node.subs:
                _drop_dead(sub)
    graph.nodes = keep[::-1]


def _shard_map_body(jaxpr: Any) -> Any:
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "shard_map":
            return jaxprs.shard_map_body(eqn)
        inner = jaxprs.call_body(eqn)
        if inner is not None:
            found = _shard_map_body(jaxprs.open_jaxpr(inner)[0])
            if found is not None:
                return found
    return None


def _collectives(nodes: Sequence[Any], mesh: MeshLike) -> list[tuple]:
    """(kind, axes, reduce op, per-device payload) of each collective the nodes run,
    once per trip of a ``scan`` body (a ring's block passing runs in one)."""
    sizes = axis_sizes(mesh)
    out = []
    for node in nodes:
        trips = jaxprs.scan_length(node.eqn)
        for sub in node.subs:
            out += _collectives(sub.nodes, mesh) * trips
        if node.prim not in MANUAL_COLLECTIVES:
            continue
        axes = node.eqn.params.get("axes", node.eqn.params.get("axis_name"))
        axes = (axes,) if isinstance(axes, str) else tuple(a for a in axes if isinstance(a, str))
        if not axes or any(a not in sizes for a in axes):
            continue
        kind, side, r = MANUAL_COLLECTIVES[node.prim]
        for v in node.eqn.invars if side == "in" else node.eqn.outvars:
            nbytes = math.prod(v.aval.shape) * np.dtype(v.aval.dtype).itemsize
            out.append((kind, axes, r, nbytes))
    return out


def region_residual_bytes(
    prim: str,
    params: Mapping[str, Any],
    attrs: Mapping[str, Any],
    required: Sequence[TensorSpec],
    produced: Sequence[TensorSpec],
    mesh: MeshLike,
    *,
    duplicate: bool = True,
) -> int:
    """Per device, the bytes a grad region holds from the forward pass to its own
    run: what its program computes from the primal inputs alone and its
    cotangent side reads (``x - mean``, the scale times the inverse deviation...).
    XLA runs that part as soon as the inputs exist (merging what equals the
    forward region's own computation) and keeps it until the backward; 0 for a
    forward region, or where the replay binds the region unsharded. ``duplicate``:
    as :func:`~spmdkit.propagation.memory.liveness` (False: a cheap value read
    by several consumers is held, not recomputed in each)."""
    facts = region_program(prim, params, attrs, required, produced, mesh)
    if facts is None:
        return 0
    return facts.residual_bytes(duplicate=duplicate)
