"""Loops and branches: how ``scan``, ``while`` and ``cond`` nodes propagate.

Each stays one node whose body is propagated as a sub-graph by the propagator
(anything with the :class:`BodyRunner` methods). ``scan`` counts its body's
costs ``length`` times; the carry keeps its entry layout or takes the fixed
point the body reaches from it, whichever costs less over the loop (the stacked
dim of ``xs`` and ``ys`` stays unsharded). A body result with a pending
reduction is resolved inside the body, each iteration, into the layout its
consumers want (:func:`ys_layout`): stacked unreduced it would hold every
iteration's full-size partial at once (a layer scan's weight gradients in the
gathered weight's shape, where FSDP reduce-scatters each into its shard).
``while`` does the same and counts its body once (trip count unknown).
``cond`` propagates every branch, costs the dearest and keeps outputs on which
the branches agree.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from spmdkit import jaxprs
from spmdkit.engine.inference import ArgReshard
from spmdkit.propagation.graph import Graph, Node
from spmdkit.propagation.pricing import Pricer
from spmdkit.propagation.steps import LoopBody, Step
from spmdkit.spec import MeshLike, TensorSpec, axis_sizes

__all__ = ["BodyRunner", "cond", "scan", "stack", "unstack", "while_loop"]

Specs = tuple[TensorSpec, ...]

#: Collectives that only resolve a pending sum (no slicing or moving besides).
_REDUCE = frozenset({"all_reduce", "reduce_scatter"})


class BodyRunner(Protocol):
    """What the control-flow nodes need of the propagator."""

    pricer: Pricer

    def body(
        self,
        graph: Graph,
        in_specs: Sequence[TensorSpec],
        spec: dict[int, TensorSpec],
        collect: list[Step] | None,
    ) -> list[TensorSpec]:
        """Propagate ``graph`` from ``in_specs``; the specs of its results."""
        ...

    def replicated(self, vid: int) -> TensorSpec:
        """The replicated spec of value ``vid``."""
        ...

    def wanted(self, vid: int) -> TensorSpec | None:
        """The layout later equations want of value ``vid`` (a hint), if any."""
        ...


def unstack(s: TensorSpec) -> tuple[TensorSpec, TensorSpec]:
    """(slice spec seen by the body, stacked spec with dim 0 unsharded)."""
    stacked = s.replace(dims=((), *s.dims[1:])) if s.dims and s.dims[0] else s
    return TensorSpec(s.shape[1:], s.dims[1:], dtype=s.dtype), stacked


def stack(s: TensorSpec, length: int) -> TensorSpec:
    """The spec of ``length`` values of spec ``s`` stacked on a new unsharded dim 0."""
    return TensorSpec((length, *s.shape), ((), *s.dims), partial=dict(s.partial), dtype=s.dtype)


def _back(
    pricer: Pricer, outs: Sequence[TensorSpec], want: Sequence[TensorSpec], label: str
) -> list[ArgReshard]:
    """Reshards of a body's results to the layouts the loop (or node) keeps."""
    return [
        a
        for i, (o, c) in enumerate(zip(outs, want, strict=True))
        if (a := pricer.reshard(f"{label} {i}", o, c)) is not None
    ]


def carry_layouts(
    runner: BodyRunner,
    body: Graph,
    init: list[TensorSpec],
    length: int,
    inputs: Callable[[list[TensorSpec]], list[TensorSpec]],
    carry_out: slice,
) -> list[TensorSpec]:
    """The loop-carry layouts: the entry layouts, or the fixed point the body
    reaches from them, whichever costs less over the whole loop."""
    carry = init
    for _ in range(4):
        outs = runner.body(body, inputs(carry), {}, None)
        new = [o.without_partial() for o in outs[carry_out]]
        if new == carry:
            break
        carry = new
    else:
        carry = [TensorSpec(s.shape, dtype=s.dtype) for s in carry]
    if carry == init:
        return init
    pricer = runner.pricer

    def cost(c: list[TensorSpec]) -> float:
        items: list[Step] = []
        outs = runner.body(body, inputs(c), {}, items)
        t = sum(pricer.time("carry", s, d) for s, d in zip(init, c, strict=True))
        back = sum(pricer.time("carry", o, d) for o, d in zip(outs[carry_out], c, strict=True))
        return t + length * (pricer.steps_time(items) + back)

    return min([init, carry], key=cost)


def _reduced_inside(steps: list[Step], vid: int, have: TensorSpec) -> bool:
    """Whether some equation of a loop body already reads ``vid`` reduced, in its layout."""
    for step in steps:
        for v, r in zip(step.node.ins, step.required, strict=True):
            if v == vid and r.dims == have.dims and not r.partial:
                return True
    return False


