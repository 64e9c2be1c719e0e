"""Per-device memory of a sharded program, by liveness.

Every value of the (flattened) program takes its per-device bytes under its
spec (:meth:`TensorSpec.local_bytes`: padded local shape × itemsize; a partial
value is as big as its local block). The estimate follows the accounting of
XLA's ``compiled.memory_analysis()``:

- **arguments** live for the whole step, donated or not (a donated buffer is
  reused for an output, which is what ``alias`` counts);
- **outputs** are their own buffers, minus those that alias a donated argument
  of the same per-device size;
- **temporaries** are the values that are neither: each is born at the equation
  that makes it and dies after its last use; the temp figure is the peak of
  their sum over the program. A loop body's own peak is added while the loop runs.
  One that XLA places in an output's (or a donated argument's) buffer before
  the output is made is not counted (:mod:`spmdkit.propagation.buffers`).

``peak_bytes = argument_bytes + output_bytes - alias_bytes + temp_bytes``.

Copies read in a value's place (``copy_reads``): a value resharded by a
collective (a pending sum all-reduced, an activation gathered) is read by the
collective once; the consumers that want the new layout read the copy, which
lives from that collective to its last reader (the driver's ``transient``
bytes), so they do not keep the value itself alive: it is freed after its last
reader in its own layout. The collectives a node needs run before the node
makes its results, so an operand only they read is gone by then. A forward
value that a backward node recomputes from a copy keeps the copy alive, not the
value. A layout constraint that changes nothing is its operand's buffer.
(Measured on the zoo's ViT and U-Net ``tp_fsdp``: XLA's live set at its peak
holds each all-reduced activation once, never beside its partial source.) A
scan body's copies live likewise on the body's own timeline, inside its
liveness (:class:`BodyCopies`), but for the copies of values the body computes
without the batch (a layer's weights gathered under FSDP), which are held at
the scan's node, as are all those of a ``while`` or ``cond`` body.

Grad regions (``held``, the upper estimate): a composite op's grad region
holds, before it runs, the part of its program XLA runs in the forward pass
(from the node that makes its last primal input) and the zero-filled buffers of
its backward loops (from the start of the program or loop body it is in: XLA's
scheduler makes those copies, which wait for nothing, first), at the top level
and inside loop bodies alike (:class:`RegionHold`). Measured on ``gather_kv``
attention in a 2-micro-batch loop (XLA:CPU, jax 0.10.2-0.12): the compiled peak
is the loop's loss backward with both live (the loop buffers, and the laid-out
K/V and query chunks).

Workspace: a convolution whose input is not laid out batch-major and
feature-minor (the filter gradient's, which contracts over the batch), or whose
kernel is not spatial-major, input- then output-feature (the filter gradient's
cotangent, as its kernel), is run by XLA:CPU on a transposed copy of it, which
XLA makes as soon as the operand exists (in the forward pass for an input,
right after the op that makes it, whose own
operands are then freed) and keeps until the convolution in the backward
pass, which reads the copy: the input itself is freed after its forward
readers. Measured: a single convolution's compiled temp is the liveness figure
plus exactly its input's bytes (3x3/1x1/5x5 windows, strides 1 and 2, 3 to 64
channels); in XLA's live ranges of stacked convolutions and of the zoo's U-Net
each convolution output dies once its transposed copy and the next forward
convolution have read it. Not modelled: XLA runs a layer's input gradient
before its filter gradient (modelled only where the input gradient is an
output), so on a stack of plain convolutions the estimate can be an activation
under XLA's live peak.

Host memory: values in host memory (a recompute policy's offloaded residuals,
``f32<host>[...]`` in the jaxpr) take no device memory; XLA:CPU keeps them in its
one memory and counts them in the temp allocation (``cpu=True``), as measured.

Workspace on XLA:CPU only (``cpu=True``): the buffers of the ops XLA:CPU has no
kernel for and expands (a max pool's gradient, a convolution with batch groups,
``ragged_dot``), in :mod:`spmdkit.propagation.workspaces`; and the copy of an
operand XLA:CPU lays out anew for a gather or reduce-scatter over a minor dim, live
while the collective runs (the driver's ``transient`` bytes,
:func:`spmdkit.propagation.records.relayout_bytes`), and in a loop body the
row-major copy a contraction makes of an operand gathered over a minor dim
(:func:`spmdkit.propagation.records.gathered_copy_bytes`).

What it does not model: XLA fuses chains of elementwise ops (their
intermediates are never materialized) and may schedule differently, so the
temp figure is an upper-side estimate for unfused programs; the test suite
states the tolerance measured against ``memory_analysis`` on CPU.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import jax
import numpy as np

from spmdkit.propagation.buffers import ELEMENTWISE as _ELEMENTWISE
from spmdkit.propagation.buffers import (
    NodeHolds,
    Span,
    heap_temps,
    own_parts,
    peak,
    peak_parts,
    zero_values,
)
from spmdkit.propagation.graph import FlatProgram, Graph, Node, dce
from spmdkit.propagation.workspaces import (
    SIXTEEN_BIT_FLOATS,
    CpuBackend,
    cpu_workspaces,
    float32_dot,
)
from spmdkit.spec import MeshLike, TensorSpec
from spmdkit.util import fmt_bytes as _fmt

__all__ = [
    "CopyRead",
    "MemoryEstimate",
    "RegionHold",
    "estimate_memory",
    "fused_values",
    "liveness",
    "program_temp_bytes",
]


# Values made by these and read only by those are fused by XLA, never materialized.
_FUSIBLE = _ELEMENTWISE | {"broadcast_in_dim", "iota", "transpose", "reshape", "squeeze"}
_FUSES_INTO = _ELEMENTWISE | {
    "reduce_sum",
    "reduce_max",
    "reduce_min",
    "broadcast_in_dim",
    "transpose",
    "reshape",
    "squeeze",
}


# Ops XLA does not duplicate into several consumer fusions: a result of one of
# these read by more than one equation is materialized.
_EXPENSIVE = frozenset(
    {
        "div",
        "exp",
        "exp2",
        "expm1",
        "log",
        "log1p",
        "logistic",
        "tanh",
        "rsqrt",
        "sqrt",
        "pow",
        "erf",
        "sin",
        "cos",
    }
)


@dataclass
class MemoryEstimate:
    """Per-device memory of one step.

    Attributes:
      peak_bytes: arguments + outputs − aliased + temporaries.
      argument_bytes: every input, for the whole step.
      output_bytes: every output.
      temp_bytes: peak of the live intermediates.
      alias_bytes: outputs that reuse a donated argument's buffer.
      by_role: role (``"params"``, ``"opt_state"``, ``"batch"``…, ``"other"`` for
        arguments with none, ``"temp"``, ``"output"``) → bytes.
    """

    peak_bytes: int
    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    by_role: dict[str, int] = field(default_factory=dict)
    alias_bytes: int = 0

    def __str__(self) -> str:
        roles = ", ".join(f"{k} {_fmt(v)}" for k, v in sorted(self.by_role.items()))
        return (
            f"peak {_fmt(self.peak_bytes)} per device (arguments {_fmt(self.argument_bytes)}, "
            f"outputs {_fmt(self.output_bytes)}, aliased {_fmt(self.alias_bytes)}, "
            f"temporaries {_fmt(self.temp_bytes)}; {roles})"
        )


class BodyCopies(NamedTuple):
    """The resharded copies of a scan's body, for its liveness: per body node, the
    bytes live while it runs (as ``transient`` of the top level), and the nested
    scans' own by body node index."""

    transient: list[int]
    nested: dict[int, BodyCopies]


