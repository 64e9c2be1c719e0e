"""The propagator: one forward sweep of specs over a flattened program.

:class:`Propagator` walks a :class:`~spmdkit.propagation.graph.Graph` node by node:
each equation's operand specs go to its registered rule (via
:func:`~spmdkit.propagation.primitives.to_rule`), the
:class:`~spmdkit.propagation.choose.Chooser` picks among the rule's answers and
the hints, and the node's result specs are recorded; loops and branches go to
:mod:`spmdkit.propagation.control`. Every decision is appended as a
:class:`~spmdkit.propagation.steps.Step`.

**Unknown primitives.** A primitive with no rule is never an error: its inputs
are made replicated (that reshard is priced), its outputs are replicated, one
warning is issued per primitive and the count is kept in :attr:`Propagator.unknown`.
A rule that does not fit an equation (it raises :class:`~spmdkit.SpmdError` or
``NotImplementedError``) is treated the same way; any other exception from a
rule is a bug and surfaces.
"""

from __future__ import annotations

import collections
import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from jax.sharding import PartitionSpec as P

from spmdkit import jaxprs
from spmdkit.engine.region import FORWARD, GRAD, KEPT_NOTHING, REGIONS, kept_dtypes, kept_layout
from spmdkit.engine.registry import registered_ops
from spmdkit.errors import SpmdError
from spmdkit.propagation.choose import Chooser
from spmdkit.propagation.control import cond, scan, while_loop
from spmdkit.propagation.graph import FlatProgram, Graph, Node
from spmdkit.propagation.pricing import Pricer, target_backend
from spmdkit.propagation.primitives import (
    GENERATORS,
    RULE_ERRORS,
    index_parallel,
    no_op_reshard,
    sharded_bits,
    to_rule,
    with_masked_lookup,
)
from spmdkit.propagation.regions import RegionAnswer, region_answer, region_layouts
from spmdkit.propagation.steps import Step
from spmdkit.spec import MeshLike, TensorSpec
from spmdkit.state import register_cache
from spmdkit.topology import Topology
from spmdkit.versions import reassociates_all_reduces

__all__ = ["STRUCTURAL_OPS", "Propagator"]

#: The ops a step may name that are not registered rules: layouts the propagator gives
#: by construction (fresh values, sharding constraints, a ``shard_map``'s own specs,
#: an optimization barrier over several operands). Every other op a step names is a
#: registered rule (``spmdkit rules`` lists it; tests/propagation/test_primitives.py).
STRUCTURAL_OPS = frozenset(
    {
        *GENERATORS,
        "sharding_constraint",
        "reshard",
        "mesh_cast",
        "shard_map",
        "optimization_barrier",
    }
)

_WARNED: set[str] = register_cache(
    set(),
    module=__name__,
    name="_WARNED",
    why="primitives already warned about having no rule (cleared: they warn again).",
)
_Specs = tuple[TensorSpec, ...]
_Answer = tuple[str | None, dict, _Specs, _Specs]  # (op, attrs, required inputs, outputs)


@dataclass(frozen=True)
class GraphFacts:
    """What the driver reads off the program's graph before propagating it, handed
    to the :class:`Propagator` (and by it to its pricer and chooser) when built.

    Attributes:
      uses: value id → number of readers (:attr:`Propagator.uses`).
      producer: value id → the primitive that makes it (``Pricer.producer``).
      widened: value id → the narrower dtype a cast widened it from (``Pricer.widened``).
      stationary: ids of the activations (``Chooser.stationary``).
      seq_axes: the mesh axes the batch's sequence dim is split over (``Chooser.seq_axes``).
      weights: ids of values of the parameters alone (``Chooser.weights``).
    """

    uses: Mapping[int, int] = field(default_factory=dict)
    producer: Mapping[int, str] = field(default_factory=dict)
    widened: Mapping[int, Any] = field(default_factory=dict)
    stationary: frozenset[int] = frozenset()
    seq_axes: frozenset[str] = frozenset()
    weights: frozenset[int] = frozenset()


