"""What reshards and equations cost, as XLA's partitioner does them.

:class:`Pricer` plans and prices the reshard between two specs of a value
(:func:`spmdkit.plan_reshard` under a :class:`~spmdkit.topology.Topology`), with
two conventions of XLA's: a pending reduction made by a scatter or gather is
reduced at the layout it was made in before it moves, and staged gathers (or
reduce-scatters) of one dim are one collective over all their axes. It also
sums the reshard time and the per-device FLOPs of the propagator's steps, and
:func:`reshard_once` reuses a layout a value was already moved to.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from spmdkit.engine.inference import ArgReshard
from spmdkit.propagation.graph import FILL, Node
from spmdkit.propagation.primitives import REDUCERS
from spmdkit.propagation.steps import Step
from spmdkit.resharding import Collective, ReshardPlan, plan_reshard
from spmdkit.spec import MeshLike, TensorSpec, axis_sizes
from spmdkit.topology import RAGGED_BACKENDS, Topology, mesh_platform
from spmdkit.util import CONTRACTIONS, contraction_flops

__all__ = [
    "Pricer",
    "node_flops",
    "charged_bytes",
    "on_link",
    "reshard_once",
    "steps_bytes",
    "steps_flops",
    "target_backend",
]

# Producers of sum-partial values that XLA reduces at the layout they were made in:
# it computes a dot's or a reduction's result directly in a sliced layout, but
# not a scatter's (an embedding's gradient is all-reduced whole, then sliced).
_REDUCE_IN_PLACE = frozenset({"scatter-add", "scatter_add", "scatter", "gather"})


def target_backend(mesh: MeshLike, topology: object) -> str:
    """The XLA backend whose passes the prediction follows: the mesh's devices'
    platform, else the topology's (:meth:`spmdkit.topology.Topology.target`), else
    jax's default backend."""
    target = getattr(topology, "target", None)
    if target is not None:
        return target(mesh)
    import jax

    return mesh_platform(mesh) or jax.default_backend()


def on_link(c: Collective, mesh: MeshLike, topology: Topology) -> Collective:
    """``c`` as the link carries it on ``topology``: a padded all-to-all that
    knows the rows it routes (``c.routed_bytes``: the routed experts' exchange,
    :mod:`spmdkit.rules.moe`) sends only those on a backend with a ragged
    all-to-all (:data:`~spmdkit.topology.RAGGED_BACKENDS`), so its wire bytes and
    time are theirs there (its payload stays the padded buffer the HLO shows, as
    the analytic model's :mod:`spmdkit.planner.experts` prices it); any other
    collective is returned as it is.

    Example::

        >>> from spmdkit.resharding import Collective
        >>> c = Collective("all_to_all", ("x",), 4, payload_bytes=4096,
        ...                wire_bytes=3072, routed_bytes=1024)
        >>> on_link(c, sk.abstract_mesh(x=4), sk.Topology.h100()).wire_bytes
        768
    """
    if c.routed_bytes is None or target_backend(mesh, topology) not in RAGGED_BACKENDS:
        return c
    n = c.group_size
    wire = c.routed_bytes * (n - 1) // n
    t = topology.collective_time(c.kind, wire, n, c.axes, mesh)
    return dataclasses.replace(c, wire_bytes=wire, time_s=t)


def charged_bytes(c: Collective, mesh: MeshLike, topology: Topology) -> int:
    """The bytes a choice among layouts compares for ``c`` (bytes first): what
    :func:`on_link` sends of a padded all-to-all on a backend with a ragged one
    (its routed rows), else its payload."""
    if c.routed_bytes is not None and target_backend(mesh, topology) in RAGGED_BACKENDS:
        return c.routed_bytes
    return c.payload_bytes