class CopyRead(NamedTuple):
    """A copy of a value that a node reads in the value's place.

    Attributes:
      made: the index of the node whose collective (or transpose) makes it.
      last: the index of the last node that reads it.
      spec: its layout (None: never extended past ``last``).
    """

    made: int
    last: int
    spec: TensorSpec | None = None


def _applied_aliases(
    graph: Graph, aliases: Mapping[int, int] | None, last: Mapping[int, int], fused: set[int]
) -> dict[int, int]:
    """The ``aliases`` that hold (result id → operand id): an alias of a value fused
    into it is what XLA makes (as the fusion decided); of a materialized value (or
    an alias of one), that value's buffer."""
    applied: dict[int, int] = {}
    for node in graph.nodes:
        for o in node.outs:
            if aliases and o in aliases and o in last:
                v = aliases[o]
                if v not in fused or v in applied:
                    applied[o] = v
    return applied


def _lifetimes(
    graph: Graph,
    prog: FlatProgram,
    fuse: bool,
    duplicate: bool,
    copy_reads: Mapping[int, Mapping[int, CopyRead]] | None = None,
    aliases: Mapping[int, int] | None = None,
) -> tuple[dict[int, int], set[int], dict[CopyRead, int], dict[int, int]]:
    """(value id → index of the node that reads it last, the ids of values fused
    into their consumers and never materialized, copies read by a forward value
    that a backward node recomputes → the index they must live to, the
    ``aliases`` that hold: result id → the operand whose buffer it is); see
    :func:`_temp_peak`.

    ``copy_reads``: node index → {value id: the resharded copy the node reads
    instead of the value (:class:`CopyRead`)}. A collective
    reads a materialized buffer (a computed value is never fused; a transpose
    or reshape is, XLA lays its operand out for the collective), and a node that
    reads a copy made before it does not keep the value alive: the copy is
    what lives on (the resharded copies' own lifetimes, ``transient``).
    ``aliases``: result id → operand id of nodes whose result is their operand's
    buffer (:func:`_aliases`): the operand lives as long as the result, and the
    result takes no buffer of its own (it is reported as fused), unless the
    operand is fused into it (then it is the fusion's result)."""
    last: dict[int, int] = {}
    consumers: dict[int, set[str]] = {}
    readers: dict[int, int] = {}
    copy_reads_values = {v for via in (copy_reads or {}).values() for v in via}
    collected: set[int] = set()
    for i, node in enumerate(graph.nodes):
        via = copy_reads.get(i, {}) if copy_reads else {}
        if node.prim not in _MOVES_ONLY:
            collected.update(o for o in node.outs if o in copy_reads_values)
        for v in set(node.ins):
            if v in via and via[v].made < i:
                continue
            last[v] = i
            consumers.setdefault(v, set()).add(node.prim)
            readers[v] = readers.get(v, 0) + 1
    fused = (
        {
            o
            for node in graph.nodes
            if node.prim in _FUSIBLE
            for o in node.outs
            if o in consumers
            and consumers[o] <= _FUSES_INTO
            and (readers[o] == 1 or (duplicate and node.prim not in _EXPENSIVE))
        }
        - set(graph.outvars)
        - collected
        if fuse
        else set()
    )
    # broadcasts of constants (masks, fill values) are fused into their users or
    # sunk into loop bodies by XLA: never materialized at full size; a pvary of
    # one is the same broadcast (pvary lowers to nothing; jax up to 0.11 traces
    # a kernel's fill as pvary(broadcast(c)), 0.12 as broadcast(pvary(c)))
    const = {v for v in consumers if prog.const[v]}
    for node in graph.nodes:
        if node.kind == "eqn" and all(v in const for v in node.ins):
            const.update(node.outs)
            if node.prim in ("broadcast_in_dim", "pvary") and fuse:
                fused.update(o for o in node.outs if o not in graph.outvars)
    end = len(graph.nodes)
    for v in graph.outvars:
        last[v] = end
    # a forward value fused into a backward consumer is recomputed there: its
    # operands stay live until then (walk backwards so chains of fused values extend
    # their roots). Other fused values are not extended: XLA schedules their
    # consumers' fusions where the operands are ready, wherever the program order
    # put them.
    applied = _applied_aliases(graph, aliases, last, fused)
    extended: dict[CopyRead, int] = {}
    for i in range(len(graph.nodes) - 1, -1, -1):
        node = graph.nodes[i]
        for o in node.outs:
            if o in applied:
                v = applied[o]
                last[v] = max(last.get(v, i), last[o])
                fused.add(o)
        if node.backward:
            continue
        for o in node.outs:
            j = last.get(o, end)
            if o in fused and j < end and graph.nodes[j].backward:
                via = copy_reads.get(i, {}) if copy_reads else {}
                for v in node.ins:
                    if v in via:  # recomputed from the copy it reads: the copy lives on
                        c = via[v]
                        extended[c] = max(extended.get(c, c.last), last[o])
                    else:
                        last[v] = max(last.get(v, i), last[o])
    return last, fused, extended, applied


