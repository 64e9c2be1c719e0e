"""The analytic cost model: a layout's step time and memory, priced per parameter group.

``estimator="analytic"`` (and the inner loop of ``strategy="auto"``). The train
step is traced once per model (:func:`spmdkit.planner.search.trace_step`, a
:class:`StepTrace`): total FLOPs and the bytes of the residuals saved for the
backward pass. A candidate layout is then costed per parameter, which is what
makes the search fast:

- a param sharded over an axis that also splits the batch (FSDP) pays one
  all-gather and one reduce-scatter of its grad over that axis;
- its grad is all-reduced over the batch axes that do not shard it;
- a param sharded over an axis that does not split the batch (tensor
  parallelism) pays one all-reduce of an activation ``tokens × other dim``
  (Megatron's pair of all-reduces per column/row block); a sharded expert dim pays
  four all-to-alls of the tokens;
- optimizer state sharded over more axes than its param costs an all-gather of
  the updated param over the extra axes (ZeRO-1);
- compute is the param's share of the traced FLOPs divided by the batch and
  tensor shards, at ``peak_flops``; step time = compute + communication (no overlap);
- memory per device = params + grads + optimizer state at their shards +
  residual activations divided by the batch (and sequence) shards, and by the
  tensor shards for the fraction of activations tensor parallelism splits.

Collective times come from :class:`spmdkit.topology.Topology`. Parameters of the
same role in different layers (paths that differ only in layer numbers) form one
:class:`ParamGroup` and are costed once.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
from jax.sharding import PartitionSpec as P

from spmdkit.flax.model import ModelInfo, ParamInfo
from spmdkit.planner.plans import Cost, Dims, PyTree
from spmdkit.spec import MeshLike
from spmdkit.topology import Topology

__all__ = [
    "CostContext",
    "GroupCost",
    "GroupLayout",
    "ParamGroup",
    "StepTrace",
    "group_cost",
    "param_flops",
    "param_groups",
    "total_cost",
]

#: Logical dims that are not the activation width a tensor-parallel param moves.
_SKIP_OTHER = {"head_dim", "conv_window", "layers", "expert"}


@dataclass
class StepTrace:
    """What one abstract trace of a model's train step tells the cost models.

    Attributes:
      flops: FLOPs of the loss's value and grad (global, scans unrolled).
      resid_bytes: bytes of the residuals saved for the backward pass (params
        and batch not counted).
      opt_bytes: param path → bytes of its optimizer state.
      opt_other_bytes: optimizer state that belongs to no param (step counts).
      tokens: batch × sequence (× image) positions of the first batch field.
      batch_size: its ``batch`` dim.
      seq_len: its ``seq`` dim (1 without one).
      act_itemsize: bytes per activation element (the smallest matrix dtype).
      abstract_opt: the optimizer state's ``ShapeDtypeStruct`` tree.
    """

    flops: float
    resid_bytes: int
    opt_bytes: dict[str, int]
    opt_other_bytes: int
    tokens: int
    batch_size: int
    seq_len: int
    act_itemsize: int
    abstract_opt: PyTree


@dataclass(frozen=True)
class ParamGroup:
    """Parameters of one role in different layers: same path up to layer
    numbers, shape, dtype, logical names and pin; costed once, times :attr:`count`.

    Attributes:
      key: the path with layer numbers replaced by ``*``.
      paths: the member params' paths.
      shape, dtype, logical, pinned: as in :class:`~spmdkit.flax.ParamInfo`.
      opt_bytes: optimizer-state bytes of one member.
    """

    key: str
    paths: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: str
    logical: tuple[str | None, ...] | None
    pinned: P | None
    opt_bytes: int

    @property
    def count(self) -> int:
        """Number of member params."""
        return len(self.paths)

    @property
    def nbytes(self) -> int:
        """Global bytes of one member."""
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


class GroupLayout(NamedTuple):
    """One group's layout: the params' dims and their optimizer state's dims."""

    params: Dims
    opt: Dims


def param_groups(info: ModelInfo, trace: StepTrace) -> list[ParamGroup]:
    """The model's params grouped by role (:class:`ParamGroup`), in tree order."""
    by: dict[tuple, list[ParamInfo]] = {}
    for p in info.params:
        k = (re.sub(r"(^|/)\d+(?=/|$)", r"\1*", p.path), p.shape, p.dtype, p.logical, p.pinned)
        by.setdefault(k, []).append(p)
    out = []
    for (k, shape, dtype, logical, pinned), ps in by.items():
        ob = max(trace.opt_bytes.get(p.path, 0) for p in ps)
        out.append(ParamGroup(k, tuple(p.path for p in ps), shape, dtype, logical, pinned, ob))
    return out