def ys_layout(
    pricer: Pricer,
    have: TensorSpec,
    wanted: Sequence[TensorSpec],
    stacked_xs: Sequence[TensorSpec],
) -> TensorSpec:
    """The layout a scan body's sum-partial result is reduced to each iteration.

    The first group with a candidate decides: the layouts consumers want of it
    (``wanted``: hints on the body result, and the slice of a hint on the stacked
    scan result), then the slices of the loop's stacked inputs of the same shape
    (a layer's weight gradient takes its weight's layout), then the all-reduced
    layout; an input slice only where the reduction alone reaches it (an
    all-reduce then a slice leaves XLA free to keep the loop's stacked buffer
    whole and gather into it). A stacked layout sharded over layers (FSDP of a layer stack: the loop
    gathers it) gives its slice with the pending sums over those axes scattered
    over the slice's dims: each layer's gradient as evenly sharded as its weight.
    Within a group, the reduction that moves the fewest payload bytes wins, then
    the smallest result per device (a reduce-scatter moves what an all-reduce
    does), then the quickest.

    Example::

        >>> g = TensorSpec((8, 4), (), partial={"data": "sum"})
        >>> w = TensorSpec((2, 8, 4), ("data", None, None))
        >>> ys_layout(pricer, g, [], [w]).dims
        (('data',), ())
    """
    mesh = pricer.mesh
    spread = [x for st in stacked_xs for x in _slice_wanted(have, st, mesh)]
    for group, pure in ((wanted, False), (spread, True)):
        best: tuple | None = None
        for c in group:
            if c.shape != have.shape or c.partial:
                continue
            t = c.replace(dtype=have.dtype)
            a = pricer.reshard("output", have, t)
            if a is None or (pure and any(x.kind not in _REDUCE for x in a.plan.steps)):
                continue
            key = (a.payload_bytes, t.local_bytes(mesh), a.plan.time_s)
            if best is None or key < best[0]:
                best = (key, t)
        if best is not None:
            return best[1]
    return have.without_partial()


def _sliced_inside(
    pricer: Pricer, have: TensorSpec, stacked: TensorSpec | None, what: str, value: int
) -> tuple[TensorSpec, ArgReshard | None]:
    """A whole body result whose stacked consumers want it split: taken apart in
    the body, each iteration (a local slice, no collective), so the loop stacks
    the slices rather than the whole values (a region's weight gradient, whole per
    layer, would otherwise stack whole). ``(have, None)`` where no such slice is
    wanted."""
    if stacked is None or not stacked.dims or stacked.partial:
        return have, None
    base = unstack(stacked)[0].replace(dtype=have.dtype)
    if base.shape != have.shape or base == have:
        return have, None
    if base.local_bytes(pricer.mesh) >= have.local_bytes(pricer.mesh):
        return have, None
    a = pricer.reshard(what, have, base, value)
    if a is None or a.plan.collectives:
        return have, None
    return base, a


def _slice_wanted(have: TensorSpec, stacked: TensorSpec | None, mesh: MeshLike) -> list:
    """The slice layouts a hint on a scan's stacked result asks of a body result:
    its slice, with (when the consumers shard the stack over layers, as FSDP of a
    layer stack does) the pending sums over the stacked dim's axes scattered over
    the slice's dims, as evenly sharded as the consumers want it."""
    if stacked is None or not stacked.dims:
        return []
    base = TensorSpec(stacked.shape[1:], stacked.dims[1:], dtype=stacked.dtype)
    t = _scattered(have, base, stacked.dims[0], mesh) if stacked.dims[0] else None
    return [t] if t is not None else [base]


def _scattered(
    have: TensorSpec, base: TensorSpec, allowed: Sequence[str], mesh: MeshLike
) -> TensorSpec | None:
    """``base`` (a non-partial layout of ``have``) with each of ``have``'s pending
    sums over an ``allowed`` axis ``base`` does not use scattered over the dim with
    the largest block that axis divides evenly (None: no such axis, or no such dim)."""
    used = {a for d in base.dims for a in d}
    axes = [a for a, op in have.partial if op == "sum" and a not in used and a in allowed]
    sizes = axis_sizes(mesh)
    dims = [tuple(d) for d in base.dims]
    added = False
    for a in axes:
        local = TensorSpec(base.shape, [d or None for d in dims]).local_shape(mesh)
        fits = [i for i, n in enumerate(local) if n % sizes[a] == 0 and n >= sizes[a]]
        if not fits:
            continue
        i = max(fits, key=lambda j: (local[j], -j))
        dims[i] = (*dims[i], a)
        added = True
    if not added:
        return None
    return TensorSpec(base.shape, [d or None for d in dims], dtype=base.dtype)