@dataclass
class _Copies:
    """Backend buffers that are none of the program's values: held from the start
    of one node to the end of another (``spans``: first node, last node, bytes,
    the node of the op that makes or reads it), or live while one node runs
    (``during``)."""

    spans: list[tuple[int, int, int, int]] = field(default_factory=list)
    during: dict[int, int] = field(default_factory=dict)

    def hold(self, first: int, last: int, nbytes: int, at: int | None = None) -> None:
        """``nbytes`` live from the start of node ``first`` to the end of node ``last``,
        made or read by the op of node ``at`` (default: ``last``, an operand of it)."""
        self.spans.append((first, last, nbytes, last if at is None else at))

    def at(self, i: int, nbytes: int) -> None:
        """``nbytes`` live while node ``i`` runs."""
        self.during[i] = self.during.get(i, 0) + nbytes


class RegionHold(NamedTuple):
    """What a grad region node holds before it runs, besides its operands.

    Attributes:
      primals: how many of its first operands are the forward's (primal) inputs.
      residual: bytes held from the node that makes the last of them to the region
        (the part of its program XLA runs in the forward pass).
      early: bytes held from the start of the graph the node is in (its loop
        buffers, made there by XLA's scheduler).
    """

    primals: int
    residual: int = 0
    early: int = 0


def _region_holds(graph: Graph, held: Mapping[int, RegionHold], out: _Copies) -> None:
    """Hold each grad region's :class:`RegionHold` bytes up to the node before it."""
    made = {o: i for i, node in enumerate(graph.nodes) for o in node.outs}
    for g, node in enumerate(graph.nodes):
        h = held.get(id(node))
        if h is None or g == 0:
            continue
        start = max((made.get(v, 0) for v in node.ins[: h.primals]), default=0)
        if h.residual and start + 1 < g:
            out.hold(start + 1, g - 1, h.residual)
        if h.early:
            out.hold(0, g - 1, h.early)


def _transposed_copies(graph: Graph, nbytes: Any, out: _Copies) -> dict[int, dict[int, CopyRead]]:
    """The transposed input copies of :func:`_transposes_input` equations: each is
    made as soon as its operand exists (right after its producer, whose operands
    and resharded copies are then gone — measured: a concatenation's output is
    copied after the concatenation's inputs are freed — or at the start for an
    input of the graph) and freed after the equation reading it. Returns where
    each was made, as :func:`_lifetimes`' ``copy_reads``: the equation reads the
    copy, so the operand itself is freed after its other readers (the forward
    convolution)."""
    producer = {o: i for i, node in enumerate(graph.nodes) for o in node.outs}
    reads: dict[int, dict[int, CopyRead]] = {}
    for i, node in enumerate(graph.nodes):
        for k in _transposed_operands(node):
            v = node.ins[k]
            # an argument's kernel is copied where it is read
            first = min(producer[v] + 1, i) if v in producer else (0 if k == 0 else i)
            out.hold(first, i, nbytes(v))
            if node.ins.count(v) == 1:
                reads.setdefault(i, {})[v] = CopyRead(first, i)
    return reads


