"""What the enforced replay pins: the :class:`Program` and its per-node :class:`NodePins`.

:func:`spmdkit.compile.enforce.replay` re-runs the traced program with every
equation pinned to the layouts propagation chose. :func:`pins` says, per node,
the layouts to pin its operands and results to, how each operand moves there
(by the plan's own collectives, or through the intermediate layouts of a
multi-step reshard), and for a contraction whose result is sum-partial, the
plan by which the replay reduces it where it is computed (:func:`_fused_reduction`).
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from spmdkit import jaxprs
from spmdkit.propagation.graph import Graph, Node
from spmdkit.propagation.pricing import Pricer
from spmdkit.propagation.primitives import LOOKUP_MODES, grouped_partial, lookup_dims
from spmdkit.propagation.steps import Step
from spmdkit.resharding import ReshardPlan
from spmdkit.spec import MeshLike, TensorSpec

__all__ = ["NodePins", "Program", "pins"]


class NodePins(NamedTuple):
    """What the replay pins for one node.

    Attributes:
      required: the operands' layouts after their reshards.
      produced: the results' layouts.
      steps: per operand, the :class:`~spmdkit.resharding.ReshardPlan` that moves
        it when the replay runs it with its own collectives (no partial layout
        on the way, even blocks; or the plan's collectives alone when they all
        come before its first partial layout: :func:`_explicit_head`), else the
        layouts it passes through when its reshard takes several collectives
        (partial ones left out), else ``()``.
      fused: the reshard plan that reduces a contraction's sum-partial result to
        the layout all its readers (and the step's outputs) slice from, or a
        ``reduce_sum``'s that only the step's outputs read (None when the result
        is not partial, a loop body returns it, its readers differ, or a block
        would be uneven); the transposes, reshapes, casts and size-1 broadcasts
        it passes on the way carry reduced layouts.
      runs: how many times the node runs per step (loop trip counts).
      attrs: the op attributes propagation chose (a region's ``strategy``).
      chain: with ``fused``, the nodes the partial passes on its way to its
        readers when one of them shrinks it (a ``reduce_sum``: grouped-query
        attention's key and value gradients summed over each group's heads), each
        with its result's layout: the replay runs them per device after the
        contraction and reduces the last one's result (``fused`` starts there),
        so the plan's smaller sum is what is moved.
      ran: the node is one of another node's ``chain``: its result is that node's.
    """

    required: tuple[TensorSpec | None, ...]
    produced: tuple[TensorSpec | None, ...]
    steps: tuple[ReshardPlan | tuple[TensorSpec, ...], ...]
    fused: ReshardPlan | None
    runs: int
    attrs: Mapping[str, Any] | None = None
    chain: tuple[tuple[Any, TensorSpec], ...] = ()
    ran: bool = False


@dataclass(frozen=True, eq=False)
class Program:
    """The flattened traced program with the layouts propagation chose.

    Attributes:
      graph: the flattened program (call-like equations inlined).
      values: constant value id → value.
      specs: ``id(node)`` → its :class:`NodePins`.
      out_tree: the output treedef (None when propagating a closed jaxpr
        without one).
      outs: per step output, the :class:`~spmdkit.resharding.ReshardPlan` the
        replay runs with its own collectives to move it into the layout the
        step returns it in (None: returned as made, or moved by XLA to the
        output sharding: a pending sum, an uneven block). Left to the output
        sharding, XLA moved an optimizer's results from the gradient's layout
        into the parameters' by a permute and a gather over part of an axis,
        where the plan gathers the whole axis.
    """

    graph: Graph
    values: dict[int, Any]
    specs: dict[int, NodePins]
    out_tree: Any
    outs: tuple[ReshardPlan | None, ...] = ()


#: Contractions whose sum-partial result the replay reduces itself (see NodePins).
#: A grouped GEMM too when its result is partial over its groups' axes
#: (:func:`~spmdkit.propagation.primitives.grouped_partial`): it runs its
#: rule's local computation there (the group sizes shifted to the device's own
#: rows and groups, computed locally: XLA's partitioned lowering gathers them).
#: Other grouped GEMMs are left to XLA, which reduces a partial over a
#: contracted dim where the plan does (tests/rules/test_ragged.py).
_FUSED_REDUCE = frozenset({"dot_general", "conv_general_dilated"})

#: Reductions whose sum-partial result the replay reduces itself when the step
#: returns it (a bias's gradient, summed over a sharded batch): the output's
#: layout is the only constraint, and left to it XLA may reduce and then slice and
#: permute where the plan gathers and reduce-scatters.
_REDUCED_FOR_OUTPUT = frozenset({"reduce_sum"})

#: Ops a pending sum passes through unchanged in size: a contraction's partial
#: result may be transposed or reshaped before its readers reduce it.
_PARTIAL_PASS = frozenset(
    {"transpose", "reshape", "convert_element_type", "copy", "squeeze", "expand_dims"}
)

#: Ops a pending sum passes through that shrink it (a sum over dims it does not
#: shard): the replay runs the path to its readers per device and reduces the
#: smaller result, as the plan does (:attr:`NodePins.chain`).
_PARTIAL_SHRINK = frozenset({"reduce_sum"})

_Readers = Mapping[int, list[tuple[Node | None, TensorSpec | None]]]


def pins(
    steps: list[Step], pricer: Pricer, graph: Graph, final_out: Sequence[TensorSpec | None]
) -> tuple[dict[int, NodePins], tuple[ReshardPlan | None, ...]]:
    """``id(node)`` → :class:`NodePins` for the top-level ``steps`` of ``graph``
    and, recursively, their loop bodies; and per output of ``graph`` the plan
    the replay moves it by (:attr:`Program.outs`). ``final_out`` are the
    layouts the step's outputs leave in."""
    returned: dict[int, TensorSpec | None] = {}
    for v, s in zip(graph.outvars, final_out, strict=True):
        returned[v] = None if v in returned else s  # returned twice: left alone
    out: dict[int, NodePins] = {}
    made, avail = _node_pins(steps, pricer, returned, _body_outvars(graph), out, 1)
    moves = []
    for v in graph.outvars:
        have, want = made.get(v), returned.get(v)
        plan = None
        if have is not None and want is not None and not have.partial:
            move = _moves(pricer, v, have, want, avail)
            plan = move if isinstance(move, ReshardPlan) else None
        moves.append(plan)
    return out, tuple(moves)


def _body_outvars(graph: Graph, out: set[int] | None = None) -> set[int]:
    """Values that loop or branch bodies return (their layout is the loop's)."""
    out = set() if out is None else out
    for node in graph.all_nodes or graph.nodes:
        for sub in node.subs:
            out.update(sub.outvars)
            _body_outvars(sub, out)
    return out


def _explicit_move(plan: ReshardPlan, mesh: MeshLike) -> bool:
    """Whether the replay runs this reshard with its own collectives under
    ``shard_map``: no partial layout on the way (a pending sum cannot cross a
    shard_map boundary under Auto axes) and even blocks all the way."""
    return all(not x.partial and x.is_even(mesh) for x in plan.specs)


def _node_pins(
    steps: list[Step],
    pricer: Pricer,
    returned: dict[int, TensorSpec | None],
    blocked: set[int],
    out: dict[int, NodePins],
    runs: int,
) -> tuple[dict[int, TensorSpec | None], dict[int, list[TensorSpec]]]:
    """Fill ``out`` for ``steps`` (and their loop bodies); returns each value's
    layout as the replay leaves it (a fused reduction's result reduced) and the
    layouts each value has copies in (the records' copies)."""
    # value → (reading node, None for the step's output; the layout it wants)
    readers: dict[int, list[tuple[Node | None, TensorSpec | None]]] = collections.defaultdict(list)
    made: dict[int, TensorSpec | None] = {}
    for v, r in returned.items():
        readers[v].append((None, r))
    for step in steps:
        for v, r in zip(step.node.ins, step.required, strict=True):
            readers[v].append((step.node, r))
        made.update(zip(step.node.outs, step.outputs, strict=True))
    settled: dict[int, tuple[TensorSpec, TensorSpec] | None] = {}  # None: in a chain
    avail: dict[int, list[TensorSpec]] = {}  # value → layouts it has (the records' copies)
    # a fused reduction's end value → the layout the replay leaves it in (reduced)
    reduced: dict[int, TensorSpec] = {}
    for step in steps:
        node, req, outs = step.node, step.required, step.outputs
        if id(node) in settled:
            layouts = settled[id(node)]
            if layouts is None:  # run inside the contraction's shard_map
                out[id(node)] = NodePins((None,), tuple(outs), ((),), None, runs, ran=True)
                continue
            before, after = layouts
            req = tuple(before if r is not None and r.partial else r for r in step.given)
            out[id(node)] = NodePins(req, (after,), ((),) * len(req), None, runs)
            continue
        # a pending sum the replay reduced where it was computed is read from the
        # layout it was reduced to: moved from its partial layout again, the chain
        # of a multi-step reduction (pinned at each of its layouts) would undo the
        # shard_map's work and XLA would move it a second time
        chains = tuple(
            _moves(pricer, v, reduced.get(v, s), r, avail)
            for v, s, r in zip(node.ins, step.given, req, strict=True)
        )
        fused, chain = None, ()
        if (
            (
                node.prim in _FUSED_REDUCE
                or node.prim in _REDUCED_FOR_OUTPUT
                or _lookup(node, req)
                or grouped_partial(node.eqn, req[1] if len(req) > 1 else None, outs[0])
            )
            and len(outs) == 1
            and outs[0] is not None
            and outs[0].partial
            and all(r is not None and not r.partial for r in req)
            and node.outs[0] not in blocked
        ):
            fused, layouts, chain, end = _fused_reduction(
                node, outs[0], req, pricer, readers, made, blocked
            )
            settled.update(layouts)
            reduced.update(end)
        out[id(node)] = NodePins(
            tuple(req), tuple(outs), chains, fused, runs, step.attrs, chain=chain
        )
        if step.loop is not None:
            ys = _scan_ys(node, outs)
            inner = blocked - set(ys) if ys else blocked
            _node_pins(step.loop.steps, pricer, ys, inner, out, runs * step.loop.trips)
    return {**made, **reduced}, avail


def _lookup(node: Node, req: Sequence[TensorSpec | None]) -> bool:
    """A gather looked up with a mask in a table sharded over the dims it indexes
    (:func:`~spmdkit.propagation.primitives.lookup_dims`): its partial result is
    reduced by the replay like a contraction's. Left alone, XLA splits the indices
    over the table's idle axes, all-reduces the smaller block and permutes it into
    the readers' layout, where the plan reduce-scatters."""
    return (
        node.prim == "gather"
        and req[0] is not None
        and node.eqn.params["mode"] in LOOKUP_MODES
        and bool(lookup_dims(node.eqn, req[0]))
    )


def _scan_ys(node: Node, outs: Sequence[TensorSpec | None]) -> dict[int, TensorSpec | None]:
    """A scan body's ``ys`` results → the (non-partial) slice layout each leaves
    the body in (the scan reduces a pending sum inside the body); a value the
    body returns twice, or as carry too, is left alone."""
    if node.kind != "scan":
        return {}
    nk = jaxprs.scan(node.eqn).num_carry
    body = node.subs[0]
    ys: dict[int, TensorSpec | None] = {}
    for bo, s in zip(body.outvars[nk:], outs[nk:], strict=True):
        if s is None or s.partial or not s.dims or s.dims[0]:
            continue
        ys[bo] = None if bo in ys else TensorSpec(s.shape[1:], s.dims[1:], dtype=s.dtype)
    for bo in body.outvars[:nk]:
        ys.pop(bo, None)
    return {v: t for v, t in ys.items() if t is not None}


def _source(
    pricer: Pricer, vid: int, src: TensorSpec, dst: TensorSpec, avail: dict[int, list[TensorSpec]]
) -> TensorSpec:
    """The layout the records move ``vid`` from: the cheapest one it already has
    (:func:`~spmdkit.propagation.pricing.reshard_once`, whose choices the
    prediction counts), so the replay moves from the same copy."""
    have = avail.setdefault(vid, [src])
    if src not in have:
        have.insert(0, src)
    best, cost = src, None
    for h in have:
        if h.dims == dst.dims and h.partial == dst.partial:
            return h
        a = pricer.reshard("input", h, dst, vid)
        key = None if a is None else (a.plan.time_s, a.payload_bytes)
        if a is not None and (cost is None or key < cost):
            best, cost = h, key
    have.append(dst)
    return best


def _moves(
    pricer: Pricer,
    vid: int,
    src: TensorSpec | None,
    dst: TensorSpec | None,
    avail: dict[int, list[TensorSpec]],
) -> ReshardPlan | tuple[TensorSpec, ...]:
    """How the replay moves an operand: the plan itself (run with its own
    collectives, or locally from a copy the value already has in another
    layout), else its non-partial intermediate layouts (pinned in turn)."""
    given = src
    if src is not None and dst is not None:
        src = _source(pricer, vid, src, dst, avail)
    a = pricer.reshard("input", src, dst, vid) if src is not None and dst is not None else None
    copy = src != given and not (src.dims == dst.dims and src.partial == dst.partial)
    if a is not None and (a.plan.collectives or copy) and _explicit_move(a.plan, pricer.mesh):
        return a.plan
    head = _explicit_head(a.plan, pricer.mesh) if a is not None else None
    if head is not None:
        return head
    if a is not None and not a.plan.collectives and _made_partial(a.plan):
        return (_made_partial(a.plan),)
    steps = a.plan.specs[1:-1] if a is not None and len(a.plan.collectives) > 1 else ()
    return tuple(x for x in steps if not x.partial)


def _made_partial(plan: ReshardPlan) -> TensorSpec | None:
    """The layout a value is split into before a local step makes it partial (a
    scatter-add's zero operand joining the sum its sharded updates make), when the
    plan moves no bytes and ends partial. The replay pins that layout: a partial
    one cannot be pinned, and left with no constraint at all XLA lays the operand
    out replicated and partitions the op around it (it gathered a scatter-add's
    updates over the axes that split their window dims, scattered them whole and
    all-reduced the whole result where the plan all-reduces its slice)."""
    specs = plan.specs
    if not specs[-1].partial or specs[0].partial:
        return None
    last = next(x for x in reversed(specs) if not x.partial)
    return last if last.dims != specs[0].dims else None


def _explicit_head(plan: ReshardPlan, mesh: MeshLike) -> ReshardPlan | None:
    """The plan's collectives as a plan of their own, when they all come before
    its first partial layout (a gather, then a value made partial to be added to
    a pending sum): the replay runs them under ``shard_map`` and leaves the local
    rest to the constraints. Left to a constraint (a partial cannot be pinned),
    XLA may reorder the sum and move the operand another way (slice and permute
    where the plan gathers). None when the plan has no such head."""
    specs = plan.specs
    last = max((i for i, s in enumerate(plan.steps) if not s.is_local), default=-1)
    if last < 0 or last == len(plan.steps) - 1:
        return None
    head = specs[: last + 2]
    if any(x.partial or not x.is_even(mesh) for x in head):
        return None
    return ReshardPlan(plan.src, head[-1], plan.steps[: last + 1])


def _coarsest(want: Sequence[TensorSpec | None]) -> TensorSpec | None:
    """The one non-partial layout every reader's can be sliced from (no
    communication), when there is one among them."""
    if not want or any(w is None or w.partial for w in want):
        return None
    for t in want:
        if all(
            all(wd[: len(td)] == td for wd, td in zip(w.dims, t.dims, strict=True)) for w in want
        ):
            return t
    return None


def _partial_path(
    node: Node,
    spec: TensorSpec,
    readers: _Readers,
    made: Mapping[int, TensorSpec | None],
    blocked: set[int],
) -> tuple[int, list[tuple[Node, TensorSpec, TensorSpec]]]:
    """The value a contraction's partial result reaches through single-reader
    layout-only nodes (:data:`_PARTIAL_PASS`) and sums that keep its pending sum
    (:data:`_PARTIAL_SHRINK`), and those nodes with their (input, output) specs."""
    v, passed = node.outs[0], []
    while True:
        nxt = readers.get(v, [])
        n = nxt[0][0] if len(nxt) == 1 else None
        if n is None or not (
            n.prim in _PARTIAL_PASS
            or n.prim in _PARTIAL_SHRINK
            or _adds_unit_dims(n)
            or _scaled_by(n, v, made)
        ):
            break
        one = len(n.ins) == 1 or _scaled_by(n, v, made)
        s = made.get(n.outs[0]) if len(n.outs) == 1 and one else None
        if s is None or s.partial != spec.partial or n.outs[0] in blocked:
            break
        passed.append((n, made[v], s))
        v = n.outs[0]
    return v, passed


def _scaled_by(node: Node, v: int, made: Mapping[int, TensorSpec | None]) -> bool:
    """Whether ``node`` multiplies ``v`` by a replicated scalar (a float8 GEMM's
    per-tensor scale, :func:`spmdkit.step.fp8.fp8_dot`): a pending sum passes it
    unchanged in size, and the reduced value is scaled alike."""
    if node.prim != "mul" or len(node.ins) != 2 or list(node.ins).count(v) != 1:
        return False
    other = made.get(node.ins[1 - list(node.ins).index(v)])
    return other is not None and other.shape == () and not other.partial


def _fused_reduction(
    node: Node,
    spec: TensorSpec,
    req: Sequence[TensorSpec],
    pricer: Pricer,
    readers: _Readers,
    made: Mapping[int, TensorSpec | None],
    blocked: set[int],
) -> tuple[
    ReshardPlan | None,
    dict[int, Any],
    tuple[tuple[Any, TensorSpec], ...],
    dict[int, TensorSpec],
]:
    """The plan by which the replay reduces a contraction's sum-partial result
    (None: leave it to XLA), the layouts (input, output) of the nodes the
    partial passes through on its way to its readers (None for a node run in
    the chain), that chain (:attr:`NodePins.chain`), and the value its readers
    read (the path's end) with the reduced layout the replay leaves it in.

    The readers (or the step's output) must all want non-partial layouts that
    slice (locally) from one of them, the layout it is reduced to. A partial may
    pass transposes (the target is permuted back) and, when its readers keep its
    layout (an all-reduce), reshapes and casts: it is then reduced right where
    it is computed, and those nodes move reduced values. When it passes a sum
    that shrinks it, the path runs per device and its end is reduced
    (:func:`_chain_reduction`).
    """
    if any(op != "sum" for _, op in spec.partial):
        return None, {}, (), {}
    v, passed = _partial_path(node, spec, readers, made, blocked)
    if node.prim in _REDUCED_FOR_OUTPUT and not _only_returned(v, readers):
        return None, {}, (), {}
    target = _coarsest([r for _, r in readers.get(v, [])])
    if target is None:
        return None, {}, (), {}
    if any(n.prim in _PARTIAL_SHRINK and not _adds_unit_dims(n) for n, _, _ in passed):
        if any(len(n.ins) > 1 for n, _, _ in passed):  # a chain runs one-operand nodes
            return None, {}, (), {}
        plan, layouts, chain = _chain_reduction(v, passed, target, req, pricer)
        return plan, layouts, chain, {v: target} if plan is not None else {}
    layouts: dict[int, Any] = {}
    end = {v: target}
    for n, before, after in reversed(passed):
        if n.prim == "transpose":
            dims: list[tuple[str, ...]] = [()] * len(target.dims)
            for i, d in enumerate(n.eqn.params["permutation"]):
                dims[d] = target.dims[i]
            back = TensorSpec(before.shape, [d or None for d in dims], dtype=before.dtype)
        elif target.dims == after.without_partial().dims:
            back = before.without_partial()
        elif (back := _unit_dims_back(before, target)) is None:
            return None, {}, (), {}
        layouts[id(n)] = (back, target)
        target = back
    a = pricer.reshard("input", spec, target, node.outs[0])
    # shard_map takes even blocks only
    specs = (*req, *a.plan.specs, *(x for pair in layouts.values() for x in pair)) if a else ()
    if a is None or not all(x.is_even(pricer.mesh) for x in specs):
        return None, {}, (), {}
    return a.plan, layouts, (), end


def _chain_reduction(
    v: int,
    passed: Sequence[tuple[Node, TensorSpec, TensorSpec]],
    target: TensorSpec,
    req: Sequence[TensorSpec],
    pricer: Pricer,
) -> tuple[ReshardPlan | None, dict[int, Any], tuple[tuple[Any, TensorSpec], ...]]:
    """A partial that a sum shrinks on its way to its readers (a grouped-query
    attention's key gradient, summed over each group's heads): reducing it where
    it is computed would move the larger value, and left to XLA it is reduced
    there. The replay runs the contraction and the path per device and reduces
    the path's end (value ``v``) to ``target``, as the plan does. None when a
    reshape regroups dims (its per-device program is not a local reshape) or a
    block would be uneven."""
    if any(n.prim == "reshape" and n.eqn.params.get("dimensions") for n, _, _ in passed):
        return None, {}, ()
    end = passed[-1][2]
    a = pricer.reshard("input", end, target, v)
    specs = (*req, *a.plan.specs, *(x for _, b, e in passed for x in (b, e))) if a else ()
    if a is None or not all(x.is_even(pricer.mesh) for x in specs):
        return None, {}, ()
    return a.plan, {id(n): None for n, _, _ in passed}, tuple((n.eqn, e) for n, _, e in passed)


def _only_returned(v: int, readers: _Readers) -> bool:
    """Whether only the step's outputs read ``v``, directly or through nodes that
    only add or drop size-1 dims."""
    got = readers.get(v, [])
    return bool(got) and all(
        n is None or (_adds_unit_dims(n) and _only_returned(n.outs[0], readers)) for n, _ in got
    )


def _adds_unit_dims(node: Node) -> bool:
    """A ``broadcast_in_dim``, ``reshape`` or ``reduce_sum`` that only adds or
    drops size-1 dims (a pending sum passes it unchanged in size)."""
    if node.prim not in ("broadcast_in_dim", "reshape", "reduce_sum") or len(node.ins) != 1:
        return False
    src = node.eqn.invars[0].aval.shape
    dst = node.eqn.outvars[0].aval.shape
    return [d for d in src if d != 1] == [d for d in dst if d != 1]


def _unit_dims_back(before: TensorSpec, target: TensorSpec) -> TensorSpec | None:
    """``target`` (after a node that only adds or drops size-1 dims) mapped back
    to the node's input shape: the non-unit dims keep their axes in order; None
    when ``target`` shards a size-1 dim or the dims do not pair up."""
    pairs = list(zip(target.shape, target.dims, strict=True))
    if any(n == 1 and a for n, a in pairs):
        return None
    axes = [a for n, a in pairs if n != 1]
    big = [n for n in before.shape if n != 1]
    if big != [n for n in target.shape if n != 1]:
        return None
    it = iter(axes)
    dims = [next(it) if n != 1 else () for n in before.shape]
    return TensorSpec(before.shape, [d or None for d in dims], dtype=before.dtype)
