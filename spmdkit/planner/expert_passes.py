"""The memory passes of a routed-experts call that the analytic cost model adds to
its grouped GEMMs' time (:mod:`spmdkit.planner.experts` prices the GEMMs and the
exchange).

A dropless call (:func:`spmdkit.ops.moe_experts`, and every sort + grouped GEMM
MoE layer: Megatron-LM's, torchtitan's, MaxText's ragged-dot path) moves its rows
through device memory outside its GEMMs: it copies each token once per expert it
is routed to, in expert order, and back, and runs the experts' gated activation
elementwise on the rows they computed. None of it is a weight matmul or a traced
residual of the layer (the op's internals are one region:
:mod:`spmdkit.engine.region`), so the step's fusions
(:meth:`~spmdkit.planner.analytic.StepTrace.elementwise_bytes`) do not count it.
Each pass below reads or writes one buffer once, at the topology's HBM bandwidth;
gathers and scatters of whole rows (``D`` contiguous elements) stream at it.

Per call and micro-batch, with ``T`` the tokens one device holds, ``R = T · k``
the rows it routes (the busiest device's under uniform routing,
:func:`~spmdkit.planner.experts.load_imbalance`), ``D`` the model width and
``F`` the expert width on the device (``F / n_tp`` under expert tensor
parallelism), a device moves:

=====================  ====================================  =========================
pass                   forward                               backward
=====================  ====================================  =========================
permute, unpermute     read ``T`` rows, write ``R`` (the     the transposes (read
(:data:`TOKEN_PASSES`, copies in expert order); read the     ``T``, write ``R``; read
:data:`ROUTED_PASSES`) ``R`` results, write ``T`` (the       ``R``, write ``T``) and
                       weighted sum)                         the ``R`` results read
                                                             again for the routing
                                                             weights' gradient
sort by local expert   read and write ``R`` rows each way    the same
and its inverse        (the rows received from each peer
(:data:`SORT_PASSES`)  are grouped by peer; the grouped
                       GEMM wants them by expert)
gated activation       read gate and up, write their         read gate, up and the
(:data:`GLU_PASSES`)   product (``R × F`` each)              output's gradient, write
                                                             gate's and up's
=====================  ====================================  =========================

D-wide rows: ``4 T + 5 R`` in a train step, ``8 R`` more for the sort where the
call exchanges tokens (expert parallelism) and a device holds more than one
expert (with one, or without expert parallelism, the permute's order is the
experts' already); F-wide: ``8 R``. A recipe whose recompute reruns the call's
forward (:func:`~spmdkit.planner.experts.reruns_exchange`) moves the forward's
passes again (:data:`FORWARD_PASSES`). That is the least a dropless call moves
(Megatron-LM's fused permutation kernels do these passes, spmdkit's op a few
more); it is charged to the experts' down projection, once per call, as the
exchange is.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from spmdkit.planner import experts

__all__ = [
    "FORWARD_PASSES",
    "GLU_PASSES",
    "ROUTED_PASSES",
    "SORT_PASSES",
    "TOKEN_PASSES",
    "call_bytes",
    "passes_s",
]

#: Token-wide (``T × D``) buffer passes per call and train step: the permute's
#: read and the unpermute's write, forward, and their transposes' backward.
TOKEN_PASSES = 4
#: Routed (``R × D``) buffer passes per call and train step outside the sort: the
#: permute's write and the unpermute's read forward; their transposes and the
#: results read again for the routing weights' gradient backward.
ROUTED_PASSES = 5
#: Routed (``R × D``) passes of the sort by local expert and its inverse (each a
#: read and a write), forward and backward.
SORT_PASSES = 8
#: Routed (``R × F``) passes of the gated activation: 3 forward, 5 backward.
GLU_PASSES = 8
#: Of those, the forward's, as ``(token, routed, sort, glu)``: what a recipe that
#: reruns the call's forward moves again.
FORWARD_PASSES = (2, 2, 4, 3)


def call_bytes(
    tokens: float,
    routed: float,
    d_model: int,
    d_ff: float,
    itemsize: int,
    *,
    sort: bool,
    rerun: bool = False,
) -> float:
    """Bytes one call moves through device memory in a train step (module
    docstring): ``tokens`` rows of ``d_model`` a device holds, ``routed`` of them
    routed (``tokens · k``, the busiest device's), ``d_ff`` the expert width
    there; ``sort``: the call sorts the rows it receives by local expert;
    ``rerun``: the recipe reruns the call's forward.

    Example: GPT-OSS 120B's call on one device of EP 8 (4,096 tokens, top-4,
    D = F = 2,880, bf16) moves ``(4 · 4096 + 13 · 16384) · 2880 + 8 · 16384 · 2880``
    elements of 2 bytes::

        >>> round(call_bytes(4096, 4 * 4096, 2880, 2880, 2, sort=True) / 1e9, 2)
        2.08
    """
    passes = (TOKEN_PASSES, ROUTED_PASSES, SORT_PASSES if sort else 0, GLU_PASSES)
    if rerun:
        forward = FORWARD_PASSES if sort else (*FORWARD_PASSES[:2], 0, FORWARD_PASSES[3])
        passes = tuple(a + b for a, b in zip(passes, forward, strict=True))
    token, rows, sorted_rows, glu = passes
    elements = (token * tokens + (rows + sorted_rows) * routed) * d_model
    return (elements + glu * routed * d_ff) * itemsize


def passes_s(ctx: Any, g: Any, sp: Any, token_axes: Sequence[str]) -> float:
    """Seconds one device spends on the memory passes of the calls parameter
    group ``g`` serves (all its members, every micro-batch: module docstring)
    at the topology's HBM bandwidth; 0 unless ``g`` is the down projection of a
    ``moe_experts`` call, or where the context prices FLOPs only
    (``ctx.peak_flops``)."""
    call = experts.moe_call(g, ctx.trace)
    if call is None or not experts.is_down_projection(g) or ctx.peak_flops is not None:
        return 0.0
    n_ep, t_local = experts.region_tokens(ctx, call, sp, token_axes)
    nbytes = call_bytes(
        t_local,
        t_local * call.top_k * experts.load_imbalance(call, n_ep, t_local),
        call.d_model,
        call.d_ff / math.prod(ctx.sizes[a] for a in sp.tp),
        ctx.recipe.compute_itemsize(call.itemsize),
        sort=n_ep > 1 and call.experts // n_ep > 1,
        rerun=experts.reruns_exchange(ctx.recipe),
    )
    calls = experts.stacked_calls(g) * ctx.recipe.microbatches * g.count
    return calls * nbytes / ctx.topology.hbm_bandwidth
