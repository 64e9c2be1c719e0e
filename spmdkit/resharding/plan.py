"""Reshard planning: the cheapest collectives that move a tensor between two specs, and their cost.

Semantics follow PaddlePaddle's reshard functions, done one mesh axis at a time:

================  ==================  =========================================
from              to                  step
================  ==================  =========================================
sharded           finer, other order  ``collective_permute`` (one block each)
replicated        sharded             ``slice`` (local, no communication)
sharded           replicated          ``all_gather``
partial           replicated          ``all_reduce`` with the partial's op
partial           sharded             ``reduce_scatter`` straight into the dim
sharded dim i     sharded dim j       ``all_to_all`` (same axes, other dim)
replicated        partial             ``to_partial`` (local: one rank keeps the
                                      value, the others the op's identity)
partial op A      partial op B        ``all_reduce`` then ``to_partial``
sharded           partial             ``all_gather`` then ``to_partial``
================  ==================  =========================================

A dim sharded over several axes lists them major → minor. Only the minor-most
axis of a dim can leave it (gather or all-to-all) and a new axis always joins as
the minor-most one (slice, reduce-scatter, all-to-all), so the common prefix of
the source and target tuples stays, the source axes beyond it leave minor-most
first, and the target axes beyond it join in order. An axis that leaves one dim
and joins another moves in one ``all_to_all``; several such axes that sit in the
same order at the minor end of one dim and at the join point of the other move
together in one ``all_to_all`` over their product.

**Ordering.** Every legal order of these steps reaches the target, but the bytes
differ: each collective moves the local block *as it is at that moment*. The
planner searches the (small) space of legal orders with Dijkstra under the
:class:`~spmdkit.topology.Topology` cost model — time first, then wire bytes,
payload bytes, and number of steps — so pending reductions are resolved while the
block is small, slices that do not conflict run *before* gathers when that makes
the gathers cheaper, and deadlocks (``P('a','b') -> P('b','a')``) fall back to
gather-then-slice. Then every local step is moved as late as it can go without
making any collective more expensive, and runs of local steps are sorted, so
equal-cost plans print the same way. Gathers and reduce-scatters are staged one
axis at a time (under the ring model a staged gather sends the same wire bytes
with fewer latency hops, and the slow inter-node axis carries less). Pending
reductions of one op that can go at the same point run as *one* all-reduce over
all their axes, as XLA emits them (staged all-reduces would send more bytes:
``2(n-1)/n`` of the full block per stage).

**Mixed partial ops.** Partial axes reduce in name order (see
:mod:`spmdkit.spec`); a reduction may jump ahead of a pending axis only when the
two ops commute (equal ops, or sum with avg). Otherwise the blocking axis is
reduced first and, if the target keeps it partial, made partial again.

**Device permutations.** A layout whose block on every device holds a block of
the goal's (finer or equal in every dim, no pending sum on either side) reaches
it in one ``collective_permute``: every device sends one block of the goal's size
to the one device that needs it (the devices holding a source block and those
needing the goal's blocks inside it are as many), as XLA moves it. So
``P(('model', 'data')) -> P(('data', 'model'))`` is one permute of the block, and
``P('data') -> P('model')`` on ``data=2, model=4`` a permute of half the block
(XLA slices, then permutes). A permute is only ever the last step into the goal:
XLA also permutes into layouts it then gathers (``P(('data', 'model')) ->
P('model')``: a permute into ``P(('model', 'data'))``, a gather over ``data``;
``P('model') -> P('data')``: a gather over half of ``model``), where a plan
gathers first; offered to the propagator, the permute-then-gather made loop
bodies pick layouts whose stacked results the step's outputs then gathered.

**Bytes.** ``payload_bytes`` is the per-device buffer XLA's HLO shows for that
collective: the all-gather output, the all-reduce operand, the reduce-scatter
input, the all-to-all operand, the collective-permute operand (the target's
block). Uneven dims are padded (ceil-divided local shapes,
as XLA pads) and the padding is counted. ``wire_bytes`` is what each device sends
with ring algorithms: ``(n-1)/n × payload``, twice that for all-reduce, the
whole block for a collective-permute.

:mod:`spmdkit.resharding.execute` runs a plan on a ``jax.Array``.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass
from typing import NamedTuple

from jax.sharding import AbstractMesh, AxisType

from spmdkit.errors import ReshardError, SpmdError
from spmdkit.spec import MeshLike, TensorSpec, axis_sizes
from spmdkit.state import cached
from spmdkit.topology import COLLECTIVE_KINDS, DEFAULT_TOPOLOGY, LOCAL_KINDS, Topology
from spmdkit.util import fmt_bytes, fmt_time

__all__ = ["Collective", "ReshardPlan", "plan_reshard", "clear_cache", "KINDS"]

#: Every step kind a plan may hold.
KINDS = (
    "slice",
    "all_gather",
    "all_reduce",
    "reduce_scatter",
    "all_to_all",
    "to_partial",
    "collective_permute",  # a block to another device (a reshard's, or a ring's)
)

_KIND_ORDER = {k: i for i, k in enumerate(KINDS)}

_Dims = tuple[tuple[str, ...], ...]
_Partial = tuple[tuple[str, str], ...]
_State = tuple[_Dims, _Partial]


@dataclass(frozen=True)
class Collective:
    """One reshard step: a collective over a group of devices, or a local op.

    Attributes:
      kind: ``"slice"``, ``"all_gather"``, ``"all_reduce"``, ``"reduce_scatter"``,
        ``"all_to_all"``, ``"collective_permute"`` or ``"to_partial"``; ``slice``
        and ``to_partial`` are local (no communication).
      axes: mesh axes of the group, major → minor.
      group_size: devices in the group (product of the axes' sizes).
      dim: tensor dim gathered / scattered / sliced (all-to-all: the source dim).
      dst_dim: all-to-all target dim.
      reduce_op: reduce op of all_reduce / reduce_scatter / to_partial.
      payload_bytes: per-device buffer as XLA's HLO shows it (all-gather output,
        all-reduce operand, reduce-scatter input, all-to-all operand); 0 if local.
      wire_bytes: bytes each device sends with ring algorithms.
      time_s: alpha-beta time from the plan's :class:`Topology`.
      layouts: a ``collective_permute``'s dims before and after it (each dim's
        mesh axes, major → minor); None for the other kinds.
      routed_bytes: an all-to-all whose buffer is padded for the worst case (the
        routed experts' exchange, :mod:`spmdkit.rules.moe`): the bytes of the rows
        it carries with balanced routing, what a backend with a ragged all-to-all
        sends (:func:`spmdkit.propagation.pricing.on_link`); None for every other collective.

    Example::

        >>> str(Collective("all_gather", ("x",), 4, dim=0, payload_bytes=1024,
        ...                wire_bytes=768))
        'all_gather(x) dim0 4×: 1.0 KiB'
    """

    kind: str
    axes: tuple[str, ...]
    group_size: int
    dim: int | None = None
    dst_dim: int | None = None
    reduce_op: str | None = None
    payload_bytes: int = 0
    wire_bytes: int = 0
    time_s: float = 0.0
    layouts: tuple[_Dims, _Dims] | None = None
    routed_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise SpmdError(
                op="Collective",
                must=f"kind is one of {KINDS}",
                given=repr(self.kind),
                fix="use one of the listed kinds",
            )
        axes = (self.axes,) if isinstance(self.axes, str) else tuple(self.axes)
        object.__setattr__(self, "axes", axes)
        if not axes or self.group_size < 1 or self.payload_bytes < 0 or self.wire_bytes < 0:
            raise SpmdError(
                op="Collective",
                must="at least one axis, group_size >= 1 and bytes >= 0",
                given=f"axes={axes}, group_size={self.group_size}, "
                f"payload_bytes={self.payload_bytes}, wire_bytes={self.wire_bytes}",
                fix="build steps with plan_reshard",
            )

    @property
    def is_local(self) -> bool:
        """True when no data moves between devices (local kinds, or a group of one)."""
        return self.kind in LOCAL_KINDS or self.group_size == 1

    def __str__(self) -> str:
        head = self.kind
        if self.reduce_op is not None:
            head += f"[{self.reduce_op}]"
        text = f"{head}({','.join(self.axes)})"
        if self.dst_dim is not None:
            text += f" dim{self.dim}→{self.dst_dim}"
        elif self.dim is not None:
            text += f" dim{self.dim}"
        if self.layouts is not None:
            text += f" →{_fmt_dims(self.layouts[1])}"
        cost = "local" if self.is_local else fmt_bytes(self.payload_bytes)
        return f"{text} {self.group_size}×: {cost}"


@dataclass(frozen=True)
class ReshardPlan:
    """The ordered steps that move a tensor from ``src`` to ``dst``.

    Attributes:
      src: the starting spec.
      dst: the target spec.
      steps: the steps, in order (local steps included).

    Example::

        >>> plan = plan_reshard(TensorSpec((8, 4), P("x"), dtype="float32"),
        ...                     TensorSpec((8, 4), dtype="float32"), abstract_mesh(x=4))
        >>> print(plan)
        f32[8@x,4] -> f32[8,4]: all_gather(x) dim0 4×: 128 B
    """

    src: TensorSpec
    dst: TensorSpec
    steps: tuple[Collective, ...]

    @property
    def collectives(self) -> tuple[Collective, ...]:
        """The steps that communicate."""
        return tuple(s for s in self.steps if not s.is_local)

    @property
    def payload_bytes(self) -> int:
        """Sum of per-device payload bytes over the steps."""
        return sum(s.payload_bytes for s in self.steps)

    @property
    def wire_bytes(self) -> int:
        """Sum of bytes each device sends over the steps."""
        return sum(s.wire_bytes for s in self.steps)

    @property
    def time_s(self) -> float:
        """Modelled time of the whole plan (s)."""
        return sum(s.time_s for s in self.steps)

    @property
    def is_noop(self) -> bool:
        """True when ``src`` already has ``dst``'s layout (no steps)."""
        return not self.steps

    @property
    def specs(self) -> tuple[TensorSpec, ...]:
        """The spec before the first step and after each step (``len(steps) + 1``)."""
        state = _state(self.src)
        out = [self.src]
        for step in self.steps:
            state = _apply(_move_of(step), state)
            out.append(_spec(self.src, state))
        return tuple(out)

    def __str__(self) -> str:
        head = f"{self.src} -> {self.dst}: "
        if not self.steps:
            return head + "no-op"
        text = head + "; ".join(str(s) for s in self.steps)
        if len(self.collectives) > 1:
            text += f" (total {fmt_bytes(self.payload_bytes)}, {fmt_time(self.time_s)})"
        return text


# -- planning ------------------------------------------------------------------


class _Move(NamedTuple):
    kind: str
    axes: tuple[str, ...]
    dim: int | None = None
    dst_dim: int | None = None
    reduce_op: str | None = None
    to: _Dims | None = None  # a collective_permute's dims after it


class _Ctx(NamedTuple):
    shape: tuple[int, ...]
    itemsize: int
    sizes: dict[str, int]
    mesh: AbstractMesh
    topology: Topology
    goal: _State


def _state(spec: TensorSpec) -> _State:
    return spec.dims, spec.partial


def _spec(like: TensorSpec, state: _State) -> TensorSpec:
    dims, partial = state
    return TensorSpec(like.shape, dims, partial=dict(partial), dtype=like.dtype)


def _move_of(step: Collective) -> _Move:
    to = step.layouts[1] if step.layouts is not None else None
    return _Move(step.kind, step.axes, step.dim, step.dst_dim, step.reduce_op, to)


def _fmt_dims(dims: _Dims) -> str:
    """``(('data', 'model'), ())`` as ``[(data,model),-]``."""
    one = [",".join(a) if len(a) == 1 else f"({','.join(a)})" if a else "-" for a in dims]
    return f"[{','.join(one)}]"


def _apply(move: _Move, state: _State) -> _State:
    dims = list(state[0])
    partial = dict(state[1])
    kind = move.kind
    if kind == "collective_permute":
        return move.to, state[1]
    if kind == "slice":
        dims[move.dim] += move.axes
    elif kind == "all_gather":
        dims[move.dim] = dims[move.dim][: -len(move.axes)]
    elif kind == "all_to_all":
        dims[move.dim] = dims[move.dim][: -len(move.axes)]
        dims[move.dst_dim] += move.axes
    elif kind == "reduce_scatter":
        for a in move.axes:
            del partial[a]
        dims[move.dim] += move.axes
    elif kind == "all_reduce":
        for a in move.axes:
            del partial[a]
    else:  # to_partial
        for a in move.axes:
            partial[a] = move.reduce_op
    return tuple(dims), tuple(sorted(partial.items()))


def _commute(op1: str, op2: str) -> bool:
    return op1 == op2 or {op1, op2} <= {"sum", "avg"}


def _may_reduce(group: tuple[str, ...], op: str, partial: _Partial) -> bool:
    """Whether reducing ``group`` now keeps the value (see TensorSpec's partial order)."""
    last = max(group)
    return all(b in group or b > last or _commute(o, op) for b, o in partial)


def _maximal_groups(axes: list[str], op: str, partial: _Partial) -> set[tuple[str, ...]]:
    """The largest subsets of ``axes`` (by inclusion) that may be reduced now."""
    legal = [
        set(g)
        for r in range(len(axes), 0, -1)
        for g in itertools.combinations(axes, r)
        if _may_reduce(g, op, partial)
    ]
    return {
        tuple(a for a in axes if a in g) for g in legal if not any(g < other for other in legal)
    }


def _moves(state: _State, ctx: _Ctx) -> list[_Move]:
    """Every legal step from ``state`` that makes progress towards the goal."""
    dims, partial_t = state
    goal_dims, goal_partial_t = ctx.goal
    partial = dict(partial_t)
    used = {a for axes in dims for a in axes} | set(partial)
    extra: dict[int, tuple[str, ...]] = {}
    joins: dict[int, tuple[str, ...]] = {}  # dim -> goal axes still to join, in order
    for d, (cur, want) in enumerate(zip(dims, goal_dims, strict=True)):
        k = 0
        while k < min(len(cur), len(want)) and cur[k] == want[k]:
            k += 1
        if k < len(cur):
            extra[d] = cur[k:]
        elif len(want) > k:
            joins[d] = want[k:]
    out: list[_Move] = []
    # Partial axes reduce in name order (TensorSpec.partial): reducing an axis now is
    # only legal when it commutes with every pending axis listed before it. An axis
    # whose op already matches the goal may still need a reduce (and a to_partial
    # later) when it blocks a non-commuting axis after it. All-reduces take every
    # axis of one op that can go at that point, in one collective (as XLA emits it).
    goal_partial = dict(goal_partial_t)
    mesh_order = list(ctx.sizes)
    for op in sorted({op for _, op in partial_t}):
        axes = sorted((a for a, o in partial_t if o == op), key=mesh_order.index)
        wrong = [a for a in axes if goal_partial.get(a) != op]
        groups = _maximal_groups(wrong, op, partial_t) | _maximal_groups(axes, op, partial_t)
        out.extend(_Move("all_reduce", g, reduce_op=op) for g in sorted(groups))
        for a in wrong:
            if _may_reduce((a,), op, partial_t):
                out.extend(
                    _Move("reduce_scatter", (a,), dim=j, reduce_op=op)
                    for j, want in joins.items()
                    if want[0] == a
                )
    for i, ex in extra.items():
        out.append(_Move("all_gather", (ex[-1],), dim=i))
        for k in range(1, len(ex) + 1):
            moving = ex[-k:]
            for j, want in joins.items():
                if j != i and want[:k] == moving:
                    out.append(_Move("all_to_all", moving, dim=i, dst_dim=j))
    for j, want in joins.items():
        if want[0] not in used:
            out.append(_Move("slice", (want[0],), dim=j))
    for a, op in goal_partial_t:
        if partial.get(a) != op and a not in used:
            out.append(_Move("to_partial", (a,), reduce_op=op))
    if not partial_t:
        out.extend(_permutes(dims, goal_dims, ctx))
    return out


def _permutes(dims: _Dims, goal: _Dims, ctx: _Ctx) -> list[_Move]:
    """The ``collective_permute`` into the goal's dims from ``dims`` (no pending
    sum), when every block is even, every dim's block divides into the goal's,
    and some block changes device (not a slice: the dims are not all prefixes of
    the goal's)."""
    if dims == goal or all(t[: len(d)] == d for d, t in zip(dims, goal, strict=True)):
        return []
    for n, d, t in zip(ctx.shape, dims, goal, strict=True):
        have = math.prod(ctx.sizes[a] for a in d)
        want = math.prod(ctx.sizes[a] for a in t)
        if want % have or n % want:
            return []
    names = {a for axes in (*dims, *goal) for a in axes}
    axes = tuple(a for a in ctx.sizes if a in names)
    return [_Move("collective_permute", axes, to=goal)]


def _local_shape(ctx: _Ctx, dims: _Dims) -> list[int]:
    return [
        -(-s // math.prod(ctx.sizes[a] for a in axes))
        for s, axes in zip(ctx.shape, dims, strict=True)
    ]


def _price(move: _Move, state: _State, ctx: _Ctx) -> Collective:
    n = math.prod(ctx.sizes[a] for a in move.axes)
    payload = 0
    if move.kind == "collective_permute":
        payload = math.prod(_local_shape(ctx, move.to)) * ctx.itemsize
        time = ctx.topology.collective_time(move.kind, payload, n, move.axes, ctx.mesh)
        return Collective(
            kind=move.kind,
            axes=move.axes,
            group_size=n,
            payload_bytes=payload,
            wire_bytes=payload,
            time_s=time,
            layouts=(state[0], move.to),
        )
    if move.kind in COLLECTIVE_KINDS and n > 1:
        dims = state[0]
        local = _local_shape(ctx, dims)
        if move.kind == "all_gather":
            payload = math.prod(local) * n
        elif move.kind == "all_reduce":
            payload = math.prod(local)
        else:
            # reduce-scatter input / all-to-all operand: the joined dim is padded to
            # n × (its new local size), as XLA pads an uneven split.
            j = move.dim if move.kind == "reduce_scatter" else move.dst_dim
            joined = dims[j] + move.axes
            out_j = -(-ctx.shape[j] // math.prod(ctx.sizes[a] for a in joined))
            local[j] = out_j * n
            payload = math.prod(local)
        payload *= ctx.itemsize
    hops = 2 * (n - 1) if move.kind == "all_reduce" else n - 1
    wire = payload * hops // n if payload else 0
    time = ctx.topology.collective_time(move.kind, wire, n, move.axes, ctx.mesh)
    return Collective(
        kind=move.kind,
        axes=move.axes,
        group_size=n,
        dim=move.dim,
        dst_dim=move.dst_dim,
        reduce_op=move.reduce_op,
        payload_bytes=payload,
        wire_bytes=wire,
        time_s=time,
    )


def _is_local(move: _Move, ctx: _Ctx) -> bool:
    return move.kind in LOCAL_KINDS or math.prod(ctx.sizes[a] for a in move.axes) == 1


def _simulate(moves: list[_Move], start: _State, ctx: _Ctx) -> list[Collective] | None:
    """Price ``moves`` from ``start``; None if one is illegal or the goal is missed."""
    state = start
    steps = []
    for mv in moves:
        if mv not in _moves(state, ctx):
            return None
        steps.append(_price(mv, state, ctx))
        state = _apply(mv, state)
    return steps if state == ctx.goal else None


def _search(start: _State, ctx: _Ctx) -> list[_Move]:
    counter = itertools.count()
    best: dict[_State, tuple] = {start: (0.0, 0, 0, 0)}
    heap: list = [((0.0, 0, 0, 0), next(counter), start, ())]
    while heap:
        cost, _, state, path = heapq.heappop(heap)
        if state == ctx.goal:
            return list(path)
        if best.get(state, cost) < cost:
            continue
        for mv in _moves(state, ctx):
            step = _price(mv, state, ctx)
            new = _apply(mv, state)
            new_cost = (
                cost[0] + step.time_s,
                cost[1] + step.wire_bytes,
                cost[2] + step.payload_bytes,
                cost[3] + 1,
            )
            if new not in best or new_cost < best[new]:
                best[new] = new_cost
                heapq.heappush(heap, (new_cost, next(counter), new, (*path, mv)))
    raise AssertionError(f"reshard search found no path from {start} to {ctx.goal}")


def _local_key(move: _Move, ctx: _Ctx) -> tuple:
    goal_dims = ctx.goal[0]
    pos = goal_dims[move.dim].index(move.axes[0]) if move.kind == "slice" else 0
    return (_KIND_ORDER[move.kind], -1 if move.dim is None else move.dim, pos, move.axes)


def _canonical(moves: list[_Move], start: _State, ctx: _Ctx) -> list[_Move]:
    """Sink local steps as late as they go at no extra cost; sort runs of them."""
    priced = _simulate(moves, start, ctx)
    changed = True
    while changed:
        changed = False
        for i in range(len(moves) - 1):
            a, b = moves[i], moves[i + 1]
            if not _is_local(a, ctx) or _is_local(b, ctx):
                continue
            trial = [*moves[:i], b, a, *moves[i + 2 :]]
            trial_priced = _simulate(trial, start, ctx)
            if trial_priced is not None and trial_priced[i] == priced[i + 1]:
                moves, priced, changed = trial, trial_priced, True
    i = 0
    while i < len(moves):
        j = i
        while j < len(moves) and moves[j].kind in LOCAL_KINDS:
            j += 1
        if j > i + 1:
            trial = [*moves[:i], *sorted(moves[i:j], key=lambda m: _local_key(m, ctx)), *moves[j:]]
            if _simulate(trial, start, ctx) is not None:
                moves = trial
        i = max(j, i + 1)
    return moves


@cached(maxsize=4096, why="reshard plans by (source, target, mesh sizes, topology).")
def _plan_cached(
    src: TensorSpec,
    dst: TensorSpec,
    mesh_axes: tuple[tuple[str, int], ...],
    topology: Topology,
) -> ReshardPlan:
    names = tuple(n for n, _ in mesh_axes)
    sizes = tuple(s for _, s in mesh_axes)
    dtype = src.dtype if src.dtype is not None else dst.dtype
    ctx = _Ctx(
        shape=src.shape,
        itemsize=4 if dtype is None else dtype.itemsize,
        sizes=dict(mesh_axes),
        mesh=AbstractMesh(sizes, names, axis_types=(AxisType.Auto,) * len(names)),
        topology=topology,
        goal=_state(dst),
    )
    start = _state(src)
    moves = _canonical(_search(start, ctx), start, ctx)
    return ReshardPlan(src=src, dst=dst, steps=tuple(_simulate(moves, start, ctx)))


def clear_cache() -> None:
    """Drop every cached reshard plan (benchmarks measure the uncached planner)."""
    _plan_cached.cache_clear()


def plan_reshard(
    src: TensorSpec,
    dst: TensorSpec,
    mesh: MeshLike,
    *,
    topology: Topology | None = None,
) -> ReshardPlan:
    """The cheapest ordered steps that move a tensor from ``src`` to ``dst`` on ``mesh``.

    See the module docstring for the step semantics, the ordering and the byte
    conventions. Results are cached on (src, dst, mesh axis names and sizes,
    topology).

    Args:
      src: the current spec.
      dst: the target spec; same shape (and dtype, when both have one).
      mesh: a ``jax.sharding.Mesh`` or ``AbstractMesh``.
      topology: link costs; :data:`spmdkit.topology.DEFAULT_TOPOLOGY` when None.

    Returns:
      The plan; ``plan.steps`` is empty when the layouts already agree.

    Raises:
      ReshardError: shapes or dtypes of ``src`` and ``dst`` differ.
      UnknownAxisError: a spec names an axis the mesh does not have.

    Example::

        >>> mesh = abstract_mesh(a=2, b=4)
        >>> print(plan_reshard(TensorSpec((8, 16), P("a"), dtype="float32"),
        ...                    TensorSpec((8, 16), P(None, "a"), dtype="float32"), mesh))
        f32[8@a,16] -> f32[8,16@a]: all_to_all(a) dim0→1 2×: 256 B
    """
    for name, spec in (("src", src), ("dst", dst)):
        if not isinstance(spec, TensorSpec):
            raise ReshardError(
                op="plan_reshard",
                must=f"{name} is a TensorSpec",
                given=type(spec).__name__,
                fix="build it with TensorSpec(shape, P(...)) or TensorSpec.from_value(x)",
            )
    if src.shape != dst.shape:
        raise ReshardError(
            op="plan_reshard",
            must="src and dst have the same global shape",
            given=f"{src} -> {dst}",
            fix="reshape the value first; a reshard only changes the layout",
        )
    if src.dtype is not None and dst.dtype is not None and src.dtype != dst.dtype:
        raise ReshardError(
            op="plan_reshard",
            must="src and dst have the same dtype",
            given=f"{src} -> {dst}",
            fix="cast with .astype first, or leave dst.dtype unset",
        )
    src.validate(mesh, op="plan_reshard")
    dst.validate(mesh, op="plan_reshard")
    mesh_axes = tuple(axis_sizes(mesh).items())
    return _plan_cached(src, dst, mesh_axes, topology or DEFAULT_TOPOLOGY)
