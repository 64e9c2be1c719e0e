"""``propagate()``: run the rule registry over a traced step and assemble a
:class:`~spmdkit.propagation.records.Propagation`.

It traces (or takes) the step's jaxpr, flattens it, checks the input and output
specs, runs the propagator's sweeps, prices the chosen layouts into records, and
adds the memory estimate and the program the enforced replay runs.

**Both directions.** A backward sweep (the rules' backward inference) carries
wanted layouts upstream as hints: the ``out_specs`` constraints, and the layouts
consumers slice free-made values to (a broadcast constant, a mask). The forward
sweep takes a hint where it costs no more than following the operands; the
sweeps repeat (four rounds at most) and the round with the lowest modelled
step time is kept: its reshards, its FLOPs at the bf16 peak, and the bytes its
equations write through device memory (:meth:`~spmdkit.topology.Topology.memory_time`
of :func:`~spmdkit.propagation.pricing.steps_bytes`; a value computed replicated
that could be a free slice of its readers' split is written whole on every
device). Outputs without a constraint keep what the forward sweep gives them,
with pending reductions resolved (a jitted function returns reduced values). A
value resharded once is not resharded again for another consumer wanting the
same layout.

**Costs.** ``comm_bytes`` are per-device payload bytes as XLA's HLO shows them
(:mod:`spmdkit.resharding` conventions). ``flops`` are per device: the local
blocks' multiply-adds for ``dot_general``, ``conv_general_dilated`` and
``ragged_dot_general`` (:func:`spmdkit.util.contraction_flops`), one per output element elsewhere;
compute time is the ideal one, at the bf16 peak (``topology.peak("bfloat16")``, else
:data:`spmdkit.util.H100_BF16_PEAK_FLOPS`.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from spmdkit.engine.region import GRAD, REGIONS
from spmdkit.engine.registry import get_rule
from spmdkit.errors import ShardingConflictError, SpecError
from spmdkit.propagation.buffers import ELEMENTWISE as _ELEMENTWISE
from spmdkit.propagation.choose import consumer_hints
from spmdkit.propagation.contest import sequence_axes
from spmdkit.propagation.graph import (
    FlatProgram,
    Graph,
    dce,
    producers,
    stationary,
    trace_with_tree,
    uses,
    widened,
)
from spmdkit.propagation.memory import BodyCopies, CopyRead, RegionHold, liveness
from spmdkit.propagation.pinning import Program, pins
from spmdkit.propagation.pricing import steps_bytes, steps_flops
from spmdkit.propagation.propagator import GraphFacts, Propagator
from spmdkit.propagation.records import (
    LATER,
    REPORTED,
    EqnRecord,
    LoopCopies,
    Propagation,
    Recorder,
)
from spmdkit.propagation.regions import (
    region_loop_buffer_bytes,
    region_residual_bytes,
    region_temp_parts,
)
from spmdkit.propagation.steps import Step
from spmdkit.spec import MeshLike, TensorSpec
from spmdkit.topology import DEFAULT_TOPOLOGY, Topology
from spmdkit.util import CONTRACTIONS, H100_BF16_PEAK_FLOPS

__all__ = ["propagate"]


def propagate(
    fn_or_closed_jaxpr: Any,
    *args: Any,
    in_specs: Any,
    mesh: MeshLike,
    out_specs: Any = None,
    strategies: Mapping[str, str] | None = None,
    topology: Topology = DEFAULT_TOPOLOGY,
    donate_argnums: Sequence[int] | int = (),
    arg_roles: Any = None,
    out_tree: Any = None,
    **kwargs: Any,
) -> Propagation:
    """Propagate specs through ``fn(*args, **kwargs)`` and price every reshard.

    Args:
      fn_or_closed_jaxpr: a function (traced with :func:`trace`) or a closed jaxpr.
      *args: the arguments (arrays or ``jax.ShapeDtypeStruct`` pytrees). With a
        closed jaxpr, its input avals (flat) unless given.
      in_specs: a pytree prefix of ``args`` with ``TensorSpec``, ``PartitionSpec``
        or None (replicated) leaves.
      mesh: a ``Mesh`` or ``AbstractMesh`` (no devices are needed).
      out_specs: optional constraints on the outputs (a pytree prefix of the
        outputs; None leaves are unconstrained).
      strategies: op name → strategy name, for rules with alternatives.
      topology: link model for reshard costs; its bf16 ``peak`` if it has one.
      donate_argnums: donated positional arguments (memory only).
      arg_roles: a pytree prefix of ``args`` with role strings (``"params"``,
        ``"opt_state"``, ``"batch"``…) for the memory breakdown.
      out_tree: with a closed jaxpr, the output treedef (:func:`trace_with_tree`)
        so ``out_specs`` can be a pytree; without it they are a flat list.
      **kwargs: static keyword arguments of ``fn``.

    Returns:
      A :class:`Propagation`.

    Example::

        >>> mesh = sk.abstract_mesh(data=8)
        >>> prop = propagate(train_step, params, batch, mesh=mesh,
        ...                  in_specs=(None, P("data")))
        >>> prop.comm_bytes_by_kind
        {'all_reduce': 8392704}
    """
    if hasattr(fn_or_closed_jaxpr, "jaxpr") and hasattr(fn_or_closed_jaxpr, "consts"):
        closed, out_treedef = fn_or_closed_jaxpr, out_tree
        if not args:
            args = tuple(
                jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in closed.jaxpr.invars
            )
    else:
        closed, out_treedef = trace_with_tree(fn_or_closed_jaxpr, *args, **kwargs)
    flat_in = _flat_in_specs(in_specs, args, mesh, "in_specs")
    prog = FlatProgram()
    graph, env = prog.graph(closed)
    dce(graph)
    _check_inputs(flat_in, graph, prog)
    out_req = _flat_out_specs(out_specs, out_treedef, graph, prog, mesh)
    _check_strategies(strategies or {})
    roles = _roles(arg_roles, args, graph.invars)
    facts = _facts(graph, prog, roles, flat_in)
    propagator = Propagator(prog, mesh, topology, strategies or {}, facts)
    peak = topology.peak("bfloat16") if hasattr(topology, "peak") else H100_BF16_PEAK_FLOPS
    spec, collect, unknown = _sweeps(propagator, graph, flat_in, out_req, peak)

    final_out = _final_out(propagator, graph, spec, out_req)
    node_pins, out_moves = pins(collect, propagator.pricer, graph, final_out)
    program = Program(graph, prog.values, node_pins, out_treedef, out_moves)
    donated = _donated_ids(donate_argnums, args, graph.invars)
    # the records, their totals and the memory estimate wait for their first read
    # (Propagation.report): running the step (sk.jit) needs only the program
    report, memory_as = _deferred_report(
        propagator, graph, prog, spec, collect, final_out, peak, mesh, donated, roles
    )

    return Propagation(
        mesh=mesh,
        closed_jaxpr=closed,
        in_specs=list(flat_in),
        out_specs=final_out,
        unknown=unknown,
        var_specs={v: spec[vid] for v, vid in env.items() if vid in spec},
        steps=collect,
        program=program,
        memory_as=memory_as,
        report=report,
        **dict.fromkeys(REPORTED, LATER),
    )


def _deferred_report(
    propagator: Propagator,
    graph: Graph,
    prog: FlatProgram,
    spec: Mapping[int, TensorSpec],
    collect: Any,
    final_out: list[TensorSpec],
    peak: float,
    mesh: MeshLike,
    donated: Any,
    roles: Any,
) -> tuple[Callable[[], dict[str, Any]], Callable[..., tuple[Any, Any]]]:
    """``(report, memory_as)`` for a :class:`Propagation`: ``report()`` prices the
    records, sums them and builds the memory estimate on its first call (the same
    values whichever field is read first); ``memory_as(widen, cpu)`` the memory
    estimates in another form."""
    reported: dict[str, Any] = {}

    def report() -> dict[str, Any]:
        if not reported:
            recorder = Recorder(propagator.pricer, propagator.ops, prog.values)
            records = _records(recorder, propagator, graph, spec, collect, final_out)
            totals = _totals(records, peak)
            memory = _memory_fn(
                graph, spec, final_out, mesh, prog, collect, recorder, donated, roles
            )
            reported["memory"] = memory
            reported["fields"] = {
                "records": records,
                "comm_bytes_by_kind": totals.by_kind,
                "comm_bytes": totals.comm_bytes,
                "comm_time_s": totals.comm_time_s,
                "flops": totals.flops,
                "compute_time_s": totals.compute_time_s,
                "step_time_s": totals.compute_time_s + totals.comm_time_s,
                "memory": memory(True),
                "memory_materialized": memory(False),
            }
        return reported["fields"]

    def memory_as(widen: Mapping | None = None, cpu: bool = False) -> tuple[Any, Any]:
        report()
        memory = reported["memory"]
        return memory(True, widen, cpu), memory(False, widen, cpu)

    return report, memory_as


def _final_out(
    propagator: Propagator,
    graph: Graph,
    spec: Mapping[int, TensorSpec],
    out_req: list[TensorSpec | None],
) -> list[TensorSpec]:
    """The layouts the outputs leave in: asked for, else as propagated with
    pending reductions resolved (a jitted function returns reduced values)."""
    out = []
    for v, r in zip(graph.outvars, out_req, strict=True):
        have = spec.get(v) or propagator.replicated(v)
        out.append(r if r is not None else have.without_partial())
    return out


def _records(
    recorder: Recorder,
    propagator: Propagator,
    graph: Graph,
    spec: Mapping[int, TensorSpec],
    collect: list[Step],
    final_out: list[TensorSpec],
) -> list[EqnRecord]:
    """The records of the chosen steps, then of the reshards at the outputs (to
    ``final_out``, :func:`_final_out`)."""
    records = [recorder.record(step, i) for i, step in enumerate(collect)]
    for i, (v, want) in enumerate(zip(graph.outvars, final_out, strict=True)):
        have = spec.get(v) or propagator.replicated(v)
        rec = recorder.output(len(records), i, v, have, want)
        if rec is not None:
            records.append(rec)
    return records


def _facts(
    graph: Graph, prog: FlatProgram, roles: Mapping[int, str], flat_in: Sequence[TensorSpec]
) -> GraphFacts:
    """What the propagator and its collaborators read off the graph (:class:`GraphFacts`)."""
    batch = {v for v, r in roles.items() if r == "batch"}
    still = frozenset(stationary(graph, batch))
    at = dict(zip(graph.invars, flat_in, strict=True))
    seq_axes = sequence_axes([at[v] for v in batch if v in at])
    weights: frozenset[int] = frozenset()
    if seq_axes:  # values of the parameters alone: the weights
        params = {v for v, r in roles.items() if r == "params"}
        weights = frozenset(stationary(graph, params)) - still
    return GraphFacts(uses(graph), producers(graph), widened(graph, prog), still, seq_axes, weights)


def _sweeps(
    propagator: Propagator,
    graph: Graph,
    flat_in: list[TensorSpec],
    out_req: list[TensorSpec | None],
    peak: float,
) -> tuple[dict[int, TensorSpec], list[Step], collections.Counter]:
    """Forward sweeps, each after a backward sweep from the last one's hints (four
    rounds at most); the specs, steps and equations without a rule (``unknown``)
    of the round with the lowest modelled step time (hints are heuristics): its
    reshards, FLOPs and the bytes its equations write (module docstring). The
    consumers' hints (:func:`~spmdkit.propagation.choose.consumer_hints`) of every
    round so far are kept, the latest winning: a round that no longer moves a free
    value would otherwise drop its hint, and the next round take back the backward
    hint that made it move."""
    wanted = {v: r for v, r in zip(graph.outvars, out_req, strict=True) if r is not None}
    fixed = set(graph.invars)
    pricer = propagator.pricer
    memory_time = getattr(pricer.topology, "memory_time", None)
    best: tuple | None = None
    seen: dict[int, TensorSpec] = {}
    for _ in range(4):
        spec: dict[int, TensorSpec] = {}
        collect: list[Step] = []
        propagator.sweep(graph, flat_in, spec, collect)
        t = pricer.steps_time(collect) + steps_flops(collect, propagator.mesh) / peak
        if memory_time is not None:
            t += memory_time(steps_bytes(collect, propagator.mesh))
        for v, r in zip(graph.outvars, out_req, strict=True):
            have = spec.get(v) or propagator.replicated(v)
            t += pricer.time("output", have, r if r is not None else have.without_partial())
        if best is None or t < best[0]:
            best = (t, spec, collect, propagator.unknown)
        seen.update(consumer_hints(pricer, collect, fixed | propagator.prog.const_ids()))
        asked = {**seen, **wanted}
        if not asked:
            break
        hints = propagator.chooser.backward_hints(graph, spec, asked, fixed)
        if hints == propagator.chooser.hints:
            break
        propagator.chooser.use_hints(hints)
    _, spec, collect, unknown = best
    return spec, collect, unknown


def _region_temps(
    steps: Sequence[Step], mesh: MeshLike, *, duplicate: bool = False, cpu: bool = False
) -> dict[int, tuple[int, ...]]:
    """``id(node)`` → a region node's own temporaries at its planned layouts, the
    sizes of the buffers live at their peak (see
    :func:`~spmdkit.propagation.regions.region_temp_parts`), loop bodies included.
    ``duplicate`` (the lower estimate): only the regions whose rule says their
    temporaries materialize (:attr:`~spmdkit.engine.rule.Rule.scratch_materializes`),
    at their program's own lower estimate. ``cpu``: with XLA:CPU's workspaces."""
    out: dict[int, int] = {}
    for step in steps:
        node = step.node
        if node.prim in REGIONS and (
            not duplicate or get_rule(node.eqn.params["op"]).scratch_materializes
        ):
            out[id(node)] = region_temp_parts(
                node.prim,
                node.eqn.params,
                step.attrs,
                step.required,
                step.outputs,
                mesh,
                duplicate=duplicate,
                cpu=cpu,
            )
        if step.loop is not None:
            out.update(_region_temps(step.loop.steps, mesh, duplicate=duplicate, cpu=cpu))
    return out


def _memory_fn(
    graph: Graph,
    spec: Mapping[int, TensorSpec],
    final_out: list[TensorSpec],
    mesh: MeshLike,
    prog: FlatProgram,
    collect: list[Step],
    recorder: Recorder,
    donated: set[int],
    roles: Mapping[int, str],
) -> Any:
    """``memory(duplicate, widen=None, cpu=False)``: the liveness estimate of the
    propagated program (see :func:`_memory`); ``cpu`` also makes the copies of
    batch-independent values at the start (:func:`_transient`)."""

    reads = _copy_reads(collect, recorder)
    slices = _early_slices(collect, reads, mesh)

    free = _batch_free(graph, roles)  # the same for every call below

    def memory(duplicate: bool, widen: Mapping | None = None, cpu: bool = False) -> Any:
        early = free if cpu else None
        top = {k: h for k, h in recorder.held.items() if k not in recorder.in_loops}
        transient = _transient(top, len(graph.nodes), mesh, widen, early)
        loops = {}
        for i, c in recorder.loops.items():
            loops[i], at_node = _body_copies(c, graph.nodes[i], free, mesh, widen)
            transient[i] += at_node
        for c in slices.values():
            for i in range(c.made, min(c.last, len(transient) - 1) + 1):
                transient[i] += c.spec.local_bytes(mesh)
        if cpu:
            _relayouts(graph, recorder.relayouts, transient, widen, early)
        return _memory(
            graph,
            spec,
            final_out,
            mesh,
            prog,
            collect,
            duplicate,
            transient,
            donated,
            roles,
            widen,
            cpu,
            reads,
            loops,
        )

    return memory


def _body_copies(
    copies: LoopCopies, node: Any, free: set[int], mesh: MeshLike, widen: Mapping | None
) -> tuple[BodyCopies, int]:
    """A scan body's resharded copies (:class:`~spmdkit.propagation.records.LoopCopies`)
    as bytes live per body node (``widen`` as :func:`_transient`), and the bytes
    held at the scan ``node`` itself. ``free``: the values of the graph the scan
    is in that do not depend on the batch (:func:`_batch_free`). A copy of a
    value the body computes from those alone (a layer's weights, its slice of
    the stack, gathered under FSDP) waits for nothing: XLA's schedulers run such
    collectives early (on CPU at the top of the body), so these copies are held
    at the scan's node, as all of a body's copies were before (of the designs
    tried, the one tiny scanned Llama's FSDP step and tiny GPT's fsdp step with
    full recompute both verify under; figures in commit 39451ef). The others (an
    activation gathered for a matmul, sequence parallelism's) live from the op
    that makes them to their last reader inside the body."""
    sub = node.subs[0]
    inner: set[int] = set()
    if free and len(sub.invars) == len(node.ins):
        inner = {b for b, v in zip(sub.invars, node.ins, strict=True) if v in free}
        for n in sub.nodes:
            if not n.subs and all(v in inner for v in n.ins):
                inner.update(n.outs)
    timeline = {k: h for k, h in copies.held.items() if k[0] not in inner}
    transient = _transient(timeline, len(sub.nodes), mesh, widen)
    nested = {}
    for j, c in copies.nested.items():
        nested[j], at_node = _body_copies(c, sub.nodes[j], inner, mesh, widen)
        transient[j] += at_node
    at_scan = sum(
        _held_bytes(layout, h[2], mesh, widen)
        for (vid, layout), h in copies.held.items()
        if vid in inner
    )
    return BodyCopies(transient, nested), at_scan


def _memory(
    graph: Graph,
    spec: Mapping[int, TensorSpec],
    final_out: list[TensorSpec],
    mesh: MeshLike,
    prog: FlatProgram,
    collect: list[Step],
    duplicate: bool,
    transient: list[int],
    donated: set[int],
    roles: Mapping[int, str],
    widen: Mapping | None = None,
    cpu: bool = False,
    copy_reads: Mapping[int, Mapping[int, CopyRead]] | None = None,
    loops: Mapping[int, BodyCopies] | None = None,
) -> Any:
    """The liveness estimate (``duplicate``, ``widen``, ``cpu``, ``copy_reads``: see
    :func:`liveness`). The regions'
    own temporaries and what a grad region holds from the forward pass count in
    the materialized (upper) estimate only: XLA fuses most of a region's
    elementwise body and merges its recompute with the forward region's where it
    can, so how much stays depends on its schedule (measured on the reference
    models: from none of it, a toy megatron step, to most of it, ConvNet's group
    norms under FSDP). The exception: a rule whose temporaries materialize
    (attention's scores) counts them in the lower estimate too."""
    return liveness(
        graph,
        spec,
        final_out,
        mesh,
        prog,
        donated=donated,
        roles=roles,
        transient=transient,
        duplicate=duplicate,
        widen=widen,
        inner=_region_temps(collect, mesh, duplicate=duplicate, cpu=cpu),
        cpu=cpu,
        copy_reads=copy_reads,
        held=None if duplicate else _region_holds(collect, mesh),
        loops=loops,
    )


def _copy_reads(steps: Sequence[Step], recorder: Recorder) -> dict[int, dict[int, CopyRead]]:
    """Top-level node index → {value id: the resharded copy (``recorder.held``)
    the node reads in its place}, for the operands a node reads only through such
    a copy (an operand it also reads as it is, or resharded without a
    collective, a slice, is read itself; a backward contraction's slice of a
    forward value is added by :func:`_early_slices`)."""
    made = {
        (num, layout.dims, layout.partial): CopyRead(first, last, layout)
        for (num, layout), (first, last, _) in recorder.held.items()
    }
    out: dict[int, dict[int, CopyRead]] = {}
    for i, step in enumerate(steps):
        own: set[int] = set()
        via: dict[int, CopyRead] = {}
        for v, s, r in zip(step.node.ins, step.given, step.required, strict=True):
            key = (recorder.numbers.of(v), r.dims, r.partial)
            if (s.dims, s.partial) == (r.dims, r.partial) or key not in made:
                own.add(v)
            else:
                via[v] = made[key]
        via = {v: c for v, c in via.items() if v not in own}
        if via:
            out[i] = via
    return out


def _early_slices(
    steps: Sequence[Step], reads: dict[int, dict[int, CopyRead]], mesh: MeshLike
) -> dict[tuple, CopyRead]:
    """Slices of forward values that backward contractions read (a head-sharded
    gradient's local heads of attention computed whole in the forward pass): XLA
    cuts each slice as soon as its value exists and keeps the slice, not the
    value, for the backward pass (measured: GPT-2 megatron's queries, keys and
    probabilities, gathered whole for the forward pass, held as their local heads).
    Added to ``reads`` (node index → value → the slice it reads); returns the
    slices by (value, layout)."""
    made: dict[int, int] = {}
    out: dict[tuple, CopyRead] = {}
    for i, step in enumerate(steps):
        node = step.node
        if node.backward and node.prim in _SLICE_READERS:
            for v, s, r in zip(node.ins, step.given, step.required, strict=True):
                if v not in made or v in reads.get(i, {}) or not _finer(s, r, mesh):
                    continue
                key = (v, r.dims)
                out[key] = CopyRead(made[v], i, r.without_partial())
                reads.setdefault(i, {})[v] = out[key]
        if not node.backward:
            made.update(dict.fromkeys(node.outs, i))
    for via in reads.values():  # one slice per value and layout, to its last reader
        for v, c in via.items():
            if c.spec is not None and (v, c.spec.dims) in out:
                via[v] = out[(v, c.spec.dims)]
    return out


#: Backward readers that take a forward value's slice as a buffer of its own
#: (elementwise readers fuse the slice and read the value itself).
_SLICE_READERS = frozenset({"dot_general"})


def _finer(given: TensorSpec | None, want: TensorSpec | None, mesh: MeshLike) -> bool:
    """``want`` is a strictly smaller local slice of ``given`` (no collective)."""
    if given is None or want is None or given.partial or want.partial:
        return False
    slices = all(w[: len(g)] == g for g, w in zip(given.dims, want.dims, strict=True))
    return slices and want.local_bytes(mesh) < given.local_bytes(mesh)


def _region_holds(steps: Sequence[Step], mesh: MeshLike) -> dict[int, RegionHold]:
    """``id(node)`` → what each grad region holds before it runs, loop bodies
    included (a micro-batch loop's): its forward-pass part
    (:func:`~spmdkit.propagation.regions.region_residual_bytes`), from the node
    that makes the last of its primal inputs, and its zero-filled loop buffers
    (:func:`~spmdkit.propagation.regions.region_loop_buffer_bytes`), from the
    start of the program or body it is in."""
    out: dict[int, RegionHold] = {}
    for step in steps:
        node = step.node
        if node.prim == GRAD:
            p = node.eqn.params
            args = (node.prim, p, step.attrs, step.required, step.outputs, mesh)
            out[id(node)] = RegionHold(
                len(p["diff"]),
                region_residual_bytes(*args, duplicate=False),
                region_loop_buffer_bytes(*args),
            )
        if step.loop is not None:
            out.update(_region_holds(step.loop.steps, mesh))
    return out


def _batch_free(graph: Graph, roles: Mapping[int, str]) -> set[int]:
    """Values computed without the batch (from parameters, state, constants: a
    weight's reversed or cast copy); empty when no input has the ``batch`` role."""
    if "batch" not in roles.values():
        return set()
    free = {v for v in graph.invars if roles.get(v) != "batch"}
    for node in graph.nodes:
        if not node.subs and all(v in free for v in node.ins):
            free.update(node.outs)
    return free


def _transient(
    held: Mapping,
    n: int,
    mesh: Any,
    widen: Mapping | None = None,
    early: set[int] | None = None,
) -> list[int]:
    """Per top-level node, the bytes of resharded copies live during it: a copy
    lives from the equation that makes it to its last reuse (``widen``: dtype →
    the dtype the backend holds such copies in). A copy of an ``early`` value is
    made at the start: XLA:CPU's scheduler runs the collectives that do not wait
    for the batch (a parameter's all-gather, for the forward and the backward
    pass) before the forward pass."""
    transient = [0] * n
    for (vid, layout), (made, last, held_bytes) in held.items():
        first = 0 if early and vid in early else made
        nbytes = _held_bytes(layout, held_bytes, mesh, widen)
        for i in range(first, min(last, n - 1) + 1):
            transient[i] += nbytes
    return transient


def _held_bytes(layout: TensorSpec, nbytes: int, mesh: Any, widen: Mapping | None) -> int:
    """A resharded copy's bytes as the backend holds it (``widen``: dtype → the
    dtype it holds such copies in)."""
    if widen and layout.dtype in widen:
        return layout.replace(dtype=widen[layout.dtype]).local_bytes(mesh)
    return nbytes


def _relayouts(
    graph: Graph,
    relayouts: Sequence[tuple[int, int, int, int, Any, int]],
    transient: list[int],
    widen: Mapping | None,
    early: set[int] | None,
) -> None:
    """Add to ``transient`` XLA:CPU's copies of the operands it lays out anew for a
    gather or scatter over a minor dim (:func:`~spmdkit.propagation.records.relayout_bytes`),
    live while the collective runs (at the start for an ``early`` value, see
    :func:`_transient`). An elementwise result that the collective alone reads is
    made in that layout by its own fusion: no copy. A reduce-scatter is counted
    after a contraction only: the enforced replay reduces a contraction's pending
    sum with the plan's collectives, where XLA's partitioner runs the others as an
    all-reduce and a slice on CPU (``spmdkit.verification.planned.as_on_cpu``). A
    contraction's row-major copy of an operand gathered over a minor dim
    (:func:`~spmdkit.propagation.records.gathered_copy_bytes`) is live with it."""
    producer = {o: node for node in graph.nodes for o in node.outs}
    readers = collections.Counter(v for node in graph.nodes for v in set(node.ins))
    for at, vid, gathers, scatters, dtype, copied in relayouts:
        made = producer.get(vid)
        nbytes = copied + (scatters if made is not None and made.prim in CONTRACTIONS else 0)
        if made is None or made.prim not in _ELEMENTWISE or readers[vid] > 1:
            nbytes += gathers
        if not nbytes:
            continue
        if widen and dtype in widen:
            nbytes = nbytes * np.dtype(widen[dtype]).itemsize // np.dtype(dtype).itemsize
        i = 0 if early and vid in early else min(at, len(transient) - 1)
        transient[i] += nbytes


class _Totals(NamedTuple):
    by_kind: dict[str, int]
    comm_bytes: int
    comm_time_s: float
    flops: float
    compute_time_s: float


def _totals(records: Sequence[EqnRecord], peak: float) -> _Totals:
    by_kind: dict[str, int] = {}
    for r in records:
        for kind, n in r.bytes_by_kind().items():
            by_kind[kind] = by_kind.get(kind, 0) + n
    flops = sum(r.flops for r in records)
    return _Totals(
        by_kind=dict(sorted(by_kind.items())),
        comm_bytes=int(sum(r.comm_bytes for r in records)),
        comm_time_s=sum(r.comm_time_s for r in records),
        flops=flops,
        compute_time_s=flops / peak,
    )


# -- input and output specs ----------------------------------------------------------


def _is_spec_leaf(x: Any) -> bool:
    return x is None or isinstance(x, (TensorSpec, P))


def _leaf_dtype(x: Any) -> np.dtype:
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        dtype = np.asarray(x).dtype
    try:
        return np.dtype(dtype)
    except TypeError:
        return np.dtype("uint32")


def _flat_in_specs(in_specs: Any, args: tuple, mesh: MeshLike, what: str) -> list[TensorSpec]:
    leaves, treedef = jax.tree.flatten(in_specs, is_leaf=_is_spec_leaf)
    try:
        groups = treedef.flatten_up_to(args)
    except (ValueError, TypeError) as e:
        raise SpecError(
            op="propagate",
            must=f"{what} is a pytree prefix of the arguments",
            given=f"{treedef} for arguments {jax.tree.structure(args)}",
            fix="give one spec (TensorSpec, PartitionSpec or None) per array, or one per subtree",
        ) from e
    out: list[TensorSpec] = []
    for leaf, group in zip(leaves, groups, strict=True):
        for x in jax.tree.leaves(group):
            shape = tuple(getattr(x, "shape", ()))
            dtype = _leaf_dtype(x)
            if isinstance(leaf, TensorSpec):
                if leaf.shape != shape:
                    raise SpecError(
                        op="propagate",
                        must=f"each {what} TensorSpec has its argument's shape",
                        given=f"{leaf} for an argument of shape {shape}",
                        fix="build the spec with the argument's shape, or pass a PartitionSpec",
                    )
                s = leaf if leaf.dtype is not None else leaf.replace(dtype=dtype)
            elif leaf is None:
                s = TensorSpec(shape, dtype=dtype)
            else:
                s = TensorSpec(shape, leaf, dtype=dtype)
            out.append(s.validate(mesh, op="propagate"))
    return out


def _check_inputs(flat_in: list[TensorSpec], graph: Graph, prog: FlatProgram) -> None:
    if len(flat_in) != len(graph.invars):
        raise SpecError(
            op="propagate",
            must="one input spec per traced input",
            given=f"{len(flat_in)} specs for {len(graph.invars)} inputs",
            fix="pass in_specs as a pytree prefix of the positional arguments",
        )
    for vid, s in zip(graph.invars, flat_in, strict=True):
        if s.shape != prog.shapes[vid]:
            raise SpecError(
                op="propagate",
                must="each input spec has its input's shape",
                given=f"{s} for an input of shape {prog.shapes[vid]}",
                fix="pass specs matching the arguments",
            )


def _flat_out_specs(
    out_specs: Any, out_treedef: Any, graph: Graph, prog: FlatProgram, mesh: MeshLike
) -> list[TensorSpec | None]:
    """Per flat output, the layout ``out_specs`` asks for (None: unconstrained)."""
    if out_specs is None:
        return [None] * len(graph.outvars)
    out_avals = [jax.ShapeDtypeStruct(prog.shapes[v], prog.dtypes[v]) for v in graph.outvars]
    tree = jax.tree.unflatten(out_treedef, out_avals) if out_treedef else out_avals
    leaves, treedef = jax.tree.flatten(out_specs, is_leaf=_is_spec_leaf)
    groups = treedef.flatten_up_to(tree)
    flat: list[TensorSpec | None] = []
    for leaf, group in zip(leaves, groups, strict=True):
        for x in jax.tree.leaves(group):
            if leaf is None:
                flat.append(None)
            elif isinstance(leaf, TensorSpec):
                flat.append(leaf if leaf.dtype else leaf.replace(dtype=x.dtype))
            else:
                flat.append(TensorSpec(x.shape, leaf, dtype=x.dtype, mesh=mesh))
    return flat


def _check_strategies(strategies: Mapping[str, str]) -> None:
    for op, name in strategies.items():
        rule = get_rule(op)  # unknown op: NoRuleError naming near matches
        if name not in rule.strategies:
            raise ShardingConflictError(
                op=op,
                must=f"strategy is one of {rule.strategies}",
                given=repr(name),
                fix=f"pass strategies={{{op!r}: one of {rule.strategies}}}",
            )


def _donated_ids(donate_argnums: Sequence[int] | int, args: tuple, invars: list[int]) -> set[int]:
    nums = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
    out: set[int] = set()
    pos = 0
    for i, a in enumerate(args):
        n = len(jax.tree.leaves(a))
        if i in nums:
            out.update(invars[pos : pos + n])
        pos += n
    return out


def _is_role_leaf(x: Any) -> bool:
    return x is None or isinstance(x, str)


def _roles(arg_roles: Any, args: tuple, invars: list[int]) -> dict[int, str]:
    if arg_roles is None:
        return {}
    leaves, treedef = jax.tree.flatten(arg_roles, is_leaf=_is_role_leaf)
    groups = treedef.flatten_up_to(args)
    out: dict[int, str] = {}
    pos = 0
    for role, group in zip(leaves, groups, strict=True):
        for _ in jax.tree.leaves(group):
            if role is not None:
                out[invars[pos]] = role
            pos += 1
    return out
