"""What a float8 recipe costs besides its matmuls' FLOPs, per parameter group.

Under ``Recipe(compute_dtype="float8")`` (:mod:`spmdkit.step.fp8`) the analytic model
prices each group's weight matmuls at the float8 peak, except:

- the LM head (``Recipe.fp8_exclude``, default ``("lm_head",)``): the groups
  whose parameters the step's LM head reads (:attr:`StepTrace.lm_head_params
  <spmdkit.planner.analytic.StepTrace>`, found by ``spmdkit.step.fp8.lm_heads`` in
  the traced loss) run in bfloat16, and their FSDP all-gathers move bfloat16;
- the quantization passes (:func:`quantize_s`), memory-bound work priced as
  bytes over HBM bandwidth like the model's other fusions
  (:meth:`~spmdkit.topology.Topology.memory_time`, so a stack's
  ``fusion_traffic`` scales them). Per float8 matmul, with ``a`` bytes per
  bfloat16 element, each operand quantized (the input ``x`` and the weight's
  local shard forward, the output gradient ``g`` backward) costs

  - current scaling: ``(2a + 1)`` bytes per element, two passes: one reads
    it for its absolute maximum, then the cast reads it again and writes a byte
    (the scale is the amax of the very tensor it scales, so no fusion merges
    the two: in XLA's compiled step each amax is a reduction fusion of its own,
    the cast a fusion after it; torchao's dynamic scaling is the same pair);
  - delayed scaling: ``(a + 1)``, one pass: the scale is known before the
    tensor, so the amax for the history is computed in the cast's pass
    (Transformer Engine's fused cast kernels; a sibling fusion in XLA);

  and the backward's GEMMs read transposed float8 copies of ``x``, ``g`` and
  the gathered weight, 2 bytes per element each (read and write a byte):
  Hopper's float8 tensor-core GEMMs take both operands with the contracted dim
  innermost (cuBLASLt's "TN" layout only), and the weight gradient contracts
  ``x`` and ``g`` over the tokens, the input gradient ``W`` over its output
  dim, where the forward contracted them otherwise. torchao makes those copies
  explicitly; XLA's GPU GEMM rewriter transposes the operands it hands
  cuBLASLt. Column-parallel groups sharing an input (q/k/v, gate/up) quantize
  it once. A weight is quantized once per micro-batch, or once per step where
  the step holds its gathered weights over the micro-batches (a pipelined
  plan; Transformer Engine casts the weights on a step's first micro-batch
  and reuses the float8 copies).

- the layers' residuals (:func:`layer_residuals`): a float8 step that recomputes
  nothing keeps each weight matmul's float8 input (1 byte an element) for the
  backward's GEMMs instead of the bfloat16 one, so a layer keeps the share of
  its bfloat16 bytes measured on its traced body (``StepTrace.layer_float8``,
  :mod:`spmdkit.planner.trace`); under a remat policy it keeps what bfloat16's
  step keeps (the policy saves bfloat16 values: the GEMMs' outputs, the named
  ones, the layer input; the float8 inputs are recomputed), but the layer
  being recomputed holds its float8 set.

The byte counts are the same on every stack (the hardware's layout rule and the
amax-before-cast dependence are the stack's too); eager PyTorch's unfused
kernels are its ``fusion_traffic``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from spmdkit.step.recipe import LM_HEAD

#: A :class:`spmdkit.planner.analytic.CostContext` (not imported: analytic imports
#: this module).
CostContext = Any
#: A :class:`spmdkit.planner.analytic.ParamGroup`.
ParamGroup = Any
#: A :class:`spmdkit.planner.analytic.StepTrace`.
StepTrace = Any
#: A :class:`spmdkit.step.recipe.Recipe`.
Recipe = Any

__all__ = [
    "TRANSPOSE_BYTES",
    "attention_dtype",
    "cast_ratio",
    "copy_ratio",
    "kept_in_bf16",
    "layer_residuals",
    "matmul_dtype",
    "quantize_bytes",
    "quantize_s",
]

#: Bytes per element of a transposed float8 copy (read a byte, write a byte).
TRANSPOSE_BYTES = 2


def kept_in_bf16(ctx: CostContext, g: ParamGroup) -> bool:
    """Whether ``g``'s matmuls stay in bfloat16 under a float8 recipe: the recipe
    excludes the LM head and ``g`` holds a parameter the LM head reads."""
    recipe = ctx.recipe
    if recipe.compute_dtype != "float8" or LM_HEAD not in recipe.fp8_exclude:
        return False
    return any(p in ctx.trace.lm_head_params for p in g.paths)


def matmul_dtype(ctx: CostContext, g: ParamGroup) -> str:
    """The dtype ``g``'s matmuls run in (:meth:`CostContext.compute_dtype
    <spmdkit.planner.analytic.CostContext.compute_dtype>`, bfloat16 for a group
    :func:`kept_in_bf16`)."""
    return "bfloat16" if kept_in_bf16(ctx, g) else ctx.compute_dtype(g.dtype)


def cast_ratio(ctx: CostContext, g: ParamGroup) -> float:
    """Bytes of the compute-dtype copy of ``g``'s params (what the matmuls read
    and an FSDP all-gather moves) per byte of the param: a byte per weight under
    float8, bfloat16's for a group :func:`kept_in_bf16`."""
    recipe = ctx.recipe
    if recipe.compute_dtype is None:
        return 1.0
    size = recipe.compute_itemsize(4) if kept_in_bf16(ctx, g) else recipe.weight_itemsize(4)
    return size / np.dtype(g.dtype).itemsize


def copy_ratio(ctx: CostContext, g: ParamGroup) -> float:
    """Bytes of the compute-dtype copy of ``g``'s params the step holds, per byte
    of the param: the parameters cast to the recipe's activation dtype
    (:func:`spmdkit.step.cast.cast_params`: bfloat16 under float8, which
    quantizes each weight inside its own matmul, :mod:`spmdkit.step.fp8`, a
    layer's at a time); 1.0 where that is the stored dtype (no copy)."""
    itemsize = np.dtype(g.dtype).itemsize
    return ctx.recipe.compute_itemsize(itemsize) / itemsize


def attention_dtype(dtype: str) -> str:
    """The dtype attention's batched matmuls run in: bf16 under float8 (spmdkit.step.fp8
    quantizes weight matmuls only), else the compute dtype."""
    return "bfloat16" if dtype == "float8" else dtype


def quantize_bytes(scaling: str, itemsize: int) -> int:
    """HBM bytes per element of quantizing an ``itemsize``-byte operand to float8
    (module docstring): ``2 * itemsize + 1`` under current scaling (the amax
    pass, then the cast), ``itemsize + 1`` under delayed scaling (one pass)."""
    return (2 if scaling == "current" else 1) * itemsize + 1


def _is_matmul_weight(g: ParamGroup) -> bool:
    """A weight ``spmdkit.step.fp8`` quantizes: two dims or more, not an embedding
    table (``vocab`` first: a lookup) or a convolution kernel."""
    logical = g.logical or ()
    if len(g.shape) < 2 or (logical and logical[0] == "vocab"):
        return False
    return not any(n and str(n).startswith("conv") for n in logical)


def quantize_s(
    ctx: CostContext, g: ParamGroup, flops: float, m: float, k: float, n: float, n_fsdp: int
) -> float:
    """Seconds per step of the float8 quantization passes of ``g``'s matmuls on a
    device (module docstring): ``flops`` of GEMMs shaped ``m × k`` by ``k × n``
    (the device's share, all members and micro-batches: ``flops / 6mkn`` GEMMs
    of a train step), the weight sharded over ``n_fsdp`` devices before its
    gather. 0 unless the group runs in float8."""
    if matmul_dtype(ctx, g) != "float8" or flops <= 0 or not _is_matmul_weight(g):
        return 0.0
    m, k, n = max(m, 1.0), max(k, 1.0), max(n, 1.0)
    gemms = flops / (6.0 * m * k * n)
    # the weights' casts: per micro-batch, or once per step where the step
    # holds the gathered weights over its micro-batches (a pipeline's)
    weights = gemms / ctx.recipe.microbatches if ctx.gather_once else gemms
    x = m * k / ctx.siblings.get(g.key, 1)  # an input column-parallel siblings share
    grad, w = m * n, k * n
    per = quantize_bytes(ctx.recipe.fp8_scaling, ctx.recipe.compute_itemsize(2))
    acts = gemms * (per + TRANSPOSE_BYTES) * (x + grad)
    return ctx.topology.memory_time(acts + weights * (per / max(n_fsdp, 1) + TRANSPOSE_BYTES) * w)


def layer_residuals(trace: StepTrace, recipe: Recipe) -> float:
    """The bytes one layer keeps for its backward pass when none of it is
    recomputed (global batch, in the traced dtype, as ``layer_resid``): the
    traced ``layer_resid``, times the share a float8 step keeps
    (``trace.layer_float8``: measured on the layer's body as ``spmdkit.step.fp8``
    rewrites it, module docstring) under ``compute_dtype="float8"``.

    Example::

        >>> layer_residuals(trace, Recipe(compute_dtype="float8")) / trace.layer_resid
        0.826...  # Llama 3 70B's layer
    """
    share = getattr(trace, "layer_float8", None)
    if recipe.compute_dtype != "float8" or share is None:
        return trace.layer_resid
    return trace.layer_resid * share()
