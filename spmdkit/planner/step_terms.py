"""The step-wide terms of the analytic cost model (:mod:`spmdkit.planner.analytic`):
activation bytes per device, the memory-bound work (fusions, the optimizer update),
the remat policy's recomputed matmuls, the host traffic of offloaded activations,
and the memory by kind. ``ctx`` is a :class:`~spmdkit.planner.analytic.CostContext`
(not imported: analytic imports this module).
"""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = [
    "PolicyFacts",
    "activations",
    "grads_at_state",
    "memory_bound_s",
    "memory_by_kind",
    "offload_traffic",
    "recompute_s",
]


class PolicyFacts(NamedTuple):
    """One layer under a remat policy, as jax runs it (global batch): the bytes
    it keeps for the backward pass besides its inputs, on the device and on the
    host (offloaded), and the FLOPs its backward pass recomputes (weight
    matmuls, attention's batched products)."""

    device_bytes: float
    host_bytes: float
    recompute_mm: float
    recompute_attn: float


def memory_by_kind(
    ctx: Any,
    params: float,
    grads: float,
    opt: float,
    acts: float,
    offloaded: float,
    held: dict[str, float],
) -> dict[str, int]:
    """:func:`~spmdkit.planner.analytic.total_cost`'s memory by kind: ``held`` adds
    its nonzero entries."""
    trace, recipe = ctx.trace, ctx.recipe
    memory = {
        "params": int(params),
        "grads": int(grads),
        "opt_state": int(opt + (0 if recipe.offload_opt else trace.opt_other_bytes)),
        "activations": int(acts),
    }
    memory |= {k: int(v) for k, v in held.items() if v}
    if trace.state_bytes:
        memory["state"] = 2 * int(trace.state_bytes)
    if recipe.offload_opt:
        # The offloaded state is on the device only for the update, after the
        # activations are freed: the peak grows only where it exceeds them.
        memory["opt_update"] = int(max(offloaded - acts, 0.0))
    return memory


def grads_at_state(ctx: Any, layout: Any) -> bool:
    """Whether the step holds a group's gradient at its optimizer state's shard
    (divided over the ZeRO axes beyond the parameters'): ZeRO-2
    (the layout's ``grads_sharded``), or, outside a pipelined stage, a step of two or more
    micro-batches, whose each micro-batch's gradient is reduce-scattered into the
    state's shard (:func:`spmdkit.planner.analytic.group_cost`'s collectives) and summed there
    (:func:`spmdkit.step.grad.accumulate_microbatches`: the accumulator is
    unconstrained, and propagation lays it out as the reduce-scatter leaves it).
    A single micro-batch's gradient is whole until the step's reduce-scatter."""
    return layout.grads_sharded or (ctx.recipe.microbatches > 1 and not ctx.gather_once)


def activations(ctx: Any, shards: int, tp_frac: float, seq_sharded: bool) -> float:
    """Activation bytes per device: residuals under the remat policy at the
    compute itemsize, split by the batch/sequence shards and micro-batches;
    tensor parallelism splits about half of them (the mlp/heads-wide ones), in
    proportion to the FLOPs it splits (sequence parallelism the rest as well)."""
    trace, recipe = ctx.trace, ctx.recipe
    tp_split = 1.0 if seq_sharded else 1 - 0.5 * tp_frac
    scale = recipe.compute_itemsize(trace.act_itemsize) / trace.act_itemsize
    # The logits and their gradient (twice the largest residual) stay float32
    # under a narrower compute dtype: the loss computes in float32 (the models'
    # cross-entropy, torchtitan's and MaxText's losses all upcast).
    logits = 2.0 * trace.resid_peak
    logit_scale = 1.0 if recipe.compute_dtype is None else max(scale, 4.0 / trace.act_itemsize)
    total = (trace.activation_bytes(recipe) - logits) * scale + logits * logit_scale
    return total / shards / recipe.microbatches * tp_split


def memory_bound_s(
    ctx: Any, shards: int, tp_frac: float, seq_sharded: bool, update: float
) -> float:
    """Seconds of memory-bound work per device: the fusions' bytes
    (:meth:`~spmdkit.planner.analytic.StepTrace.elementwise_bytes`, at the compute
    itemsize, split like the activations) and the optimizer update's ``update``
    bytes (it reads params, grads and state and writes params, state and the
    compute-dtype copy)."""
    trace, recipe = ctx.trace, ctx.recipe
    scale = recipe.compute_itemsize(trace.act_itemsize) / trace.act_itemsize
    tp_split = 1.0 if seq_sharded else 1 - 0.5 * tp_frac
    elementwise = trace.elementwise_bytes(recipe) * scale * tp_split / shards
    return ctx.topology.memory_time(elementwise + update)


def recompute_s(ctx: Any, layer_s: float) -> float:
    """Time the remat policy spends recomputing weight matmuls: a layer's forward
    is a third of its train-step matmul time (``layer_s``), less the matmuls whose
    outputs the policy keeps."""
    trace = ctx.trace
    recompute = trace.recompute_flops(ctx.recipe)[0]
    if not recompute:
        return 0.0
    return layer_s / 3 * recompute / max(trace.layer_fwd_flops - trace.attn_fwd_flops, recompute)


def offload_traffic(
    ctx: Any, shards: int, tp_frac: float, seq_sharded: bool
) -> tuple[float, float]:
    """``(bytes, seconds)`` per device a ``remat_offload`` step moves over the host
    link: what the policy keeps, all micro-batches together (split as
    :func:`activations` splits them), out in the forward pass and back in the
    backward; ``(0, 0)`` without offload."""
    trace, recipe = ctx.trace, ctx.recipe
    if not recipe.remat_offload:
        return 0.0, 0.0
    tp_split = 1.0 if seq_sharded else 1 - 0.5 * tp_frac
    scale = recipe.compute_itemsize(trace.act_itemsize) / trace.act_itemsize / recipe.remat_every
    moved = 2 * trace.layers * trace.saved_bytes(recipe)[1] * scale / shards * tp_split
    return moved, moved / ctx.topology.host_bandwidth