def _held_wide(
    graph: Graph,
    spec: Mapping[int, TensorSpec],
    prog: FlatProgram,
    widen: Mapping[np.dtype, np.dtype] | None,
    cpu: bool | CpuBackend,
) -> tuple[Mapping[np.dtype, np.dtype] | None, set[int]]:
    """(the ``widen`` the temporaries are held by, the 16-bit values held in float32
    besides): a backend that runs 16-bit dots natively keeps 16-bit temporaries at
    their size but for :func:`_float32_results` (its resharded copies are widened
    elsewhere, as ``widen`` says)."""
    if not getattr(cpu, "native_16bit_dots", False):
        return widen, set()
    if widen:
        widen = {k: d for k, d in widen.items() if k not in SIXTEEN_BIT_FLOATS} or None
    return widen, _float32_results(graph, spec, prog)


def _held_layout(
    spec: Mapping[int, TensorSpec],
    prog: FlatProgram,
    widen: Mapping[np.dtype, np.dtype] | None,
    wide: set[int],
) -> Callable[[int], TensorSpec]:
    """Value id → its layout as the backend holds it: in the dtype ``widen`` maps
    its own to, or in float32 for the values of ``wide``."""

    def layout(v: int) -> TensorSpec:
        s = spec.get(v)
        if s is None:
            s = TensorSpec(prog.shapes[v], dtype=prog.dtypes[v])
        if widen and s.dtype in widen:
            s = s.replace(dtype=widen[s.dtype])
        elif v in wide:
            s = s.replace(dtype=np.dtype(np.float32))
        return s

    return layout


def _float32_dots(graph: Graph, prog: FlatProgram) -> list[int]:
    """Indices of the 16-bit float dots XLA:CPU runs in float32 where it runs the
    others natively (:func:`~spmdkit.propagation.workspaces.float32_dot`)."""
    out = []
    for i, node in enumerate(graph.nodes):
        if node.prim != "dot_general" or node.eqn is None or len(node.ins) != 2:
            continue
        lhs, rhs = node.ins
        if not {prog.dtypes[lhs], prog.dtypes[rhs]} & SIXTEEN_BIT_FLOATS:
            continue
        dims = node.eqn.params["dimension_numbers"]
        if float32_dot(len(prog.shapes[lhs]), len(prog.shapes[rhs]), dims):
            out.append(i)
    return out


def _float32_results(graph: Graph, spec: Mapping[int, TensorSpec], prog: FlatProgram) -> set[int]:
    """The 16-bit values XLA:CPU holds in float32 where it runs 16-bit dots
    natively: the results of :func:`_float32_dots`, and the partial sums it
    reduces (its collectives reduce 16-bit floats in float32, so the partial sum
    is converted as it is made)."""
    out = {o for i in _float32_dots(graph, prog) for o in graph.nodes[i].outs}
    out |= {v for node in graph.nodes for v in node.outs if v in spec and spec[v].partial}
    return {v for v in out if prog.dtypes[v] in SIXTEEN_BIT_FLOATS}


def _float32_dot_copies(
    graph: Graph, prog: FlatProgram, layout: Any, mesh: MeshLike, out: _Copies
) -> dict[int, dict[int, CopyRead]]:
    """The float32 copies of the 16-bit operands of :func:`_float32_dots` (XLA:CPU
    converts them for its Eigen dot): each made as soon as its operand exists (at
    the start for an input of the graph) and held until the dot, which reads it in
    the operand's place (``copy_reads``, as :func:`_transposed_copies`)."""
    producer = {o: i for i, node in enumerate(graph.nodes) for o in node.outs}
    reads: dict[int, dict[int, CopyRead]] = {}
    for i in _float32_dots(graph, prog):
        node = graph.nodes[i]
        for v in dict.fromkeys(node.ins):
            s = layout(v)
            if s.dtype not in SIXTEEN_BIT_FLOATS:
                continue
            first = min(producer[v] + 1, i) if v in producer else 0
            out.hold(first, i, s.replace(dtype=np.dtype(np.float32)).local_bytes(mesh))
            reads.setdefault(i, {})[v] = CopyRead(first, i)
    return reads


def _transposed_operands(node: Any) -> tuple[int, ...]:
    """The operands XLA:CPU runs this equation on transposed copies of (module
    docstring): a convolution's input when it is not batch-major and
    feature-minor, its kernel when it is not spatial-major, input-feature then
    output-feature (the filter gradient's cotangent, as its kernel)."""
    if node.prim != "conv_general_dilated" or node.eqn is None:
        return ()
    dims = node.eqn.params["dimension_numbers"]
    lhs, rhs = tuple(dims.lhs_spec), tuple(dims.rhs_spec)
    n = len(rhs)
    return tuple(
        k
        for k, moved in enumerate(
            (lhs[:2] != (0, n - 1), rhs[:2] != (n - 1, n - 2) or rhs[2:] != tuple(range(n - 2)))
        )
        if moved
    )


