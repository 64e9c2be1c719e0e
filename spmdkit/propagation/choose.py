"""Choosing among a rule's alternative answers, and the hints that steer them.

Where a rule's answer costs communication (operands disagree, or the result is
left sum-partial), :meth:`Chooser.forward` prices the answers with one operand
keeping a contested axis alone, with one operand leading, and with the
operands' hints too — operand reshards plus resolving the result's pending
reductions, payload bytes first — and the cheapest whose results are no bigger
per device wins; ties keep the rule's answer. Activations (values computed from
the batch) stay put where they contest an axis with a weight. A pending sum is
also priced resolved before the op where the rule would make another operand
join it (a conv's partial result concatenated with a replicated skip
connection: the later reduction would move the skip's bytes too), and is
resolved before an op that splits it into several results (XLA reduces a
contraction's result where it is made, and the replay can pin the split's input
only when it is not partial).

Hints are layouts later equations want, carried upstream: :meth:`Chooser.backward_hints`
runs the rules' backward inference from wanted outputs (the ``out_specs``
constraints), :func:`consumer_hints` finds free-made values (a broadcast
constant, a mask) that consumers slice to a more sharded layout and broadcasts
of a small sharded operand whose result a consumer moves (gathering the operand
moves fewer bytes: a batch norm's statistics sharded like an FSDP scale), and
:meth:`Chooser.take_hint` takes a hint on a node's outputs where it costs no
more than the forward answer.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

from spmdkit import jaxprs
from spmdkit.engine.inference import InferenceResult, infer_backward, infer_forward
from spmdkit.engine.registry import get_rule
from spmdkit.propagation.contest import contested, settled, stays, stays_one
from spmdkit.propagation.control import stack
from spmdkit.propagation.graph import FlatProgram, Graph, Node, vids
from spmdkit.propagation.pricing import Pricer
from spmdkit.propagation.primitives import RULE_ERRORS, drop_axes, no_op_reshard, to_rule
from spmdkit.propagation.steps import Step
from spmdkit.spec import TensorSpec
from spmdkit.state import register_cache

__all__ = ["Chooser", "consumer_hints"]

# (mesh, topology, op, attrs, specs, hints, stationary) -> chosen forward answer
_CHEAPEST: dict[tuple, Any] = register_cache(
    {},
    module=__name__,
    name="_CHEAPEST",
    why="the cheapest forward answer per (mesh, op, specs, hints).",
)


class Chooser:
    """Picks each equation's answer among the rule's alternatives and the hints.

    ``hints`` (value id → wanted layout) are set between the driver's sweeps;
    ``stationary`` (ids of activations), ``seq_axes`` and ``weights`` come with it
    (:class:`~spmdkit.propagation.propagator.GraphFacts`); ``ops`` are the registered
    rule names.
    """

    def __init__(
        self,
        prog: FlatProgram,
        pricer: Pricer,
        ops: frozenset[str],
        *,
        stationary: frozenset[int] = frozenset(),
        seq_axes: frozenset[str] = frozenset(),
        weights: frozenset[int] = frozenset(),
    ) -> None:
        self.prog = prog
        self.pricer = pricer
        self.mesh = pricer.mesh
        self.ops = ops
        self.hints: dict[int, TensorSpec] = {}
        self.stationary = frozenset(stationary)
        self.seq_axes = frozenset(seq_axes)
        self.weights = frozenset(weights)

    def use_hints(self, hints: dict[int, TensorSpec]) -> None:
        """Answer the next sweep with ``hints`` (value id → the layout later
        equations want), the driver's backward sweep from the last one."""
        self.hints = hints

    def forward(
        self, op: str, attrs: dict, specs: tuple[TensorSpec, ...], ins: Sequence[int] = ()
    ) -> InferenceResult:
        """The rule's answer; where that costs communication, also the answers led
        by each sharded operand alone and the one with the operands' backward hints
        (the layouts later equations want); the cheapest whose outputs are no bigger
        per device wins (ties keep the rule's own answer). A rule that is not
        ``searched`` gives its own answer only."""
        hinted = None
        if self.hints and ins:
            hinted = tuple(
                h if (h := self.hints.get(v)) is not None and h.shape == x.shape else x
                for v, x in zip(ins, specs, strict=True)
            )
        still = tuple(v in self.stationary for v in ins) if ins else ()
        heavy = self.tensor_parallel(op, attrs, specs, ins)
        try:
            attr_key = tuple(sorted(attrs.items()))
            key = (self.pricer.key, op, id(get_rule(op)), attr_key, specs, hinted, still, heavy)
            hit = _CHEAPEST.get(key)
        except TypeError:  # unhashable attributes: no caching
            key, hit = None, None
        if hit is not None:
            return hit
        best = self._cheapest(op, attrs, specs, hinted, still, heavy)
        if key is not None:
            if len(_CHEAPEST) > 65536:
                _CHEAPEST.clear()
            _CHEAPEST[key] = best
        return best

    def tensor_parallel(
        self, op: str | None, attrs: dict, specs: Sequence[TensorSpec], ins: Sequence[int]
    ) -> tuple[bool, ...]:
        """Which operands are tensor-parallel weights that keep a sequence axis
        (:mod:`.contest`): weights (values of the parameters alone) a matmul reads
        sharded over a sequence axis on a dim it does not contract (column-parallel),
        and a lookup's vocab-parallel table. A weight split over a contracted dim is
        FSDP's (gathered where it meets the activations); so is any other."""
        if not self.seq_axes or not ins or not any(v in self.weights for v in ins):
            return ()
        if op == "embedding":
            return tuple(v in self.weights for v in ins)
        if op != "dot_general" or len(specs) != 2:
            return ()
        (lc, rc), _ = attrs["dimension_numbers"]
        out = []
        for v, s, contracted in zip(ins, specs, (lc, rc), strict=True):
            free = {a for j, d in enumerate(s.dims) if j not in contracted for a in d}
            held = {a for j, d in enumerate(s.dims) if j in contracted for a in d}
            seq = self.seq_axes
            out.append(v in self.weights and bool(free & seq) and not held & seq)
        return tuple(out)

    def _cheapest(
        self,
        op: str,
        attrs: dict,
        specs: tuple[TensorSpec, ...],
        hinted: tuple[TensorSpec, ...] | None,
        still: tuple[bool, ...],
        heavy: tuple[bool, ...] = (),
    ) -> InferenceResult:
        res = infer_forward(op, *specs, mesh=self.mesh, **attrs)
        if not get_rule(op).searched:
            return res
        if len(res.outputs) > 1 and any(s.partial for s in specs):
            # a pending sum split into several results (the cotangent of a
            # concatenation) is resolved first, where the replay can pin it: XLA
            # reduces a contraction's result where it is made and would otherwise
            # lay the split's input out as it likes
            cand = self._try_forward(op, attrs, tuple(s.without_partial() for s in specs))
            price = functools.partial(self.pricer.price, specs)
            if cand is not None and price(cand.inputs, cand.outputs) <= price(
                res.inputs, res.outputs
            ):
                return cand
        if (
            not any(a.plan.collectives for a in res.reshards)
            and not any(o.partial and not any(s.partial for s in specs) for o in res.outputs)
            and not _joins_partial(specs, res.inputs)
        ):
            return res
        # where an activation (a value computed from the batch) and a weight contest a
        # mesh axis, the weight gives it up (it is all-gathered, as in FSDP) rather than
        # the activation being moved or left sum-partial; on a sequence axis the
        # weight keeps it and the activation is gathered (:mod:`.contest`)
        act = [i for i, m in enumerate(still) if m]
        axes = contested(specs, still, self.seq_axes, heavy)
        keeps = functools.partial(_keeps, specs, still, axes, heavy)
        if act and len(act) < len(specs) and not keeps(res):
            cand = self._try_forward(op, attrs, settled(specs, still, axes, heavy))
            if cand is not None and keeps(cand):
                return cand
        # the alternatives: none moves an activation off an axis it keeps (the
        # weights' part of the rule is the settled answer's, above)
        keeps = functools.partial(_keeps, specs, still, axes, ())
        kept = bool(act) and keeps(res)
        best, best_t = res, self.pricer.price(specs, res.inputs, res.outputs)
        size = sum(o.local_bytes(self.mesh) for o in res.outputs)
        alts = _alternatives(specs)
        if hinted is not None:
            alts.append(hinted)
        for alt in alts:
            if alt == specs:
                continue
            cand = self._try_forward(op, attrs, alt)
            if cand is None or (kept and not keeps(cand)):
                continue
            t = self.pricer.price(specs, cand.inputs, cand.outputs)
            smaller = sum(o.local_bytes(self.mesh) for o in cand.outputs) <= size
            if smaller and t < best_t:
                best, best_t = cand, t
        return best

    def _try_forward(
        self, op: str, attrs: dict, specs: tuple[TensorSpec, ...]
    ) -> InferenceResult | None:
        try:
            return infer_forward(op, *specs, mesh=self.mesh, **attrs)
        except RULE_ERRORS:
            return None

    def take_hint(
        self,
        node: Node,
        specs: tuple[TensorSpec, ...],
        op: str | None,
        attrs: dict,
        req: tuple[TensorSpec, ...],
        outs: tuple[TensorSpec, ...],
    ) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
        """(required inputs, outputs) taking the backward hint on the outputs when
        it costs no more than the forward answer plus resharding to the hint."""
        hints = [self.hints.get(o) for o in node.outs]
        if (
            op is None
            or op not in self.ops
            or all(h is None or h == o for h, o in zip(hints, outs, strict=True))
        ):
            return req, outs
        want = tuple(h if h is not None else o for h, o in zip(hints, outs, strict=True))
        try:
            res = infer_backward(op, *specs, outputs=want, mesh=self.mesh, **attrs)
        except RULE_ERRORS:
            return req, outs
        if tuple(o.dims for o in res.outputs) != tuple(w.dims for w in want):
            return req, outs
        # candidate inputs: backward's layout, keeping operands' partials out
        fwd = self._try_forward(op, attrs, res.inputs)
        if fwd is None:
            return req, outs
        cand_in, cand_out = fwd.inputs, fwd.outputs
        if tuple(o.dims for o in cand_out) != tuple(w.dims for w in want):
            # forward cannot recreate it (dims new in the output): backward's own answer
            cand_in, cand_out = res.inputs, res.outputs
        cand_out = tuple(o.replace(dtype=w.dtype) for o, w in zip(cand_out, want, strict=True))
        still = [v in self.stationary for v in node.ins]
        tp = self.tensor_parallel(op, attrs, specs, node.ins)
        heavy = [*tp, *[False] * (len(specs) - len(tp))]
        axes = contested(specs, still, self.seq_axes, heavy)
        moved = [
            i for i, a in enumerate(still) if not stays_one(specs[i], cand_in[i], a, axes, heavy[i])
        ]
        # a broadcast that only gathers its (small) operand: the activation that stays
        # put is its result, and bytes come first (as in _cheapest: at small sizes the
        # latency term would rather move the broadcast result than gather the operand)
        spread = node.prim == "broadcast_in_dim" and all(
            _kept(c, s) for c, s in zip(cand_in, specs, strict=True)
        )
        # activations stay put (see _cheapest); the forward answer may itself have
        # moved one over a sequence axis (two activations contesting it)
        loose = axes | self.seq_axes
        if (
            moved
            and not spread
            and all(
                stays_one(specs[i], req[i], still[i], loose if still[i] else axes, heavy[i])
                for i in moved
            )
        ):
            return req, outs

        def cost(required: Sequence[TensorSpec], produced: Sequence[TensorSpec]) -> tuple:
            ins = zip(specs, required, strict=True)
            pairs = [(f"input {i}", s, r) for i, (s, r) in enumerate(ins)]
            outs = zip(produced, want, strict=True)
            pairs += [(f"output {i}", o, w) for i, (o, w) in enumerate(outs)]
            moves = [a for p in pairs if (a := self.pricer.reshard(*p)) is not None]
            t = sum(a.plan.time_s for a in moves)
            return (sum(a.payload_bytes for a in moves), t) if spread else (t,)

        if cost(cand_in, cand_out) <= cost(req, outs):
            return cand_in, cand_out
        return req, outs

    def backward_hints(
        self,
        graph: Graph,
        spec: Mapping[int, TensorSpec],
        wanted: dict[int, TensorSpec],
        fixed: set[int],
    ) -> dict[int, TensorSpec]:
        """The backward sweep: layouts wanted of ``graph``'s values, from the
        ``wanted`` layouts of some of them, by the rules' backward inference
        (``fixed`` values and constants get none)."""
        hints = dict(wanted)
        for node in reversed(graph.nodes):
            if node.kind == "scan":
                self._scan_hints(node, spec, hints, fixed)
                continue
            if node.kind != "eqn":
                continue
            want = [hints.get(o) for o in node.outs]
            if all(w is None for w in want):
                continue
            if no_op_reshard(node.eqn):  # the identity: its operand is wanted alike
                v, w = node.ins[0], want[0]
                if not (v in fixed or self.prog.const[v] or v in hints):
                    hints[v] = w.replace(dtype=spec[v].dtype)
                continue
            conv = to_rule(node.eqn)
            if conv is None or conv[0] not in self.ops:
                continue
            op, attrs = conv
            outs = tuple(
                w if w is not None else spec[o] for w, o in zip(want, node.outs, strict=True)
            )
            ins = tuple(spec[v] for v in node.ins)
            try:
                res = infer_backward(op, *ins, outputs=outs, mesh=self.mesh, **attrs)
            except RULE_ERRORS:
                continue
            if self._reduced_to(node, spec, outs, res.inputs):
                continue
            for v, s in zip(node.ins, res.inputs, strict=True):
                if v in fixed or self.prog.const[v] or v in hints:
                    continue
                if s.sharding_axes and s.dims != spec[v].dims:
                    hints[v] = s
        return hints

    def _reduced_to(
        self,
        node: Node,
        spec: Mapping[int, TensorSpec],
        want: Sequence[TensorSpec],
        ins: Sequence[TensorSpec],
    ) -> bool:
        """Whether the layouts ``want``ed of the sum-partial results ``node`` makes
        (from operands without pending sums) are made by resolving those sums
        there, a reduce-scatter (a weight's gradient contracted over the batch,
        wanted split like its weight), for no more payload bytes than moving the
        operands to the backward answer's layouts ``ins`` would: the hint then
        stops at the node (carried upstream it moved the activations the
        contraction reads: a cotangent split over the vocabulary where its reader
        keeps it split over the batch)."""
        made = [spec[o] for o in node.outs]
        if not any(s.partial for s in made) or any(spec[v].partial for v in node.ins):
            return False  # no pending sum, or one made upstream (the hint goes on to it)
        out_bytes = 0
        for s, w in zip(made, want, strict=True):
            if s.dims == w.dims and s.partial == w.partial:
                continue
            if not s.partial:
                return False
            a = self.pricer.reshard("output", s, w)
            if a is None or not all(c.kind == "reduce_scatter" for c in a.plan.collectives):
                return False
            out_bytes += a.payload_bytes
        in_bytes = 0
        for i, (v, r) in enumerate(zip(node.ins, ins, strict=True)):
            a = self.pricer.reshard(f"input {i}", spec[v], r)
            in_bytes += a.payload_bytes if a is not None else 0
        return out_bytes <= in_bytes

    def _scan_hints(
        self, node: Node, spec: Mapping[int, TensorSpec], hints: dict, fixed: set[int]
    ) -> None:
        """Carry the hints on a scan's results into its body and back out to its
        operands (the stacked dim stays unsharded)."""
        sc = jaxprs.scan(node.eqn)
        nc, nk = sc.num_consts, sc.num_carry
        body = node.subs[0]
        inner: dict[int, TensorSpec] = {v: h for v, h in hints.items() if v in vids(body)}
        for j, (o, bo) in enumerate(zip(node.outs, body.outvars, strict=True)):
            h = hints.get(o)
            if h is None or bo in inner:
                continue
            if j < nk:
                inner[bo] = h
            elif not h.dims[0]:
                inner[bo] = TensorSpec(h.shape[1:], h.dims[1:], dtype=h.dtype)
        if not inner:
            return
        got = self.backward_hints(body, spec, inner, set())
        for v, h in got.items():
            hints.setdefault(v, h)
        for j, (v, bi) in enumerate(zip(node.ins, body.invars, strict=True)):
            h = got.get(bi)
            if h is None or v in fixed or self.prog.const[v] or v in hints:
                continue
            if j >= nc + nk:
                h = stack(h, self.prog.shapes[v][0])
            if h.shape == self.prog.shapes[v]:
                hints[v] = h


