"""The analytic cost model: a layout's step time and memory, priced per parameter group.

``estimator="analytic"`` (and the inner loop of ``strategy="auto"``). The train step is
traced once per model (:func:`spmdkit.planner.trace.trace_step`, a :class:`StepTrace`):
total FLOPs and the bytes of the residuals saved for the backward pass. A candidate layout
is then costed per parameter, which is what makes the search fast:

- a param sharded over an axis that also splits the batch (FSDP) pays one
  all-gather and one reduce-scatter of its grad over that axis;
- its grad is all-reduced over the batch axes that do not shard it;
- a param sharded over an axis that does not split the batch (tensor
  parallelism) pays one all-reduce of an activation ``tokens × other dim``
  (Megatron's pair of all-reduces per column/row block); a sharded expert dim pays
  four all-to-alls of the tokens;
- optimizer state sharded over more axes than its param (ZeRO-1/2, the distributed
  optimizer): the grad reduce-scattered into the update's shard, the updated param
  all-gathered; ZeRO-2 (``GroupLayout.grads_sharded``) keeps the grad there;
- compute is the param's share of the traced weight-matmul FLOPs divided by the
  batch and tensor shards, plus the attention FLOPs, at the topology's achievable
  rate for the compute dtype (:meth:`~spmdkit.topology.Topology.compute_time`);
- communication that XLA's latency-hiding scheduler overlaps with compute (FSDP
  all-gathers and reduce-scatters, gradient all-reduces and ZeRO's reduce-scatters)
  hides under ``overlap × compute``; tensor-parallel all-reduces, expert all-to-alls
  and ZeRO's parameter all-gather (after the update: nothing left to hide it) don't;
- memory per device = params + grads + optimizer state at their shards + residual
  activations divided by the batch (and sequence) shards, and by the tensor shards for the
  fraction of activations tensor parallelism splits; attention without a fused kernel
  adds one layer's score matrices for one micro-batch (``attention_scores``).

The recipe (:class:`~spmdkit.step.recipe.Recipe`) changes these terms:

- ``remat``: the activations kept per layer: all residuals (``none``), the layer input
  (``full``), the layer input and the weight-matmul outputs (``dots``), the input and the
  values with the policy's ``checkpoint_name`` tags (the named policies, ``names``); with
  remat, one layer's residuals live again while it is recomputed; recomputation costs the
  layers' forward FLOPs less the matmuls whose outputs are kept (``dots``: the attention
  forward only, the scores are not saved);
- ``remat_offload``: the kept values (less the layer input) live on the host: not device
  memory, but they cross the host link twice per step (out in the forward, back in the
  backward), overlapped with compute;
- ``compute_dtype``: activations at its itemsize; compute at its peak;
  FSDP/gradient collectives move the cast (bf16) weights and gradients; the
  copy of the local parameters cast to the activation dtype is live during the
  step (none where they are stored in it; float8 quantizes each weight inside its
  matmul, a layer at a time); ``"float8"``: as
  :mod:`spmdkit.planner.float8` prices it (LM head in bf16, quantization, residuals);
- ``microbatches``: activations of one micro-batch; FSDP gathers and
  reduce-scatters once per micro-batch; the gradient all-reduce once; a ZeRO
  layout's gradient reduce-scattered into the optimizer state's shard per
  micro-batch and accumulated there;
- ``master_weights="optimizer"``: groups as :mod:`spmdkit.planner.stored` stores them;
- ``offload_opt``: optimizer state lives on the host and crosses the host link
  twice per step (exposed); on the device it is live only during the update,
  after the activations are freed.

Collective times come from :class:`spmdkit.topology.Topology`. Parameters of the
same role in different layers (paths that differ only in layer numbers) form one
:class:`ParamGroup` and are costed once.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
from jax.sharding import PartitionSpec as P

from spmdkit.introspect.model import ModelInfo, ParamInfo
from spmdkit.pipeline.layouts import accumulator_dtype
from spmdkit.planner import expert_passes, experts, float8
from spmdkit.planner.context_parallel import stage_context_attention
from spmdkit.planner.experts import MoeCall
from spmdkit.planner.float8 import attention_dtype, cast_ratio, copy_ratio, matmul_dtype, quantize_s
from spmdkit.planner.group_gemms import (
    column_siblings,
    gemm_dims,
    rerun_charged,
    routed_share,
    tp_times,
)
from spmdkit.planner.plain_attention import (
    PLAIN_DOT_PASSES,
    PLAIN_RERUN_DOT,
    PLAIN_RERUN_SOFTMAX,
    PLAIN_SOFTMAX_PASSES,
    score_bytes,
    score_traffic_s,
)
from spmdkit.planner.plans import Cost, Dims, PyTree
from spmdkit.planner.step_terms import (
    PolicyFacts,
    activations,
    grads_at_state,
    memory_bound_s,
    memory_by_kind,
    offload_traffic,
    recompute_s,
)
from spmdkit.planner.stored import stored_group
from spmdkit.spec import MeshLike
from spmdkit.step.recipe import Recipe
from spmdkit.topology import Topology

__all__ = [
    "CostContext",
    "GroupCost",
    "GroupLayout",
    "ParamGroup",
    "StepTrace",
    "column_siblings",
    "cost_levers",
    "group_cost",
    "param_flops",
    "param_groups",
    "tensor_parallel_bytes",
    "total_cost",
]

#: A fused attention kernel's train FLOPs over the region's (forward 2 matmuls +
#: backward 5 with the scores recomputed inside, vs the region's VJP that reruns
#: the 2-matmul forward first): 7 / 9.
_FUSED_BACKWARD = 7.0 / 9.0

#: Logical dims that are not the activation width a tensor-parallel param moves.
_SKIP_OTHER = {"head_dim", "conv_window", "layers", "expert"}


def _traced_policy(recipe: Recipe) -> bool:
    """Priced from the layer traced under its policy (:attr:`StepTrace.layer_policy`);
    ``dots`` and ``full`` on the device keep their closed forms."""
    return recipe.remat not in ("none", "full", "dots") or recipe.remat_offload


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
      attn_flops: FLOPs of batched dots (attention scores and values) in the
        step, forward and backward (global).
      layers: iterations of the model's layer scan (0: no scanned layers).
      layer_resid: residual bytes one layer saves (global batch).
      layer_carry: bytes of one layer's input (the scan carry).
      layer_dots: bytes of one layer's weight-matmul outputs.
      layer_named: ``checkpoint_name`` tag → bytes per layer.
      layer_named_flops: ``checkpoint_name`` tag → FLOPs per layer of the
        matmul whose output the tag names (what keeping it saves recomputing).
      layer_fwd_flops: forward FLOPs of all layers together.
      attn_fwd_flops: forward FLOPs of the batched dots.
      attn_fused_fwd_flops: of ``attn_fwd_flops``, those in attention regions
        that run a fused kernel on a GPU (the models' ``"auto"`` attention).
      attn_causal_fwd_flops: of those, the causal ones (a fused kernel skips
        the masked blocks).
      attn_plain_fwd_flops: of ``attn_fwd_flops``, those in attention regions
        that run no fused kernel (``"xla"``, ``"blockwise"``).
      attn_plain_scores: elements of those regions' score matrices
        (``b·h·Sq·Sk`` each, global, all layers, one forward pass): what they
        move through device memory (:meth:`StepTrace.plain_attention`).
      attn_plain_live: of those elements, the ones the regions materialize at
        once (plain attention: all; the blockwise version: one key block's).
      attn_kv_bytes: bytes of the keys and values attention reads in one
        forward pass (global, all layers): what context parallelism exchanges.
      resid_peak: the largest single residual (the logits), live again as its
        gradient in the backward pass.
      state_bytes: the model's mutable state (batch statistics), global; counted
        replicated (it is per-channel and small), twice (the step's input and
        its updated output).
      layer_policy: recipe → :class:`PolicyFacts` of one layer, from the layer
        scan's body differentiated under the recipe's ``jax.checkpoint`` policy
        (memoized; what the named policies and the offload forms are priced by:
        a tag whose value the backward pass does not read is not kept).
      lm_head_params: paths of the params the loss's LM head reads
        (``spmdkit.step.fp8.lm_heads``): a float8 recipe keeps them in bf16.
      layer_float8: share of ``layer_resid`` a float8 step keeps (:mod:`spmdkit.planner.float8`).
      expert_top_k: expert count → how many experts the step routes each token
        to: the ``k`` of its ``top_k`` over that many experts (the router's
        choice), else the rows per token of a grouped GEMM over that many groups
        (:func:`spmdkit.planner.trace.trace_step` reads both from the step).
      moe_calls: expert count → the step's ``moe_experts`` call of that many
        experts (:mod:`spmdkit.planner.experts`).
      param_uses: path → weight matmuls reading it outside layer scans (2+; 0: a lookup).
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
    attn_flops: float = 0.0
    layers: int = 0
    layer_resid: float = 0.0
    layer_carry: float = 0.0
    layer_dots: float = 0.0
    layer_named: dict[str, float] = field(default_factory=dict)
    layer_named_flops: dict[str, float] = field(default_factory=dict)
    layer_fwd_flops: float = 0.0
    attn_fwd_flops: float = 0.0
    attn_fused_fwd_flops: float = 0.0
    attn_causal_fwd_flops: float = 0.0
    attn_plain_fwd_flops: float = 0.0
    attn_plain_scores: float = 0.0
    attn_plain_live: float = 0.0
    attn_kv_bytes: float = 0.0
    resid_peak: float = 0.0
    state_bytes: int = 0
    lm_head_params: frozenset[str] = frozenset()
    layer_policy: Callable[[Recipe], PolicyFacts] | None = field(default=None, repr=False)
    layer_float8: Callable[[], float] | None = field(default=None, repr=False)
    expert_top_k: dict[int, float] = field(default_factory=dict)
    moe_calls: dict[int, MoeCall] = field(default_factory=dict)
    param_uses: dict[str, int] = field(default_factory=dict)

    def routed_share(self, experts: int) -> float:
        """The share of the tokens one of ``experts`` experts sees: ``top_k / experts``
        (:attr:`expert_top_k`); every token where the step routes none (each
        token then meets every expert, as in a dense mixture)."""
        experts = max(experts, 1)
        return min(self.expert_top_k.get(experts, experts) / experts, 1.0)

    def activation_bytes(self, recipe: Recipe) -> float:
        """Global activation bytes the backward pass needs under ``recipe``'s
        remat policy, in the traced dtype (module docstring)."""
        other = max(self.resid_bytes - self.layers * self.layer_resid, 0.0)
        full = float8.layer_residuals(self, recipe)  # a layer's, as the recipe's step keeps it
        if recipe.remat == "none" or not self.layers:
            return other + self.layers * full + self.resid_peak
        kept = min(self.layer_carry + self.saved_bytes(recipe)[0], full)
        k = recipe.remat_every  # one layer in k recomputed, the others keep everything
        return other + self.layers * (kept + (k - 1) * full) / k + full + self.resid_peak

    def attention_flops(self, recipe: Recipe, topology: Topology) -> float:
        """Attention FLOPs of the step as the kernel that runs computes them
        (global, recompute included): a fused kernel's backward recomputes the
        scores inside (:data:`_FUSED_BACKWARD` of what the region's VJP, which
        reruns the forward, does), and causal it computes only
        :meth:`~spmdkit.topology.Topology.causal_share` of the blocks; the
        blockwise fallback and plain attention compute what was traced."""
        recompute = self.recompute_flops(recipe)[1]
        if self.attn_fwd_flops <= 0 or self.attn_fused_fwd_flops <= 0:
            return self.attn_flops + recompute
        fused = min(self.attn_fused_fwd_flops / self.attn_fwd_flops, 1.0)
        causal = min(self.attn_causal_fwd_flops / self.attn_fused_fwd_flops, 1.0)
        kept = 1.0 - causal * (1.0 - topology.causal_share(self.seq_len))
        train = self.attn_flops * (1.0 - fused + fused * kept * _FUSED_BACKWARD)
        return train + recompute * (1.0 - fused + fused * kept)

    def plain_attention(self, recipe: Recipe) -> tuple[float, float, float]:
        """``(FLOPs, dot elements, softmax elements)`` of the step's attention
        regions that run no fused kernel (global, recompute included): their
        share of :meth:`attention_flops`, and the score-matrix elements their
        batched dots and their softmax fusions move through device memory
        (:mod:`~spmdkit.planner.plain_attention`'s passes, and once more per
        layer the remat policy recomputes). Plain attention materializes its scores;
        the blockwise version, compiled by XLA, writes each key block's
        scores too, so neither is priced by its FLOPs alone."""
        if self.attn_plain_scores <= 0 or self.attn_fwd_flops <= 0:
            return 0.0, 0.0, 0.0
        share = min(self.attn_plain_fwd_flops / self.attn_fwd_flops, 1.0)
        recompute = self.recompute_flops(recipe)[1]
        reruns = recompute / self.attn_fwd_flops  # layer forwards recomputed, per layer
        dots = self.attn_plain_scores * (PLAIN_DOT_PASSES + reruns * PLAIN_RERUN_DOT)
        softmax = self.attn_plain_scores * (PLAIN_SOFTMAX_PASSES + reruns * PLAIN_RERUN_SOFTMAX)
        return (self.attn_flops + recompute) * share, dots, softmax

    def elementwise_bytes(self, recipe: Recipe) -> float:
        """Bytes memory-bound work moves through device memory in a step (global,
        traced dtype): the residuals saved for the backward pass other than the
        weight-matmul outputs are the outputs of XLA's fusions (norms, rotary
        embedding, activation functions, softmax, casts); each is written and
        read in the forward pass, read again with its gradient written and read
        in the backward pass (5 passes), and written and read once more when the
        remat policy recomputes the layer; the logits (``resid_peak``) take
        three passes (softmax, its gradient, the cast)."""
        if not self.layers:
            return 5.0 * max(self.resid_bytes - self.resid_peak, 0.0) + 3.0 * self.resid_peak
        per_layer = max(self.layer_resid - self.layer_dots, 0.0)
        passes = 5.0 if recipe.remat == "none" else 5.0 + 2.0 / recipe.remat_every
        other = max(self.resid_bytes - self.layers * self.layer_resid - self.resid_peak, 0.0)
        return passes * self.layers * per_layer + 5.0 * other + 3.0 * self.resid_peak

    def saved_bytes(self, recipe: Recipe) -> tuple[float, float]:
        """``(device, host)`` bytes per layer (global batch) the remat policy
        keeps besides the layer input: the weight-matmul outputs (``dots``),
        nothing (``full``), what the layer traced under the policy keeps (the
        named policies, ``names``, the offload forms: :attr:`layer_policy`;
        without it, the tagged values' bytes)."""
        if recipe.remat in ("none", "full"):
            return 0.0, 0.0
        if _traced_policy(recipe) and self.layer_policy is not None:
            facts = self.layer_policy(recipe)
            return facts.device_bytes, facts.host_bytes
        if recipe.remat == "dots":
            kept = self.layer_dots
        else:
            kept = sum(self.layer_named.get(n, 0.0) for n in recipe.saved_names)
        return (0.0, kept) if recipe.remat_offload else (kept, 0.0)

    def recompute_flops(self, recipe: Recipe) -> tuple[float, float]:
        """``(weight-matmul, attention)`` FLOPs the remat policy adds (global)."""
        if recipe.remat == "none" or not self.layers:
            return 0.0, 0.0
        k = recipe.remat_every  # one layer in k is recomputed
        if _traced_policy(recipe) and self.layer_policy is not None:
            facts = self.layer_policy(recipe)
            return self.layers * facts.recompute_mm / k, self.layers * facts.recompute_attn / k
        if recipe.remat == "dots":
            return 0.0, self.attn_fwd_flops / k
        kept = sum(self.layer_named_flops.get(n, 0.0) for n in recipe.saved_names)
        matmuls = self.layer_fwd_flops - self.attn_fwd_flops - self.layers * kept
        return max(matmuls, 0.0) / k, self.attn_fwd_flops / k


@dataclass(frozen=True)
class ParamGroup:
    """Parameters of one role in different layers: same path up to layer
    numbers, shape, dtype, logical names and pin; costed once, times :attr:`count`.

    Attributes:
      key: the path with layer numbers replaced by ``*``.
      paths: the member params' paths.
      shape, dtype, logical, pinned: as in :class:`~spmdkit.introspect.ParamInfo`.
      opt_bytes: optimizer-state bytes of one member.
      master: of :attr:`opt_bytes`, the fp32 master's (:mod:`spmdkit.planner.stored`).
      uses: weight matmuls one member is in per token (:attr:`StepTrace.param_uses`).
    """

    key: str
    paths: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: str
    logical: tuple[str | None, ...] | None
    pinned: P | None
    opt_bytes: int
    master: int = 0
    uses: int = 1

    @property
    def count(self) -> int:
        """Number of member params."""
        return len(self.paths)

    @property
    def nbytes(self) -> int:
        """Global bytes of one member."""
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


class GroupLayout(NamedTuple):
    """One group's layout: the params' dims and their optimizer state's dims;
    ``grads_sharded``: the gradient is kept at the optimizer state's dims (ZeRO-2)."""

    params: Dims
    opt: Dims
    grads_sharded: bool = False


def param_groups(info: ModelInfo, trace: StepTrace) -> list[ParamGroup]:
    """The model's params grouped by role (:class:`ParamGroup`), in tree order."""
    by: dict[tuple, list[ParamInfo]] = {}
    for p in info.params:
        k = (re.sub(r"(^|/)\d+(?=/|$)", r"\1*", p.path), p.shape, p.dtype, p.logical, p.pinned)
        by.setdefault(k, []).append(p)
    out = []
    for (k, shape, dtype, logical, pinned), ps in by.items():
        ob = max(trace.opt_bytes.get(p.path, 0) for p in ps)
        uses, paths = max(trace.param_uses.get(p.path, 1) for p in ps), tuple(p.path for p in ps)
        out.append(ParamGroup(k, paths, shape, dtype, logical, pinned, ob, uses=uses))
    return out


@dataclass
class CostContext:
    """What every group's cost depends on besides its layout, and a memo of them.

    Attributes:
      mesh: the mesh.
      sizes: mesh axis → size.
      topology: link model for collectives.
      trace: the model's :class:`StepTrace`.
      peak_flops: per-device FLOP/s override (None: the topology's peak for the
        compute dtype, at its matmul and attention efficiencies).
      flops_scale: traced weight-matmul FLOPs / the per-param estimate
        (calibrates :func:`param_flops` to the trace).
      recipe: the step's recipe (remat, compute dtype, micro-batches, offload).
      gather_once: FSDP as the pipeline executor runs it
        (:mod:`spmdkit.pipeline.execute`): a group's weights are gathered over
        their FSDP axes once per step, at the pipeline's input, and held for the
        step; their gradients accumulate at that full size over the
        micro-batches (in float32 under a narrower compute dtype) and are
        reduce-scattered over those axes once, at the end.
        Neither collective overlaps the ticks. False: gathered and
        reduce-scattered once per micro-batch, overlapped (the unpipelined step).
      context: the context-parallel axes (:mod:`spmdkit.planner.context_parallel`): weights
        sharded over them are gathered like FSDP's; attention exchanges K/V over them.
      memo: ``(group, layout, batch axes, seq axes, recipe levers)`` → :class:`GroupCost`,
        and a collective's time by kind, bytes and axes: contexts share one only
        where their mesh shape and topology are the same.
      siblings: group key → column-parallel groups sharing its input
        (:func:`column_siblings`; missing: 1).
    """

    mesh: MeshLike
    sizes: dict[str, int]
    topology: Topology
    trace: StepTrace
    peak_flops: float | None
    flops_scale: float
    recipe: Recipe = field(default_factory=Recipe)
    gather_once: bool = False
    context: tuple[str, ...] = ()
    memo: dict[tuple, GroupCost] = field(default_factory=dict)
    siblings: dict[str, int] = field(default_factory=dict)

    def compute_dtype(self, param_dtype: str) -> str:
        """The dtype matmuls run in: the recipe's, else the params' (fp32 matmuls
        run as TF32 on tensor cores, XLA's default on GPUs)."""
        name = self.recipe.compute_dtype or str(param_dtype)
        return "tfloat32" if name == "float32" else name

    def compute_time(self, matmul_flops: float, attention_flops: float, dtype: str) -> float:
        """Seconds for the FLOPs: at ``peak_flops`` when overridden, else at the
        topology's achievable rate for ``dtype``."""
        if self.peak_flops is not None:
            return (matmul_flops + attention_flops) / self.peak_flops
        return self.topology.compute_time(matmul_flops, attention_flops, dtype)

    def matmul_time(self, flops: float, m: float, k: float, n: float, dtype: str) -> float:
        """Seconds for ``flops`` of GEMMs shaped ``m × k`` by ``k × n``: at
        ``peak_flops`` when overridden, else the topology's roofline
        (:meth:`~spmdkit.topology.Topology.matmul_time`)."""
        if self.peak_flops is not None:
            return flops / self.peak_flops
        itemsize = {"tfloat32": 4, "float8": 1}.get(dtype) or np.dtype(dtype).itemsize
        return self.topology.matmul_time(flops, m, k, n, dtype, itemsize)

    def accumulator_ratio(self, param_dtype: str) -> float:
        """Bytes of a pipelined stage's gradient accumulator per byte of the param
        (:func:`spmdkit.pipeline.layouts.accumulator_dtype` of the compute dtype:
        float32 under bf16 compute)."""
        compute = np.dtype(self.recipe.activation_dtype or param_dtype)
        return accumulator_dtype(compute).itemsize / np.dtype(param_dtype).itemsize

    def grad_ratio(self, param_dtype: str) -> float:
        """Bytes of a weight's gradient, as the collectives reduce it (the compute
        dtype's, bf16 under float8), per byte of the param."""
        if self.recipe.compute_dtype is None:
            return 1.0
        return self.recipe.compute_itemsize(4) / np.dtype(param_dtype).itemsize


def param_flops(g: ParamGroup, trace: StepTrace) -> float:
    """FLOPs one member of ``g`` adds to a train step: 6 per weight per token it
    sees (an expert weight: those routed to it, :func:`routed_share`), per use."""
    if len(g.shape) < 2:
        return 0.0
    return 6.0 * trace.tokens * math.prod(g.shape) * routed_share(g, trace) * g.uses


#: ``CostContext.memo`` key prefix of a collective's time (:func:`_coll`).
_COLL_KEY = ("analytic", "collective_time")
#: ``CostContext.memo`` key prefix of what a group's cost takes from its parameters'
#: layout alone (:func:`_params_part`).
_PARAMS_KEY = ("analytic", "params_part")
#: ``CostContext.memo`` key prefix of a group's :func:`_split` (recipes share it).
_SPLIT_KEY = ("analytic", "split")


class _Coll(NamedTuple):
    time_s: float
    kind: str
    payload: float
    hidden: bool = False
    #: hides only under another micro-batch's forward compute (a backward-pass
    #: expert exchange under the priced-only 1F1B overlap: experts.overlapped)
    paired: bool = False
    axes: tuple[str, ...] = ()


def _coll(
    ctx: CostContext,
    kind: str,
    payload: float,
    axes: tuple[str, ...],
    *,
    hidden: bool = False,
    times: int = 1,
) -> _Coll:
    n = math.prod(ctx.sizes[a] for a in axes)
    if n <= 1 or payload <= 0:
        return _Coll(0.0, kind, 0.0, hidden)
    wire = int(payload * (n - 1) / n * (2 if kind == "all_reduce" else 1))
    # the memo is shared only by contexts of one mesh shape and topology
    key = (_COLL_KEY, kind, wire, axes)
    t = ctx.memo.get(key)
    if t is None:
        t = ctx.memo[key] = ctx.topology.collective_time(kind, wire, n, axes, ctx.mesh)
    return _Coll(t * times, kind, payload * times, hidden, axes=axes)


@dataclass(frozen=True)
class GroupCost:
    """One group's share of a step under one layout (all members together).

    Attributes:
      comm_s, compute_s: communication and compute time.
      comm_bytes: ``(collective kind, payload bytes)`` pairs, sorted.
      params, grads, opt: bytes per device (``opt`` 0 when offloaded).
      tp_weight: the FLOPs tensor parallelism splits, × (1 - 1/shards).
      hidden_s: the part of ``comm_s`` that can overlap with compute.
      layer_compute_s: the part of ``compute_s`` spent in layer params (what
        full recompute repeats a third of).
      cast: bytes of the compute-dtype copy of the local params.
      gathered: bytes the step holds beyond the local params and grads when the
        weights are gathered once and held (:attr:`CostContext.gather_once`):
        the gathered weights (compute dtype) and their full-size gradient
        accumulators (:meth:`CostContext.accumulator_ratio`), less the local
        shares.
      accumulators: those full-size gradient accumulators' bytes (0 unless
        :attr:`CostContext.gather_once`).
      offload_opt: optimizer-state bytes per device kept on the host.
      tp_shards: devices tensor parallelism splits this group's FLOPs over.
      tp_bytes: payload bytes of its tensor-parallel collectives per step.
      buffers: bytes a call of its ``moe_experts`` op holds while it runs
        (:func:`spmdkit.planner.experts.dispatch_buffer_bytes`; one call at a time).
      kept: bytes its ``moe_experts`` calls hold from their forward to their
        backward (:func:`spmdkit.planner.experts.kept_residual_bytes`).
      stage_kept: in a pipelined stage, bytes the ``moe_experts`` call one
        member serves in one layer keeps from its forward to its backward per
        micro-batch in flight (:func:`spmdkit.planner.experts.stage_kept_bytes`).
      paired_s: the part of ``comm_s`` that can hide only under another
        micro-batch's forward compute (backward-pass expert exchanges under the
        priced-only 1F1B overlap: :func:`spmdkit.planner.experts.overlapped`).
    """

    comm_s: float
    compute_s: float
    comm_bytes: tuple[tuple[str, float], ...]
    params: float
    grads: float
    opt: float
    tp_weight: float
    hidden_s: float = 0.0
    layer_compute_s: float = 0.0
    cast: float = 0.0
    gathered: float = 0.0
    accumulators: float = 0.0
    offload_opt: float = 0.0
    tp_shards: int = 1
    tp_bytes: float = 0.0
    buffers: float = 0.0
    kept: float = 0.0
    paired_s: float = 0.0
    stage_kept: float = 0.0

    @property
    def time(self) -> float:
        """Exposed communication + compute, as if this group were alone (the
        search's per-group ranking; :func:`total_cost` overlaps the totals)."""
        return self.comm_s - self.hidden_s + self.compute_s

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
    itemsize = ctx.recipe.compute_itemsize(ctx.trace.act_itemsize)
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
    return [_coll(ctx, "all_reduce", payload, tp, times=t) for t in tp_times(ctx, g) if t]


class _Split(NamedTuple):
    """How one group's layout splits the mesh: param shards, FSDP vs tensor axes."""

    used: tuple[str, ...]
    fsdp: tuple[str, ...]
    tp: tuple[str, ...]
    context: tuple[str, ...]
    extra: tuple[str, ...]
    grad_sync: tuple[str, ...]
    local: float
    tokens_local: float
    ep: tuple[str, ...] = ()


def _split(
    ctx: CostContext,
    g: ParamGroup,
    layout: GroupLayout,
    batch_axes: tuple[str, ...],
    seq_axes: tuple[str, ...],
) -> _Split:
    sizes = ctx.sizes
    dims, odims = layout.params, layout.opt
    used = tuple(a for d in dims for a in d)
    logical = g.logical or (None,) * len(g.shape)
    # Axes on a stacked-layers dim: FSDP-like (each scan step gathers its layer); split no compute
    layer_axes = tuple(a for d, n in zip(dims, logical, strict=True) if n == "layers" for a in d)
    # an expert-parallel moe_experts weight: its EP axes split experts, not FSDP or TP
    ep = experts.ep_axes(g, dims, sizes) if experts.moe_call(g, ctx.trace) else ()
    fsdp = tuple(
        a for a in used if a not in ep and (a in batch_axes or a in ctx.context or a in layer_axes)
    )
    tp = tuple(a for a in used if a not in fsdp and a not in ep)
    # Sequence sharding over the tensor axes (Megatron-SP) turns each all-reduce
    # into a reduce-scatter + all-gather of the same bytes; over other axes it
    # splits the tokens (context parallelism).
    context = tuple(a for a in seq_axes if a not in tp and a not in batch_axes)
    batch_shards = math.prod(sizes[a] for a in batch_axes)
    oused = tuple(a for d in odims for a in d)
    return _Split(
        used=used,
        fsdp=fsdp,
        tp=tp,
        context=context,
        extra=tuple(a for a in oused if a not in used),
        # grads are partial sums over every axis that splits the tokens but not the param
        grad_sync=tuple(a for a in (*batch_axes, *context) if a not in used),
        local=g.nbytes / math.prod(sizes[a] for a in used),
        tokens_local=ctx.trace.tokens / batch_shards / math.prod(sizes[a] for a in context),
        ep=ep,
    )


def _collectives(
    ctx: CostContext, g: ParamGroup, layout: GroupLayout, sp: _Split, tp: list[_Coll]
) -> list[_Coll]:
    """What one member of ``g`` moves per step under ``layout`` and ``ctx.recipe``
    (``tp``: its tensor-parallel collectives, :func:`_params_part`)."""
    # Under mixed precision the weights are cast before they are gathered, and
    # their gradients reduced before the cast back: collectives of params and
    # grads move compute-dtype bytes.
    wire = sp.local * cast_ratio(ctx, g)
    # under float8 the weights travel quantized (1 byte), their gradients in bf16
    grad_wire = sp.local * ctx.grad_ratio(g.dtype)
    m = ctx.recipe.microbatches
    n_fsdp = math.prod(ctx.sizes[a] for a in sp.fsdp)
    colls: list[_Coll] = []
    if sp.fsdp and ctx.gather_once:
        colls.append(_coll(ctx, "all_gather", wire * n_fsdp, sp.fsdp))
        # the accumulators, in float32 under a narrower compute dtype
        acc = sp.local * ctx.accumulator_ratio(g.dtype)
        colls.append(_coll(ctx, "reduce_scatter", acc * n_fsdp, sp.fsdp))
    elif sp.fsdp:
        colls.append(_coll(ctx, "all_gather", wire * n_fsdp, sp.fsdp, hidden=True, times=m))
        colls.append(
            _coll(ctx, "reduce_scatter", grad_wire * n_fsdp, sp.fsdp, hidden=True, times=m)
        )
    if sp.extra and (layout.grads_sharded or not (ctx.gather_once and sp.tp)):
        # ZeRO: reduce-scattered into the state's shard, all-reduced over the rest; once per
        # micro-batch (a pipeline's once; its ZeRO-1 TP weights': layouts.update_specs)
        n_extra, k = math.prod(ctx.sizes[a] for a in sp.extra), 1 if ctx.gather_once else m
        scatter = tuple(a for a in sp.extra if a in sp.grad_sync)
        shard = grad_wire * math.prod(ctx.sizes[a] for a in scatter) / n_extra
        rest = tuple(a for a in sp.grad_sync if a not in sp.extra)
        rs = _coll(ctx, "reduce_scatter", shard, scatter, hidden=True, times=k)
        ar = _coll(ctx, "all_reduce", grad_wire / n_extra, rest, hidden=True, times=k)
        colls.extend(c for c in (rs, ar) if c.payload)
    elif sp.grad_sync:
        colls.append(_coll(ctx, "all_reduce", grad_wire, sp.grad_sync, hidden=True))
    colls.extend(tp)
    if sp.extra:
        colls.append(_coll(ctx, "all_gather", sp.local, sp.extra))
    return colls


def cost_levers(ctx: CostContext, g: ParamGroup) -> tuple:
    """What :func:`group_cost` of ``g`` depends on in ``ctx`` besides the mesh, the
    topology and the trace (which contexts sharing a memo share): the recipe's
    levers and how the step runs."""
    recipe = ctx.recipe
    # The remat policy changes a group's cost only by whether the forward (and
    # its tensor-parallel all-reduces) reruns, and that only for a layered
    # row-parallel weight: recipes that differ only otherwise share the entry.
    rerun = recipe.remat in ("full", "names") and rerun_charged(g)
    # a moe_experts call reruns its forward exchanges under any recompute
    # (experts.exchanges), and keeps its buffers for the layers it does not
    # recompute (experts.kept_residual_bytes)
    moe_rerun = (
        (recipe.remat, recipe.remat_every) if experts.moe_call(g, ctx.trace) is not None else None
    )
    return (
        (recipe.compute_dtype, recipe.fp8_scaling, recipe.fp8_exclude, recipe.master_weights),
        recipe.microbatches,
        recipe.offload_opt,
        ctx.gather_once,
        rerun,
        ctx.context,
        moe_rerun,
    )


def group_cost(
    ctx: CostContext,
    g: ParamGroup,
    layout: GroupLayout,
    batch_axes: tuple[str, ...],
    seq_axes: tuple[str, ...],
) -> GroupCost:
    """The cost of laying ``g`` out as ``layout`` with the batch over
    ``batch_axes`` and the sequence over ``seq_axes`` under ``ctx.recipe``
    (module docstring); memoized in ``ctx``."""
    recipe = ctx.recipe
    # (the stored group has the same key and shape: looked up before it is made)
    key = (g.key, g.shape, layout, batch_axes, seq_axes, cost_levers(ctx, g))
    hit = ctx.memo.get(key)
    if hit is not None:
        return hit
    g = stored_group(recipe, g)
    count, cast = g.count, cast_ratio(ctx, g)
    sizes = ctx.sizes
    sp, tp, flops, compute_s = _params_part(ctx, g, layout, key)
    n_fsdp = math.prod(sizes[a] for a in sp.fsdp)
    by_kind: dict[str, float] = {}
    comm_s = hidden_s = paired_s = 0.0
    colls = _collectives(ctx, g, layout, sp, tp)
    compute_s += experts.transposes_s(ctx, g, layout, colls, tp) * count
    for c in colls:
        comm_s += c.time_s * count
        hidden_s += c.time_s * count if c.hidden else 0.0
        paired_s += c.time_s * count if c.paired else 0.0
        by_kind[c.kind] = by_kind.get(c.kind, 0.0) + c.payload * count
    oshards = math.prod(sizes[a] for d in layout.opt for a in d)
    opt = g.opt_bytes / oshards * count
    if recipe.offload_opt and opt:
        comm_s += 2 * opt / ctx.topology.host_bandwidth  # to the device for the update, and back
        by_kind["host_offload"] = by_kind.get("host_offload", 0.0) + 2 * opt
    n_tp = math.prod(sizes[a] for a in sp.tp)
    n_extra = math.prod(sizes[a] for a in sp.extra)
    logical = g.logical or ()
    out = GroupCost(
        comm_s=comm_s,
        compute_s=compute_s,
        comm_bytes=tuple(sorted(by_kind.items())),
        params=sp.local * count,
        grads=sp.local * count / (n_extra if grads_at_state(ctx, layout) else 1),
        opt=0.0 if recipe.offload_opt else opt,
        tp_weight=flops * (1 - 1 / n_tp),
        hidden_s=hidden_s,
        layer_compute_s=compute_s if count > 1 or "layers" in logical else 0.0,
        # the compute-dtype copy (none where the stored params are in that dtype)
        cast=sp.local * count * copy if (copy := copy_ratio(ctx, g)) != 1.0 else 0.0,
        gathered=(
            ((n_fsdp - 1) * cast + n_fsdp * ctx.accumulator_ratio(g.dtype) - 1) * sp.local * count
            if ctx.gather_once
            else 0.0
        ),
        accumulators=(
            n_fsdp * sp.local * count * ctx.accumulator_ratio(g.dtype) if ctx.gather_once else 0.0
        ),
        offload_opt=opt if recipe.offload_opt else 0.0,
        tp_shards=n_tp if any(n in ("heads", "kv_heads") for n in logical) else 1,
        tp_bytes=sum(c.payload for c in tp) * count,
        buffers=experts.dispatch_buffer_bytes(ctx, g, sp, (*batch_axes, *sp.context)),
        kept=experts.kept_residual_bytes(ctx, g, sp, (*batch_axes, *sp.context)) * count,
        paired_s=paired_s,
        stage_kept=experts.stage_kept_bytes(ctx, g, sp, (*batch_axes, *sp.context)),
    )
    ctx.memo[key] = out
    return out


def _params_part(
    ctx: CostContext, g: ParamGroup, layout: GroupLayout, key: tuple
) -> tuple[_Split, list[_Coll], float, float]:
    """What :func:`group_cost` of ``g`` laid out as ``layout`` (memo ``key``) takes
    from its parameters' layout alone, with what it takes from its optimizer
    state's added: its split (:func:`_split`), tensor-parallel collectives, FLOPs
    and compute time; memoized in ``ctx`` (a layout and its ZeRO variants share it)."""
    g_key, shape, _, batch_axes, seq_axes, levers = key
    dims = layout.params
    pkey = (_PARAMS_KEY, g_key, shape, dims, batch_axes, seq_axes, levers)
    hit = ctx.memo.get(pkey)
    if hit is not None:
        sp, tp, flops, compute_s = hit
        oused = tuple(a for d in layout.opt for a in d)
        return sp._replace(extra=tuple(a for a in oused if a not in sp.used)), tp, flops, compute_s
    # the split of the parameters' layout, whatever the recipe (the stored dtype aside)
    skey = (_SPLIT_KEY, g_key, shape, g.dtype, g.logical, dims, batch_axes, seq_axes, ctx.context)
    sp = ctx.memo.get(skey)
    if sp is None:
        sp = ctx.memo[skey] = _split(ctx, g, GroupLayout(dims, dims), batch_axes, seq_axes)
    oused = tuple(a for d in layout.opt for a in d)
    sp = sp._replace(extra=tuple(a for a in oused if a not in sp.used))
    sizes = ctx.sizes
    tp = _tp_collectives(ctx, g, dims, sp.tp, sp.local, sp.tokens_local) if sp.tp else []
    flops = param_flops(g, ctx.trace) * ctx.flops_scale * g.count
    splits = math.prod(sizes[a] for a in {*batch_axes, *sp.tp, *sp.context, *sp.ep})
    k, n = gemm_dims(g, dims, sp.tp, sizes)
    m = sp.tokens_local * routed_share(g, ctx.trace) / ctx.recipe.microbatches
    call, on, exchanged = experts.moe_call(g, ctx.trace), (*batch_axes, *sp.context), []
    if call is not None:
        tp += (exchanged := experts.dispatch_collectives(ctx, g, call, sp, on, _coll))
        m = experts.rows_per_expert(ctx, g, call, sp, on)
    n_fsdp = math.prod(sizes[a] for a in sp.fsdp)
    compute_s = ctx.matmul_time(flops / splits, m, k, n, matmul_dtype(ctx, g))
    if call is not None:  # as the busiest device runs them, beside an exchange's SMs
        compute_s = experts.call_compute_s(ctx, g, call, sp, on, compute_s, exchanged)
        compute_s += expert_passes.passes_s(ctx, g, sp, on)  # rows through memory
    compute_s += quantize_s(ctx, g, flops / splits, m, k, n, n_fsdp)
    ctx.memo[pkey] = (sp, tp, flops, compute_s)
    return sp, tp, flops, compute_s


def tensor_parallel_bytes(
    ctx: CostContext,
    groups: Sequence[ParamGroup],
    choice: Sequence[GroupLayout],
    batch_axes: tuple[str, ...],
    seq_axes: tuple[str, ...],
) -> float:
    """Payload bytes per device per step of the tensor-parallel collectives of
    ``groups`` laid out as ``choice`` (the activation all-reduces Megatron-LM
    counts, :func:`~spmdkit.planner.group_gemms.tp_times`)."""
    return sum(
        group_cost(ctx, g, layout, batch_axes, seq_axes).tp_bytes
        for g, layout in zip(groups, choice, strict=True)
    )


def total_cost(
    ctx: CostContext,
    groups: Sequence[ParamGroup],
    choice: Sequence[GroupLayout],
    batch_axes: tuple[str, ...],
    seq_axes: tuple[str, ...],
) -> Cost:
    """The analytic :class:`~spmdkit.planner.plans.Cost` of one layout per group
    under ``ctx.recipe``."""
    sizes = ctx.sizes
    trace = ctx.trace
    seq_shards = math.prod(sizes[a] for a in seq_axes)
    comm_s = compute_s = hidden_s = layer_s = paired_s = 0.0
    comm: dict[str, float] = {}
    params = grads = opt = tp_weight = cast = offloaded = gathered = buffers = kept = 0.0
    total_flops = 0.0
    heads_tp = 1
    for g, layout in zip(groups, choice, strict=True):
        c = group_cost(ctx, g, layout, batch_axes, seq_axes)
        comm_s += c.comm_s
        hidden_s, paired_s = hidden_s + c.hidden_s, paired_s + c.paired_s
        compute_s += c.compute_s
        layer_s += c.layer_compute_s
        for k, v in c.comm_bytes:
            comm[k] = comm.get(k, 0.0) + v
        params += c.params
        grads += c.grads
        opt += c.opt
        cast += c.cast
        gathered += c.gathered
        buffers, kept = max(buffers, c.buffers), kept + c.kept
        offloaded += c.offload_opt
        tp_weight += c.tp_weight
        heads_tp = max(heads_tp, c.tp_shards)
        total_flops += param_flops(g, trace) * ctx.flops_scale * g.count
    batch_shards = math.prod(sizes[a] for a in batch_axes)
    dtype = ctx.compute_dtype(min((g.dtype for g in groups), default="float32", key=_itemsize))
    attn_split = batch_shards * heads_tp
    attn_split *= _attention_seq_shards(ctx, groups, choice, batch_axes, seq_axes)
    attn_s = _attention_s(ctx, attention_dtype(dtype), attn_split)
    compute_s += attn_s + (rerun_s := recompute_s(ctx, layer_s))
    if not total_flops and trace.flops:
        compute_s = ctx.compute_time(trace.flops / batch_shards, 0.0, dtype)
    # a pipelined stage gathers K/V over its tensor axes around the exchange
    heads = ()
    if ctx.gather_once and ctx.context:
        heads = tuple(
            a for a in _head_axes(ctx, groups, choice, batch_axes, seq_axes) if a not in ctx.context
        )
    cp = stage_context_attention(ctx, batch_shards * heads_tp, attn_s, heads)
    comm_s, hidden_s = comm_s + cp.comm_s, hidden_s + cp.hidden_s
    for k, v in cp.payload.items():
        comm[k] = comm.get(k, 0.0) + v
    tp_frac = tp_weight / total_flops if total_flops else 0.0
    # the sequence split over tensor axes (Megatron-SP) splits every activation
    sp = any(a not in ctx.context for a in seq_axes)
    acts = activations(ctx, batch_shards * seq_shards, tp_frac, sp)
    if ctx.peak_flops is None:
        update = 3 * params + grads + 2 * (opt + offloaded) + cast
        shards = batch_shards * seq_shards
        compute_s += memory_bound_s(ctx, shards, tp_frac, sp, update)
    moved, host_s = offload_traffic(ctx, batch_shards * seq_shards, tp_frac, sp)
    if moved:  # overlapped with the layers' compute
        comm["host_activations"] = moved
        comm_s, hidden_s = comm_s + host_s, hidden_s + host_s
    hidden_s += min(paired_s, ctx.topology.overlap * (compute_s - rerun_s) / 3)  # forward's
    exposed = comm_s - hidden_s
    step = compute_s + ctx.topology.exposed_comm(hidden_s, exposed, compute_s)
    hidden = comm_s - (step - compute_s)
    held = {"compute_copy": cast, "gathered_stage": gathered, "context_kv": cp.memory}
    held |= {"moe_buffers": buffers, "moe_kept": kept}
    held["attention_scores"] = score_bytes(ctx, attention_dtype(dtype), attn_split)
    memory = memory_by_kind(ctx, params, grads, opt, acts, offloaded, held)
    return Cost(
        step_time_s=step,
        compute_time_s=compute_s,
        comm_time_s=comm_s,
        comm_bytes={k: int(v) for k, v in sorted(comm.items())},
        memory=memory,
        hidden_comm_s=hidden,
        ops={"attention": {cp.strategy: max(trace.layers, 1)}} if ctx.context else {},
    )


def _attention_s(ctx: CostContext, dtype: str, split: float) -> float:
    """Seconds per device of the step's attention regions in ``dtype``, split over
    ``split`` batch, sequence and head shards: their FLOPs, and, without a fused
    kernel, their score traffic (:func:`~spmdkit.planner.plain_attention.score_traffic_s`)."""
    flops = ctx.trace.attention_flops(ctx.recipe, ctx.topology) / split
    attn_s = ctx.compute_time(0.0, flops, dtype)
    if ctx.peak_flops is None:
        attn_s += score_traffic_s(ctx, dtype, split)
    return attn_s


def _head_axes(
    ctx: CostContext,
    groups: Sequence[ParamGroup],
    choice: Sequence[GroupLayout],
    batch_axes: tuple[str, ...],
    seq_axes: tuple[str, ...],
) -> tuple[str, ...]:
    """The tensor axes that split the attention heads (size > 1, in mesh order)."""
    axes = {
        a
        for g, layout in zip(groups, choice, strict=True)
        if g.logical and any(n in ("heads", "kv_heads") for n in g.logical)
        for a in _split(ctx, g, layout, batch_axes, seq_axes).tp
    }
    return tuple(a for a in ctx.sizes if a in axes and ctx.sizes[a] > 1)


def _attention_seq_shards(
    ctx: CostContext,
    groups: Sequence[ParamGroup],
    choice: Sequence[GroupLayout],
    batch_axes: tuple[str, ...],
    seq_axes: tuple[str, ...],
) -> int:
    """The sequence shards that split attention beyond the head shards: attention
    splits over the batch, sequence and head shards, but a sequence axis that also
    splits the heads (Megatron-SP: the sequence is gathered before attention,
    which runs on the local heads) splits it once, not twice."""
    if not seq_axes:  # the common case, on the search's hot path
        return 1
    head_axes = _head_axes(ctx, groups, choice, batch_axes, seq_axes)
    return math.prod(ctx.sizes[a] for a in seq_axes if a not in head_axes)


def _itemsize(dtype: str) -> int:
    return np.dtype(dtype).itemsize