def _temp_peak(
    graph: Graph,
    spec: Mapping[int, TensorSpec],
    mesh: MeshLike,
    prog: FlatProgram,
    exclude: set[int],
    fuse: bool = True,
    transient: Sequence[int] | None = None,
    duplicate: bool = True,
    widen: Mapping[np.dtype, np.dtype] | None = None,
    inner: Mapping[int, tuple[int, ...]] | None = None,
    cpu: bool | CpuBackend = False,
    copy_reads: Mapping[int, Mapping[int, CopyRead]] | None = None,
    held: Mapping[int, RegionHold] | None = None,
    outputs: Sequence[tuple[int | None, int, int | None]] = (),
    loops: Mapping[int, BodyCopies] | None = None,
    parts: list[int] | None = None,
) -> int:
    """Peak bytes of values born inside ``graph`` (minus ``exclude``), by liveness;
    ``transient[i]`` bytes (resharded operands) are live during node ``i`` only.
    ``duplicate``: a cheap elementwise value read by several consumers is fused
    into each of them; False: only single-reader values fuse, the others are
    materialized once. ``widen``: dtype → the dtype its values are held in.
    ``inner``: ``id(node)`` → the buffers a node holds while it runs (those live
    at its region program's peak), in this graph or a nested body.
    ``cpu``: add XLA:CPU's workspaces (:mod:`spmdkit.propagation.workspaces`).
    ``copy_reads``: node index → {value id: the resharded copy the node reads in
    its place} (:func:`_lifetimes`). ``held``: ``id(node)`` → what a grad region
    holds before it runs (:class:`RegionHold`), in this graph or a nested body.
    ``outputs``: per output of the program, its value (None: made at the end),
    bytes and the donated argument it reuses (or None): temporaries XLA places in
    their buffers are not counted
    (:func:`~spmdkit.propagation.buffers.output_allocations`), nor the buffers of
    a loop body at its peak or of a region's own program it places there.
    ``parts``: filled with the sizes of the buffers live at the peak.

    A node that reshards an operand runs in two steps: its collectives (the
    operand and its new copy both live, the node's results not yet made), then
    the node itself (an operand that only the collective read is freed)."""
    widen, wide = _held_wide(graph, spec, prog, widen, cpu)
    cache: dict[int, int] = dict.fromkeys(_narrowed(graph, prog, widen), 0) if widen else {}
    layout = _held_layout(spec, prog, widen, wide)

    def nbytes(v: int) -> int:
        b = cache.get(v)
        if b is None:
            on_host = v in prog.host and not cpu
            b = cache[v] = 0 if on_host else layout(v).local_bytes(mesh)
        return b

    copies, copy_reads = _workspaces(graph, prog, layout, nbytes, mesh, cpu, copy_reads)
    _region_holds(graph, held or {}, copies)
    aliases = _aliases(graph, spec, prog, nbytes, copy_reads)
    last, fused, extended, applied = _lifetimes(graph, prog, fuse, duplicate, copy_reads, aliases)
    fused |= _output_roots(graph, exclude & set(graph.outvars), applied)
    _extend_copies(extended, mesh, widen, copies)
    # three steps per node: 3i its collectives (operands and new copies), 3i + 1
    # the node itself (results and copies; an operand only the collective read is
    # gone), 3i + 2 after it (what is made as soon as the node's results exist:
    # copies of them, outputs that read them)
    temps = [Span(max(0, 3 * first - 1), 3 * end + 1, n, at) for first, end, n, at in copies.spans]
    temp_of: dict[int, int] = {}
    for i, node in enumerate(graph.nodes):
        for o in node.outs:
            if o in exclude or o in fused:
                continue
            j = last.get(o, i)
            c = copy_reads.get(j, {}).get(o)
            temp_of[o] = len(temps)
            temps.append(Span(3 * i + 1, 3 * j + (c is None or c.made != j), nbytes(o), i))
    bodies, body_parts = _body_peaks(
        graph, spec, mesh, prog, fuse, duplicate, widen, inner, cpu, held, loops
    )
    # per node, bytes live while it runs: reshards and workspaces, its region's by buffer
    extras = [
        (transient[i] if transient is not None and i < len(transient) else 0)
        + copies.during.get(i, 0)
        for i in range(len(graph.nodes))
    ]
    holds = NodeHolds(extras, [own_parts(inner, n) for n in graph.nodes], bodies, body_parts)
    if outputs:
        temps, placed = heap_temps(
            graph,
            outputs,
            spec,
            mesh,
            widen,
            copy_reads,
            temps,
            temp_of,
            extras,
            last,
            fused,
            applied,
            movable := holds.movable(),
        )
        holds.place(placed, movable)
    if parts is None:
        return peak(temps + holds.spans())
    parts.extend(peak_parts(temps + holds.spans()))
    return sum(parts)