class Pricer:
    """Reshard plans and their costs on one mesh and topology, cached.

    ``producer`` (value id → the primitive that makes it) says which values are
    reduced in place (see :meth:`reshard`); ``widened`` (value id → the narrower
    dtype a cast widened it from) the dtype a pending sum carried through a
    widening cast is reduced in. The driver reads both off the graph.
    """

    def __init__(
        self,
        mesh: MeshLike,
        topology: Topology,
        *,
        producer: Mapping[int, str] | None = None,
        widened: Mapping[int, Any] | None = None,
    ) -> None:
        self.mesh = mesh
        self.topology = topology
        self.producer: dict[int, str] = dict(producer or {})
        self.widened: dict[int, Any] = dict(widened or {})
        self.key = (tuple(axis_sizes(mesh).items()), topology)
        self._plans: dict[tuple, ArgReshard | None] = {}

    def reshard(
        self, label: str, src: TensorSpec, dst: TensorSpec, vid: int | None = None
    ) -> ArgReshard | None:
        """The reshard of a value from ``src`` to ``dst`` (None when they agree).

        A value made by a scatter or gather (``vid``'s producer) is reduced at the
        layout it was made in before it moves (``ArgReshard.in_place``); a broadcast
        scalar (:data:`~spmdkit.propagation.graph.FILL`) moves for nothing: the
        replay makes it anew in the reader's layout."""
        if src.dims == dst.dims and src.partial == dst.partial:
            return None
        made = self.producer.get(vid) if vid is not None else None
        if made == FILL and not src.partial and not dst.partial:  # made where it is read
            return ArgReshard(label, src, dst, ReshardPlan(src, dst, ()))
        strict = made in _REDUCE_IN_PLACE
        # a pending sum carried through a widening cast: XLA reduces the producer's
        # result in its own (narrower) dtype, before the cast
        narrow = self.widened.get(vid) if vid is not None and src.partial else None
        key = (label, src, dst, strict, narrow)
        hit = self._plans.get(key, 0)
        if hit != 0:
            return hit
        dtype = dst.dtype if narrow is None else np.dtype(narrow)
        src_t = src if src.dtype == dtype else src.replace(dtype=dtype)
        dst_t = dst if dst.dtype == dtype else dst.replace(dtype=dtype)
        plan = plan_reshard(src_t, dst_t, self.mesh, topology=self.topology)
        if strict and not _reduces_first(plan):
            plan = self._reduce_then_move(src_t, dst_t)
        plan = self._one_group(plan)
        out = ArgReshard(label, src, dst, plan, in_place=strict)
        self._plans[key] = out
        return out

    def time(self, label: str, src: TensorSpec, dst: TensorSpec) -> float:
        """Modelled time of :meth:`reshard` (0 when nothing moves)."""
        a = self.reshard(label, src, dst)
        return a.plan.time_s if a is not None else 0.0

    def price(
        self, given: Sequence[TensorSpec], required: Sequence[TensorSpec], outs: Sequence
    ) -> tuple[int, float]:
        """(payload bytes, time) of the operand reshards plus resolving the outputs'
        pending reductions (most are paid later, so alternatives are compared with
        them included). Bytes come first: under the latency term a plan that adds
        small collectives to save hops looks cheaper than what XLA does."""
        pairs = list(zip(given, required, strict=True))
        pairs += [(o, o.without_partial()) for o in outs if o.partial]
        nbytes, t = 0, 0.0
        for i, (s, r) in enumerate(pairs):
            a = self.reshard(f"arg {i}", s, r)
            if a is not None:
                nbytes += a.payload_bytes
                t += a.plan.time_s
        return nbytes, t

    def steps_time(self, steps: Sequence[Step]) -> float:
        """Modelled reshard time of steps (loops: body × trip count)."""
        t = 0.0
        for step in steps:
            for s, r in zip(step.given, step.required, strict=True):
                t += self.time("input", s, r)
            if step.loop is not None:
                back = sum(a.plan.time_s for a in step.loop.back)
                t += step.loop.trips * (self.steps_time(step.loop.steps) + back)
        return t

    def _reduce_then_move(self, src: TensorSpec, dst: TensorSpec) -> ReshardPlan:
        """Reduce the pending axes ``dst`` does not keep at ``src``'s layout, then move."""
        keep = dict(dst.partial)
        mid = src.replace(partial={a: op for a, op in src.partial if keep.get(a) == op})
        first = plan_reshard(src, mid, self.mesh, topology=self.topology)
        then = plan_reshard(mid, dst, self.mesh, topology=self.topology)
        return ReshardPlan(src, dst, first.steps + then.steps)

    def _one_group(self, plan: ReshardPlan) -> ReshardPlan:
        """Staged gathers (or reduce-scatters) of one dim as the one collective over
        all their axes that XLA's partitioner emits (its payload: the full gathered
        block, or the whole reduce-scatter input)."""
        steps: list[Collective] = []
        merged = False
        for c in plan.steps:
            last = steps[-1] if steps else None
            if (
                last is not None
                and c.kind == last.kind
                and c.kind in ("all_gather", "reduce_scatter")
                and c.dim == last.dim
                and c.reduce_op == last.reduce_op
                and not c.is_local
                and not last.is_local
            ):
                steps[-1] = self._merged(last, c)
                merged = True
            else:
                steps.append(c)
        return ReshardPlan(plan.src, plan.dst, tuple(steps)) if merged else plan

    def _merged(self, last: Collective, c: Collective) -> Collective:
        axes = c.axes + last.axes if c.kind == "all_gather" else last.axes + c.axes
        n = last.group_size * c.group_size
        payload = max(c.payload_bytes, last.payload_bytes)
        wire = payload * (n - 1) // n
        return Collective(
            kind=c.kind,
            axes=axes,
            group_size=n,
            dim=c.dim,
            reduce_op=c.reduce_op,
            payload_bytes=payload,
            wire_bytes=wire,
            time_s=self.topology.collective_time(c.kind, wire, n, axes, self.mesh),
        )


