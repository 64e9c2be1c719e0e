"""What propagation reports: :class:`EqnRecord` per equation, :class:`Propagation`
for the whole step, and how the propagator's steps become records (:func:`record`).

A record prices a step's operand reshards (a value moved once is not moved
again for the next reader wanting the same layout), the collectives a
``shard_map`` body calls, a rule's own collectives (a norm's statistic
all-reduce) and the step's per-device FLOPs; a loop's record holds its body's
records and counts them ``repeat`` times.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from spmdkit import jaxprs
from spmdkit.engine.inference import ArgReshard, infer_forward
from spmdkit.engine.region import GRAD, REGIONS
from spmdkit.propagation.cse import ValueNumbers
from spmdkit.propagation.memory import MemoryEstimate
from spmdkit.propagation.pinning import Program
from spmdkit.propagation.pricing import (
    Pricer,
    node_flops,
    on_link,
    reshard_once,
    target_backend,
)
from spmdkit.propagation.primitives import RULE_ERRORS
from spmdkit.propagation.regions import (
    MANUAL_COLLECTIVES,
    region_input_collectives,
    region_layouts,
    region_unread_inputs,
)
from spmdkit.propagation.steps import Step
from spmdkit.resharding import Collective, ReshardPlan
from spmdkit.spec import MeshLike, TensorSpec, axis_sizes
from spmdkit.util import CONTRACTIONS, fmt_bytes
from spmdkit.versions import cse_merges_through_barriers

__all__ = ["LATER", "REPORTED", "EqnRecord", "LoopCopies", "Propagation", "Recorder"]

#: The fields of :class:`Propagation` its ``report`` may compute on first read.
REPORTED = (
    "records",
    "comm_bytes_by_kind",
    "comm_bytes",
    "comm_time_s",
    "flops",
    "compute_time_s",
    "step_time_s",
    "memory",
    "memory_materialized",
)
#: The value :func:`~spmdkit.propagation.propagate` gives a :data:`REPORTED`
#: field that its ``report`` computes when first read.
LATER: Any = type("Later", (), {"__repr__": lambda self: "LATER"})()


@dataclass(frozen=True)
class EqnRecord:
    """What propagation decided for one equation.

    Attributes:
      index: position in the flattened program.
      primitive: the jax primitive name.
      op: the rule used (None: no rule, treated as replicated).
      attrs: the attributes the rule got.
      inputs: the specs the operands were given to the rule in (after reshards).
      outputs: the result specs.
      reshards: operands that had to move, with their plans.
      comm_bytes: per-device payload bytes of those reshards (× trip count in loops).
      comm_time_s: their modelled time.
      flops: per-device flops of the equation.
      strategy: the rule strategy used.
      source: ``file:line (function)`` of the user code that made the equation.
      backward: True for equations of the backward pass (``transpose(jvp(...))``).
      repeat: how many times ``body`` runs (scan length; 1 otherwise).
      body: records of a loop's or branch's equations (``carry``: the reshard of
        the carry back to its loop-entry layout).
    """

    index: int
    primitive: str
    op: str | None
    attrs: dict
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    reshards: tuple[ArgReshard, ...]
    comm_bytes: int
    comm_time_s: float
    flops: float
    strategy: str
    source: str
    backward: bool
    repeat: int = 1
    body: tuple[EqnRecord, ...] = ()

    def collectives(self) -> list[Collective]:
        """The communicating steps of this equation's reshards, then of its loop
        body (``repeat`` times)."""
        steps = [c for r in self.reshards for c in r.plan.collectives]
        inner = [c for r in self.body for c in r.collectives()]
        return steps + inner * self.repeat

    def bytes_by_kind(self) -> dict[str, int]:
        """Payload bytes of :meth:`collectives` per kind, summed without listing
        them (a loop body's once, times ``repeat``: nested scans of many layers
        list millions)."""
        out: dict[str, int] = {}
        for r in self.reshards:
            for c in r.plan.collectives:
                out[c.kind] = out.get(c.kind, 0) + c.payload_bytes
        inner: dict[str, int] = {}
        for b in self.body if self.repeat else ():
            for k, v in b.bytes_by_kind().items():
                inner[k] = inner.get(k, 0) + v
        for k, v in inner.items():
            out[k] = out.get(k, 0) + v * self.repeat
        return out


@dataclass
class Propagation:
    """The result of :func:`~spmdkit.propagation.propagate`: specs of every value,
    costs, memory.

    Attributes:
      mesh: the mesh.
      closed_jaxpr: the traced program.
      in_specs: flat input specs.
      out_specs: flat output specs (after resolving pending reductions or
        meeting the ``out_specs`` constraints).
      records: one per equation (flattened), plus ``output`` records for the
        reshards at the outputs.
      unknown: primitive → number of equations without a rule.
      comm_bytes_by_kind: collective kind → per-device payload bytes.
      comm_bytes: total per-device payload bytes.
      comm_time_s: modelled communication time.
      flops: per-device flops.
      compute_time_s: flops / peak flops.
      step_time_s: compute + communication (no overlap assumed).
      memory: per-device memory estimate, a cheap elementwise value recomputed
        inside each consumer's fusion (as XLA:GPU does, and XLA:CPU often): the
        planner's estimate and the low end of the predicted range.
      memory_materialized: the same with every value that several consumers read
        materialized once (never recomputed): the high end of the range.
        Which of the two XLA does for a given value is its fusion heuristic's
        choice, so ``plan.verify`` accepts a compiled peak anywhere in the range
        (widened by its tolerance).
      memory_as: ``(widen=None, cpu=False)`` → ``(memory,
        memory_materialized)`` re-measured as a backend holds the program:
        ``widen`` (dtype → a wider dtype) holds temporaries and resharded copies
        of those dtypes in the wider one (a backend without native 16-bit floats),
        ``cpu`` (True or a ``spmdkit.propagation.workspaces.CpuBackend``) adds
        the workspaces of the ops XLA:CPU expands and makes the
        batch-independent resharded copies at the start, as XLA:CPU schedules
        them (see ``spmdkit.verification.planned.held_on_cpu``); None when not
        propagated.
      var_specs: top-level jaxpr variable → spec.
      steps: propagation's decided steps, one per top-level record in order (a
        loop's body steps in its ``loop``): which value each equation read and
        made, and how its layouts were decided (:mod:`spmdkit.propagation.provenance`).
      program: what :func:`spmdkit.compile.enforce.replay` needs to run the traced
        program with every equation pinned to its propagated layouts.
      report: how :func:`~spmdkit.propagation.propagate` computes the fields of
        :data:`REPORTED` (the records, their totals and the memory estimate) when
        it leaves them :data:`LATER`: on the first read of any of them, all at
        once, then kept (running the step needs only ``program``; a report,
        ``plan.verify`` or the planner reads the rest).
    """

    mesh: MeshLike
    closed_jaxpr: Any
    in_specs: list[TensorSpec]
    out_specs: list[TensorSpec]
    records: list[EqnRecord]
    unknown: collections.Counter
    comm_bytes_by_kind: dict[str, int]
    comm_bytes: int
    comm_time_s: float
    flops: float
    compute_time_s: float
    step_time_s: float
    memory: MemoryEstimate
    # no class-level default for a REPORTED field: __getattr__ finds those left LATER
    memory_materialized: MemoryEstimate = field(repr=False)
    var_specs: dict = field(default_factory=dict, repr=False)
    steps: list[Step] = field(default_factory=list, repr=False, compare=False)
    program: Program | None = field(default=None, repr=False, compare=False)
    memory_as: Callable[..., tuple[MemoryEstimate, MemoryEstimate]] | None = field(
        default=None, repr=False, compare=False
    )
    report: Callable[[], Mapping[str, Any]] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        later = [k for k in REPORTED if self.__dict__.get(k) is LATER]
        if later and self.report is None:
            raise ValueError(f"Propagation: {later} are LATER but no report computes them")
        for k in later:  # read through __getattr__ until the report has run
            del self.__dict__[k]

    def __getattr__(self, name: str) -> Any:
        # only reached for an attribute not set: a REPORTED field still LATER
        report = self.__dict__.get("report")
        if name not in REPORTED or report is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        try:
            fields = dict(report())
        except AttributeError as e:  # not "no such attribute" to getattr's callers
            raise RuntimeError(f"Propagation: computing {name!r} failed: {e}") from e
        for k in REPORTED:
            self.__dict__.setdefault(k, fields[k])
        return self.__dict__[name]

    def collectives(self) -> list[Collective]:
        """Every predicted collective, in program order (loop bodies repeated)."""
        return [c for r in self.records for c in r.collectives()]

    def region_strategies(self) -> dict[str, dict[str, int]]:
        """Composite ops traced as regions (:mod:`spmdkit.engine.region`): op (``:grad`` for
        the grad region) → chosen strategy → how many equations took it."""
        out: dict[str, dict[str, int]] = {}
        todo = list(self.records)
        while todo:
            r = todo.pop(0)
            todo.extend(r.body)
            if r.primitive in REGIONS:
                key = r.op + (":grad" if r.primitive == GRAD else "")
                per = out.setdefault(key, {})
                per[r.strategy] = per.get(r.strategy, 0) + 1
        return out

    def table(self, limit: int | None = None) -> str:
        """A text table of the equations that communicate, costliest first."""
        rows = sorted(
            (r for r in self.records if r.comm_bytes),
            key=lambda r: (-r.comm_bytes, r.index),
        )
        if limit is not None:
            rows = rows[:limit]
        lines = [
            f"{'#':>5}  {'primitive':<18} {'pass':<4} {'bytes':>10}  reshards",
        ]
        for r in rows:
            moves = "; ".join(str(a.plan) for a in r.reshards if a.plan.collectives)
            if r.body:
                per: dict[str, int] = {}
                for c in (c for b in r.body for c in b.collectives()):
                    per[c.kind] = per.get(c.kind, 0) + c.payload_bytes
                inner = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in sorted(per.items()))
                moves = (moves + "; " if moves else "") + f"body per iteration: {inner}"
            rep = f" ×{r.repeat}" if r.repeat > 1 else ""
            lines.append(
                f"{r.index:>5}  {r.primitive:<18} {'bwd' if r.backward else 'fwd':<4} "
                f"{fmt_bytes(r.comm_bytes):>10}  {moves}{rep}"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        kinds = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in self.comm_bytes_by_kind.items())
        head = [
            f"propagation on mesh {dict(axis_sizes(self.mesh))}: {len(self.records)} equations",
            f"  communication: {fmt_bytes(self.comm_bytes)} per device ({kinds or 'none'}), "
            f"{self.comm_time_s * 1e3:.3f} ms",
            f"  compute: {self.flops:.3g} flops per device, {self.compute_time_s * 1e3:.3f} ms",
            f"  step time (model): {self.step_time_s * 1e3:.3f} ms",
            f"  memory: {self.memory}",
        ]
        regions = self.region_strategies()
        if regions:
            head.append(
                "  ops (strategy): "
                + ", ".join(
                    f"{op} {name}" + (f"×{n}" if n > 1 else "")
                    for op, per in regions.items()
                    for name, n in per.items()
                )
            )
        if self.unknown:
            head.append(
                "  no rule (replicated): "
                + ", ".join(f"{k}×{n}" for k, n in sorted(self.unknown.items()))
            )
        table = self.table(limit=20)
        return "\n".join(head) + ("\n" + table if table.count("\n") else "")


# -- steps → records ---------------------------------------------------------------

_MANUAL = MANUAL_COLLECTIVES


def _source(eqn: Any) -> str:
    try:
        from jax._src import source_info_util  # no public equivalent

        return source_info_util.summarize(eqn.source_info)
    except Exception:
        return ""


class LoopCopies(NamedTuple):
    """The resharded copies one scan's body makes, on the body's own timeline: the
    memory estimate holds them inside the body's liveness (from the op that
    makes one to its last reader; a copy of a batch-free value is held at the
    scan's node, ``spmdkit.propagation.driver``), where held at the scan's node
    they would all count at once.

    Attributes:
      held: (value number, layout) → ``[first, last, bytes]`` over the body's node
        indices (as :attr:`Recorder.held` over the top level's).
      nested: body node index → the :class:`LoopCopies` of the scan there.
    """

    held: dict
    nested: dict


def _hoisted_keys(
    step: Step, before: Sequence[EqnRecord], after: Sequence[EqnRecord], numbers: Any
) -> list[tuple]:
    """The ``held`` keys (value number, layout) of the body reshards :func:`_hoist`
    moved out of the loop (in ``before``'s records, not in ``after``'s)."""
    keys = []
    for b, a, x in zip(before, after, step.loop.steps, strict=False):
        for r in b.reshards:
            if r in a.reshards or not r.arg.startswith("input "):
                continue
            i = int(r.arg.split()[1])
            keys.append((numbers.of(x.node.ins[i]), x.required[i]))
    return keys


class Recorder:
    """Prices the propagator's steps into :class:`EqnRecord` s, in program order.

    A value resharded once is not resharded again for a later reader wanting the
    same layout (``avail``: value id → layouts it has); ``held`` collects the
    resharded copies' lifetimes for the memory estimate (see
    :func:`~spmdkit.propagation.pricing.reshard_once`). Values are priced by
    their number (:class:`~spmdkit.propagation.cse.ValueNumbers`): a value XLA's
    CSE merges with an earlier identical one is that value, already moved, and
    its equation's FLOPs are not counted again. Likewise, where XLA merges
    collectives through an optimization barrier (XLA:CPU up to jaxlib 0.10:
    :func:`~spmdkit.versions.cse_merges_through_barriers`), a grad region does not
    count again a collective its recomputed forward runs on an operand (through
    the barrier the replay puts there) exactly as the forward region of the same
    op did on the same value: XLA computes the identical collective once
    (``shared``). Elsewhere the barrier keeps them apart and both are counted.
    """

    def __init__(
        self, pricer: Pricer, ops: frozenset[str], values: dict[int, Any] | None = None
    ) -> None:
        self.pricer = pricer
        self.mesh = pricer.mesh
        self.ops = ops
        self.avail: dict[int, list[TensorSpec]] = {}
        self.held: dict = {}
        # the copies scans' bodies make, on their bodies' timelines (LoopCopies), by
        # top-level node; the keys of ``held`` they count; the scans being recorded
        self.loops: dict[int, LoopCopies] = {}
        self.in_loops: set = set()
        self._frames: list[LoopCopies | None] = []
        # (top-level index, value id, bytes before gathers, bytes before scatters,
        # dtype, bytes after gathers): the operands XLA:CPU lays out anew for a gather
        # or a scatter over a minor dim (:func:`relayout_bytes`), and the gathered
        # results a contraction copies back to row-major (:func:`gathered_copy_bytes`)
        self.relayouts: list[tuple[int, int, int, int, Any, int]] = []
        self.numbers = ValueNumbers(values)
        # a once-run scan's stacked result (its number) → the body's value stacked
        # (its number) and the stacked layout: a later once-run scan slicing it in
        # that layout reads that value (XLA folds the slice of the stack)
        self.stacked: dict[int, tuple[int, TensorSpec]] = {}
        self.shared: collections.Counter = collections.Counter()
        self.merges = cse_merges_through_barriers(target_backend(self.mesh, pricer.topology))
        # partially manual shard_maps' operand layouts on their automatic axes, by
        # manual axes (:meth:`_operand_layouts`)
        self.manual_layouts: dict[frozenset, dict[tuple, int]] = {}

    def record(self, step: Step, index: int, at: int | None = None, scope: Any = None) -> EqnRecord:
        """The record of one step (``at``: the top-level index it runs at;
        ``scope``: where XLA may merge it with an identical equation, see
        :mod:`spmdkit.propagation.cse`)."""
        node, op, attrs, req, outs = step.node, step.op, step.attrs, step.required, step.outputs
        in_body = at is not None
        at = index if at is None else at
        ins = [self.numbers.of(v) for v in node.ins]
        unread = (
            region_unread_inputs(node.prim, node.eqn.params, attrs, req, outs, self.mesh)
            if node.prim in REGIONS
            else frozenset()
        )
        reshards = tuple(
            a
            for i, (v, s, r) in enumerate(zip(ins, step.given, req, strict=True))
            if i not in unread
            and (a := reshard_once(self.pricer, self.avail, v, f"input {i}", s, r, self.held, at))
            is not None
        )
        if self._frames and self._frames[-1] is not None:
            self._claim(self._frames[-1], index, at, ins, step)
        for a in reshards:
            k = int(a.arg.split()[1])
            gathers = relayout_bytes(a, self.mesh, ("all_gather",))
            scatters = relayout_bytes(a, self.mesh, ("reduce_scatter",))
            # counted in loop bodies only, where the body's reshards are held at the
            # loop's node; at the top level the estimate's live set at the copy
            # already covers it (counted there, the FSDP dropout MLP's peak is
            # predicted 1.2 MiB, compiled 905.8 KiB)
            copied = (
                gathered_copy_bytes(a, self.mesh) if in_body and node.prim in CONTRACTIONS else 0
            )
            if gathers or scatters or copied:
                self.relayouts.append((at, node.ins[k], gathers, scatters, a.src.dtype, copied))
        merged = self.numbers.merge(node, req, outs, self.numbers.scope(node, scope))
        if node.kind == "shard_map":
            layouts = self._operand_layouts(jaxprs.manual_axes(node.eqn), req)
            body = jaxprs.open_jaxpr(jaxprs.shard_map_body(node.eqn))[0]
            reshards += tuple(self._manual_collectives(body, layouts))
        if node.prim in REGIONS:
            reshards += tuple(self._region_collectives(node, attrs, req, outs))
        else:
            reshards += tuple(self._own_collectives(op, attrs, req))
        comm = sum(a.payload_bytes for a in reshards)
        ctime = sum(a.plan.time_s for a in reshards)
        flops = 0.0 if merged else node_flops(node, req, outs, self.mesh)
        body: tuple[EqnRecord, ...] = ()
        repeat = 1
        if step.loop is not None:
            repeat = step.loop.trips
            body, hoisted = self._body(step, index, at, scope)
            reshards += hoisted
            comm += sum(a.payload_bytes for a in hoisted)
            ctime += sum(a.plan.time_s for a in hoisted)
            if step.loop.back:
                body += (_carry_record(len(body), step.loop.back, node.backward),)
            comm += repeat * sum(r.comm_bytes for r in body)
            ctime += repeat * sum(r.comm_time_s for r in body)
            flops += repeat * sum(r.flops for r in body)
        return EqnRecord(
            index=index,
            primitive=node.prim,
            op=op,
            attrs=dict(attrs),
            inputs=tuple(req),
            outputs=tuple(outs),
            reshards=reshards,
            comm_bytes=int(comm),
            comm_time_s=ctime,
            flops=flops,
            strategy=str(attrs.get("strategy", "default")),
            source=_source(node.eqn),
            backward=node.backward,
            repeat=repeat,
            body=body,
        )

    def _body(
        self, step: Step, index: int, at: int, scope: Any
    ) -> tuple[tuple[EqnRecord, ...], tuple[ArgReshard, ...]]:
        """The records of a loop node's body and the reshards hoisted out of it
        (:func:`_hoist`); a scan's body's copies noted on its own timeline
        (:class:`LoopCopies`: in :attr:`loops`, or in the enclosing scan's)."""
        node = step.node
        scan = node.kind == "scan" and len(node.subs) == 1
        self._frames.append(LoopCopies({}, {}) if scan else None)
        inner = self._enter(step, scope)
        body = tuple(self.record(x, j, at, inner) for j, x in enumerate(step.loop.steps))
        if inner is scope:
            self._leave(step, scope)
        copies = self._frames.pop()
        hoisted: tuple[ArgReshard, ...] = ()
        if step.loop.trips > 1 and node.kind == "scan":
            before = body
            hoisted, body = _hoist(step, body)
            if copies is not None:  # made once, before the loop: held through it
                for key in _hoisted_keys(step, before, body, self.numbers):
                    if copies.held.pop(key, None) is not None:
                        self.in_loops.discard(key)
        if copies is not None:
            if not self._frames:
                self.loops[index] = copies
            elif self._frames[-1] is not None:
                self._frames[-1].nested[index] = copies
            else:  # inside a loop whose copies are held at its node
                self._unclaim(copies)
        return body, hoisted

    def _claim(self, frame: LoopCopies, j: int, at: int, ins: list[int], step: Step) -> None:
        """Note in ``frame`` (the scan body being recorded) the resharded copies
        node ``j`` of the body reads that the body made (``held`` has them at the
        top-level node ``at``): from the node that makes one to its last reader."""
        for v, s, r in zip(ins, step.given, step.required, strict=True):
            key = (v, r)
            h = self.held.get(key)
            if h is None or (s.dims, s.partial) == (r.dims, r.partial):
                continue
            if key in frame.held:
                frame.held[key][1] = j
            elif key not in self.in_loops and h[0] == at:
                frame.held[key] = [j, j, h[2]]
                self.in_loops.add(key)

    def _unclaim(self, copies: LoopCopies) -> None:
        """Give ``copies`` (and its nested scans') back to the flat ``held``."""
        self.in_loops.difference_update(copies.held)
        for inner in copies.nested.values():
            self._unclaim(inner)

    def _enter(self, step: Step, scope: Any) -> Any:
        """The scope a loop's body is numbered in: the caller's for a scan that
        runs once (XLA inlines it; its operands are the caller's values, the
        ``xs`` sliced at 0: where the ``xs`` is another once-run scan's ``ys``
        stacked in the layout it is read in, the value that scan's body stacked,
        as XLA's simplifier folds the slice of the stack), else the loop's own."""
        node = step.node
        if node.kind != "scan" or jaxprs.scan_length(node.eqn) != 1:
            return ("loop", id(node))
        first_xs = jaxprs.scan(node.eqn).first_xs
        body = node.subs[0]
        for i, (b, v) in enumerate(zip(body.invars, node.ins, strict=True)):
            stacked = self.stacked.get(self.numbers.of(v))
            if i < first_xs:
                self.numbers.alias(b, v)
            elif stacked is not None and stacked[1] == step.required[i]:
                self.numbers.alias(b, stacked[0])  # the slice of a once-run scan's stack
            else:
                self.numbers.derived(b, ("x0", scope, self.numbers.of(v), step.required[i]))
        return scope

    def _leave(self, step: Step, scope: Any) -> None:
        """A once-run scan's results are its body's (``ys`` stacked)."""
        node = step.node
        nk = jaxprs.scan(node.eqn).num_carry
        body = node.subs[0]
        for k, (b, o) in enumerate(zip(body.outvars, node.outs, strict=True)):
            if k < nk:
                self.numbers.alias(o, b)
            else:
                self.numbers.derived(o, ("ys", scope, self.numbers.of(b), step.outputs[k]))
                self.stacked.setdefault(self.numbers.of(o), (self.numbers.of(b), step.outputs[k]))

    def output(self, index: int, i: int, vid: int, have: TensorSpec, want: TensorSpec):
        """The record of moving the step's output ``i`` (value ``vid``) from
        ``have`` to ``want``; None when it needs no move."""
        vid = self.numbers.of(vid)
        a = reshard_once(self.pricer, self.avail, vid, f"output {i}", have, want)
        if a is None:
            return None
        return EqnRecord(
            index=index,
            primitive="output",
            op=None,
            attrs={"output": i},
            inputs=(have,),
            outputs=(want,),
            reshards=(a,),
            comm_bytes=a.payload_bytes,
            comm_time_s=a.plan.time_s,
            flops=0.0,
            strategy="default",
            source="",
            backward=False,
        )

    def _operand_layouts(self, manual: frozenset, req: Sequence[TensorSpec]) -> dict[tuple, int]:
        """A partially manual ``shard_map``'s operands, by their shape inside the
        body (leading 1s dropped): how many devices of the axes left automatic
        split each (its layout there is the outer one, see the propagator); then
        those of the earlier ``shard_map``s manual over the same axes (a
        forward's, for its transpose, whose operands are residuals)."""
        sizes = axis_sizes(self.mesh)
        if not manual or manual >= set(sizes):
            return {}
        out: dict[tuple, int] = {}
        for spec in req:
            local = tuple(
                n // math.prod(sizes[a] for a in entry if a in manual)
                for n, entry in zip(spec.shape, spec.dims, strict=True)
            )
            split = math.prod(sizes[a] for entry in spec.dims for a in entry if a not in manual)
            if split > 1:  # a replicated one of the same shape does not hide it
                out.setdefault(_squeezed(local), split)
        earlier = self.manual_layouts.setdefault(manual, {})
        for shape, split in earlier.items():
            out.setdefault(shape, split)
        earlier.update(out)
        return out

    def _manual_collectives(self, jaxpr: Any, layouts: dict[tuple, int]) -> list[ArgReshard]:
        """The collectives a shard_map body calls (psum, all_gather, psum_scatter,
        all_to_all, pmax, pmin), with per-device payload bytes from the body's local
        shapes; wrapped as one-step reshards so records treat them like any other.
        Under a partially manual ``shard_map`` a value shaped like an operand is
        taken to be split like it over the automatic axes (``layouts``: a tensor-
        parallel stage's gradient sums, as XLA lays them out)."""
        out: list[ArgReshard] = []
        sizes = axis_sizes(self.mesh)
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            body = jaxprs.call_body(eqn)
            if body is not None:
                out += self._manual_collectives(jaxprs.open_jaxpr(body)[0], layouts)
                continue
            if name not in _MANUAL:
                continue
            axes = eqn.params.get("axes", eqn.params.get("axis_name"))
            axes = (
                (axes,) if isinstance(axes, str) else tuple(a for a in axes if isinstance(a, str))
            )
            if not axes or any(a not in sizes for a in axes):
                continue
            n = math.prod(sizes[a] for a in axes)
            kind, side, op = _MANUAL[name]
            for v in eqn.invars if side == "in" else eqn.outvars:
                local = TensorSpec(v.aval.shape, dtype=np.dtype(v.aval.dtype))
                split = layouts.get(_squeezed(tuple(v.aval.shape)), 1)
                c = self._collective(kind, axes, n, op, local.local_bytes(self.mesh) // split)
                plan = ReshardPlan(local, local, (c,))
                out.append(ArgReshard(f"{name} in shard_map", local, local, plan))
        return out

    def _collective(
        self, kind: str, axes: tuple[str, ...], n: int, op: str | None, payload: int
    ) -> Collective:
        wire = payload * (n - 1) // n * (2 if kind == "all_reduce" else 1)
        t = self.pricer.topology.collective_time(kind, wire, n, axes, self.mesh)
        return Collective(
            kind, axes, n, reduce_op=op, payload_bytes=payload, wire_bytes=wire, time_s=t
        )

    def _region_collectives(
        self,
        node: Any,
        attrs: dict,
        req: Sequence[TensorSpec],
        produced: Sequence[TensorSpec] | None = None,
    ) -> list[ArgReshard]:
        """A region's own collectives under its chosen strategy (see
        :mod:`spmdkit.propagation.regions`)."""
        p = node.eqn.params
        try:
            ans = region_layouts(node.prim, p, attrs, req, self.mesh, produced=produced)
        except RULE_ERRORS:
            return []
        own = [on_link(c, self.mesh, self.pricer.topology) for c in ans.collectives]
        on_in = region_input_collectives(node.prim, p, attrs, req, ans.outputs, self.mesh)
        for i, kind, axes, nbytes in on_in:
            key = (p["op"], p["attrs"], self.numbers.of(node.ins[i]), req[i], kind, axes, nbytes)
            if node.prim != GRAD:
                self.shared[key] += 1
                continue
            same = next(
                (c for c in own if (c.kind, c.axes, c.payload_bytes) == (kind, axes, nbytes)),
                None,
            )
            if self.merges and self.shared[key] and same is not None:
                own.remove(same)
        spec = ans.outputs[0] if ans.outputs else req[0]
        return [_wrap_own(f"{p['op']} (region)", spec, c) for c in own]

    def _own_collectives(
        self, op: str | None, attrs: dict, req: Sequence[TensorSpec]
    ) -> list[ArgReshard]:
        """The op's own collectives (a rule strategy's statistic all-reduce…), wrapped
        as one-step reshards like the shard_map ones."""
        if op is None or op not in self.ops or not req:
            return []
        try:
            res = infer_forward(op, *req, mesh=self.mesh, **attrs)
        except RULE_ERRORS:
            return []
        out = []
        for c in res.collectives:
            spec = res.outputs[0] if res.outputs else req[0]
            out.append(ArgReshard(f"{op} (own)", spec, spec, ReshardPlan(spec, spec, (c,))))
        return out


def _hoist(
    step: Step, body: tuple[EqnRecord, ...]
) -> tuple[tuple[ArgReshard, ...], tuple[EqnRecord, ...]]:
    """A scan body's operand reshards XLA runs once, before the loop, and the
    body's records without them.

    XLA's loop-invariant code motion hoists a collective whose operand does not
    change from one iteration to the next out of the while loop (a weight the
    body casts and moves in a micro-batch loop is moved once per step, not once
    per micro-batch). An operand is invariant when it is a loop constant (one of
    the scan's ``consts``) or made in the body from invariant values alone; its
    reshard is named after the constant it is made from (``input k`` of the scan,
    so a weight's move stays that weight's)."""
    node = step.node
    nc = jaxprs.scan(node.eqn).num_consts
    sub = node.subs[0]
    made = {o for x in step.loop.steps for o in x.node.outs} | set(sub.invars)
    root: dict[int, int | None] = {b: k for k, b in enumerate(sub.invars[:nc])}
    hoisted: list[ArgReshard] = []
    out: list[EqnRecord] = []
    for rec, x in zip(body, step.loop.steps, strict=False):
        n = x.node
        fixed = [v for v in n.ins if v in made]  # the others are literals
        if n.kind == "eqn" and not n.eqn.effects and all(v in root for v in fixed):
            first = next((root[v] for v in fixed if root[v] is not None), None)
            root.update(dict.fromkeys(n.outs, first))
        keep, gone = [], []
        for a in rec.reshards:
            i = int(a.arg.split()[1]) if a.arg.startswith("input ") else -1
            k = root.get(n.ins[i]) if 0 <= i < len(n.ins) else None
            if k is None or not a.plan.collectives:
                keep.append(a)
            else:
                gone.append(a)
                hoisted.append(dataclasses.replace(a, arg=f"input {k}"))
        if not gone:
            out.append(rec)
            continue
        out.append(
            dataclasses.replace(
                rec,
                reshards=tuple(keep),
                comm_bytes=rec.comm_bytes - sum(a.payload_bytes for a in gone),
                comm_time_s=rec.comm_time_s - sum(a.plan.time_s for a in gone),
            )
        )
    out.extend(body[len(out) :])  # the carries' record
    return tuple(hoisted), tuple(out)


def _wrap_own(name: str, spec: TensorSpec, c: Collective) -> ArgReshard:
    return ArgReshard(name, spec, spec, ReshardPlan(spec, spec, (c,)))


def _carry_record(index: int, back: Sequence[ArgReshard], backward: bool) -> EqnRecord:
    """The record of a loop body's results moving back to the carry layouts (and a
    scan's sum-partial ``ys`` reduced to the layouts they leave the loop in)."""
    return EqnRecord(
        index,
        "carry",
        None,
        {},
        (),
        (),
        tuple(back),
        sum(a.payload_bytes for a in back),
        sum(a.plan.time_s for a in back),
        0.0,
        "default",
        "",
        backward,
    )


def _squeezed(shape: tuple) -> tuple:
    """``shape`` without its leading 1s."""
    i = 0
    while i < len(shape) and shape[i] == 1:
        i += 1
    return shape[i:]


def gathered_copy_bytes(reshard: ArgReshard, mesh: MeshLike) -> int:
    """Bytes of the row-major copy a contraction makes of an operand all-gathered
    over a minor dim.

    The all-gather's result is laid out with the gathered dim most major
    (:func:`relayout_bytes`); a dot or a convolution on XLA:CPU reads its operands
    row-major, so where a dim before the gathered one holds more than one element
    XLA copies the whole gathered block back (a ``copy`` fusion between the
    collective and the contraction, both live while it runs). Measured on the
    Llama ``tiny_scan`` FSDP step (XLA:CPU, 2x4): each MLP kernel gathered over
    ``embed`` in the backward loop, ``f32[192,64]{0,1}``, is copied to
    ``{1,0}`` before its dot, two 48 KiB buffers at once.

    Args:
      reshard: one operand's reshard, read by a contraction.
      mesh: the mesh its specs are laid out on.

    Returns:
      The bytes of the copy at the reshard's dtype (0: none).
    """
    dst = reshard.dst.local_shape(mesh)
    gathers = [c for c in reshard.plan.collectives if c.kind == "all_gather" and c.dim is not None]
    if not gathers or not any(dst[k] > 1 for k in range(gathers[-1].dim)):
        return 0
    return gathers[-1].payload_bytes


def relayout_bytes(
    reshard: ArgReshard, mesh: MeshLike, kinds: Sequence[str] = ("all_gather", "reduce_scatter")
) -> int:
    """Bytes of the copies XLA:CPU makes of a reshard's operands to lay them out
    for its gathers and scatters.

    XLA:CPU's layout assignment gives an all-gather or a reduce-scatter over dim
    ``d`` (operand and result) a layout with ``d`` most major, so that each
    device's block is contiguous. When a dim before ``d`` holds more than one
    element, that is not the row-major layout the operand was made in, and XLA
    copies the operand into it (a ``copy`` fusion read by the collective alone,
    freed after it): the whole block before a reduce-scatter, the local block
    before an all-gather. The consumers read the result in the collective's
    layout (an elementwise fusion) or copy it where they read it. Measured on
    the zoo's NNX CNN under megatron (XLA:CPU, 2x4): the input gradient of the
    strided convolution, f32[4,16,16,16] partial over ``model``, is copied to
    layout ``{2,1,0,3}`` for its reduce-scatter over the channels, both live at
    the compiled peak.

    Args:
      reshard: one operand's reshard.
      mesh: the mesh its specs are laid out on.
      kinds: the collective kinds to count.

    Returns:
      The bytes of those copies at the reshard's dtype (0: none).
    """
    src, dst = reshard.src.local_shape(mesh), reshard.dst.local_shape(mesh)
    total = 0
    for c in reshard.plan.collectives:
        if c.kind not in kinds or c.kind not in ("all_gather", "reduce_scatter") or c.dim is None:
            continue
        if any(min(src[k], dst[k]) > 1 for k in range(c.dim)):
            total += (
                c.payload_bytes if c.kind == "reduce_scatter" else c.payload_bytes // c.group_size
            )
    return total