def _body_peaks(
    graph: Graph,
    spec: Mapping[int, TensorSpec],
    mesh: MeshLike,
    prog: FlatProgram,
    fuse: bool,
    duplicate: bool,
    widen: Mapping[np.dtype, np.dtype] | None,
    inner: Mapping[int, tuple[int, ...]] | None,
    cpu: bool | CpuBackend,
    held: Mapping[int, RegionHold] | None,
    loops: Mapping[int, BodyCopies] | None = None,
) -> tuple[list[int], list[tuple[int, ...]]]:
    """Per node, the peak of its loop bodies' own temporaries (0 for none), a scan's
    body's resharded copies included (``loops``, by node index), and the sizes of
    the buffers live at that peak."""
    peaks, parts = [], []
    for i, node in enumerate(graph.nodes):
        copies = (loops or {}).get(i)
        best, best_parts = 0, ()
        for sub in node.subs:
            found: list[int] = []
            b = _temp_peak(
                sub,
                spec,
                mesh,
                prog,
                set(sub.invars),
                fuse,
                transient=copies.transient if copies else None,
                duplicate=duplicate,
                widen=widen,
                inner=inner,
                cpu=cpu,
                held=held,
                loops=copies.nested if copies else None,
                parts=found,
            )
            if b > best:
                best, best_parts = b, tuple(found)
        peaks.append(best)
        parts.append(best_parts)
    return peaks, parts


def _workspaces(
    graph: Graph,
    prog: FlatProgram,
    layout: Any,
    nbytes: Any,
    mesh: MeshLike,
    cpu: bool | CpuBackend,
    copy_reads: Mapping[int, Mapping[int, CopyRead]] | None,
) -> tuple[_Copies, dict[int, dict[int, CopyRead]]]:
    """The backend's own buffers (transposed convolution inputs; on XLA:CPU, the
    max-pool gradient's workspace and the float32 operands of the 16-bit dots it
    does not run natively) and ``copy_reads`` with the copies read in place of
    their values."""
    copies = _Copies()
    transposed = _transposed_copies(graph, nbytes, copies)
    if cpu:
        cpu_workspaces(graph, layout, mesh, copies)
    if getattr(cpu, "native_16bit_dots", False):
        for i, via in _float32_dot_copies(graph, prog, layout, mesh, copies).items():
            transposed.setdefault(i, {}).update(via)
    reads = {
        i: {**transposed.get(i, {}), **(copy_reads or {}).get(i, {})}
        for i in set(transposed) | set(copy_reads or {})
    }
    return copies, reads


def _extend_copies(
    extended: Mapping[CopyRead, int],
    mesh: MeshLike,
    widen: Mapping[np.dtype, np.dtype] | None,
    out: _Copies,
) -> None:
    """Hold each resharded copy a backward node recomputes a forward value from
    (:func:`_lifetimes`) from after its own last reader to that node."""
    for c, j in extended.items():
        if c.spec is None or j <= c.last:
            continue
        s = c.spec
        if widen and s.dtype in widen:
            s = s.replace(dtype=widen[s.dtype])
        out.hold(c.last + 1, j, s.local_bytes(mesh), at=c.made)


#: Primitives that only move elements: fused into a collective that reads them.
_MOVES_ONLY = frozenset({"transpose", "reshape", "squeeze", "broadcast_in_dim"})

#: Primitives whose result is their operand when the layouts agree (no buffer).
_LAYOUT_ONLY = frozenset({"sharding_constraint", "reshard"})


#: Primitives that only reinterpret their operand's shape: on XLA's row-major
#: layouts a bitcast (the same buffer) when each device keeps its block.
_RESHAPES = frozenset({"reshape", "squeeze", "expand_dims"})


def _bitcast(node: Node, prog: FlatProgram) -> bool:
    """A reshape, or a transpose that moves only size-1 dims (the other dims keep
    their order): XLA makes it a bitcast of its operand."""
    if node.prim in _RESHAPES:
        return True
    if node.prim != "transpose":
        return False
    shape = prog.shapes[node.ins[0]]
    moved = [d for d in node.eqn.params["permutation"] if shape[d] != 1]
    return moved == sorted(moved)


def _aliases(
    graph: Graph,
    spec: Mapping[int, TensorSpec],
    prog: FlatProgram,
    nbytes: Callable[[int], int],
    copy_reads: Mapping[int, Mapping[int, CopyRead]] | None,
) -> dict[int, int]:
    """Result id → operand id of nodes whose result is their operand's buffer:
    layout constraints that leave their operand's layout as it is (XLA drops
    them), and bitcasts (:func:`_bitcast`) that reshard nothing (each device's
    block is its operand's, as many bytes, read in place)."""
    out = {}
    zeros = zero_values(graph, prog)
    for i, node in enumerate(graph.nodes):
        ins = node.ins
        if node.prim in ("add", "add_any") and len(ins) == 2 and len(node.outs) == 1:
            # XLA folds x + 0 into x
            ins = [v for v in ins if v not in zeros]
        if len(ins) != 1 or len(node.outs) != 1:
            continue
        a, b = spec.get(ins[0]), spec.get(node.outs[0])
        if node.prim in ("add", "add_any"):
            if (
                prog.shapes[ins[0]] == prog.shapes[node.outs[0]]
                and (
                    (a is None) == (b is None)
                    and (a is None or (a.dims, a.partial) == (b.dims, b.partial))
                )
                and not (copy_reads and copy_reads.get(i))
            ):
                out[node.outs[0]] = ins[0]
        elif node.prim in _LAYOUT_ONLY:
            if a is None or b is None or (a.dims, a.partial) == (b.dims, b.partial):
                out[node.outs[0]] = node.ins[0]
        elif (
            node.kind == "eqn"
            and _bitcast(node, prog)
            and not (copy_reads and copy_reads.get(i))
            and (a is None) == (b is None)
            and (a is None or a.partial == b.partial)
            and nbytes(node.ins[0]) == nbytes(node.outs[0])
        ):
            out[node.outs[0]] = node.ins[0]
    return out


