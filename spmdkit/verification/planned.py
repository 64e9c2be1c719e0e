"""Verify a planned step: its prediction, as the target backend emits it, against its HLO.

:func:`verify_plan` takes a step compiled for a plan (what ``sk.jit(step, plan)``
returns), propagates the plan through it, reads the compiled executable back
(:func:`spmdkit.verification.compiled.report`) and compares the two
(:func:`spmdkit.verification.compiled.verify`). It is what ``plan.verify(step, ...)``
and ``PlannedFunction.verify`` run.

On CPU, XLA emits some reductions differently from the plan's collectives,
runs 16-bit floats in float32 and expands a max pool's gradient into buffers of
its own; the prediction is adjusted to what the CPU backend emits first
(:func:`as_on_cpu`, :func:`promoted_on_cpu`, :func:`held_on_cpu`).

This module reads the planned step through :class:`PlannedProgram` (the three
members it uses), so it never imports :mod:`spmdkit.compile`, which calls it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from spmdkit.engine.inference import ArgReshard
from spmdkit.errors import SpmdError
from spmdkit.planner.plans import Plan
from spmdkit.propagation import EqnRecord, Propagation
from spmdkit.propagation.workspaces import CpuBackend
from spmdkit.resharding import ReshardPlan
from spmdkit.spec import MeshLike
from spmdkit.verification.blame import attribute
from spmdkit.verification.compiled import VerifyReport, report, verify
from spmdkit.verification.pipelined import counted_by_schedule, pipelined_prediction
from spmdkit.versions import cpu_float8_held_as

__all__ = [
    "PlannedProgram",
    "CPU_PROMOTED",
    "CPU_WIDENED_COLLECTIVES",
    "as_on_cpu",
    "as_replayed",
    "held_on_cpu",
    "promoted_on_cpu",
    "platform",
    "unsliced_bytes",
    "unsliced_plan_bytes",
    "verify_plan",
]


@runtime_checkable
class PlannedProgram(Protocol):
    """What verification needs of a step compiled for a plan (``sk.jit``'s
    :class:`~spmdkit.compile.PlannedFunction` has these)."""

    mesh: MeshLike
    fn: Callable  #: the step as written (traced once more for a pipeline's facts)

    def program(self, *args: Any) -> tuple[Callable, Propagation]:
        """``(body, propagation)``: the compiled function and its prediction."""
        ...

    def compile(self, *args: Any) -> jax.stages.Compiled:
        """The executable the step runs for these arguments."""
        ...


def verify_plan(
    plan: Plan, step: PlannedProgram, *args: Any, bytes_tol: float = 0.1, mem_tol: float = 0.2
) -> VerifyReport:
    """Propagate the plan through ``step`` and compare with its compiled HLO.

    Args:
      plan: the plan ``step`` was compiled for (named in the error when ``step``
        is not a planned step).
      step: what ``sk.jit(step, plan)`` returns; its own executable is read (a
        step that has run is not compiled again).
      *args: the step's arguments (concrete, or ``jax.ShapeDtypeStruct``).
      bytes_tol: relative tolerance on collective payload bytes.
      mem_tol: relative tolerance on peak memory.

    Returns:
      The :class:`~spmdkit.verification.compiled.VerifyReport` (``.ok``, ``.mismatches``;
      ``.attribution``: every compiled collective traced to its equation and
      matched to the predicted ones, :mod:`spmdkit.verification.blame`).

    Raises:
      SpmdError: ``step`` is not a step compiled for a plan (a plain function).

    Example::

        >>> step = sk.jit(jax.value_and_grad(loss), plan)
        >>> verify_plan(plan, step, params, batch).ok
        True
    """
    if not isinstance(step, PlannedProgram):
        raise SpmdError(
            op="verify_plan",
            must="the step is compiled for the plan by sk.jit",
            given=f"{type(step).__name__} {getattr(step, '__name__', '')}".rstrip(),
            fix=f"wrap with sk.jit(step, plan) (plan: {plan!r}) and pass what it returns",
        )
    _, prop = step.program(*args)
    traced = prop = as_replayed(prop)
    if platform(step.mesh) == "cpu":
        prop = held_on_cpu(promoted_on_cpu(prop, as_on_cpu(prop)))
    if plan.pipeline is not None:
        # the step itself, not the body: the enforced body replays the traced
        # program and never calls the pipeline, so it reports no pipeline facts
        prop = pipelined_prediction(plan, step.fn, prop, *args)
    compiled = report(step.compile(*args))
    if plan.pipeline is not None:
        compiled = counted_by_schedule(compiled, plan.pipeline)
    rep = verify(prop, compiled, bytes_tol=bytes_tol, mem_tol=mem_tol)
    rep.attribution = attribute(traced, compiled.collectives, compiled.executions)
    return rep


def platform(mesh: MeshLike) -> str | None:
    """The platform of a device mesh's devices (``"cpu"``, ``"gpu"``…); None for
    an abstract mesh."""
    try:
        return mesh.devices.flat[0].platform
    except (AttributeError, IndexError, ValueError):  # AbstractMesh: ValueError
        return None


def as_replayed(prop: Propagation) -> Propagation:
    """The prediction with the sums the enforced replay reduces itself moved as
    the replay moves them.

    Propagation prices a contraction's pending sum at each reader: one reader
    may reduce-scatter it and another gather that back (the RMS norm's output
    gradient under sequence parallelism: the scale gradient's ``mul`` reads it
    split over the sequence, the input gradient's whole). The replay reduces such
    a sum once, where it is computed, to the coarsest layout its readers want
    (:attr:`~spmdkit.propagation.pinning.NodePins.fused`: an all-reduce here),
    and each reader slices its block locally: the compiled program has the one
    reduction and no gather. For each such sum of the top-level program whose
    reduction a direct reader's record prices, the readers' moves of it are
    dropped from their records and the replay's reduction is recorded on the
    producing equation (as ``output 0``); ``comm_bytes_by_kind`` follows. Sums
    reduced along a chain of ops, or inside a loop body, are left as priced.

    Args:
      prop: a propagation of a planned step (``prop.program`` holds the replay's
        pins; without it ``prop`` is returned).

    Returns:
      ``prop`` with ``records`` and ``comm_bytes_by_kind`` as the replay runs them.

    Example::

        >>> replayed = as_replayed(prop)  # megatron_sp: RS + AG at two readers
        >>> replayed.comm_bytes_by_kind["all_gather"] < prop.comm_bytes_by_kind["all_gather"]
        True
    """
    program = prop.program
    if program is None:
        return prop
    nodes = program.graph.nodes
    # a record per node of the top-level program, at the node's position
    records = {
        r.index: r
        for r in prop.records
        if r.index < len(nodes) and nodes[r.index].prim == r.primitive
    }
    reads: dict[int, list[tuple[int, int]]] = {}  # value → (reader node, operand)
    for j, node in enumerate(nodes):
        for k, v in enumerate(node.ins):
            reads.setdefault(v, []).append((j, k))
    delta: dict[str, int] = {}
    changed: dict[int, EqnRecord] = {}
    for i, node in enumerate(nodes):
        pins = program.specs.get(id(node))
        if pins is None or pins.fused is None or pins.chain or i not in records:
            continue
        fused = pins.fused
        moves = [
            (j, a)
            for j, k in reads.get(node.outs[0], ())
            if j in records
            for a in changed.get(j, records[j]).reshards
            if a.arg == f"input {k}"
        ]
        if not any(a.src == fused.src for _, a in moves):
            continue  # the reduction is priced further on (a chain): left as is
        for j, a in moves:
            r = changed.get(j, records[j])
            changed[j] = _without(r, a)
            for c in a.plan.collectives:
                delta[c.kind] = delta.get(c.kind, 0) - c.payload_bytes
        own = ArgReshard("output 0", fused.src, fused.dst, fused)
        changed[i] = _with(changed.get(i, records[i]), own)
        for c in fused.collectives:
            delta[c.kind] = delta.get(c.kind, 0) + c.payload_bytes
    if not changed:
        return prop
    kinds = dict(prop.comm_bytes_by_kind)
    for kind, n in delta.items():
        kinds[kind] = kinds.get(kind, 0) + n
    kinds = {k: n for k, n in sorted(kinds.items()) if n}
    new = {id(records[i]): r for i, r in changed.items()}
    out = tuple(new.get(id(r), r) for r in prop.records)
    return dataclasses.replace(prop, records=out, comm_bytes_by_kind=kinds)


def _without(record: EqnRecord, move: ArgReshard) -> EqnRecord:
    """``record`` without the reshard ``move`` (its bytes and time taken off)."""
    kept = tuple(a for a in record.reshards if a is not move)
    return dataclasses.replace(
        record,
        reshards=kept,
        comm_bytes=record.comm_bytes - move.plan.payload_bytes,
        comm_time_s=record.comm_time_s - move.plan.time_s,
    )


def _with(record: EqnRecord, move: ArgReshard) -> EqnRecord:
    """``record`` with the reshard ``move`` added (its bytes and time too)."""
    return dataclasses.replace(
        record,
        reshards=(*record.reshards, move),
        comm_bytes=record.comm_bytes + move.plan.payload_bytes,
        comm_time_s=record.comm_time_s + move.plan.time_s,
    )


def as_on_cpu(prop: Propagation) -> Propagation:
    """The prediction as XLA's CPU backend emits it.

    A reduce-scatter that XLA's partitioner makes becomes an all-reduce of the
    same operand followed by a local slice. When one reshard reduce-scatters over
    several axes in turn (partial over ``data`` and ``model`` into dims tiled by
    both), the slices all come after the last all-reduce, so every stage
    all-reduces the whole block the first stage had, not the shrinking block the
    plan's staged scatters send. The same holds for a reduce-scatter followed by
    an all-reduce of a value made by an op XLA reduces in place (a scatter-add's
    table gradient); after other ops it slices between the two. Reductions the
    enforced program runs itself (``Program.specs``' fused plans,
    ``psum_scatter`` under ``shard_map``) stay reduce-scatters.
    """
    kinds = dict(prop.comm_bytes_by_kind)
    moved = kinds.pop("reduce_scatter", 0)
    if not moved:
        return prop
    extra = unsliced_bytes(prop.records)
    kept = manual_scatter_bytes(prop.records)
    program = prop.program
    for pins in program.specs.values() if program is not None else ():
        plan, runs = pins.fused, pins.runs
        if plan is not None:
            rs = [c.payload_bytes for c in plan.collectives if c.kind == "reduce_scatter"]
            kept += runs * sum(rs)
            extra -= runs * unsliced_plan_bytes(plan)
    kinds["all_reduce"] = kinds.get("all_reduce", 0) + moved - kept + extra
    if kept:
        kinds["reduce_scatter"] = kept
    return dataclasses.replace(prop, comm_bytes_by_kind=dict(sorted(kinds.items())))


#: Float dtypes XLA's CPU backend does not reduce or move natively: it converts
#: them to float32 around each collective (the reduction computations end in
#: ``_promoted``), so the compiled collective moves twice the predicted bytes.
CPU_PROMOTED = frozenset({np.dtype(jnp.bfloat16), np.dtype(jnp.float16)})

#: The float8 dtypes (``spmdkit.step.fp8``'s operands), which XLA's CPU backend keeps
#: in no buffer of their own: each cast to float8 is fused into the fusion that
#: widens it back, so a quantized value is held in float32 (the dot's operand),
#: or in float16 where a collective moves it (:data:`CPU_WIDENED_COLLECTIVES`).
CPU_FLOAT8 = frozenset({np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2)})

#: Float dtypes whose collectives XLA's CPU backend runs at twice their width: the
#: 16-bit floats in float32 (:data:`CPU_PROMOTED`), float8 in float16 (its float
#: normalization widens f8 before an all-gather: ``spmdkit.step.fp8``'s FSDP gathers).
CPU_WIDENED_COLLECTIVES = CPU_PROMOTED | CPU_FLOAT8


def promoted_on_cpu(prop: Propagation, on_cpu: Propagation | None = None) -> Propagation:
    """The prediction with 16-bit float collectives moved in float32 and float8 ones
    in float16, as XLA's CPU backend runs them (:data:`CPU_WIDENED_COLLECTIVES`); GPUs
    and TPUs move them as is.

    Args:
      prop: the propagation (its records say which reshards move 16-bit floats).
      on_cpu: the prediction to add to (default ``prop``); after
        :func:`as_on_cpu`, whose reduce-scatters the CPU backend runs as
        all-reduces (except the enforced program's own, fused ones).

    Example::

        >>> promoted_on_cpu(prop).comm_bytes_by_kind  # bf16 gathers counted twice
    """
    extra: dict[str, int] = {}

    def walk(records: Iterable[EqnRecord], repeat: int) -> None:
        for r in records:
            for a in r.reshards:
                # the dtype the collectives move (a pending sum carried through a
                # widening cast is reduced in the narrower one)
                if a.plan.src.dtype not in CPU_WIDENED_COLLECTIVES:
                    continue
                for c in a.plan.collectives:
                    extra[c.kind] = extra.get(c.kind, 0) + repeat * c.payload_bytes
            if r.body:
                walk(r.body, repeat * r.repeat)

    walk(prop.records, 1)
    scattered = extra.pop("reduce_scatter", 0)
    if on_cpu is None:
        extra["reduce_scatter"] = scattered
    elif scattered:
        # the enforced program's own (fused) reduce-scatters stay; the rest run as
        # all-reduces on CPU (as_on_cpu)
        kept = manual_scatter_bytes(prop.records, promoted=True)
        for pins in prop.program.specs.values() if prop.program is not None else ():
            plan = pins.fused
            if plan is not None and plan.src.dtype in CPU_PROMOTED:
                rs = [c.payload_bytes for c in plan.collectives if c.kind == "reduce_scatter"]
                kept += pins.runs * sum(rs)
        kept = min(kept, scattered)
        extra["reduce_scatter"] = kept
        extra["all_reduce"] = extra.get("all_reduce", 0) + scattered - kept
    base = on_cpu if on_cpu is not None else prop
    if not extra:
        return base
    kinds = dict(base.comm_bytes_by_kind)
    for kind, n in extra.items():
        if n:
            kinds[kind] = kinds.get(kind, 0) + n
    return dataclasses.replace(base, comm_bytes_by_kind=dict(sorted(kinds.items())))


def held_on_cpu(prop: Propagation) -> Propagation:
    """The prediction's memory as XLA's CPU backend holds the program: 16-bit float
    temporaries in float32 (:data:`CPU_PROMOTED`), the workspaces of the ops
    it expands (a max pool's gradient, ``select_and_scatter``: positions and
    iotas, :func:`~spmdkit.propagation.workspaces.select_and_scatter_workspace`), and
    the resharded copies of values that do not depend on the batch (a parameter's
    all-gathers, for the forward and for the backward pass) made at the start, as
    its scheduler runs those collectives before the forward pass (measured on
    the fsdp steps of the zoo's ResNet, U-Net and NNX decoder: every all-gather
    lies in the first 40% of the compiled schedule). GPUs and TPUs hold 16-bit
    floats as is and run
    ``select_and_scatter`` natively.

    XLA:CPU up to jaxlib 0.10 has no native bfloat16 or float16 arithmetic: it
    converts around every dot (the dot runs in float32 on float32 operands and
    result) and every collective (:func:`promoted_on_cpu`), computes elementwise
    fusions in float32, and, allowed excess precision
    (``xla_allow_excess_precision``, on by default), drops the float32 → 16-bit →
    float32 round trips between them, so the buffers in between are float32 too.
    From jaxlib 0.11 it runs most 16-bit dots natively, so temporaries keep their
    16-bit size except the float32 ones it still makes
    (:class:`~spmdkit.propagation.workspaces.CpuBackend`): the result of each dot
    it runs in float32 (one that reads its left operand transposed in place,
    :func:`~spmdkit.propagation.workspaces.float32_dot`) and that dot's float32
    operand copies, and each partial sum, which its collectives reduce in float32;
    a resharded copy is held in float32 as before. Measured per device on a bf16
    MLP's gradient (data=8): 1,280 KiB held against 1,280 compiled on jaxlib 0.12,
    where float32 temporaries throughout put it at 1,536; on tiny GPT's bf16
    gradient (dp, data=8) 1.4 MiB against 1.5. Measured on the tiny scanned Llama's bf16 train
    step (fsdp, 8 devices): of the buffers the compiled program materializes
    outside fusions, 3.4 MB are float32 and 0.65 MB bfloat16 (the loop state:
    stacked residuals), and every dot and collective is float32. The estimate's
    arguments and outputs keep their dtypes (fp32 master parameters, optimizer
    state); its temporaries and resharded copies of 16-bit floats are counted at
    float32 size, except casts down from float32 (the round trip is dropped: the
    cast reads its float32 source). The stacked residuals, bf16 on CPU, are then
    counted high; net, on the tiny scanned GPT and Llama (bf16, and bf16 with full
    recompute and 2 micro-batches) the estimate is 9% under to 4% over the
    compiled peak, where native bf16 sizes put it 13-29% under.

    Float8 (:data:`CPU_FLOAT8`): the compiled CPU program of an ``spmdkit.step.fp8``
    step holds no float8 buffer: each quantizing cast is fused with the convert
    that feeds the dot, so the quantized activations the backward keeps are
    buffers of the dot's operand dtype, and only the FSDP-gathered weights are
    narrower (float16, :data:`CPU_WIDENED_COLLECTIVES`). That dtype depends on
    jaxlib (:func:`~spmdkit.versions.cpu_float8_held_as`): float32 up to 0.10,
    where every such dot runs in float32, and 16 bits from 0.11, where XLA:CPU
    runs them natively. Measured on tiny GPT's fsdp float8 step (8 devices,
    per device): 934-982 KiB predicted against 942 KiB compiled on jaxlib 0.10.2
    (float8 sizes would put it at 525 KiB), and with 16-bit copies 737-790 KiB
    against 694 KiB on 0.12.0, where float32 copies put it 35% over. (A bare
    float8 MLP's gradient, whose few values XLA fuses further, is counted high:
    conservative.)

    Args:
      prop: the propagation (its ``memory_as`` re-measures the peak).

    Returns:
      ``prop`` with ``memory`` and ``memory_materialized`` re-measured; ``prop``
      itself when it cannot be re-measured.

    Example::

        >>> held_on_cpu(prop).memory.temp_bytes >= prop.memory.temp_bytes
        True
    """
    if prop.memory_as is None:
        return prop
    widen = {}
    held = {CPU_PROMOTED: np.dtype(np.float32), CPU_FLOAT8: np.dtype(cpu_float8_held_as())}
    for dtypes, wide in held.items():
        if _holds(prop.records, dtypes):
            widen.update(dict.fromkeys(dtypes, wide))
    cpu = CpuBackend(native_16bit_dots=cpu_float8_held_as() != "float32")
    memory, materialized = prop.memory_as(widen or None, cpu=cpu)
    return dataclasses.replace(prop, memory=memory, memory_materialized=materialized)


def _holds(records: Iterable[EqnRecord], dtypes: frozenset) -> bool:
    """Whether any equation of ``records`` (bodies included) makes a value of ``dtypes``."""
    for r in records:
        if any(getattr(o, "dtype", None) in dtypes for o in r.outputs):
            return True
        if r.body and _holds(r.body, dtypes):
            return True
    return False


def unsliced_plan_bytes(plan: ReshardPlan, in_place: bool = False) -> int:
    """Bytes the unsliced stages of one plan's staged reductions add: further
    reduce-scatters after a reduce-scatter, and all-reduces too when the value's
    producer reduces in place (``ArgReshard.in_place``)."""
    extra, first = 0, None
    later = ("reduce_scatter", "all_reduce") if in_place else ("reduce_scatter",)
    for c in plan.collectives:
        if first is not None and c.kind in later:
            extra += first - c.payload_bytes
        elif c.kind == "reduce_scatter":
            first = c.payload_bytes
        else:
            first = None
    return extra


def manual_scatter_bytes(
    records: Iterable[EqnRecord], repeat: int = 1, *, promoted: bool = False
) -> int:
    """The reduce-scatter bytes of the ``psum_scatter`` calls that ``shard_map`` bodies
    call (a pipeline's gradients; a region's own, e.g. ``gather_kv`` attention's K/V
    gradients, or its result reduce-scattered onto the sequence: XLA runs them as
    written, on CPU too; loops repeated). ``promoted``: only those of 16-bit floats
    (:data:`CPU_PROMOTED`)."""
    total = 0
    for r in records:
        for a in r.reshards:
            if not a.arg.endswith((" in shard_map", " (region)")):
                continue
            if promoted and a.src.dtype not in CPU_PROMOTED:
                continue
            rs = [c.payload_bytes for c in a.plan.collectives if c.kind == "reduce_scatter"]
            total += repeat * sum(rs)
        if r.body:
            total += manual_scatter_bytes(r.body, repeat * r.repeat, promoted=promoted)
    return total


def unsliced_bytes(records: Iterable[EqnRecord], repeat: int = 1) -> int:
    """:func:`unsliced_plan_bytes` over every reshard of ``records`` (loops repeated)."""
    extra = 0
    for r in records:
        extra += repeat * sum(unsliced_plan_bytes(a.plan, a.in_place) for a in r.reshards)
        if r.body:
            extra += unsliced_bytes(r.body, repeat * r.repeat)
    return extra