def _broadcasts(steps: Sequence[Step]) -> dict[int, TensorSpec]:
    """Value id → its operand's layout, for values made by ``broadcast_in_dim`` of
    a sharded operand (outside loops)."""
    return {
        step.node.outs[0]: step.given[0]
        for step in steps
        if step.loop is None
        and step.node.prim == "broadcast_in_dim"
        and len(step.given) == 1
        and step.given[0].sharding_axes
    }


def _gather_first(pricer: Pricer, operand: TensorSpec, have: TensorSpec, want: TensorSpec) -> bool:
    """Whether moving a broadcast's result from ``have`` to ``want`` costs more than
    gathering its whole (unbroadcast) ``operand``, which lets the broadcast make
    ``want`` itself."""
    move = pricer.reshard("input", have, want)
    if move is None or not move.plan.collectives or have.partial or want.partial:
        return False
    gather = pricer.reshard("input", operand, operand.replace(dims=((),) * len(operand.dims)))
    return gather is not None and gather.payload_bytes < move.payload_bytes


def _alternatives(specs: tuple[TensorSpec, ...]) -> list[tuple[TensorSpec, ...]]:
    """Operand layouts to try besides the given ones: an axis sharding several
    operands kept by each of them alone, and each sharded operand leading with
    the others replicated."""
    alts: list[tuple[TensorSpec, ...]] = []
    if len(specs) <= 1:
        return alts
    owners: dict[str, list[int]] = {}
    for i, x in enumerate(specs):
        for a in x.sharding_axes:
            owners.setdefault(a, []).append(i)
    for a, who in sorted(owners.items()):
        for i in who if len(who) > 1 else ():
            alts.append(tuple(x if j == i else drop_axes(x, {a}) for j, x in enumerate(specs)))
    for i, lead in enumerate(specs):  # one operand leads, the others replicated
        if lead.sharding_axes:
            alts.append(tuple(x if j == i else drop_axes(x, None) for j, x in enumerate(specs)))
    if any(not x.partial for x in specs):  # pending sums resolved before the op
        resolved = tuple(x.without_partial() for x in specs)
        if resolved != specs:
            alts.append(resolved)
    return alts