def _output_roots(graph: Graph, outputs: set[int], aliases: Mapping[int, int]) -> set[int]:
    """Values that outputs are bitcasts of (through ``aliases``): the output's
    buffer, counted with the outputs, not as temporaries."""
    roots = set()
    for o in outputs:
        v = o
        while v in aliases:
            v = aliases[v]
            roots.add(v)
    return roots - set(graph.invars)


def _narrowed(graph: Graph, prog: FlatProgram, widen: Mapping[np.dtype, np.dtype]) -> set[int]:
    """Values cast down to a dtype the backend holds wider, from that wider dtype:
    the backend drops the round trip (excess precision) and reads the source, so
    the cast copy takes no buffer of its own. Not a cast to float8: its rounding
    is the quantization (``spmdkit.step.fp8``), kept, so the quantized copy is a
    buffer (held wide)."""
    out = set()
    for node in graph.nodes:
        if node.prim != "convert_element_type" or len(node.ins) != 1:
            continue
        src, dst = prog.dtypes[node.ins[0]], prog.dtypes[node.outs[0]]
        if widen.get(dst) == src and not dst.name.startswith("float8"):
            out.add(node.outs[0])
    return out


def _outputs(
    graph: Graph,
    out_specs: Sequence[TensorSpec],
    mesh: MeshLike,
    args: set[int],
    donated: set[int],
    donated_args: list[tuple[int, int]],
    pending: set[int],
) -> list[tuple[int | None, int, int | None]]:
    """Per distinct output: its value (None: made at the end), bytes, and the
    donated argument it reuses (the first of its size in ``donated_args``, taken)."""
    out, seen = [], set()
    for v, s in zip(graph.outvars, out_specs, strict=True):
        if v in seen:
            continue
        seen.add(v)
        b = s.local_bytes(mesh)
        if v in args:  # an input returned as is: XLA copies unless donated
            b = b if v not in donated else 0
        reused = next((a for a in donated_args if a[0] == b), None) if b else None
        if reused is not None:
            donated_args.remove(reused)
        made = None if v in args or v in pending else v
        out.append((made, b, None if reused is None else reused[1]))
    return out


def liveness(
    graph: Graph,
    spec: Mapping[int, TensorSpec],
    out_specs: Sequence[TensorSpec],
    mesh: MeshLike,
    prog: FlatProgram,
    *,
    donated: set[int] = frozenset(),
    roles: Mapping[int, str] | None = None,
    transient: Sequence[int] | None = None,
    duplicate: bool = True,
    widen: Mapping[np.dtype, np.dtype] | None = None,
    inner: Mapping[int, tuple[int, ...]] | None = None,
    cpu: bool | CpuBackend = False,
    copy_reads: Mapping[int, Mapping[int, CopyRead]] | None = None,
    held: Mapping[int, RegionHold] | None = None,
    loops: Mapping[int, BodyCopies] | None = None,
) -> MemoryEstimate:
    """The estimate for a flattened program (see :mod:`spmdkit.propagation`).

    Args:
      graph: the flattened program (invars, outvars, nodes).
      spec: value id → spec.
      out_specs: the final output specs (pending reductions resolved).
      mesh: the mesh.
      prog: the value table (shapes, dtypes).
      donated: donated input value ids.
      roles: input value id → role.
      transient: per node, bytes of operands resharded for it (live during it).
      duplicate: fuse a cheap elementwise value read by several consumers into
        each of them (recomputed there); False fuses single-reader values only
        and materializes the others once.
      widen: dtype → a wider dtype the backend holds its temporaries in (XLA's
        CPU backend computes 16-bit floats in float32); arguments and outputs
        keep their own dtypes.
      inner: ``id(node)`` → the buffers a node holds while it runs besides its
        results (those live at its region program's peak:
        :func:`~spmdkit.propagation.regions.region_temp_parts`).
      cpu: add the workspaces XLA's CPU backend takes where it expands an op
        (:mod:`spmdkit.propagation.workspaces`); a
        :class:`~spmdkit.propagation.workspaces.CpuBackend` that runs 16-bit dots
        natively also keeps 16-bit temporaries at their size (not ``widen``ed),
        but for the float32 ones it makes (its ``native_16bit_dots``).
      copy_reads: node index → {value id: the resharded copy of it that the
        node reads (:class:`CopyRead`)}: the value is materialized for the
        collective, freed once no node reads it in its own layout (its copies
        live in ``transient``; one that a backward node recomputes a forward
        value from lives on to it), and one that only the collective of node
        ``i`` reads is freed before node ``i``'s results are made.
      loops: node index → the resharded copies of the scan there
        (:class:`BodyCopies`), held inside its body's liveness.
    """
    roles = dict(roles or {})
    by_role: dict[str, int] = {}
    arg_bytes = 0
    seen_args: set[int] = set()
    donated_args: list[tuple[int, int]] = []  # (bytes, value id)
    for v in graph.invars:
        if v in seen_args:
            continue
        seen_args.add(v)
        s = spec.get(v) or TensorSpec(prog.shapes[v], dtype=prog.dtypes[v])
        b = s.local_bytes(mesh)
        arg_bytes += b
        role = roles.get(v, "other")
        by_role[role] = by_role.get(role, 0) + b
        if v in donated:
            donated_args.append((b, v))
    # an output that still needs a reduction is a temporary; its reduced copy is the output
    pending = {
        v
        for v, s in zip(graph.outvars, out_specs, strict=True)
        if v in spec and (spec[v].dims, spec[v].partial) != (s.dims, s.partial)
    }
    allocations = _outputs(graph, out_specs, mesh, seen_args, donated, donated_args, pending)
    out_bytes = sum(b for _, b, _ in allocations)
    alias = sum(b for _, b, arg in allocations if arg is not None)
    seen_out = set(graph.outvars)
    temp = _temp_peak(
        graph,
        spec,
        mesh,
        prog,
        seen_args | (seen_out - pending),
        transient=transient,
        duplicate=duplicate,
        widen=widen,
        inner=inner,
        cpu=cpu,
        copy_reads=copy_reads,
        held=held,
        outputs=allocations,
        loops=loops,
    )
    by_role["temp"] = by_role.get("temp", 0) + temp
    by_role["output"] = by_role.get("output", 0) + out_bytes - alias
    return MemoryEstimate(
        peak_bytes=arg_bytes + out_bytes - alias + temp,
        argument_bytes=arg_bytes,
        output_bytes=out_bytes,
        temp_bytes=temp,
        by_role=by_role,
        alias_bytes=alias,
    )


