"""``MoE``: a dropless mixture-of-experts layer whose experts are :func:`spmdkit.ops.moe_experts`.

Routing is plain jnp around the op (the planner sees its primitives):

1. scores: ``softmax`` or ``sigmoid`` of the router logits ``x @ router``;
2. top-k on the scores plus the aux-loss-free ``expert_bias`` (DeepSeek-V3: the
   bias moves the choice, never the weights), the chosen scores renormalised to
   sum to 1 (``normalize_top_k``) and scaled by ``routed_scaling``. With
   ``groups`` (DeepSeek-V3's group-limited routing: ``n_group``, ``topk_group``)
   the experts are ``groups`` contiguous groups of ``E / groups``; each group is
   scored by the sum of its two best biased scores (its best alone when a group
   holds one expert), the ``group_top_k`` best groups kept and the top-k taken
   among their experts only: a token reaches at most ``group_top_k`` groups, so
   at most that many nodes when each group's experts live on one node;
3. the routed experts as one op (sort by expert, grouped GEMMs, combine; an
   all-to-all under expert parallelism), plus ``n_shared_experts`` experts every
   token goes through (one SwiGLU of ``n_shared_experts * d_ff_expert`` units).

Losses, returned beside the output (``weight * loss`` summed): the load-balancing
loss ``E * sum_e f_e * P_e`` (``f_e``: the fraction of assignments routed to expert
``e``, ``P_e``: its mean normalised score) over the whole batch (``"global"``) or per
sequence, averaged (``"sequence"``); the router z-loss ``mean(logsumexp(logits)^2)``.

The aux-loss-free bias is model state (an :class:`ExpertBias` variable, not a
parameter): each call in training mode moves it by ``bias_update_rate`` towards
the experts that got fewer assignments than the mean (``sign(mean - load_e)``),
as BatchNorm's statistics move; the optimizer never sees it.

Parameters carry logical axis names: the experts' ``(expert, embed, mlp)`` and
``(expert, mlp, embed)``, the router's ``(embed, None)`` (replicated experts:
top-k reads every score), the shared experts' ``(embed, mlp)`` and ``(mlp, embed)``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from spmdkit.errors import ShardingConflictError
from spmdkit.nn.calls import call_op
from spmdkit.ops import moe_experts

__all__ = ["ExpertBias", "MoE"]

_SCORES = ("softmax", "sigmoid")
_BALANCE = ("global", "sequence", None)


class ExpertBias(nnx.Variable):
    """The aux-loss-free routing bias: model state updated by the load, not by grads."""


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], fan_in: int, names: tuple, dtype: Any):
    init = jax.nn.initializers.normal(fan_in**-0.5)
    return nnx.Param(init(rngs.params(), shape, dtype), out_sharding=names)


def _check(cond: bool, must: str, given: Any, fix: str) -> None:
    if not cond:
        raise ShardingConflictError(op="spmdkit.nn.MoE", must=must, given=repr(given), fix=fix)


def _check_groups(e: int, k: int, groups: int | None, group_top_k: int | None) -> None:
    """Raise ShardingConflictError for group-limited routing that cannot route."""
    if groups is None and group_top_k is None:
        return
    _check(
        groups is not None and group_top_k is not None,
        "groups and group_top_k are given together",
        {"groups": groups, "group_top_k": group_top_k},
        "pass both (DeepSeek-V3: groups=8, group_top_k=4) or neither",
    )
    _check(
        groups >= 1 and e % groups == 0,
        "groups >= 1 divides n_experts",
        {"groups": groups, "n_experts": e},
        "pick groups among the divisors of n_experts",
    )
    _check(
        1 <= group_top_k <= groups and group_top_k * (e // groups) >= k,
        "1 <= group_top_k <= groups, the kept groups holding at least top_k experts",
        {"group_top_k": group_top_k, "groups": groups, "experts_per_group": e // groups},
        "raise group_top_k (or lower top_k)",
    )


def _group_limited(pick: jax.Array, groups: int, group_top_k: int) -> jax.Array:
    """``pick`` ``[T, E]`` with the experts outside each token's ``group_top_k``
    best groups set to ``-inf`` (module docstring: a group's score is the sum of
    its two best entries)."""
    t, e = pick.shape
    grouped = pick.reshape(t, groups, e // groups)
    best, _ = jax.lax.top_k(grouped, min(2, e // groups))
    _, keep = jax.lax.top_k(jnp.sum(best, axis=-1), group_top_k)  # [T, group_top_k]
    kept = jnp.sum(jax.nn.one_hot(keep, groups, dtype=jnp.bool_), axis=-2) > 0
    return jnp.where(kept[:, :, None], grouped, -jnp.inf).reshape(t, e)


class MoE(nnx.Module):
    """Routed (and shared) SwiGLU experts; ``moe(x [..., D]) -> (y [..., D], aux_loss)``.

    Args:
      d_model: the model dim ``D``.
      n_experts: routed experts ``E``.
      top_k: experts per token.
      d_ff_expert: hidden units of one expert ``F``.
      n_shared_experts: experts every token goes through (DeepSeek's shared experts).
      score: ``"softmax"`` or ``"sigmoid"`` router scores.
      normalize_top_k: renormalise the chosen scores to sum to 1.
      routed_scaling: factor on the routed experts' weights.
      groups: expert groups for group-limited routing (``None``: none; module
        docstring); must divide ``n_experts``.
      group_top_k: groups a token may route to (with ``groups``); their experts
        must number at least ``top_k``.
      aux_loss_free_bias: keep an :class:`ExpertBias` that steers the choice.
      bias_update_rate: the bias step per training call.
      load_balance: ``"global"``, ``"sequence"`` or ``None``.
      load_balance_weight: weight of the load-balancing loss in ``aux_loss``.
      z_loss_weight: weight of the router z-loss in ``aux_loss``.
      capacity_factor: ``None`` (dropless) or token dropping (see the op).
      strategy: the op's strategy (``None``: the planner's choice).
      param_dtype: the parameters' dtype.
      rngs: the rng streams (``params``).

    Example::

        >>> moe = MoE(64, n_experts=8, top_k=2, d_ff_expert=128, rngs=nnx.Rngs(0))
        >>> y, aux = moe(jnp.ones((2, 16, 64)))
    """

    def __init__(
        self,
        d_model: int,
        *,
        n_experts: int,
        top_k: int,
        d_ff_expert: int,
        n_shared_experts: int = 0,
        score: str = "softmax",
        normalize_top_k: bool = True,
        routed_scaling: float = 1.0,
        groups: int | None = None,
        group_top_k: int | None = None,
        aux_loss_free_bias: bool = False,
        bias_update_rate: float = 1e-3,
        load_balance: str | None = "global",
        load_balance_weight: float = 0.01,
        z_loss_weight: float = 0.0,
        capacity_factor: float | None = None,
        strategy: str | None = None,
        param_dtype: Any = jnp.float32,
        rngs: nnx.Rngs,
    ) -> None:
        _check(
            1 <= top_k <= n_experts,
            "1 <= top_k <= n_experts",
            (top_k, n_experts),
            "pick top_k between 1 and n_experts",
        )
        _check(score in _SCORES, f"score is one of {_SCORES}", score, 'pass score="softmax"')
        _check(
            load_balance in _BALANCE,
            f"load_balance is one of {_BALANCE}",
            load_balance,
            'pass load_balance="global", "sequence" or None',
        )
        _check_groups(n_experts, top_k, groups, group_top_k)
        d, e, f = d_model, n_experts, d_ff_expert
        self.groups, self.group_top_k = groups, group_top_k
        self.n_experts, self.top_k, self.score = e, top_k, score
        self.normalize_top_k, self.routed_scaling = normalize_top_k, routed_scaling
        self.load_balance, self.load_balance_weight = load_balance, load_balance_weight
        self.z_loss_weight, self.capacity_factor = z_loss_weight, capacity_factor
        self.strategy, self.bias_update_rate = strategy, bias_update_rate
        self.update_bias = True
        self.router = _param(rngs, (d, e), d, ("embed", None), param_dtype)
        self.w_gate = _param(rngs, (e, d, f), d, ("expert", "embed", "mlp"), param_dtype)
        self.w_up = _param(rngs, (e, d, f), d, ("expert", "embed", "mlp"), param_dtype)
        self.w_down = _param(rngs, (e, f, d), f, ("expert", "mlp", "embed"), param_dtype)
        self.expert_bias = nnx.data(
            ExpertBias(jnp.zeros((e,), jnp.float32)) if aux_loss_free_bias else None
        )
        s = n_shared_experts * f
        shared = (
            (
                _param(rngs, (d, s), d, ("embed", "mlp"), param_dtype),
                _param(rngs, (d, s), d, ("embed", "mlp"), param_dtype),
                _param(rngs, (s, d), s, ("mlp", "embed"), param_dtype),
            )
            if n_shared_experts
            else (None, None, None)
        )
        self.shared_gate, self.shared_up, self.shared_down = (nnx.data(p) for p in shared)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Route, run the experts, combine; also the weighted auxiliary loss."""
        shape = x.shape
        seqs = x.reshape(-1, shape[-2], shape[-1]) if x.ndim > 2 else x[None]
        tokens = seqs.reshape(-1, shape[-1])
        logits = (tokens @ self.router[...].astype(x.dtype)).astype(jnp.float32)
        scores = jax.nn.softmax(logits) if self.score == "softmax" else jax.nn.sigmoid(logits)
        pick = scores if self.expert_bias is None else scores + self.expert_bias[...]
        pick = jax.lax.stop_gradient(pick)
        if self.groups is not None:
            pick = _group_limited(pick, self.groups, self.group_top_k)
        _, idx = jax.lax.top_k(pick, self.top_k)
        weights = jnp.take_along_axis(scores, idx, axis=-1)
        if self.normalize_top_k:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        weights = weights * self.routed_scaling
        kw: dict[str, Any] = {"capacity_factor": self.capacity_factor}
        if self.strategy is not None:
            kw["strategy"] = self.strategy
        if self.groups is not None:
            kw["expert_groups"] = (self.groups, self.group_top_k)
        y = call_op(
            moe_experts,
            tokens,
            idx,
            weights.astype(x.dtype),
            self.w_gate[...],
            self.w_up[...],
            self.w_down[...],
            **kw,
        )
        if self.shared_gate is not None:  # the shared experts: one SwiGLU every token runs
            gate, up = tokens @ self.shared_gate[...], tokens @ self.shared_up[...]
            y = y + (jax.nn.silu(gate) * up) @ self.shared_down[...]
        chosen = jnp.sum(jax.nn.one_hot(idx, self.n_experts, dtype=jnp.float32), axis=-2)
        if self.expert_bias is not None and self.update_bias:
            load = jnp.sum(chosen, axis=0)
            step = self.bias_update_rate * jnp.sign(jnp.mean(load) - load)
            self.expert_bias[...] = self.expert_bias[...] + jax.lax.stop_gradient(step)
        aux = self._aux(logits, scores, chosen, seqs.shape[0])
        return y.reshape(shape).astype(x.dtype), aux

    def _aux(self, logits: jax.Array, scores: jax.Array, chosen: jax.Array, n_seq: int):
        """The weighted load-balancing and z losses (float32 scalar)."""
        aux = jnp.zeros((), jnp.float32)
        if self.load_balance is not None and self.load_balance_weight:
            e, k = self.n_experts, self.top_k
            probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
            groups = n_seq if self.load_balance == "sequence" else 1
            frac = jnp.mean(chosen.reshape(groups, -1, e), axis=1) / k  # [groups, E]
            mean_p = jnp.mean(probs.reshape(groups, -1, e), axis=1)
            lb = e * jnp.mean(jnp.sum(frac * mean_p, axis=-1))
            aux = aux + self.load_balance_weight * lb
        if self.z_loss_weight:
            z = jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)
            aux = aux + self.z_loss_weight * z
        return aux