class Propagator:
    """Propagates specs forward through a flattened program, one node at a time.

    Its job: for every node, the layouts its operands must have and the layouts
    of its results (:meth:`run`), given the operands' current layouts, the
    registered rules, the per-op ``strategies`` and the hints set on
    :attr:`chooser`. It prices nothing itself (:attr:`pricer` does) and keeps no
    result beyond the steps it appends and :attr:`unknown`.

    Attributes:
      prog: the flattened program (shapes, dtypes, constants).
      mesh: the mesh.
      pricer: reshard plans and costs (its ``producer`` map from ``facts``).
      chooser: picks among a rule's answers; holds ``hints`` and ``stationary``.
      uses: value id → number of readers (a pending reduction read several
        times is reduced once, where it is made).
      reassociates: whether the target backend's XLA sums pending reductions that
        meet at an add before reducing once
        (:func:`~spmdkit.versions.reassociates_all_reduces`).
      unknown: primitive → number of equations propagated without a rule.
    """

    def __init__(
        self,
        prog: FlatProgram,
        mesh: MeshLike,
        topology: Topology,
        strategies: Mapping,
        facts: GraphFacts | None = None,
    ) -> None:
        facts = GraphFacts() if facts is None else facts
        self.prog = prog
        self.mesh = mesh
        self.strategies = dict(strategies or {})
        self.ops = frozenset(registered_ops())
        self.pricer = Pricer(mesh, topology, producer=facts.producer, widened=facts.widened)
        self.chooser = Chooser(
            prog,
            self.pricer,
            self.ops,
            stationary=facts.stationary,
            seq_axes=facts.seq_axes,
            weights=facts.weights,
        )
        self.uses: dict[int, int] = dict(facts.uses)
        self.unknown: collections.Counter = collections.Counter()
        self.reassociates = reassociates_all_reduces(target_backend(mesh, topology))
        # value id → (kept layout, attributes, operand layouts) of the forward region
        # that made that kept residual, carried through checkpoint names and scans
        self.kept: dict[int, tuple[Any, dict, _Specs]] = {}

    def replicated(self, vid: int) -> TensorSpec:
        """The replicated spec of value ``vid``."""
        return TensorSpec(self.prog.shapes[vid], dtype=self.prog.dtypes[vid])

    def wanted(self, vid: int) -> TensorSpec | None:
        """The layout later equations want of value ``vid`` (the chooser's hint)."""
        h = self.chooser.hints.get(vid)
        return h if h is not None and h.shape == self.prog.shapes[vid] else None

    def warn(self, prim: str, why: str) -> None:
        """Count an equation propagated without a rule; warn once per primitive."""
        self.unknown[prim] += 1
        if prim not in _WARNED:
            _WARNED.add(prim)
            warnings.warn(
                f"spmdkit.propagation: no sharding rule for primitive {prim!r} ({why}); "
                "its operands are made replicated and the cost counted. "
                "Register one with sk.register_primitive.",
                stacklevel=4,
            )

    # -- whole graphs ---------------------------------------------------------------

    def sweep(
        self,
        graph: Graph,
        in_specs: Sequence[TensorSpec],
        spec: dict[int, TensorSpec],
        collect: list[Step],
    ) -> None:
        """One forward sweep of the whole program (:meth:`run`) from the chooser's
        current hints; :attr:`unknown` then counts this sweep's equations only."""
        self.unknown = collections.Counter()
        self.run(graph, in_specs, spec, collect)

    def run(
        self,
        graph: Graph,
        in_specs: Sequence[TensorSpec],
        spec: dict[int, TensorSpec],
        collect: list[Step] | None,
    ) -> None:
        """Propagate ``graph`` from ``in_specs``: every value's spec into ``spec``,
        every node's :class:`Step` appended to ``collect`` (when given)."""
        for vid, s in zip(graph.invars, in_specs, strict=True):
            spec[vid] = s
        for node in graph.nodes:
            for v in node.ins:
                if v not in spec:
                    spec[v] = self.replicated(v)
            specs = tuple(spec[v] for v in node.ins)
            step = self._step(node, specs, spec)
            for o, s in zip(node.outs, step.outputs, strict=True):
                spec[o] = s
            if collect is not None:
                collect.append(step)

    def body(
        self,
        graph: Graph,
        in_specs: Sequence[TensorSpec],
        spec: dict[int, TensorSpec],
        collect: list[Step] | None,
    ) -> list[TensorSpec]:
        """:meth:`run` over a loop or branch body; the specs of its results."""
        self.run(graph, in_specs, spec, collect)
        return [spec.get(v) or self.replicated(v) for v in graph.outvars]

    def _step(self, node: Node, specs: _Specs, spec: dict[int, TensorSpec]) -> Step:
        if node.kind == "eqn" and any(s.partial for s in specs):
            eff = self._reduced_first(node, specs)
            if eff != specs:
                op, attrs, req, outs, hinted = self._equation(node, eff)
                return Step(node, op, attrs, specs, req, outs, hinted=hinted)
        if node.prim == "name":
            self._carry_kept(node.ins, node.outs)
        if node.kind in ("scan", "while", "cond"):
            run = {"scan": scan, "while": while_loop, "cond": cond}
            if node.kind == "scan":
                self._carry_kept(node.ins, node.subs[0].invars)
            req, outs, loop = run[node.kind](self, node, specs, spec)
            if node.kind == "scan":
                self._carry_kept(node.subs[0].outvars, node.outs)
            return Step(node, node.prim, _loop_attrs(node), specs, req, outs, loop)
        if node.kind == "shard_map":
            op, attrs, req, outs = self._shard_map(node, specs)
            return Step(node, op, attrs, specs, req, outs)
        op, attrs, req, outs, hinted = self._equation(node, specs)
        return Step(node, op, attrs, specs, req, outs, hinted=hinted)

    def _reduced_first(self, node: Node, specs: _Specs) -> _Specs:
        """The operands with the pending reductions that are resolved before the
        equation runs made non-partial: one read by several equations is reduced
        once, where it is made (XLA all-reduces a dot's result), not once per
        reader; so are pending reductions that meet (XLA reduces each one, unless
        the target sums them first: :meth:`_summed_first`) and one a broadcast
        would enlarge (reducing first moves fewer bytes, and XLA does so)."""
        meet = sum(1 for s in specs if s.partial) > 1 and not self._summed_first(node, specs)
        grows = node.prim == "broadcast_in_dim" and math.prod(
            self.prog.shapes[node.outs[0]]
        ) > math.prod(self.prog.shapes[node.ins[0]])
        return tuple(
            s.without_partial() if s.partial and (meet or grows or self.uses.get(v, 0) > 1) else s
            for v, s in zip(node.ins, specs, strict=True)
        )

    def _summed_first(self, node: Node, specs: _Specs) -> bool:
        """Whether XLA on the target adds these pending sums before reducing once
        (``AllReduceReassociate``, :func:`~spmdkit.versions.reassociates_all_reduces`):
        an add of operands that are all sum-partial over the same axes (the same
        replica groups), each read by the add alone. Summed first, the add's
        result is the one pending sum: a layer's q, k and v input gradients
        reduce once, as Megatron-LM's fused QKV does."""
        if not self.reassociates or node.prim not in ("add", "add_any"):
            return False
        first = specs[0].partial
        return (
            bool(first)
            and all(op == "sum" for _, op in first)
            and all(s.partial == first and s.dtype == specs[0].dtype for s in specs)
            and all(self.uses.get(v, 0) == 1 for v in node.ins)
        )

    # -- one equation -----------------------------------------------------------------

    def _equation(self, node: Node, specs: _Specs) -> tuple[Any, ...]:
        """:meth:`infer`, then the backward hint on the outputs where it is cheaper;
        its answer and whether the hint was taken."""
        op, attrs, req, outs = self.infer(node, specs)
        if not self.chooser.hints:
            return op, attrs, req, outs, False
        forward = outs
        req, outs = self.chooser.take_hint(node, specs, op, attrs, req, outs)
        return op, attrs, req, outs, outs != forward

    def infer(self, node: Node, specs: _Specs) -> _Answer:
        """(op, attrs, required inputs, outputs) for a plain equation."""
        name = node.prim
        if not node.ins and name not in GENERATORS:
            return None, {}, (), tuple(self.replicated(o) for o in node.outs)
        if name in GENERATORS:  # fresh values: replicated, or the layout consumers want
            hints = self.chooser.hints if sharded_bits(node.eqn) else {}
            outs = tuple(
                h if (h := hints.get(o)) is not None else self.replicated(o) for o in node.outs
            )
            return name, {}, tuple(s.without_partial().replace(dims=()) for s in specs), outs
        if name == "optimization_barrier" and len(specs) == len(node.outs):
            return name, {}, specs, specs  # identity on every operand, layouts kept
        if no_op_reshard(node.eqn):  # lowered to nothing: the layout passes through
            return name, {}, specs, specs
        if name in ("sharding_constraint", "reshard", "mesh_cast"):
            got = self._constraint(node, specs[0])
            if got is not None:
                return name, {}, (got,), (got,)
        if name in REGIONS:
            return self._region(node, specs)
        conv = to_rule(node.eqn)
        if conv is not None and conv[0] in self.ops:
            return self._by_rule(node, specs, *conv)
        self.warn(name, "no rule registered")
        return self._unknown(node, specs)

    def _by_rule(self, node: Node, specs: _Specs, op: str, attrs: dict) -> _Answer:
        """The registered rule's (chosen) answer; replicated, warned, when it does
        not fit the equation."""
        strategy = self.strategies.get(op)
        if strategy is not None:
            attrs = {**attrs, "strategy": strategy}
        try:
            local = index_parallel(node.eqn, specs) if op == "gather" else None
            if local is not None:
                res = self.chooser.forward(op, attrs, local[0], node.ins)
                res = with_masked_lookup(res, specs[0], local[1])
            else:
                res = self.chooser.forward(op, attrs, specs, node.ins)
        except RULE_ERRORS as e:
            why = f"rule {op!r} failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        else:
            outs = res.outputs
            out_shapes = [self.prog.shapes[o] for o in node.outs]
            if [o.shape for o in outs] == out_shapes:
                dtypes = [self.prog.dtypes[o] for o in node.outs]
                outs = tuple(
                    o if o.dtype == d else o.replace(dtype=d)
                    for o, d in zip(outs, dtypes, strict=True)
                )
                return op, attrs, res.inputs, outs
            why = f"rule {op!r} gave output shapes {[o.shape for o in outs]}"
        self.warn(node.prim, why)
        return self._unknown(node, specs)

    def _region(self, node: Node, specs: _Specs) -> _Answer:
        """A composite op's region, laid out whole by its rule, its strategy
        searched (:mod:`spmdkit.propagation.regions`)."""
        p = node.eqn.params
        still = tuple(v in self.chooser.stationary for v in node.ins)
        ans = region_answer(
            node.prim,
            p,
            specs,
            self.pricer,
            self.strategies.get(p["op"]),
            still,
            self.chooser.seq_axes,
            self.chooser.tensor_parallel(p["op"], {}, specs, node.ins),
        )
        if ans is None:
            self.warn(node.prim, f"rule {p['op']!r} does not fit the region")
            return self._unknown(node, specs)
        ans = self._pair_kept(node, specs, ans)
        dtypes = [self.prog.dtypes[o] for o in node.outs]
        outs = tuple(o.replace(dtype=d) for o, d in zip(ans.outputs, dtypes, strict=True))
        return p["op"], ans.attrs, ans.required, outs

    def _pair_kept(self, node: Node, specs: _Specs, ans: RegionAnswer) -> RegionAnswer:
        """A region of an op that keeps residuals for its grad region
        (:func:`~spmdkit.engine.region.kept_dtypes`): a forward region notes the layout
        it keeps them under; a grad region reads them on that layout, or recomputes
        where the forward kept none. Each pass picks its cheapest strategy alone, so
        where the grad region's own pick would read another layout (a forward
        ``local``, its grad ``all_to_all``: no residuals to read), it is laid out as
        its forward region was (that strategy, the primal operands moved to the
        forward's layouts: priced reshards), the pairing ``sk.jit`` checks."""
        p = node.eqn.params
        op, fwd = p["op"], node.prim == FORWARD
        n = len(node.ins) if fwd else len(p["diff"])
        n_kept = len(kept_dtypes(op, [self.prog.dtypes[v] for v in node.ins[:n]]))
        if not n_kept:
            return ans
        layout = kept_layout(node.prim, p, ans.attrs, ans.required, ans.outputs, self.mesh)
        if fwd:
            made = (KEPT_NOTHING if layout is None else layout, ans.attrs, ans.required)
            for vid in node.outs[len(node.outs) - n_kept :]:
                self.kept[vid] = made
            return ans
        found = {id(self.kept.get(v)): self.kept.get(v) for v in node.ins[n : n + n_kept]}
        if len(found) != 1 or None in found.values():
            return ans  # no forward region in sight: nothing to pair with
        made_under, attrs, required = next(iter(found.values()))
        if (KEPT_NOTHING if layout is None else layout) == made_under:
            return ans
        try:
            paired = region_layouts(GRAD, p, attrs, (*required, *specs[n:]), self.mesh)
        except RULE_ERRORS:
            return ans  # sk.jit refuses the pair, naming both layouts
        again = kept_layout(GRAD, p, paired.attrs, paired.required, paired.outputs, self.mesh)
        return paired if (KEPT_NOTHING if again is None else again) == made_under else ans

    def _carry_kept(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Carry the forward regions' kept layouts from values ``src`` to ``dst``
        (position by position: a scan's operands into its body, its body's results
        out, a checkpoint name's operand to its result)."""
        for a, b in zip(src, dst, strict=True):
            if a in self.kept:
                self.kept[b] = self.kept[a]

    def _unknown(self, node: Node, specs: _Specs) -> _Answer:
        """No rule: operands made replicated (pending reductions resolved), results
        replicated."""
        req = tuple(TensorSpec(s.shape, dtype=s.dtype) for s in specs)
        return None, {}, req, tuple(self.replicated(o) for o in node.outs)

    def _constraint(self, node: Node, spec: TensorSpec) -> TensorSpec | None:
        """The layout a sharding constraint (or reshard, mesh_cast) asks for; None
        when it leaves some dim unconstrained or does not fit the mesh."""
        p = node.eqn.params
        sharding = p.get("sharding", p.get("dst_sharding"))
        pspec = getattr(sharding, "spec", sharding)
        if not isinstance(pspec, P) or any(e is P.UNCONSTRAINED for e in pspec):
            return None
        try:
            return TensorSpec(spec.shape, pspec, dtype=spec.dtype, mesh=self.mesh)
        except SpmdError:
            return None

    def _shard_map(self, node: Node, specs: _Specs) -> _Answer:
        """A ``shard_map`` takes its in/out specs as given on its manual axes. On
        the axes it leaves automatic (``axis_names=`` a subset of the mesh, as the
        pipeline's executor does) an operand keeps its layout, and a result
        shaped like an operand is taken to be laid out like it there (else
        replicated over them): the specs say nothing of those axes."""
        in_specs, out_specs = jaxprs.shard_map_specs(node.eqn)
        try:
            manual = _manual_axes(node.eqn)
            req = tuple(
                _on_manual(TensorSpec(s.shape, ps, dtype=s.dtype, mesh=self.mesh), s, manual)
                for s, ps in zip(specs, in_specs, strict=True)
            )
            outs = []
            for o, ps in zip(node.outs, out_specs, strict=True):
                out = TensorSpec(self.prog.shapes[o], ps, dtype=self.prog.dtypes[o], mesh=self.mesh)
                like = next((r for r in req if (r.shape, r.dtype) == (out.shape, out.dtype)), None)
                outs.append(out if like is None else _on_manual(out, like, manual))
            return "shard_map", {}, req, tuple(outs)
        except (SpmdError, KeyError, TypeError):
            self.warn("shard_map", "in/out specs not understood")
            return self._unknown(node, specs)


def _manual_axes(eqn: Any) -> frozenset | None:
    """The axes a ``shard_map`` equation makes manual; None when all of them."""
    names = jaxprs.manual_axes(eqn)
    if not names:
        return None
    mesh_axes = frozenset(getattr(jaxprs.shard_map_mesh(eqn), "axis_names", ()))
    return None if not mesh_axes or names >= mesh_axes else names


def _on_manual(given: TensorSpec, outer: TensorSpec, manual: frozenset | None) -> TensorSpec:
    """``given`` (a shard_map's spec) on the ``manual`` axes, ``outer``'s layout
    (no pending sums) on the other axes; ``given`` when every axis is manual."""
    if manual is None:
        return given
    used = {a for entry in given.dims for a in entry}
    dims = [
        tuple(entry) + tuple(a for a in keep if a not in manual and a not in used)
        for entry, keep in zip(given.dims, outer.dims, strict=True)
    ]
    return TensorSpec(given.shape, [d or None for d in dims], dtype=given.dtype)


def _loop_attrs(node: Node) -> dict:
    return {"length": jaxprs.scan_length(node.eqn)} if node.kind == "scan" else {}