def estimate_memory(
    closed_jaxpr: Any,
    var_specs: Mapping[Any, TensorSpec],
    mesh: MeshLike,
    *,
    donated: Sequence[int] = (),
    roles: Sequence[str | None] | None = None,
    cpu: bool | CpuBackend = False,
) -> MemoryEstimate:
    """Per-device memory of ``closed_jaxpr`` with the given layouts.

    Args:
      closed_jaxpr: the program (e.g. ``Propagation.closed_jaxpr``).
      var_specs: jaxpr variable → spec (e.g. ``Propagation.var_specs``);
        variables not listed (and those inside inlined calls) are replicated.
      mesh: the mesh.
      donated: indices of donated flat inputs.
      roles: per flat input, a role name or None.
      cpu: add XLA:CPU's workspaces (see :func:`liveness`).

    Example::

        >>> prop = sk.propagate(step, params, batch, in_specs=..., mesh=mesh)
        >>> estimate_memory(prop.closed_jaxpr, prop.var_specs, mesh).peak_bytes
        1245184
    """
    prog = FlatProgram()
    graph, env = prog.graph(closed_jaxpr)
    dce(graph)
    spec = {vid: var_specs[v] for v, vid in env.items() if v in var_specs}
    outs = [
        (spec.get(v) or TensorSpec(prog.shapes[v], dtype=prog.dtypes[v])).without_partial()
        for v in graph.outvars
    ]
    donated_ids = {graph.invars[i] for i in donated}
    role_ids = (
        {} if roles is None else {graph.invars[i]: r for i, r in enumerate(roles) if r is not None}
    )
    return liveness(graph, spec, outs, mesh, prog, donated=donated_ids, roles=role_ids, cpu=cpu)


_NO_MESH = jax.sharding.AbstractMesh((), ())


def program_temp_bytes(
    closed_jaxpr: Any, *, duplicate: bool = True, cpu: bool = False, parts: list | None = None
) -> int:
    """Peak bytes of a program's temporaries: the values it makes that are
    neither its inputs nor its outputs, by liveness with the fusion model above
    (``cpu``: with XLA:CPU's workspaces; ``parts``: filled with the sizes of the
    buffers live at that peak).

    Every value is taken at its own (per-device) shape: pass the body of a
    ``shard_map`` to get what one device holds while the body runs.

    Example::

        >>> body = jax.make_jaxpr(lambda x: jnp.exp(x) @ x)(jnp.ones((64, 64)))
        >>> program_temp_bytes(body)   # exp(x) is materialized for the matmul
        16384
    """
    prog = FlatProgram()
    graph, _ = prog.graph(closed_jaxpr)
    dce(graph)
    ends = set(graph.invars) | set(graph.outvars)
    return _temp_peak(graph, {}, _NO_MESH, prog, ends, duplicate=duplicate, cpu=cpu, parts=parts)


def fused_values(graph: Graph, prog: FlatProgram, *, duplicate: bool = True) -> set[int]:
    """Ids of the values of ``graph`` that XLA fuses into their consumers (never
    materialized), by the fusion model of :func:`liveness`."""
    return _lifetimes(graph, prog, True, duplicate)[1]