def _reduces_first(plan: ReshardPlan) -> bool:
    """Whether every pending reduction of ``plan.src`` that ``plan.dst`` does not
    keep happens before any other step (a reduce-scatter straight into a dim
    counts as such a reduction): see :meth:`Pricer.reshard`."""
    keep = dict(plan.dst.partial)
    pending = {a for a, op in plan.src.partial if keep.get(a) != op}
    for c in plan.steps:
        if not pending:
            return True
        if c.kind in ("all_reduce", "reduce_scatter"):
            pending -= set(c.axes)
        elif c.kind != "to_partial":
            return False
    return True


def reshard_once(
    pricer: Pricer,
    avail: dict[int, list[TensorSpec]],
    vid: int,
    label: str,
    src: TensorSpec,
    dst: TensorSpec,
    held: dict | None = None,
    at: int = 0,
) -> ArgReshard | None:
    """The reshard of value ``vid`` to ``dst``, from the cheapest layout it already has.

    A value resharded once for one consumer is not resharded again for the
    next one that needs the same layout (XLA computes it once and keeps the copy:
    ``held[(vid, layout)]`` is ``[first use, last use, bytes]`` over top-level
    equation indices ``at``)."""
    if src.dims == dst.dims and src.partial == dst.partial:
        return None
    have = avail.setdefault(vid, [src])
    if src not in have:
        have.insert(0, src)
    for h in have:
        if h.dims == dst.dims and h.partial == dst.partial:
            if held is not None and (vid, h) in held:
                held[(vid, h)][1] = at
            return None
    best = None
    for h in have:
        a = pricer.reshard(label, h, dst, vid)
        if a is not None and (
            best is None
            or (a.plan.time_s, a.payload_bytes) < (best.plan.time_s, best.payload_bytes)
        ):
            best = a
    have.append(dst)
    if held is not None and best is not None and best.plan.collectives:
        held[(vid, dst)] = [at, at, dst.local_bytes(pricer.mesh)]
    return best


def node_flops(
    node: Node, req: Sequence[TensorSpec], outs: Sequence[TensorSpec], mesh: MeshLike
) -> float:
    """Per-device FLOPs of a node in the given layouts: a contraction's multiply-adds
    of the local blocks, a reduction's operand elements, one per output element
    elsewhere (loops and branches: 0, their bodies count).

    A grouped GEMM (``ragged_dot_general``) counts its local rows times one group's
    local weights whatever shards the groups: with the experts sharded each device
    still runs every row it holds (those of other devices' experts meet a zero
    group, :mod:`spmdkit.rules.ragged`), so expert parallelism over replicated
    tokens divides the weights, not the FLOPs."""
    if node.prim in CONTRACTIONS and len(req) >= 2 and outs:
        lhs, rhs = (r.local_shape(mesh) for r in req[:2])
        return contraction_flops(node.prim, node.eqn.params, lhs, rhs, outs[0].local_shape(mesh))
    if node.prim in REDUCERS or node.prim in ("argmax", "argmin"):
        return float(math.prod(req[0].local_shape(mesh))) if req else 0.0
    if node.kind != "eqn" or not outs:
        return 0.0
    return float(sum(math.prod(o.local_shape(mesh)) for o in outs))


def steps_bytes(steps: Sequence[Step], mesh: MeshLike) -> float:
    """Per-device bytes the steps' equations write: their results' local blocks
    (loops: body × trip count; a loop's own results are its body's). A value
    computed replicated where its readers hold it sharded is written whole on
    every device: work that :func:`steps_flops` prices at the matmul peak, one
    FLOP an element, though it streams through device memory.

    Example::

        >>> steps_bytes([], sk.abstract_mesh(data=2))
        0.0
    """
    total = 0.0
    for step in steps:
        if step.loop is not None:
            total += step.loop.trips * steps_bytes(step.loop.steps, mesh)
        elif step.node.kind == "eqn":
            total += float(sum(o.local_bytes(mesh) for o in step.outputs))
    return total


def steps_flops(steps: Sequence[Step], mesh: MeshLike) -> float:
    """Per-device FLOPs of steps (loops: body × trip count)."""
    total = 0.0
    for step in steps:
        total += node_flops(step.node, step.required, step.outputs, mesh)
        if step.loop is not None:
            total += step.loop.trips * steps_flops(step.loop.steps, mesh)
    return total