def scan(
    runner: BodyRunner, node: Node, specs: Specs, spec: dict[int, TensorSpec]
) -> tuple[Specs, Specs, LoopBody]:
    """(required operands, results, body) of a ``scan`` node."""
    sc = jaxprs.scan(node.eqn)
    nc, nk, length = sc.num_consts, sc.num_carry, sc.length
    body = node.subs[0]
    consts = [s.without_partial() for s in specs[:nc]]
    carry = [s.without_partial() for s in specs[nc : nc + nk]]
    xs = [unstack(s.without_partial()) for s in specs[nc + nk :]]
    carry = carry_layouts(
        runner, body, carry, length, lambda c: [*consts, *c, *(x for x, _ in xs)], slice(0, nk)
    )
    inner: list[Step] = []
    outs = runner.body(body, [*consts, *carry, *(x for x, _ in xs)], spec, inner)
    req = (*consts, *carry, *(stacked for _, stacked in xs))
    # a result the body already reduced leaves the loop reduced (no second
    # reduction after it); the other pending sums are reduced inside the body,
    # each iteration, into the layout their consumers want (see ys_layout)
    given_xs = [s.without_partial() for s in specs[nc + nk :]]
    ys: list[TensorSpec] = []
    ys_back = []
    for j, (bo, o) in enumerate(zip(body.outvars[nk:], outs[nk:], strict=True)):
        y = o
        if o.partial and _reduced_inside(inner, bo, o):
            y = o.without_partial()
        elif o.partial:
            hint = runner.wanted(bo)
            want = [hint] if hint is not None else []
            want += _slice_wanted(o, runner.wanted(node.outs[nk + j]), runner.pricer.mesh)
            y = ys_layout(runner.pricer, o, want, given_xs)
            ys_back.append(runner.pricer.reshard(f"output {nk + j}", o, y, bo))
        else:
            wanted = runner.wanted(node.outs[nk + j])
            y, moved = _sliced_inside(runner.pricer, o, wanted, f"output {nk + j}", bo)
            ys_back.append(moved)
        ys.append(stack(y, length))
    # the carry coming back each iteration must have the carry-in layout
    back = _back(runner.pricer, outs[:nk], carry, "carry") + [a for a in ys_back if a]
    return req, (*carry, *ys), LoopBody(inner, back, length)


def while_loop(
    runner: BodyRunner, node: Node, specs: Specs, spec: dict[int, TensorSpec]
) -> tuple[Specs, Specs, LoopBody]:
    """(required operands, results, condition and body) of a ``while`` node."""
    loop = jaxprs.while_loop(node.eqn)
    cn, bn = loop.cond_nconsts, loop.body_nconsts
    cconsts = [s.without_partial() for s in specs[:cn]]
    bconsts = [s.without_partial() for s in specs[cn : cn + bn]]
    carry = [s.without_partial() for s in specs[cn + bn :]]
    body = node.subs[1]
    carry = carry_layouts(runner, body, carry, 1, lambda c: [*bconsts, *c], slice(0, None))
    inner: list[Step] = []
    runner.body(node.subs[0], [*cconsts, *carry], spec, inner)
    outs = runner.body(body, [*bconsts, *carry], spec, inner)
    back = _back(runner.pricer, outs, carry, "carry")
    return (*cconsts, *bconsts, *carry), tuple(carry), LoopBody(inner, back, 1)


def cond(
    runner: BodyRunner, node: Node, specs: Specs, spec: dict[int, TensorSpec]
) -> tuple[Specs, Specs, LoopBody]:
    """(required operands, results, dearest branch) of a ``cond`` node (operands:
    the branch index, then the branches' operands)."""
    ops = [s.without_partial() for s in specs[1:]]
    branches = []
    for g in node.subs:
        items: list[Step] = []
        branches.append((runner.body(g, ops, spec, items), items))
    node_outs = []
    for j, o in enumerate(node.outs):
        cands = {r[j].without_partial() for r, _ in branches}
        node_outs.append(cands.pop() if len(cands) == 1 else runner.replicated(o))
    costed = []
    for results, items in branches:
        back = _back(runner.pricer, results, node_outs, "output")
        t = runner.pricer.steps_time(items) + sum(a.plan.time_s for a in back)
        costed.append((t, items, back))
    # one branch runs: cost the dearest (first among equals)
    _, inner, back = max(costed, key=lambda c: c[0])
    req = (TensorSpec(specs[0].shape, dtype=specs[0].dtype), *ops)
    return req, tuple(node_outs), LoopBody(inner, back, 1)
