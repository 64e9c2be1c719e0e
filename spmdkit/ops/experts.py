"""``moe_experts``: the registered ``moe_experts`` rule applied to arrays.

The routed experts of a mixture-of-experts layer as one op: assignments sorted
by expert, the experts run as grouped GEMMs (``jax.lax.ragged_dot``), the
results combined with the routing weights. Under expert parallelism
(``strategy="all_to_all"``) each device sends the assignments to the devices
holding their experts and receives the results back, three all-to-alls over
the expert axes (the per-expert counts, the tokens out, the results back; the
tokens' padded on CPU, ragged where the backend has one); ``"local"`` runs
each device's experts on the tokens it holds and sums the outputs over the
expert axes. Expert tensor parallelism (the hidden dim
sharded) leaves the output sum-partial, FSDP storage of the weights' model dim
is all-gathered inside. ``jax.grad`` differentiates the per-device program
(the transposes of the all-to-alls and gathers are the backward's collectives).
Called inside a traced step on a mesh with Auto axes, the op is a region the
planner lays out whole and prices per strategy. Traced on one device's tokens and
experts (a pipelined stage under :func:`spmdkit.expert_shard.expert_shard`), it
runs the ``all_to_all`` program directly over the manual axes. Semantics and
costs: :mod:`spmdkit.rules.moe`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from spmdkit.engine.inference import infer_forward
from spmdkit.engine.local import local_context
from spmdkit.engine.registry import get_rule
from spmdkit.errors import ShardingConflictError
from spmdkit.expert_shard import ExpertShard, current_expert_shard, note_expert_exchange
from spmdkit.mesh import abstract_mesh
from spmdkit.ops.base import apply_rule
from spmdkit.spec import MeshLike, TensorSpec

__all__ = ["moe_experts"]


def moe_experts(
    x: jax.Array,
    expert_idx: jax.Array,
    weights: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    *,
    capacity_factor: float | None = None,
    expert_groups: tuple[int, int] | None = None,
    strategy: str | None = None,
    mesh: MeshLike | None = None,
    in_specs: Sequence[Any] | None = None,
) -> jax.Array:
    """Routed SwiGLU experts whose partitioning is the ``moe_experts`` rule.

    Args:
      x: ``[T, D]`` tokens.
      expert_idx: ``[T, k]`` integer expert ids, distinct per token (as
        ``jax.lax.top_k`` gives them: the exchange buffers hold at most
        ``min(k, E_local)`` assignments of one token per peer).
      weights: ``[T, k]`` combine weights of the chosen experts.
      w_gate: ``[E, D, F]`` gate projections of the experts.
      w_up: ``[E, D, F]`` up projections.
      w_down: ``[E, F, D]`` down projections.
      capacity_factor: ``None`` (dropless), or token dropping: each expert takes
        at most ``ceil(capacity_factor * T * k / E)`` assignments, the first in
        token order over the whole batch, whatever the sharding.
      expert_groups: ``(groups, group_top_k)`` when the routing is group-limited
        (:class:`spmdkit.nn.MoE`'s ``groups``): each token's experts lie in at
        most ``group_top_k`` of ``groups`` contiguous groups of experts. A promise
        about ``expert_idx`` the op does not check or need (it computes the same);
        the planner prices a node-deduplicated exchange with it
        (:func:`spmdkit.planner.experts.node_dedup_time`).
      strategy: ``"all_to_all"`` (tokens sharded over the expert axes too,
        exchanged by all-to-all) or ``"local"`` (tokens replicated over the
        expert axes, the output summed over them); ``None``: the rule's first,
        or the planner's choice inside a planned step.
      mesh: the mesh (default: the arrays' mesh or the ``jax.set_mesh`` context).
      in_specs: per argument a ``PartitionSpec``/``TensorSpec`` or ``None``;
        needed for traced arguments under Auto mesh axes.

    Returns:
      ``[T, D]`` in ``x``'s dtype: ``sum_j weights[t, j] * expert_{idx[t, j]}(x[t])``,
      the tokens laid out as the rule requires them.

    Raises:
      ShardingConflictError: shapes or dtypes that do not fit, an unknown strategy,
        a bad ``capacity_factor``, or a layout that does not divide.
      SpecError: no mesh can be found, or a traced argument's layout is unknown.

    Example::

        >>> mesh = sk.make_mesh(data=8)
        >>> ep = NamedSharding(mesh, P("data"))
        >>> x, idx, w = (jax.device_put(a, ep) for a in (x, idx, w))   # tokens
        >>> wg, wu, wd = (jax.device_put(a, ep) for a in (wg, wu, wd))  # experts
        >>> y = moe_experts(x, idx, w, wg, wu, wd)    # [T@data, D], 3 all-to-alls
    """
    attrs: dict[str, Any] = {}
    if capacity_factor is not None:
        attrs["capacity_factor"] = float(capacity_factor)
    if expert_groups is not None:
        attrs["expert_groups"] = tuple(int(n) for n in expert_groups)
    if strategy is not None:
        attrs["strategy"] = strategy
    shard = current_expert_shard()
    if shard is not None:  # a pipelined stage on one device's tokens and experts
        return _on_shard((x, expert_idx, weights, w_gate, w_up, w_down), attrs, shard)
    return apply_rule(
        "moe_experts",
        x,
        expert_idx,
        weights,
        w_gate,
        w_up,
        w_down,
        mesh=mesh,
        in_specs=in_specs,
        **attrs,
    )


#: The name of the call a pipelined stage's routed experts run their per-device
#: program in (:func:`moe_experts` under :func:`~spmdkit.expert_shard.expert_shard`).
EXPERT_EXCHANGE = "spmdkit_expert_exchange"


def _on_shard(args: tuple, attrs: dict[str, Any], shard: ExpertShard) -> jax.Array:
    """The op on one device's tokens (``x`` and the routing: rows split over
    ``shard.tokens``) and experts (the weights: dim 0 split over ``shard.experts``),
    traced where those axes are manual: the rule's ``all_to_all`` program, called
    directly."""
    x, idx, w, wg, wu, wd = args
    if attrs.get("strategy", "all_to_all") != "all_to_all":
        raise ShardingConflictError(
            op="moe_experts",
            must="the experts of a pipelined stage split over its batch axes run the "
            "'all_to_all' strategy",
            given=f"strategy {attrs['strategy']!r} with the experts over {shard.experts}",
            fix="leave strategy=None, or plan the experts off the batch axes",
        )
    attrs = {**attrs, "strategy": "all_to_all"}
    mesh = abstract_mesh(**dict(shard.sizes))
    n_tok, n_ep = shard.token_shards, shard.expert_shards
    specs = [
        TensorSpec((a.shape[0] * n_tok, *a.shape[1:]), P(shard.tokens), dtype=a.dtype)
        for a in (x, idx, w)
    ]
    specs += [
        TensorSpec((a.shape[0] * n_ep, *a.shape[1:]), P(shard.experts), dtype=a.dtype)
        for a in (wg, wu, wd)
    ]
    res = infer_forward("moe_experts", *specs, mesh=mesh, **attrs)
    if tuple(res.inputs) != tuple(specs) or any(o.partial for o in res.outputs):
        raise ShardingConflictError(
            op="moe_experts",
            must=f"the tokens over {shard.tokens} and the experts over {shard.experts} "
            "are a layout the all_to_all strategy takes as it is (a pipelined stage)",
            given=f"the rule asks for {[str(s) for s in res.inputs]}",
            fix="plan the experts over batch axes that divide them and the tokens",
        )
    # what plan.verify predicts the stages to run: the rule's collectives here are
    # integer counts (token dropping's gather, the per-expert counts' all-to-all:
    # no cotangent), then the tokens' all-to-alls out and back (transposed in the
    # backward)
    kinds = [c.kind for c in res.collectives]
    first = kinds.index("all_to_all") if "all_to_all" in kinds else len(kinds)
    note_expert_exchange(res.collectives, [i > first for i in range(len(kinds))])
    rule = get_rule("moe_experts")
    local = rule.local_fn(local_context(rule, res, attrs, mesh))

    def spmdkit_expert_exchange(*a: jax.Array) -> jax.Array:
        return local(*a)

    return jax.jit(spmdkit_expert_exchange)(*args)
