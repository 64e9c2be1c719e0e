"""Context parallelism: one sequence's tokens split over devices, as the planner prices it.

A *context axis* splits the ``seq`` dim of the activations over devices that hold
different tokens of the same sequences. Everything token-wise (the weight
matmuls, norms, the loss) splits over it like over a data axis: weights sharded
over it are gathered (FSDP) and gradients are reduced over it. Attention is the
exception: each query block needs every earlier key, so the keys and values
travel, either

- **ring**: each device keeps its query block and passes its K/V block to the
  next device ``n − 1`` times (collective-permutes), each step overlapped with the
  attention of the block that arrived before; the backward pass sends the K/V
  blocks around again with their gradients: ``3 (n − 1)/n`` of the full
  sequence's K/V per device per layer (plus one forward's worth when the
  recompute policy reruns attention), hidden under the attention's compute as
  long as a block's transfer is shorter than its compute; or
- **gather_kv**: K/V all-gathered before the attention and their gradients
  reduce-scattered after: ``2 (n − 1)/n`` of the K/V, exposed (the attention
  waits for it), and the gathered K/V of a layer live on the device (every
  layer's when nothing is recomputed). Cheap under grouped-query attention,
  whose K/V are a fraction of the queries.

The planner prices both and takes the faster (:func:`context_attention`). The
causal mask's work is priced as evenly split: the sequence is cut into ``2n``
chunks and device ``i`` holds chunks ``i`` and ``2n − 1 − i`` (load-balanced),
so every device computes the same share of the unmasked blocks
(:func:`causal_shares`). Contiguous shards (device ``i`` holds the ``i``-th
``1/n`` of the sequence) leave the last device ``(2n − 1)/n²`` of the causal
work, ``(2n − 1)/n`` times a balanced device's, and the step waits for it; the
planner never plans them and a plan cannot hold them
(``ContextParallel(load_balanced=False)`` is refused).

``auto`` considers context parallelism on a mesh axis named ``context``
(:data:`CONTEXT_AXIS`) when the mesh has one, and otherwise splits the data axis
``data=n`` into ``data × context`` (:func:`split_context`, the context axis
minor, so a ring stays inside a node) for every degree that divides it and the
sequence into ``2 ×`` degree chunks, when the sequences are long
(:data:`LONG_SEQUENCE`) or fewer than the data axis's devices
(:func:`context_meshes`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from spmdkit.context_parallel import PIPELINED_STRATEGIES
from spmdkit.mesh import data_axis, split_axis
from spmdkit.planner.logical import PlanError
from spmdkit.spec import MeshLike, axis_sizes
from spmdkit.topology import Topology

__all__ = [
    "CONTEXT_AXIS",
    "LONG_SEQUENCE",
    "PIPELINED_STRATEGIES",
    "ContextAttention",
    "causal_shares",
    "context_attention",
    "context_axes",
    "context_meshes",
    "stage_context_attention",
    "split_context",
]

#: The mesh axis context-parallel plans split the sequence over.
CONTEXT_AXIS = "context"

#: Sequences at least this long make auto consider context parallelism even
#: when the batch fills the data axis.
LONG_SEQUENCE = 32768


def context_axes(seq_axes: tuple[str, ...]) -> tuple[str, ...]:
    """The context-parallel axes among the axes a layout splits the sequence over:
    the one named :data:`CONTEXT_AXIS` (a sequence split over a tensor axis is
    Megatron-style sequence parallelism instead: the tokens are gathered before
    the weight matmuls and attention runs on the local heads)."""
    return tuple(a for a in seq_axes if a == CONTEXT_AXIS)


def split_context(mesh: MeshLike, degree: int, axis: str = CONTEXT_AXIS) -> MeshLike:
    """``mesh`` with its data axis (``data``, else its first axis with more than
    one device) split into ``data × axis``, ``axis`` of size ``degree`` and minor
    (neighbouring devices hold one sequence's chunks, so the ring's sends stay
    inside a node). A ``Mesh``'s devices keep their order (its device array is
    reshaped).

    Raises:
        PlanError: no data axis, or ``degree`` does not divide it.

    Example::

        >>> split_context(abstract_mesh(data=8), 4).axis_names
        ('data', 'context')
    """
    sizes = axis_sizes(mesh)
    data = data_axis(mesh)
    if data is None or sizes[data] % degree or axis in sizes:
        raise PlanError(
            op="plan",
            must=f"a mesh without a '{axis}' axis has a data axis that {degree} divides",
            given=str(sizes),
            fix=f"add a '{axis}' axis to the mesh (sk.abstract_mesh(data=..., {axis}={degree}))",
        )
    return split_axis(mesh, data, axis, degree, major=False)


def context_meshes(mesh: MeshLike, batch_size: int, seq_len: int) -> list[MeshLike]:
    """The meshes auto tries context parallelism on (module docstring), smallest
    degree first: the mesh itself when it has a :data:`CONTEXT_AXIS` axis, else
    its data axis split for each degree ``c ≥ 2`` dividing the axis with ``2c``
    dividing the sequence, when the sequence is at least :data:`LONG_SEQUENCE`
    tokens or the batch does not fill the data axis; none without a sequence."""
    sizes = axis_sizes(mesh)
    if seq_len <= 1:
        return []
    if CONTEXT_AXIS in sizes:
        n = sizes[CONTEXT_AXIS]
        return [mesh] if n > 1 and seq_len % (2 * n) == 0 else []
    data = data_axis(mesh)
    if data is None:
        return []
    n = sizes[data]
    if seq_len < LONG_SEQUENCE and batch_size % n == 0:
        return []
    return [
        split_context(mesh, c) for c in range(2, n + 1) if n % c == 0 and seq_len % (2 * c) == 0
    ]


def causal_shares(
    degree: int, *, balanced: bool = True, blocks: int | None = None
) -> tuple[float, ...]:
    """Each context shard's fraction of a causal attention's work, exactly.

    The kernel skips whole blocks above the diagonal and computes a diagonal
    block whole: a query block computes every key block up to its own, so of a
    sequence of ``B`` blocks, block ``q`` computes ``q + 1`` of the ``B(B + 1)/2``.
    Contiguous shards of ``k = B / degree`` blocks: shard ``i`` computes
    ``k(k(2i + 1) + 1) / (B(B + 1))``, which tends to ``(2i + 1) / degree²`` as
    the blocks get finer (``blocks=None``: that limit). Load-balanced (shard ``i``
    holds chunks ``i`` and ``2·degree − 1 − i`` of ``B / (2·degree)`` blocks):
    ``1 / degree`` each, at every block size.

    Args:
      degree: the context shards.
      balanced: the load-balanced order (else contiguous shards).
      blocks: the kernel's blocks per contiguous shard (``B / degree``); None:
        the fine-block limit.

    Example::

        >>> causal_shares(4, balanced=False, blocks=1)  # shard-sized blocks: 1 : 2 : 3 : 4
        (0.1, 0.2, 0.3, 0.4)
        >>> causal_shares(4, balanced=False)  # fine blocks: 1 : 3 : 5 : 7
        (0.0625, 0.1875, 0.3125, 0.4375)
    """
    if not isinstance(degree, int) or degree < 1 or (blocks is not None and blocks < 1):
        raise PlanError(
            op="causal_shares",
            must="degree and blocks are positive ints",
            given=f"degree={degree!r}, blocks={blocks!r}",
            fix="pass the context degree (plan.context.degree) and the blocks per shard",
        )
    if balanced:
        return (1.0 / degree,) * degree
    if blocks is None:
        return tuple((2 * i + 1) / degree**2 for i in range(degree))
    k, total = blocks, blocks * degree
    return tuple(k * (k * (2 * i + 1) + 1) / (total * (total + 1)) for i in range(degree))


class ContextAttention(NamedTuple):
    """What attention's K/V exchange costs per device per step under context
    parallelism: ``strategy`` (``"ring"`` or ``"gather_kv"``), its collectives'
    time (``comm_s``, of which ``hidden_s`` overlaps compute), payload bytes by
    collective kind, and the device memory it holds (gathered K/V)."""

    strategy: str
    comm_s: float
    hidden_s: float
    payload: dict[str, float]
    memory: float


def context_attention(
    topology: Topology,
    mesh: MeshLike,
    axes: tuple[str, ...],
    kv_bytes: float,
    layers: int,
    attention_s: float,
    *,
    rerun: bool,
    keep_all: bool,
    microbatches: int = 1,
    strategies: tuple[str, ...] = ("ring", "gather_kv"),
    head_axes: tuple[str, ...] = (),
) -> ContextAttention:
    """The cheaper of the ring and the K/V all-gather (module docstring), among
    ``strategies``.

    Args:
      topology: the link model.
      mesh: the mesh (with the context axes).
      axes: the context axes.
      kv_bytes: the keys and values of the device's whole sequences, all layers
        (before the split over the context axes), at the compute dtype.
      layers: attention layers they are spread over (at least 1).
      attention_s: the device's attention compute time, forward and backward.
      rerun: the recompute policy reruns attention's forward (its K/V exchange too).
      keep_all: nothing is recomputed: ``gather_kv`` keeps every layer's gathered K/V.
      microbatches: the step's micro-batches (gradient accumulation or a
        pipeline's): each exchanges its own K/V, and one's are live at a time.
      strategies: the strategies that can run (a pipelined stage's:
        :data:`PIPELINED_STRATEGIES`).
      head_axes: the automatic axes that split ``kv_bytes``'s heads in a
        pipelined stage (tensor parallelism), where ``gather_kv`` runs on K/V
        whole over them: XLA gathers a device's tokens of K and V over these
        axes before the exchange over the (manual) context axes, and the
        gathered K/V's gradients before their reduce-scatter, so the exchange
        moves and holds all the heads (priced here: the gathers as
        ``all_gather`` payload, the exchange at ``h`` times ``kv_bytes``).
    """
    sizes = axis_sizes(mesh)
    n = int(np.prod([sizes[a] for a in axes])) if axes else 1
    if n <= 1 or kv_bytes <= 0:
        return ContextAttention("ring", 0.0, 0.0, {}, 0.0)
    layers, m = max(layers, 1), max(microbatches, 1)
    per_layer = kv_bytes / layers / m  # one micro-batch's
    forwards = 2 if rerun else 1
    # ring: n - 1 permutes of one block per forward, twice that in the backward
    # (K/V again, and their gradients)
    sends = m * layers * (n - 1) * (forwards + 2)
    block = per_layer / n
    ring_s = sends * topology.collective_time("collective_permute", int(block), n, axes, mesh)
    ring_hidden = min(ring_s, attention_s)
    ring = ContextAttention("ring", ring_s, ring_hidden, {"collective_permute": sends * block}, 0.0)
    # gather_kv: all-gather per forward, reduce-scatter of the gradients
    h = int(np.prod([sizes[a] for a in head_axes])) if head_axes else 1
    whole = per_layer * h  # K/V on every head (gathered over the head axes first)
    wire = whole * (n - 1) / n
    gather_s = (
        m
        * layers
        * (
            forwards * topology.collective_time("all_gather", int(wire), n, axes, mesh)
            + topology.collective_time("reduce_scatter", int(wire), n, axes, mesh)
        )
    )
    heads_moved = 0.0
    if h > 1:  # a device's tokens per forward, every token's gradients once
        heads_moved = m * layers * (forwards / n + 1) * whole
        for nbytes, count in ((whole / n, forwards), (whole, 1)):
            t = topology.collective_time(
                "all_gather", int(nbytes * (h - 1) / h), h, head_axes, mesh
            )
            gather_s += m * layers * count * t
    held = layers * whole * (n - 1) / n if keep_all else whole
    gather = ContextAttention(
        "gather_kv",
        gather_s,
        0.0,
        {
            "all_gather": m * layers * forwards * whole + heads_moved,
            "reduce_scatter": m * layers * whole,
        },
        held,
    )
    if "ring" not in strategies:
        return gather
    if "gather_kv" not in strategies:
        return ring
    exposed = (ring.comm_s - ring.hidden_s, gather.comm_s)
    return ring if exposed[0] <= exposed[1] else gather


def stage_context_attention(
    ctx: Any, shards: int, attention_s: float, head_axes: tuple[str, ...] = ()
) -> ContextAttention:
    """Attention's K/V exchange over ``ctx.context`` (:func:`context_attention`)
    for the analytic cost model's context (``ctx``: a
    :class:`spmdkit.planner.analytic.CostContext`): the traced K/V at the compute
    itemsize over ``shards``; in a pipelined stage (``ctx.gather_once``), gathered
    over the ``head_axes`` that split their heads first."""
    trace, recipe = ctx.trace, ctx.recipe
    scale = recipe.compute_itemsize(trace.act_itemsize) / trace.act_itemsize
    return context_attention(
        ctx.topology,
        ctx.mesh,
        ctx.context,
        trace.attn_kv_bytes * scale / shards,
        trace.layers,
        attention_s,
        rerun=trace.recompute_flops(recipe)[1] > 0,
        keep_all=recipe.remat == "none",
        microbatches=recipe.microbatches,
        strategies=PIPELINED_STRATEGIES if ctx.gather_once else ("ring", "gather_kv"),
        head_axes=head_axes,
    )