@dataclass
class CostContext:
    """What every group's cost depends on besides its layout, and a memo of them.

    Attributes:
      mesh: the mesh.
      sizes: mesh axis → size.
      topology: link model for collectives.
      trace: the model's :class:`StepTrace`.
      peak_flops: per-device FLOP/s.
      flops_scale: traced FLOPs / the per-param estimate (calibrates
        :func:`param_flops` to the trace).
      memo: ``(group, layout, batch axes, seq axes)`` → :class:`GroupCost`.
    """

    mesh: MeshLike
    sizes: dict[str, int]
    topology: Topology
    trace: StepTrace
    peak_flops: float
    flops_scale: float
    memo: dict[tuple, GroupCost] = field(default_factory=dict)


def param_flops(g: ParamGroup, tokens: int) -> float:
    """FLOPs one member of ``g`` adds to a train step (6 per weight per token;
    an expert weight sees the tokens routed to it, top-2)."""
    if len(g.shape) < 2:
        return 0.0
    n = math.prod(g.shape)
    logical = g.logical or ()
    if "expert" in logical:
        e = g.shape[logical.index("expert")]
        n = n * 2 / max(e, 1)  # top-2 routing: two experts' weights touch each token
    return 6.0 * tokens * n


class _Coll(NamedTuple):
    time_s: float
    kind: str
    payload: float


def _coll(ctx: CostContext, kind: str, payload: float, axes: tuple[str, ...]) -> _Coll:
    n = math.prod(ctx.sizes[a] for a in axes)
    if n <= 1 or payload <= 0:
        return _Coll(0.0, kind, 0.0)
    wire = payload * (n - 1) / n * (2 if kind == "all_reduce" else 1)
    t = ctx.topology.collective_time(kind, int(wire), n, axes, ctx.mesh)
    return _Coll(t, kind, payload)


@dataclass(frozen=True)
class GroupCost:
    """One group's share of a step under one layout (all members together).

    Attributes:
      comm_s, compute_s: communication and compute time.
      comm_bytes: ``(collective kind, payload bytes)`` pairs, sorted.
      params, grads, opt: bytes per device.
      tp_weight: the FLOPs tensor parallelism splits, × (1 - 1/shards).
    """

    comm_s: float
    compute_s: float
    comm_bytes: tuple[tuple[str, float], ...]
    params: float
    grads: float
    opt: float
    tp_weight: float

    @property
    def time(self) -> float:
        """Communication + compute."""
        return self.comm_s + self.compute_s

    @property
    def memory(self) -> float:
        """Params + grads + optimizer state."""
        return self.params + self.grads + self.opt


def _tp_collectives(
    ctx: CostContext,
    g: ParamGroup,
    dims: Dims,
    tp: tuple[str, ...],
    local: float,
    tokens_local: float,
) -> list[_Coll]:
    """What sharding ``g`` over the tensor-parallel axes ``tp`` moves per step."""
    n_tp = math.prod(ctx.sizes[a] for a in tp)
    logical = g.logical or (None,) * len(g.shape)
    layers = 1
    if "layers" in logical and not dims[logical.index("layers")]:
        layers = g.shape[logical.index("layers")]
    tp_dims = [i for i, d in enumerate(dims) if any(a in tp for a in d)]
    itemsize = ctx.trace.act_itemsize
    if len(g.shape) < 2:
        gather = _coll(ctx, "all_gather", local * n_tp, tp)
        return [gather, gather]
    if any(logical[i] == "expert" for i in tp_dims):
        embed = next(
            (s for s, n in zip(g.shape, logical, strict=True) if n == "embed"), g.shape[-1]
        )
        payload = tokens_local * embed * itemsize * layers
        return [_coll(ctx, "all_to_all", payload, tp) for _ in range(4)]
    keep = [i for i in range(len(g.shape)) if i not in tp_dims and logical[i] not in _SKIP_OTHER]
    if "embed" in [logical[i] for i in keep]:
        keep = [i for i in keep if logical[i] == "embed"]
    if keep:
        other = math.prod(g.shape[i] for i in keep)
    else:  # every dim sharded (2-D TP): one activation per sharded dim moves
        other = sum(g.shape[i] for i in tp_dims if logical[i] not in _SKIP_OTHER)
    payload = tokens_local * other * itemsize * layers
    return [_coll(ctx, "all_reduce", payload, tp)]