def _joins_partial(given: Sequence[TensorSpec], required: Sequence[TensorSpec]) -> bool:
    """Whether a rule made an operand that was not sum-partial join a partial one (a
    local ``to_partial``): the output's pending reduction then moves that operand's
    bytes too, so resolving the partial operand first may cost less (a conv's
    partial result concatenated with a replicated skip connection)."""
    return any(r.partial and not s.partial for s, r in zip(given, required, strict=True)) and any(
        s.partial for s in given
    )


def _keeps(
    specs: Sequence[TensorSpec],
    still: Sequence[bool],
    axes: frozenset[str],
    heavy: Sequence[bool],
    res: Any,
) -> bool:
    """Whether a rule's answer leaves the activations' dim shardings in place off
    the contested sequence ``axes`` and the weights' (``heavy``) on them
    (:func:`.contest.stays`)."""
    return stays(specs, still, axes, res.inputs, heavy)


def _kept(given: TensorSpec, required: TensorSpec) -> bool:
    """Whether ``required`` still shards each dim of ``given`` over its axes."""
    got = required.dims + ((),) * (len(given.dims) - len(required.dims))
    return all(set(d) <= set(r) for d, r in zip(given.dims, got, strict=False))


def consumer_hints(
    pricer: Pricer, steps: Sequence[Step], skip: set[int], free_in: frozenset[int] = frozenset()
) -> dict[int, TensorSpec]:
    """Layouts a producer may as well make itself, as seen from the consumers.

    Values made from replicated operands (broadcast constants, masks) that a
    consumer slices (no communication) to a more sharded layout: their producer may
    as well make that layout (less compute and memory); or that a consumer moves
    with collectives (the producer took a backward hint its reader did not follow):
    the producer makes the reader's layout for nothing. And values a
    ``broadcast_in_dim`` spreads from a small sharded operand that a consumer moves
    (a batch norm's statistic's cotangent, sharded like its channel-sharded scale,
    broadcast over the batch-sharded activations): moving the small operand
    before the broadcast costs less than moving the broadcast result."""
    out: dict[int, TensorSpec] = {}
    free = set(free_in) | {  # made from replicated operands: sharding them costs nothing
        o
        for step in steps
        if step.loop is None and all(x.is_replicated for x in step.given)
        for o in step.node.outs
    }
    spread = _broadcasts(steps)
    for step in steps:
        node = step.node
        for v, s, r in zip(node.ins, step.given, step.required, strict=True):
            if v in skip or v in out or r.dims == s.dims:
                continue
            if v in spread and _gather_first(pricer, spread[v], s, r):
                out[v] = r
                continue
            if v not in free or r.partial != s.partial:
                continue
            a = pricer.reshard("input", s, r)
            if a is None:
                continue
            if a.plan.collectives or len(r.sharding_axes) > len(s.sharding_axes):
                # a slice to a finer layout, or a move its producer (which reads only
                # replicated operands) avoids by making the reader's layout itself
                out[v] = r
        if step.loop is not None:
            inner_free: frozenset[int] = frozenset()
            if node.kind == "scan":  # operands reach the body as its inputs, in order
                body = node.subs[0]
                inner_free = frozenset(
                    b for v, b in zip(node.ins, body.invars, strict=True) if v in free
                )
            for v, h in consumer_hints(pricer, step.loop.steps, skip, inner_free).items():
                out.setdefault(v, h)
    return out
