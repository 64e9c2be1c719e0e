"""The step's state placed on a plan: one owner for where each part of it lives.

A training step's state is the model's parameters, the optimizer state and the
model's mutable state (batch statistics, float8 scaling histories). Where each
lives is the plan's to say, with two recipe rules on top:

* ``master_weights="optimizer"``: the parameters are stored in bfloat16 and the
  optimizer state holds their fp32 master (:mod:`spmdkit.step.master`);
* ``offload_opt``: the optimizer state lives in host memory (``pinned_host``)
  between steps, where ``sk.jit`` takes and returns it.

:func:`state_layout` says where (shardings and shapes of each part; the target a
checkpoint is restored onto) and :func:`place_state` puts the values there. Both
``sk.init_sharded`` (parameters born sharded: the initialiser runs inside
``jax.jit`` with the plan's shardings) and ``train`` (fresh or restored from a
checkpoint) go through them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from spmdkit.planner.plans import Plan, PyTree
from spmdkit.step.master import opt_init, stored_dtype, stored_params

__all__ = ["StateLayout", "place_state", "state_layout"]

#: where an offloaded optimizer state lives between steps (``Recipe.offload_opt``)
HOST = "pinned_host"


@dataclass(frozen=True, eq=False)
class StateLayout:
    """Where a step's state lives on a plan: the shardings and shapes of each part.

    Attributes:
      params: the parameters' ``NamedSharding`` tree.
      opt_state: the optimizer state's (in host memory under ``offload_opt``), or
        ``None`` without an optimizer.
      model_state: the model state's, or ``None`` when the model has none.
      abstract_params: the parameters as the step stores them (bf16 under
        ``master_weights="optimizer"``), shapes and dtypes.
      abstract_opt: the optimizer state's shapes and dtypes (``None``: no optimizer).
      abstract_model_state: the model state's (``None``: none).
      recipe: the plan's recipe.
    """

    params: PyTree
    opt_state: PyTree | None
    model_state: PyTree | None
    abstract_params: PyTree
    abstract_opt: PyTree | None
    abstract_model_state: PyTree | None
    recipe: Any

    def target(self) -> dict[str, Any]:
        """The restore target: each part as ``jax.ShapeDtypeStruct`` with its
        sharding (``params``, ``opt_state`` and ``model_state`` where present)."""
        parts = {
            "params": (self.abstract_params, self.params),
            "opt_state": (self.abstract_opt, self.opt_state),
            "model_state": (self.abstract_model_state, self.model_state),
        }
        return {
            k: jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), a, s)
            for k, (a, s) in parts.items()
            if a is not None
        }


def _shapes(tree: PyTree) -> PyTree:
    # shapes and dtypes only: parameters made on an Explicit mesh (sk.init_sharded on
    # sk.make_mesh's default axes) carry shardings that the step's Auto mesh rejects
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


def _on(mesh: Any, shardings: PyTree, kind: str | None = None) -> PyTree:
    """``shardings`` moved onto ``mesh`` (same specs), in memory ``kind``."""
    return jax.tree.map(
        lambda s: NamedSharding(mesh, s.spec, memory_kind=kind or s.memory_kind),
        shardings,
        is_leaf=lambda x: isinstance(x, NamedSharding),
    )


def state_layout(
    plan: Plan,
    params: PyTree | Callable[[], PyTree],
    optimizer: optax.GradientTransformation | None = None,
    *,
    model_state: PyTree | None = None,
    mesh: Mesh | None = None,
) -> StateLayout:
    """Where each part of the step's state lives on ``plan``.

    Args:
      plan: the plan (its mesh has devices).
      params: the parameters (arrays or shapes), or a function that makes them.
      optimizer: the optax optimizer, or ``None`` for no optimizer state.
      model_state: the model's mutable state, if any.
      mesh: the mesh the shardings name (default: ``plan.sharding_mesh``, the
        Auto-axes view ``sk.jit`` compiles on; ``sk.init_sharded`` passes
        ``plan.mesh``, whose Explicit axes stay Explicit).
    """
    recipe = plan.recipe
    made = jax.eval_shape(params) if callable(params) else params
    abstract_params = stored_params(_shapes(made), recipe)
    on = plan.sharding_mesh if mesh is None else mesh
    opt = abstract_opt = None
    if optimizer is not None:
        abstract_opt = jax.eval_shape(opt_init(optimizer, recipe), abstract_params)
        kind = HOST if recipe.offload_opt else None
        opt = _on(on, plan.opt_shardings(abstract_opt), kind)
    state = abstract_state = None
    if model_state is not None:
        abstract_state = jax.eval_shape(lambda s: s, model_state)
        if recipe.fp8_scaling == "delayed":  # the scaling histories: every device's own
            state = jax.tree.map(lambda _: NamedSharding(on, PartitionSpec()), abstract_state)
        else:
            state = _on(on, plan.state_sharding(abstract_state))
    return StateLayout(
        _on(on, plan.param_shardings(abstract_params)),
        opt,
        state,
        abstract_params,
        abstract_opt,
        abstract_state,
        recipe,
    )


def place_state(
    plan: Plan,
    params: PyTree | Callable[[], PyTree],
    optimizer: optax.GradientTransformation | None = None,
    *,
    model_state: PyTree | None = None,
    layout: StateLayout | None = None,
    mesh: Mesh | None = None,
) -> dict[str, Any]:
    """The step's state placed as ``plan`` shards it: the one way spmdkit does it.

    The parameters are cast as the recipe stores them (bf16 under
    ``master_weights="optimizer"``) and placed; the optimizer state is made from
    the placed parameters at the plan's optimizer layout (the fp32 master in it,
    in host memory under ``offload_opt``); the model state is placed.

    Args:
      plan: the plan (its mesh has devices).
      params: the parameters, or a function that makes them: it runs inside
        ``jax.jit`` with the plan's shardings as ``out_shardings``, so no device
        ever holds a whole parameter the plan shards ("born sharded").
      optimizer: the optax optimizer; ``None``: no optimizer state.
      model_state: the model's mutable state, if any.
      layout: :func:`state_layout`'s answer for these arguments, when the caller
        has it already.
      mesh: as :func:`state_layout`'s.

    Returns:
      ``{"params": ..., "opt_state": ..., "model_state": ...}``, the last two
      only when an optimizer and a model state are given.

    Example::

        >>> state = place_state(plan, params, optax.adam(1e-3))
        >>> state["opt_state"][0].mu["w"].sharding.spec == plan.opt_shardings(...)
    """
    if layout is None:
        layout = state_layout(plan, params, optimizer, model_state=model_state, mesh=mesh)
    cast = functools.partial(stored_params, recipe=layout.recipe)
    if callable(params):  # the initialisers run inside jit: born sharded
        placed = jax.jit(lambda: cast(params()), out_shardings=layout.params)()
    elif stored_dtype(layout.recipe) is not None:  # bf16 parameters, cast where they land
        placed = jax.jit(cast, out_shardings=layout.params)(params)
    else:
        placed = jax.device_put(params, layout.params)
    state: dict[str, Any] = {"params": placed}
    if optimizer is not None:
        init = opt_init(optimizer, layout.recipe)
        state["opt_state"] = jax.jit(init, out_shardings=layout.opt_state)(placed)
    if model_state is not None:
        state["model_state"] = jax.device_put(model_state, layout.model_state)
    return state