def group_cost(
    ctx: CostContext,
    g: ParamGroup,
    dims: Dims,
    odims: Dims,
    batch_axes: tuple[str, ...],
    seq_axes: tuple[str, ...],
) -> GroupCost:
    """The cost of laying ``g`` out as ``dims`` (optimizer state as ``odims``) with
    the batch over ``batch_axes`` and the sequence over ``seq_axes`` (module
    docstring); memoized in ``ctx``."""
    key = (g.key, g.shape, dims, odims, batch_axes, seq_axes)
    hit = ctx.memo.get(key)
    if hit is not None:
        return hit
    sizes = ctx.sizes
    used = tuple(a for d in dims for a in d)
    local = g.nbytes / math.prod(sizes[a] for a in used)
    logical = g.logical or (None,) * len(g.shape)
    # Axes on a stacked-layers dim: each scan step gathers its layer's weights,
    # like FSDP, and they split no compute.
    layer_axes = tuple(a for d, n in zip(dims, logical, strict=True) if n == "layers" for a in d)
    fsdp = tuple(a for a in used if a in batch_axes or a in layer_axes)
    tp = tuple(a for a in used if a not in fsdp)
    n_fsdp = math.prod(sizes[a] for a in fsdp)
    batch_shards = math.prod(sizes[a] for a in batch_axes)
    # Sequence sharding over the tensor axes (Megatron-SP) turns each all-reduce
    # into a reduce-scatter + all-gather of the same bytes; over other axes it
    # splits the tokens (context parallelism).
    context = tuple(a for a in seq_axes if a not in tp and a not in batch_axes)
    tokens_local = ctx.trace.tokens / batch_shards / math.prod(sizes[a] for a in context)
    # grads are partial sums over every axis that splits the tokens but not the param
    grad_sync = tuple(a for a in (*batch_axes, *context) if a not in used)
    colls: list[_Coll] = []
    if fsdp:
        colls.append(_coll(ctx, "all_gather", local * n_fsdp, fsdp))
        colls.append(_coll(ctx, "reduce_scatter", local * n_fsdp, fsdp))
    if grad_sync:
        colls.append(_coll(ctx, "all_reduce", local, grad_sync))
    if tp:
        colls.extend(_tp_collectives(ctx, g, dims, tp, local, tokens_local))
    oused = tuple(a for d in odims for a in d)
    extra = tuple(a for a in oused if a not in used)
    if extra:
        colls.append(_coll(ctx, "all_gather", local, extra))
    flops = param_flops(g, ctx.trace.tokens) * ctx.flops_scale * g.count
    splits = set(batch_axes) | set(tp) | set(context)
    by_kind: dict[str, float] = {}
    comm_s = 0.0
    for c in colls:
        comm_s += c.time_s * g.count
        by_kind[c.kind] = by_kind.get(c.kind, 0.0) + c.payload * g.count
    out = GroupCost(
        comm_s=comm_s,
        compute_s=flops / math.prod(sizes[a] for a in splits) / ctx.peak_flops,
        comm_bytes=tuple(sorted(by_kind.items())),
        params=local * g.count,
        grads=local * g.count,
        opt=g.opt_bytes / math.prod(sizes[a] for a in oused) * g.count,
        tp_weight=flops * (1 - 1 / math.prod(sizes[a] for a in tp)),
    )
    ctx.memo[key] = out
    return out


def total_cost(
    ctx: CostContext,
    groups: Sequence[ParamGroup],
    choice: Sequence[GroupLayout],
    batch_axes: tuple[str, ...],
    seq_axes: tuple[str, ...],
) -> Cost:
    """The analytic :class:`~spmdkit.planner.plans.Cost` of one layout per group."""
    sizes = ctx.sizes
    seq_shards = math.prod(sizes[a] for a in seq_axes)
    comm_s = compute_s = 0.0
    comm: dict[str, float] = {}
    params = grads = opt = tp_weight = 0.0
    total_flops = 0.0
    for g, (dims, odims) in zip(groups, choice, strict=True):
        c = group_cost(ctx, g, dims, odims, batch_axes, seq_axes)
        comm_s += c.comm_s
        compute_s += c.compute_s
        for k, v in c.comm_bytes:
            comm[k] = comm.get(k, 0.0) + v
        params += c.params
        grads += c.grads
        opt += c.opt
        tp_weight += c.tp_weight
        total_flops += param_flops(g, ctx.trace.tokens) * ctx.flops_scale * g.count
    batch_shards = math.prod(sizes[a] for a in batch_axes)
    # Residuals split by batch/seq shards; tensor parallelism splits about half of
    # them (the mlp/heads-wide ones), in proportion to the FLOPs it splits.
    tp_frac = tp_weight / total_flops if total_flops else 0.0
    tp_split = 1.0 if seq_axes else 1 - 0.5 * tp_frac  # SP splits the rest as well
    acts = ctx.trace.resid_bytes / batch_shards / seq_shards * tp_split
    if not total_flops and ctx.trace.flops:
        compute_s = ctx.trace.flops / batch_shards / ctx.peak_flops
    return Cost(
        step_time_s=compute_s + comm_s,
        compute_time_s=compute_s,
        comm_time_s=comm_s,
        comm_bytes={k: int(v) for k, v in sorted(comm.items())},
        memory={
            "params": int(params),
            "grads": int(grads),
            "opt_state": int(opt + ctx.trace.opt_other_bytes),
            "activations": int(acts),
        },
    )
