"""``attention``: the registered ``attention`` rule applied to arrays.

The computation runs under ``shard_map`` (see :func:`spmdkit.ops.base.apply_rule`),
with exactly the rule's collectives: none for batch- or head-parallel attention
(``strategy="default"``); two all-gathers of K and V over the sequence axes for
``"gather_kv"`` (their grads reduce-scattered back); ``n - 1`` collective-permutes
of one K and one V block each for ``"ring"`` (the grads travel back the same
way). ``jax.grad`` differentiates the local computation directly (the
transposes of ``all_gather`` and ``ppermute`` are the backward collectives the
grad rule states), so no ``custom_vjp`` is needed. Semantics and costs:
:mod:`spmdkit.rules.attention`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from spmdkit.context_parallel import (
    ContextShard,
    current_attention,
    current_order,
    current_shard,
    note_exchange,
)
from spmdkit.engine.inference import infer_forward
from spmdkit.engine.local import local_context, resolve_partials
from spmdkit.engine.registry import get_rule
from spmdkit.errors import ShardingConflictError
from spmdkit.mesh import abstract_mesh
from spmdkit.ops.base import apply_rule
from spmdkit.spec import MeshLike, TensorSpec

__all__ = ["attention"]


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = False,
    scale: float | None = None,
    strategy: str | None = None,
    implementation: str | None = None,
    block_size: int | None = None,
    mesh: MeshLike | None = None,
    in_specs: Sequence[Any] | None = None,
    balanced: int | None = None,
) -> jax.Array:
    """Scaled dot-product attention governed by the ``attention`` rule.

    Args:
      q: ``[B, Sq, H, D]`` queries.
      k: ``[B, Sk, Hkv, D]`` keys; ``H`` a multiple of ``Hkv`` (grouped-query:
        query head ``h`` reads kv head ``h // (H / Hkv)``).
      v: values, ``k``'s shape and dtype.
      causal: query ``i`` sees keys ``j <= i`` (top-left aligned, as
        ``jax.nn.dot_product_attention(is_causal=True)``).
      scale: logit scale (default ``1 / sqrt(D)``).
      strategy: ``"default"`` (the reference semantics: batch and heads parallel, sequences
        replicated), ``"gather_kv"`` (queries stay sequence-sharded, K/V
        all-gathered) or ``"ring"`` (queries and K/V sequence-sharded alike, K/V
        blocks passed around the ring). ``None``: the one a context-parallel
        plan's step pins (:func:`spmdkit.context_parallel.current_attention`), else the
        planner's choice.
      implementation: the local computation. ``None``: the op's own (float32
        scores of all keys at once; the ring's online softmax). Else a kernel of
        :mod:`spmdkit.kernels` on each device's blocks, under every strategy:
        ``"xla"`` (plain), ``"blockwise"`` (flash-style, O(S) residuals),
        ``"cudnn"`` (the fused kernel; not with a sequence-sharded causal query),
        ``"auto"`` (cuDNN on a GPU when it accepts the inputs, else blockwise).
        The unsharded reference is then that kernel too.
      block_size: key/value block of the blockwise kernel (default 512).
      mesh: the mesh (default: the arrays' mesh or the ``jax.set_mesh`` context).
      in_specs: per argument a ``PartitionSpec``/``TensorSpec`` or ``None``;
        needed for traced arguments under Auto mesh axes.
      balanced: with ``causal``, the sequence dims of q, k, v are in the
        load-balanced order for this many context shards
        (:class:`spmdkit.context_parallel.BalancedOrder`): the mask compares natural
        positions. ``None``: the order the loss is traced in
        (:func:`spmdkit.context_parallel.current_order`, set by a context-parallel plan's
        step); ``1``: natural.

    Returns:
      ``[B, Sq, H, D]`` in q's dtype, laid out as the rule claims (batch, heads
      and, beyond the reference, the query sequence as in ``q``).

    Raises:
      ShardingConflictError: shapes that do not fit (ranks, ``H % Hkv``), mixed
        or integer dtypes, an unknown strategy, or a layout that does not divide.
      SpecError: no mesh can be found, or a traced argument's layout is unknown.

    Example::

        >>> mesh = sk.make_mesh(data=2, seq=4)
        >>> sh = NamedSharding(mesh, P("data", "seq"))
        >>> q, k, v = (jax.device_put(t, sh) for t in (q, k, v))
        >>> out = attention(q, k, v, causal=True, strategy="ring")   # [B@data, S@seq, H, D]
    """
    attrs: dict[str, Any] = {}
    shard = current_shard()
    if causal:
        attrs["causal"] = True
    if scale is not None:
        attrs["scale"] = float(scale)
    strategy = current_attention() if strategy is None else strategy
    if strategy is not None:
        attrs["strategy"] = strategy
    if implementation is not None:
        attrs["implementation"] = implementation
    if block_size is not None:
        attrs["block_size"] = block_size
    if shard is not None:  # a pipelined stage on one device's tokens
        return _on_shard(q, k, v, attrs, shard)
    if balanced is None and causal:
        order = current_order()
        balanced = None if order is None else order.shards
    if causal and balanced is not None and balanced != 1:
        attrs["balanced"] = balanced
    return apply_rule("attention", q, k, v, mesh=mesh, in_specs=in_specs, **attrs)


def _on_shard(q: Any, k: Any, v: Any, attrs: dict[str, Any], shard: ContextShard) -> Any:
    """Attention on one device's tokens of sequences split over ``shard.axes``,
    traced where those axes are manual (a pipelined stage,
    :func:`spmdkit.context_parallel.context_shard`): the rule's per-device computation
    of ``shard.attention`` (the ring's permutes, or ``gather_kv``'s gathers)
    for operands whose sequence dims are split over the axes, called directly."""
    attrs = {**attrs, "strategy": shard.attention}
    if attrs.get("causal") and shard.balanced:
        attrs["balanced"] = shard.shards
    mesh = abstract_mesh(**dict(zip(shard.axes, shard.sizes, strict=True)))
    specs = [
        TensorSpec(
            (x.shape[0], x.shape[1] * shard.shards, *x.shape[2:]),
            P(None, shard.axes),
            dtype=x.dtype,
        )
        for x in (q, k, v)
    ]
    res = infer_forward("attention", *specs, mesh=mesh, **attrs)
    if tuple(res.inputs) != tuple(specs):
        raise ShardingConflictError(
            op="attention",
            must=f"strategy {shard.attention!r} takes q, k, v with their sequence split "
            f"over {shard.axes} as they are (a pipelined context-parallel stage)",
            given=f"the rule asks for {[str(s) for s in res.inputs]}",
            fix="plan the context axis with strategy 'ring' or 'gather_kv'",
        )
    note_exchange(res.collectives)  # what plan.verify predicts the stages to run
    rule = get_rule("attention")
    local = rule.local_fn(local_context(rule, res, attrs, mesh))

    def spmdkit_context_attention(q: Any, k: Any, v: Any) -> Any:
        return local(q, k, v)

    # a call of this name (CONTEXT_ATTENTION) is what the pipeline's token check
    # takes as the one op that may mix a device's tokens with others'
    out = jax.jit(spmdkit_context_attention)(q, k, v)
    return resolve_partials(out, res.outputs[0])
