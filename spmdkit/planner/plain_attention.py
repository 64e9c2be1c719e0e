"""What attention without a fused kernel (plain or blockwise attention under XLA)
costs beyond its FLOPs: its score matrices, written and read in device memory
(the time) and held while a layer's backward runs (the memory). The analytic
model (:func:`spmdkit.planner.analytic.total_cost`) adds both; a fused kernel
keeps its scores on chip and has neither."""

from __future__ import annotations

from typing import Any

__all__ = [
    "PLAIN_DOT_PASSES",
    "PLAIN_LIVE",
    "PLAIN_RERUN_DOT",
    "PLAIN_RERUN_SOFTMAX",
    "PLAIN_SOFTMAX_PASSES",
    "score_bytes",
    "score_traffic_s",
]

#: Passes over its score matrices (``b·h·Sq·Sk`` elements each) that an attention
#: region without a fused kernel (plain or blockwise attention under XLA) makes in
#: device memory in a train step, in its batched dots: the forward's ``Q·Kᵀ``
#: writes the scores and ``P·V`` reads the probabilities; the region's backward
#: reruns ``Q·Kᵀ`` (a write), writes ``dP``, reads ``dS`` twice (``dQ``, ``dK``)
#: and ``P`` once (``dV``). With ``head_dim`` contracted (64 to 128) these dots
#: do about ``head_dim`` FLOPs per score byte, fewer than a GPU's FLOP/byte, so
#: the traffic, not the FLOPs, bounds them.
PLAIN_DOT_PASSES = 7.0
#: ... and in its softmax fusions: the forward and its rerun each read the scores
#: and write the probabilities; the backward reads ``P`` and ``dP`` and writes ``dS``.
PLAIN_SOFTMAX_PASSES = 7.0
#: A layer the remat policy recomputes runs the forward once more: ``Q·Kᵀ``
#: written, ``P·V`` read; the softmax read and written.
PLAIN_RERUN_DOT, PLAIN_RERUN_SOFTMAX = 2.0, 2.0
#: Score matrices of one layer live at once while its region's backward runs
#: (the rerun ``P``, ``dP`` and ``dS``): the working set it adds to the step's peak.
PLAIN_LIVE = 3.0


def score_traffic_s(ctx: Any, dtype: str, split: float) -> float:
    """Seconds per device that attention without a fused kernel spends moving its
    score matrices (:meth:`StepTrace.plain_attention`) beyond its FLOPs' time:
    its batched dots take the longer of their FLOPs and their score traffic
    (a roofline), its softmax fusions their traffic (:meth:`Topology.memory_time`).
    The matrices are in ``dtype`` (float32 and TF32 4 bytes an element, else 2);
    ``split``: the batch, sequence and head shards that divide attention."""
    flops, dots, softmax = ctx.trace.plain_attention(ctx.recipe)
    if not dots:
        return 0.0
    itemsize = 4 if dtype in ("float32", "tfloat32") else 2
    topology = ctx.topology
    dots_s = dots * itemsize / split / topology.hbm_bandwidth
    excess = max(dots_s - ctx.compute_time(0.0, flops / split, dtype), 0.0)
    return excess + topology.memory_time(softmax * itemsize / split)


def score_bytes(ctx: Any, dtype: str, split: float) -> float:
    """Bytes per device of the score matrices one layer's attention without a fused
    kernel holds at once for one micro-batch (:data:`PLAIN_LIVE` of them, whole
    or, blockwise, one key block's: :attr:`StepTrace.attn_plain_live`, in
    ``dtype`` as :func:`score_traffic_s` prices them): transient, but on top of
    the residuals when its backward runs (0 for a fused kernel)."""
    trace = ctx.trace
    if trace.attn_plain_live <= 0:
        return 0.0
    itemsize = 4 if dtype in ("float32", "tfloat32") else 2
    layer = trace.attn_plain_live / max(trace.layers, 1)
    return PLAIN_LIVE * layer * itemsize / split / ctx.recipe.microbatches
