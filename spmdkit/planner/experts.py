"""Routed experts (:func:`spmdkit.ops.moe_experts`) as the analytic cost model prices them.

A step that calls the ``moe_experts`` op (``spmdkit.nn.MoE``) has its calls read from
the traced forward (:func:`moe_regions`: per expert count, the tokens, top-k, model
and hidden widths of one call and how many calls a step makes). A parameter group
with an ``expert`` logical dim of that count is one of the op's weights, and its
layout is priced as the op's ``all_to_all`` strategy runs it
(:mod:`spmdkit.rules.moe`):

- **expert parallelism** (EP): the mesh axes on the expert dim. The op's tokens are
  sharded over the batch axes and the EP axes together, so an EP axis that also
  splits the batch (the data axis split ``data × expert``, as context parallelism
  splits it) is not FSDP for these weights: they are never gathered over it
  (:func:`ep_axes`), the tokens travel instead. Per call each device sends its
  ``T_local · k`` assignments to the devices holding their experts in a padded
  all-to-all, ``T_local · min(k, E_local)`` rows of ``D`` per peer, and gets the
  results back the same way; with the per-expert counts (``E_local`` int32 per
  peer) that is three all-to-alls forward. The grad region reads the buffers the
  forward region kept (:func:`rules.moe.residual_programs`) and runs only their
  transposes; a pipelined stage runs the op's per-device program under plain
  autodiff (:mod:`spmdkit.expert_shard`), which exchanges the same. So per call and
  micro-batch :data:`EXCHANGES` buffers of ``n_ep · T_local · min(k, E_local) · D``
  bytes and :data:`COUNT_EXCHANGES` count exchange (:func:`dispatch_collectives`),
  the forward's again where the recipe recomputes the layer
  (:func:`exchanges`; what ``plan.verify`` predicts the stages to run). All on
  the topology's link for the EP axes (NVLink
  inside a node, the network across: :meth:`~spmdkit.topology.Topology.collective_time`).
  That buffer is the payload; what crosses the link depends on the backend: XLA's
  padded all-to-all (CPU) sends all of it, a ragged all-to-all
  (``jax.lax.ragged_all_to_all``: GPU, TPU; :data:`RAGGED_BACKENDS`) only the rows
  routed, ``T_local · k`` of ``D`` per exchange (times :func:`load_imbalance`: the
  busiest device's), which is what the link time charges there
  (:func:`ragged_exchange`).
  Charged to the down projection (the group whose last GEMM dim is ``embed``), once
  per call, as Megatron-LM's row-parallel weight carries a layer's all-reduce.
- **priced-only exchange forms** (:class:`~spmdkit.topology.Topology` fields; the
  plan then carries a ``priced_only`` note: spmdkit's executor runs none of them).
  ``expert_exchange="routed"`` prices Megatron-LM's alltoall dispatcher: the
  per-expert counts exchanged first (the host waits for them), then buffers of
  the rows routed, sized at run time (:func:`received_rows`; the link carries those
  rows on any backend). ``expert_exchange="node_dedup"`` sizes its buffers so
  too, and prices the exchange as DeepEP's normal kernels
  run it where the EP group spans nodes: a token crosses the network once per
  node holding one of its experts and is fanned out to their devices inside it
  (the combine mirrors it), so a device sends ``T_local · (nodes - 1) · p_node``
  rows of ``D`` over the network and forwards ``T_local · n_ep · p_device ·
  (g - 1) / g`` over the node's link (``node_bandwidth``), both at once (:func:`node_dedup_time`;
  ``g`` devices of the group a node: :meth:`~spmdkit.topology.Topology.node_share`).
  ``p_node`` and ``p_device``: the chance that a node (a device) holds at least
  one of a token's ``k`` experts, routed uniformly: ``1 - C(E - E_here, k) / C(E, k)``
  without a group limit; with one (the op's ``expert_groups``: DeepSeek-V3's
  group-limited routing, a token's experts in at most ``group_top_k`` groups)
  that maps onto the nodes, lower (:func:`reach_chance`).
  ``expert_overlap=True`` prices the token exchanges as overlappable with
  compute in a step of two or more micro-batches (:func:`overlapped`), as
  Megatron-LM's 1F1B all-to-all overlap runs them: one micro-batch's forward
  beside another's backward, each pass's exchanges under the other pass's
  compute. The forward pass's :data:`FORWARD_EXCHANGES` hide under the
  topology's ``overlap`` share of compute like the other overlappable
  collectives; the backward pass's (the transposes, a recompute's forward) only
  under that share of the forward pass's compute, a third of the step's compute
  less recomputation (:func:`spmdkit.planner.analytic.total_cost`).
- **grouped GEMMs**: each device runs its ``E_local`` experts on what arrived:
  ``n_ep · T_local · k / E`` rows per local expert (all devices of the EP group send
  to it), the ``m`` of the topology's GEMM roofline, so the efficiency falls as the
  tokens per local expert fall (:func:`rows_per_expert`).
- **expert tensor parallelism** (the hidden ``F`` on a non-batch axis) and **FSDP**
  of ``D`` over the batch axes are priced as the dense weights' (an all-reduce of the
  sum-partial output; the weights gathered inside the op). The search costs no
  other layout of these weights (:func:`runs_as_priced`): the op would gather such
  a weight whole before it runs and hand its gradient back whole per layer.
- **memory**: one call's backward (the grad region's program, one layer at a
  time) holds at its peak three buffers of the rows received
  (:func:`received_rows`: the op's padded ``n_ep · T_local · min(k, E_local)``,
  or a priced-only form's routed ``T_local · k`` at the busiest device's load)
  ``D`` wide (the cotangent received, the rows sorted by expert, the rows'
  cotangent), four ``F_local`` wide (the recomputed gate and up outputs and
  their cotangents) and the local experts' weight gradients before their sum
  over the token axes; the forward region's peak (the send and receive buffers)
  is below it. Where the recipe reruns the exchange the recomputed forward's
  received rows, counts and results back are held through that one layer's
  backward too (:func:`dispatch_buffer_bytes`). What the grad reads is held from each call's
  forward to its backward, for every layer the recipe does not recompute: the rows
  received (one buffer), their counts and the results back (``T_local · k · D``)
  (:func:`kept_residual_bytes`). In a pipelined stage those are kept per layer
  and micro-batch in flight, with the stage's residual set (without recompute
  the grouped GEMMs' outputs too: :func:`stage_kept_bytes`), unless the recipe
  reruns the exchange.
- **load imbalance** (:func:`load_imbalance`): the grouped GEMMs' time, and the
  rows a ragged or node-deduplicated exchange sends, are the busiest device's, and
  even routing that is balanced on average is not balanced per call. The price
  takes the routing as uniform (each token's ``k`` distinct experts uniform among
  the ``E``; with a group limit that maps onto the devices, its ``g`` groups uniform
  among the ``G`` and the experts uniform within them), which is what a forced
  balance runs: Megatron-LM's ``moe_router_force_load_balancing``, which the
  published MoE benchmarks set, replaces the router's logits with standard-normal
  noise. A device's rows per call are then a sum of ``n_ep · T_local`` independent
  per-token counts, mean ``T_local · k``; the busiest of the ``n_ep`` devices is
  priced at the mean plus the expected maximum of ``n_ep`` standard normals (Blom's
  approximation, ``Φ⁻¹((n − 0.375) / (n + 0.25))``) standard deviations. A learned
  router is less even than uniform: this is the least imbalance a dropless call
  pays. The padded buffers are sized for the worst case whatever it is.
- **SMs the exchange holds**: an overlapped exchange (``expert_overlap``) whose
  kernels run on SMs of their own (the topology's ``exchange_sms``: DeepEP's
  normal kernels) leaves the compute it overlaps the other SMs, so its time costs
  ``exchange_sms / sm_count`` of itself in compute (:func:`exchange_sm_s`).

A group of a step without ``moe_experts`` calls (experts as one-hot einsums or plain
``ragged_dot``) keeps the analytic model's own pricing, but for one term that every
stacked expert weight pays (:func:`transposes_s`): XLA runs an all-gather or a
reduce-scatter with its dim major in memory, and an expert weight ``[E, D, F]``
gathered or scattered over ``D`` or ``F`` then has its expert dim inside, which no
batched GEMM reads in place: each such collective costs a transpose of its whole
buffer (read and written at ``hbm_bandwidth``). Laid out over ``E`` it costs none.
A 2-D weight's permuted layout is a plain transpose, which the GEMM reads in place.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from statistics import NormalDist
from typing import Any, NamedTuple

from spmdkit.topology import RAGGED_BACKENDS as _RAGGED_BACKENDS

__all__ = [
    "KEPT_TAG",
    "COUNT_EXCHANGES",
    "EXCHANGES",
    "FORWARD_EXCHANGES",
    "MoeCall",
    "RAGGED_BACKENDS",
    "call_compute_s",
    "dispatch_buffer_bytes",
    "dispatch_collectives",
    "ep_axes",
    "exchange_sm_s",
    "exchanges",
    "is_down_projection",
    "kept_residual_bytes",
    "load_imbalance",
    "moe_call",
    "node_dedup_time",
    "overlapped",
    "ragged_exchange",
    "reach_chance",
    "received_rows",
    "region_tokens",
    "reruns_exchange",
    "rows_per_expert",
    "sized_buffers",
    "stacked_calls",
    "stage_kept_bytes",
    "transposes_s",
]

#: Token buffers one call's train step exchanges without recompute: the forward's
#: dispatch and combine, and their transposes in the backward.
EXCHANGES = 4

#: Token buffers of those the forward pass exchanges (its dispatch and combine).
FORWARD_EXCHANGES = 2

#: Per-expert count exchanges per call without recompute (the forward's).
COUNT_EXCHANGES = 1

#: Backends whose XLA has a ragged all-to-all (``jax.lax.ragged_all_to_all``):
#: an exchange there sends each peer only the rows routed to it (module docstring).
RAGGED_BACKENDS = _RAGGED_BACKENDS


class MoeCall(NamedTuple):
    """One ``moe_experts`` call of the traced step (global shapes).

    Attributes:
      experts: ``E``.
      tokens: ``T``, the rows of ``x``.
      top_k: ``k``.
      d_model: ``D``.
      d_ff: ``F``.
      itemsize: bytes of one element of ``x``.
      calls: how many calls one forward makes (a layer scan's trip count included).
      strategy: the op's ``strategy`` attribute (``None``: the planner's choice).
      groups: the routing's group limit ``(groups, group_top_k)`` (the op's
        ``expert_groups``), or None.
    """

    experts: int
    tokens: int
    top_k: int
    d_model: int
    d_ff: int
    itemsize: int
    calls: float
    strategy: str | None = None
    groups: tuple[int, int] | None = None


def moe_call(g: Any, trace: Any) -> MoeCall | None:
    """The ``moe_experts`` call whose weight ``g`` is (an ``expert`` logical dim of
    its expert count), else None."""
    calls = getattr(trace, "moe_calls", None)
    logical = g.logical or ()
    if not calls or "expert" not in logical:
        return None
    call = calls.get(g.shape[logical.index("expert")])
    return None if call is None or call.strategy == "local" else call


def ep_axes(g: Any, dims: Sequence[Sequence[str]], sizes: dict[str, int]) -> tuple[str, ...]:
    """The mesh axes expert-parallel ``g`` is split over: those on its expert dim,
    when the experts divide them (the op replicates experts that do not)."""
    i = (g.logical or ()).index("expert")
    axes = tuple(dims[i])
    if axes and g.shape[i] % math.prod(sizes[a] for a in axes):
        return ()
    return axes


def transposes_s(
    ctx: Any, g: Any, layout: Any, colls: Sequence[Any], activations: Sequence[Any] = ()
) -> float:
    """Seconds one member of expert weight ``g`` laid out as ``layout`` spends on
    the transposes its all-gathers and reduce-scatters need (module docstring):
    those of ``colls`` (the analytic model's, each with its mesh axes) but for the
    ``activations``' (its tensor-parallel collectives, which move no weight), a
    pass reading and writing each one's whole buffer where it runs over a mesh
    axis on a dim after the expert dim, while a device still holds several
    experts; 0 for a weight without an ``expert`` dim.

    Example: the 8-expert MoE's ``w_up`` ``[layers, 8, 256, 512]`` with ``embed``
    over ``data`` (FSDP) gathers and scatters 4 MiB a layer over dim 2: two
    transposes of 8 MiB of traffic a layer; with ``expert`` over ``data``, none."""
    logical = g.logical or ()
    if "expert" not in logical:
        return 0.0
    e = logical.index("expert")
    sizes = ctx.sizes
    if math.prod(sizes[a] for a in layout.params[e]) >= g.shape[e]:
        return 0.0  # one expert a device: the expert dim is a unit dim
    after = {a for dims in (layout.params, layout.opt) for d in dims[e + 1 :] for a in d}
    moved = sum(
        c.payload
        for c in colls
        if c.kind in ("all_gather", "reduce_scatter")
        and after.intersection(c.axes)
        and all(c is not a for a in activations)
    )
    return 2.0 * moved / ctx.topology.hbm_bandwidth


def runs_as_priced(g: Any, dims: Sequence[Sequence[str]], token_axes: Sequence[str]) -> bool:
    """Whether the op runs expert weight ``g`` laid out as ``dims`` the way the
    analytic model prices it: its model dim ``D`` split only over the op's token
    axes (FSDP: gathered inside the op, the gradient reduce-scattered back there)
    and its hidden dim ``F`` over none of them (expert TP). The op gathers a weight
    split any other way whole before it runs (:mod:`spmdkit.rules.moe`), and its
    gradient leaves each layer whole: a stack of whole gradients the dense pricing
    does not see, so the search leaves such layouts out."""
    logical = list(g.logical or ())
    tokens = set(token_axes) | set(dims[logical.index("expert")])
    for name, d in zip(logical, dims, strict=False):
        if name == "embed" and not set(d) <= tokens:
            return False
        if name == "mlp" and set(d) & tokens:
            return False
    return True


def is_down_projection(g: Any) -> bool:
    """Whether ``g`` is the experts' down projection (its last GEMM dim ``embed``):
    the group a call's exchanges are charged to."""
    logical = [n for n in (g.logical or ()) if n not in ("layers", "expert")]
    return bool(logical) and logical[-1] == "embed"


def stacked_calls(g: Any) -> int:
    """Calls one member of ``g`` serves: its stacked-layers dim's length, else 1."""
    logical = g.logical or ()
    return int(g.shape[logical.index("layers")]) if "layers" in logical else 1


def region_tokens(ctx: Any, call: MoeCall, sp: Any, token_axes: Sequence[str]) -> tuple[int, float]:
    """``(n_ep, tokens)``: the EP degree and the tokens one device holds inside one
    micro-batch's call: the layer's (``sp.tokens_local`` of the step's tokens) split
    further over the EP axes that do not already split them (``token_axes``: the
    batch and context axes)."""
    sizes = ctx.sizes
    n_ep = math.prod(sizes[a] for a in sp.ep)
    share = sp.tokens_local / max(ctx.trace.tokens, 1)
    extra = math.prod(sizes[a] for a in sp.ep if a not in token_axes)
    return n_ep, call.tokens * share / extra / ctx.recipe.microbatches


def _per_peer(call: MoeCall, t_local: float, n_ep: int) -> float:
    """Rows of the exchange buffer per peer (the rule's ``_buffer_rows``)."""
    return math.ceil(t_local) * min(call.top_k, call.experts // n_ep)


def sized_buffers(ctx: Any) -> bool:
    """Whether the topology's exchange form sizes its buffers to the rows routed
    (module docstring): ``expert_exchange`` ``"routed"`` or ``"node_dedup"``, priced
    only; spmdkit's op (``"all_to_all"``) pads them for the worst case."""
    return ctx.topology.expert_exchange != "all_to_all"


def received_rows(ctx: Any, call: MoeCall, n_ep: int, t_local: float) -> float:
    """Rows of ``D`` one device receives per call and micro-batch from ``n_ep``
    peers, as its buffers hold them (module docstring): the op's padded buffer,
    ``n_ep · T_local · min(k, E_local)``, or under :func:`sized_buffers` the rows
    routed to the busiest device, ``T_local · k`` times :func:`load_imbalance`.

    Example: Qwen3-30B-A3B under EP 16 (128 experts top-8), 4,096 tokens a
    device: 524,288 padded rows, about 33,000 routed."""
    if sized_buffers(ctx):
        return math.ceil(t_local) * call.top_k * load_imbalance(call, n_ep, t_local)
    return n_ep * _per_peer(call, t_local, n_ep)


def dispatch_collectives(
    ctx: Any, g: Any, call: MoeCall, sp: Any, token_axes: Sequence[str], coll: Any
) -> list[Any]:
    """The all-to-alls one member of ``g`` is charged per step (module docstring):
    per call and micro-batch the token buffers and count exchanges of
    :func:`exchanges` over its EP axes; none unless ``g`` is
    the down projection. ``coll(ctx, kind, payload, axes, times=)`` builds one
    collective (the analytic model's)."""
    n_ep, t_local = region_tokens(ctx, call, sp, token_axes)
    if n_ep <= 1 or not is_down_projection(g):
        return []
    times = stacked_calls(g) * ctx.recipe.microbatches
    itemsize = ctx.recipe.compute_itemsize(call.itemsize)
    buf = n_ep * _per_peer(call, t_local, n_ep) * call.d_model * itemsize
    counts = n_ep * (call.experts // n_ep) * 4
    buffers, count_exchanges = exchanges(ctx)
    tokens = coll(ctx, "all_to_all", buf, sp.ep, times=buffers * times)
    dedup = node_dedup_time(ctx, call, sp, t_local, itemsize)
    if dedup is not None:  # priced only (module docstring): the buffer stays the payload
        tokens = tokens._replace(time_s=dedup * buffers * times)
    elif ragged_exchange(ctx) or ctx.topology.expert_exchange == "routed":
        # the link carries the routed rows; the op's buffer is the payload
        routed = t_local * call.top_k * call.d_model * itemsize
        routed *= load_imbalance(call, n_ep, t_local)
        sent = coll(ctx, "all_to_all", routed, sp.ep, times=buffers * times)
        tokens = tokens._replace(time_s=sent.time_s)
    counted = coll(ctx, "all_to_all", counts, sp.ep, times=count_exchanges * times)
    if not overlapped(ctx):
        return [tokens, counted]
    # the forward pass's dispatch and combine hide under another micro-batch's
    # backward; the backward pass's (transposes, a recompute's) under its forward
    forward = FORWARD_EXCHANGES / buffers
    ahead = tokens._replace(
        time_s=tokens.time_s * forward, payload=tokens.payload * forward, hidden=True
    )
    behind = tokens._replace(
        time_s=tokens.time_s - ahead.time_s, payload=tokens.payload - ahead.payload, paired=True
    )
    return [ahead, behind, counted]


def overlapped(ctx: Any) -> bool:
    """Whether the token exchanges are priced as overlappable with compute
    (module docstring): the topology's ``expert_overlap`` (priced only), in a step
    of two or more micro-batches (a pipeline's, or gradient accumulation's)."""
    return bool(ctx.topology.expert_overlap) and ctx.recipe.microbatches >= 2


def exchange_sm_s(ctx: Any, colls: Sequence[Any]) -> float:
    """Seconds of compute the overlapped token exchanges among ``colls`` (those
    :func:`dispatch_collectives` marks hidden or paired) take from the GEMMs they
    overlap (module docstring): their time × the topology's ``exchange_sms`` over
    its ``sm_count``; 0 when they are not overlapped (:func:`overlapped`) or hold no
    SMs.

    Example: 2 s of overlapped exchange on kernels holding 20 of 132 SMs cost
    20 / 132 × 2 ≈ 0.30 s of compute."""
    topo = ctx.topology
    if not topo.exchange_sms or not overlapped(ctx):
        return 0.0
    overlapping = sum(c.time_s for c in colls if c.hidden or c.paired)
    return overlapping * topo.exchange_sms / topo.sm_count


def call_compute_s(
    ctx: Any,
    g: Any,
    call: MoeCall,
    sp: Any,
    token_axes: Sequence[str],
    balanced_s: float,
    colls: Sequence[Any],
) -> float:
    """Seconds of a call's grouped GEMMs of ``g`` priced at ``balanced_s`` for
    balanced routing, as the busiest device runs them (:func:`load_imbalance`),
    plus what the overlapped exchanges among ``colls`` take from them
    (:func:`exchange_sm_s`) and, on the down projection, the topology's fixed
    ``moe_call_s`` per call and micro-batch (priced only: an eager framework's)."""
    busiest = load_imbalance(call, *region_tokens(ctx, call, sp, token_axes))
    calls = stacked_calls(g) * g.count * ctx.recipe.microbatches if is_down_projection(g) else 0
    return balanced_s * busiest + exchange_sm_s(ctx, colls) + ctx.topology.moe_call_s * calls


def _device_variance(call: MoeCall, n_ep: int) -> float:
    """Variance of how many of one token's ``k`` experts one of ``n_ep`` devices
    holds, routed uniformly (module docstring): hypergeometric, ``k`` draws from
    ``E`` of which the device holds ``E / n_ep``; with a group limit ``(G, g)``
    whose groups each hold whole devices' experts, a mixture: the device's group
    kept with chance ``g / G``, then ``k`` draws from the kept ``g · E / G``."""
    e, k = call.experts, call.top_k
    here = e // n_ep

    def hyper(pool: int) -> tuple[float, float]:
        share = here / pool
        var = k * share * (1 - share) * (pool - k) / (pool - 1) if pool > 1 else 0.0
        return k * share, var

    groups = call.groups
    if groups is not None and groups[0] <= n_ep and (e // groups[0]) % here == 0:
        n_groups, kept = groups
        chance = kept / n_groups
        mean, var = hyper(kept * e // n_groups)
        return chance * (var + mean * mean) - (chance * mean) ** 2
    return hyper(e)[1]


def load_imbalance(call: MoeCall, n_ep: int, t_local: float) -> float:
    """The busiest of ``n_ep`` devices' routed rows over the mean, per call, for
    ``t_local`` tokens a device under uniform routing (module docstring): 1 plus
    the expected maximum of ``n_ep`` standard normals (Blom) times the coefficient
    of variation of a device's rows, ``√(n_ep · T_local · var) / (T_local · k)``.
    1.0 without expert parallelism.

    Example: GPT-OSS 120B's calls under EP 8 (128 experts top-4, 4,096 tokens a
    device): a device's 16,384 rows vary by about 118, the busiest of 8 by about
    1.4 of that: about 1.01."""
    if n_ep <= 1 or t_local <= 0 or call.experts < n_ep:
        return 1.0
    var = _device_variance(call, n_ep)
    z = NormalDist().inv_cdf((n_ep - 0.375) / (n_ep + 0.25))
    return 1.0 + z * math.sqrt(n_ep * t_local * var) / (t_local * call.top_k)


def _hit(experts: int, here: int, k: int) -> float:
    """The chance that ``here`` of ``experts`` experts hold at least one of a
    token's ``k`` distinct experts, chosen uniformly: ``1 - C(E - here, k) / C(E, k)``."""
    if here <= 0:
        return 0.0
    return 1.0 - math.comb(experts - here, k) / math.comb(experts, k)


def reach_chance(experts: int, k: int, holders: int, groups: tuple[int, int] | None) -> float:
    """The chance that one of ``holders`` equal contiguous shares of the experts
    (a node's, a device's) holds at least one of a token's ``k`` experts.

    Without a group limit, the ``k`` experts are distinct and uniform:
    ``1 - C(E - E/holders, k) / C(E, k)``. With one (``groups``: ``(G, g)``, the
    experts ``G`` contiguous groups, a token's experts in ``g`` of them) that maps
    onto the holders (``G`` divides by ``holders`` or ``holders`` by ``G``), the
    ``g`` groups are uniform among ``G`` and the ``k`` experts uniform among their
    ``g · E / G``: a share overlapping ``m = max(1, G / holders)`` groups with
    ``h = E / max(G, holders)`` experts in each is reached with chance
    ``Σ_j P(j of its m groups kept) · (1 - C(gE/G - jh, k) / C(gE/G, k))``,
    ``P`` hypergeometric. A limit that does not map onto the holders is left out
    (the unlimited chance)."""
    if holders <= 0:
        return 0.0
    here = experts // holders
    if groups is None:
        return _hit(experts, here, k)
    n_groups, kept_groups = groups
    if n_groups % holders and holders % n_groups:
        return _hit(experts, here, k)
    m = max(1, n_groups // holders)
    h = experts // max(n_groups, holders)
    kept = kept_groups * experts // n_groups
    total = math.comb(n_groups, kept_groups)
    return sum(
        math.comb(m, j) * math.comb(n_groups - m, kept_groups - j) / total * _hit(kept, j * h, k)
        for j in range(1, min(m, kept_groups) + 1)
    )


def node_dedup_time(
    ctx: Any, call: MoeCall, sp: Any, t_local: float, itemsize: int
) -> float | None:
    """Seconds of one token exchange (one dispatch or combine of one micro-batch's
    call) priced as a node-deduplicated exchange (module docstring): the network
    part (a token once per remote node holding one of its experts) and the
    intra-node fan-out run at once, the slower sets the time. None unless the
    topology's ``expert_exchange`` is ``"node_dedup"`` and the EP group spans two
    or more nodes (:meth:`~spmdkit.topology.Topology.node_share`). A group-limited
    routing (``call.groups``) lowers the chances a token reaches a node or a
    device (:func:`reach_chance`)."""
    topo = ctx.topology
    if topo.expert_exchange != "node_dedup":
        return None
    n_ep = math.prod(ctx.sizes[a] for a in sp.ep)
    share = topo.node_share(sp.ep, ctx.mesh)
    nodes = n_ep // max(share, 1)
    if nodes <= 1 or n_ep % share:
        return None
    row = call.d_model * itemsize * load_imbalance(call, n_ep, t_local)
    net_bw, net_lat = topo.link(tuple(sp.ep), ctx.mesh)
    nodes_hit = (nodes - 1) * reach_chance(call.experts, call.top_k, nodes, call.groups)
    devices_hit = n_ep * reach_chance(call.experts, call.top_k, n_ep, call.groups)
    network = (nodes - 1) * net_lat + t_local * nodes_hit * row / net_bw
    inside = t_local * devices_hit * (share - 1) / share * row
    fan_out = (share - 1) * topo.node_latency + inside / topo.node_bandwidth
    return max(network, fan_out)


#: The ``checkpoint_name`` the op's kept exchange buffers carry
#: (:func:`spmdkit.engine.region.kept_name` of ``moe_experts``).
KEPT_TAG = "moe_experts"


def reruns_exchange(recipe: Any) -> bool:
    """Whether the recipe's remat reruns a recomputed layer's token exchange: any
    policy but ``none`` and those keeping the exchanged buffers (their tag,
    :func:`spmdkit.engine.region.kept_name` of ``moe_experts``: the policy
    ``save_out_proj_experts``, or ``names`` with it), which hold them from the
    forward to the backward instead (:func:`kept_residual_bytes`)."""
    return recipe.remat != "none" and KEPT_TAG not in recipe.saved_names


def exchanges(ctx: Any) -> tuple[int, int]:
    """``(token buffers, count exchanges)`` one call runs per train step and
    micro-batch (module docstring): :data:`EXCHANGES` and :data:`COUNT_EXCHANGES`
    (the forward's two and their transposes, one count exchange), and the
    forward's three again where the recipe's remat recomputes the layer. A grad
    region reads the forward region's kept buffers; a pipelined stage's plain
    autodiff does the same (:func:`spmdkit.verification.pipelined.expert_exchange`)."""
    forwards = 2 if reruns_exchange(ctx.recipe) else 1
    return EXCHANGES + 2 * (forwards - 1), COUNT_EXCHANGES * forwards


def ragged_exchange(ctx: Any) -> bool:
    """Whether the plan's target backend sends only the routed rows (module
    docstring): one of :data:`RAGGED_BACKENDS`."""
    return ctx.topology.target(ctx.mesh) in RAGGED_BACKENDS


def rows_per_expert(ctx: Any, g: Any, call: MoeCall, sp: Any, token_axes: Sequence[str]) -> float:
    """Rows one local expert's grouped GEMM multiplies per call and micro-batch:
    every device of the EP group sends it its share, ``n_ep · T_local · k / E``
    (balanced routing)."""
    n_ep, t_local = region_tokens(ctx, call, sp, token_axes)
    return n_ep * t_local * call.top_k / call.experts


def kept_residual_bytes(ctx: Any, g: Any, sp: Any, token_axes: Sequence[str]) -> float:
    """Bytes one device holds from the forward to the backward of the calls one
    member of ``g`` serves (module docstring): per call and micro-batch in flight,
    the rows received, their counts and the results back, for the layers the
    recipe does not recompute (:func:`rules.moe.residual_programs`); 0 unless ``g``
    is the down projection of an expert-parallel call, or in a pipelined stage
    (its residuals are the stage's, per micro-batch in flight:
    :func:`stage_kept_bytes`)."""
    if ctx.gather_once:
        return 0.0
    recipe = ctx.recipe
    kept = 1.0 if not reruns_exchange(recipe) else (recipe.remat_every - 1) / recipe.remat_every
    return kept * stacked_calls(g) * _call_kept_bytes(ctx, g, sp, token_axes)


def stage_kept_bytes(ctx: Any, g: Any, sp: Any, token_axes: Sequence[str]) -> float:
    """In a pipelined stage (:attr:`~spmdkit.planner.analytic.CostContext.gather_once`),
    the bytes one layer's call (``g`` its down projection) keeps on one device
    from its forward to its backward for one micro-batch, where the recipe keeps
    the exchanged buffers (:func:`reruns_exchange`): the rows received, their
    counts and the results back (a policy keeping :data:`KEPT_TAG`), and without
    recompute the grouped GEMMs' gate, up and hidden outputs too (``F_local``
    wide each); 0 otherwise, or outside a pipelined stage. The stage's plain
    autodiff of the op's per-device program keeps them with each micro-batch's
    residual set (:mod:`spmdkit.expert_shard`), and the traced step holds only
    stand-ins for them (:mod:`spmdkit.engine.region`), so the pipelined price
    adds them per micro-batch in flight
    (:func:`spmdkit.planner.pipeline.cost.activation_bytes`)."""
    if not ctx.gather_once or reruns_exchange(ctx.recipe):
        return 0.0
    return _call_kept_bytes(ctx, g, sp, token_axes, gemms=ctx.recipe.remat == "none")


def _call_kept_bytes(
    ctx: Any,
    g: Any,
    sp: Any,
    token_axes: Sequence[str],
    gemms: bool = False,
    down: bool = True,
) -> float:
    """One call's kept buffers on one device for one micro-batch (the rows
    received, their counts, the results back; ``gemms``: the grouped GEMMs'
    three outputs too); 0 unless ``g`` is a weight (``down``: the down
    projection) of an expert-parallel call."""
    call = moe_call(g, ctx.trace)
    if call is None or (down and not is_down_projection(g)):
        return 0.0
    n_ep, t_local = region_tokens(ctx, call, sp, token_axes)
    if n_ep <= 1:
        return 0.0
    itemsize = ctx.recipe.compute_itemsize(call.itemsize)
    rows = received_rows(ctx, call, n_ep, t_local)
    got = rows * call.d_model * itemsize
    back = math.ceil(t_local) * call.top_k * call.d_model * itemsize
    counts = n_ep * (call.experts // n_ep) * 4
    f_local = call.d_ff / math.prod(ctx.sizes[a] for a in sp.tp)
    outputs = 3 * rows * f_local * itemsize if gemms else 0.0
    return got + back + counts + outputs


def dispatch_buffer_bytes(ctx: Any, g: Any, sp: Any, token_axes: Sequence[str]) -> float:
    """Bytes one call's backward holds while it runs (module docstring): the grad
    region's program (:func:`rules.moe.residual_programs`) at its peak holds three
    buffers of the exchanged rows ``D`` wide (the received cotangent, the rows
    sorted by expert that the weight gradients read, and the rows' cotangent
    formed), four of the grouped GEMMs' ``F_local``-wide values (the gate and
    up outputs it recomputes, their cotangents) and the local experts' three
    weight gradients before their sum over the token axes; where the recipe reruns the
    exchange (:func:`reruns_exchange`) it also holds, for the one layer it
    recomputes, what the forward region hands it (the rows received, their
    counts and the results back: what :func:`kept_residual_bytes` holds for every
    layer otherwise); 0 for a group that is no ``moe_experts`` weight."""
    call = moe_call(g, ctx.trace)
    if call is None:
        return 0.0
    n_ep, t_local = region_tokens(ctx, call, sp, token_axes)
    f_local = call.d_ff / math.prod(ctx.sizes[a] for a in sp.tp)
    itemsize = ctx.recipe.compute_itemsize(call.itemsize)
    rows = received_rows(ctx, call, n_ep, t_local) if n_ep > 1 else t_local * call.top_k
    held = 0.0
    if n_ep > 1 and reruns_exchange(ctx.recipe):
        held = _call_kept_bytes(ctx, g, sp, token_axes, down=False)
    # the local experts' three weight gradients, each before its sum over the tokens' axes
    e_local = call.experts // n_ep if n_ep > 1 else call.experts
    weight_grads = 3 * e_local * call.d_model * f_local * itemsize
    return rows * (3 * call.d_model + 4 * f_local) * itemsize + weight_grads + held
