"""``moe_experts``: the registered ``moe_experts`` rule applied to arrays.

The routed experts of a mixture-of-experts layer as one op: assignments sorted
by expert, the experts run as grouped GEMMs (``jax.lax.ragged_dot``), the
results combined with the routing weights. Under expert parallelism
(``strategy="all_to_all"``) each device sends the assignments to the devices
holding their experts and receives the results back, three padded all-to-alls
over the expert axes (the per-expert counts, the tokens out, the results
back); ``"local"`` runs each device's experts on the tokens it holds and sums
the outputs over the expert axes. Expert tensor parallelism (the hidden dim
sharded) leaves the output sum-partial, FSDP storage of the weights' model dim
is all-gathered inside. ``jax.grad`` differentiates the per-device program
(the transposes of the all-to-alls and gathers are the backward's collectives).
Called inside a traced step on a mesh with Auto axes, the op is a region the
planner lays out whole and prices per strategy. Semantics and costs:
:mod:`spmdkit.rules.moe`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from spmdkit.ops.base import apply_rule
from spmdkit.spec import MeshLike

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
    if strategy is not None:
        attrs["strategy"] = strategy
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
