"""Master weights in the optimizer state: low-precision parameters, an fp32 copy beside them.

``Recipe(compute_dtype="bfloat16", master_weights="optimizer")`` stores the
step's parameters in the compute dtype (bfloat16; bfloat16 too under
``"float8"``, whose matmuls quantize a bf16 weight) and keeps an fp32 *master*
copy of every floating parameter inside the optimizer state. This is what
Megatron-LM's distributed optimizer does (``--bf16`` with
``--use-distributed-optimizer``: the model holds bf16 parameters, the optimizer
fp32 "main params" sharded over the data-parallel ranks with its moments), and
what NeMo / Megatron-Bridge run; MaxText's ``weight_dtype`` names the same
choice. The default, ``master_weights="params"``, keeps the parameters
themselves in fp32 and casts a compute copy inside the step (torchtitan's
``MixedPrecisionPolicy``).

Why it matters: a layout that replicates parameters over the data axis
(tensor or pipeline parallelism with a sharded optimizer, ``megatron+zero1``)
holds every parameter and its gradient once per data rank. In bf16 both halve,
while the fp32 master lives in the optimizer state and is sharded exactly as the
moments are (``+zero1``, ``fsdp``): on NeMo's Llama 3.1 70B layout (TP 4 × PP 4
× CP 2, the optimizer state over data × context) the planner's peak per GPU drops
by the halved parameters and gradients (``benchmarks/calibration.py``).

What one step does (:func:`master_update`):

1. the loss is differentiated at the bf16 parameters, so the gradients are bf16
   and every gradient collective reduces bf16 (Megatron-Core's default,
   ``DistributedDataParallelConfig.grad_reduce_in_fp32=False``; NeMo's bf16
   DDP config turns it on, which spmdkit does not model); micro-batches
   accumulate them in bf16 too (Megatron-Core's ``main_grad`` has the
   parameters' dtype then), while a pipelined step accumulates and reduces a
   stage's gradients in fp32 (:func:`spmdkit.pipeline.layouts.accumulator_dtype`);
2. the gradients are cast to fp32 and the optimizer updates the fp32 master
   (its moments were made from the master, so they are fp32 too);
3. the new parameters are the new master cast down. Never ``bf16_param +
   bf16_update``: an update smaller than half a bf16 ulp of the parameter
   would round away every step, while the master accumulates it.

The optimizer state is a :class:`MasterState` ``(master, inner)``: a plan lays
out each master leaf like the rest of the state of its parameter (its path ends
with the parameter's), checkpoints save and restore it with the rest, and
restoring onto another mesh reshards it like the moments.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from spmdkit.errors import RecipeError
from spmdkit.step.passes import Step
from spmdkit.step.recipe import Recipe

__all__ = [
    "MasterState",
    "check_stored",
    "master_bytes",
    "master_init",
    "master_update",
    "opt_init",
    "stored_dtype",
    "stored_params",
    "update_master",
]

_MASTER_DTYPE = jnp.float32


class MasterState(NamedTuple):
    """The optimizer state under ``master_weights="optimizer"``.

    Attributes:
      master: the fp32 copy of the parameters (the same tree; non-floating
        leaves as they are).
      inner: the optimizer's own state, made from and updated on ``master``.
    """

    master: Any
    inner: Any


def stored_dtype(recipe: Recipe) -> str | None:
    """The dtype a recipe stores floating parameters in: its activation dtype
    (bfloat16 under bf16 and float8 compute) with ``master_weights="optimizer"``,
    else None (the parameters' own)."""
    if recipe.master_weights != "optimizer":
        return None
    return recipe.activation_dtype


def _floating(x: Any) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def _cast_tree(tree: Any, dtype: Any) -> Any:
    def one(x: Any) -> Any:
        if not _floating(x):
            return x
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, dtype, sharding=x.sharding)
        return x.astype(dtype)

    return jax.tree.map(one, tree)


def stored_params(params: Any, recipe: Recipe) -> Any:
    """``params`` as a recipe's step takes them: floating leaves (arrays or
    ``ShapeDtypeStruct``) in :func:`stored_dtype`; unchanged under the default.

    Example::

        >>> params = stored_params(params, Recipe(compute_dtype="bfloat16",
        ...                                       master_weights="optimizer"))
    """
    dtype = stored_dtype(recipe)
    return params if dtype is None else _cast_tree(params, dtype)


def check_stored(params: Any, recipe: Recipe, *, op: str) -> None:
    """Raise when a step with the master in the optimizer state is given
    parameters in another dtype (they would be trained at that precision and
    priced wrongly, silently).

    Raises:
      RecipeError: a floating parameter leaf is not in :func:`stored_dtype`.
    """
    dtype = stored_dtype(recipe)
    if dtype is None:
        return
    wrong = sorted({str(x.dtype) for x in jax.tree.leaves(params) if _floating(x)} - {dtype})
    if wrong:
        raise RecipeError(
            op=op,
            must=f"with master_weights='optimizer' the floating parameters are {dtype} "
            "(the fp32 master lives in the optimizer state)",
            given=f"parameters in {', '.join(wrong)}",
            fix="make them with sk.init_sharded(model, plan), or cast them with "
            "spmdkit.step.master.stored_params(params, recipe) before opt_init",
        )


def master_init(optimizer: Any, params: Any) -> MasterState:
    """The optimizer state with the master in it: the parameters upcast to fp32
    (as Megatron's optimizer copies its bf16 model parameters into fp32 main
    parameters) and the optimizer's state of that master."""
    master = _cast_tree(params, _MASTER_DTYPE)
    return MasterState(master, optimizer.init(master))


def opt_init(optimizer: Any, recipe: Recipe) -> Callable[[Any], Any]:
    """``params -> opt_state`` for a recipe: ``optimizer.init``, or
    :func:`master_init` with ``master_weights="optimizer"`` (what ``sk.train``,
    the planner and checkpoint restores make the state with).

    Example::

        >>> opt_state = jax.jit(opt_init(optax.adam(1e-3), plan.recipe))(params)
    """
    if recipe.master_weights != "optimizer":
        return optimizer.init
    return lambda params: master_init(optimizer, params)


def master_update(optimizer: Any, grads: Any, state: MasterState, params: Any) -> tuple[Any, Any]:
    """One update with the master in the optimizer state (module docstring):
    ``(new params, new state)``, the parameters the new master cast to their dtype.

    Raises:
      RecipeError: ``state`` is not a :class:`MasterState` (an optimizer state
        made by ``optimizer.init`` rather than :func:`opt_init`).
    """
    if not isinstance(state, MasterState):
        raise RecipeError(
            op="sk.train_step",
            must="with master_weights='optimizer' the optimizer state holds the fp32 master "
            "(a spmdkit.step.master.MasterState)",
            given=f"an optimizer state of type {type(state).__name__}",
            fix="make it with spmdkit.step.master.opt_init(optimizer, recipe)(params) "
            "(sk.train does), not optimizer.init(params)",
        )
    wide = _cast_tree(grads, _MASTER_DTYPE)
    updates, inner = optimizer.update(wide, state.inner, state.master)

    def apply(m: Any, u: Any) -> Any:
        return (m + u).astype(m.dtype) if _floating(m) else m

    master = jax.tree.map(apply, state.master, updates)

    def down(m: Any, p: Any) -> Any:
        return m.astype(p.dtype) if _floating(p) else p

    return jax.tree.map(down, master, params), MasterState(master, inner)


def master_bytes(shape: tuple[int, ...], dtype: Any) -> int:
    """Bytes of the fp32 master of one parameter (0 for a non-floating one)."""
    if not jnp.issubdtype(np.dtype(dtype), jnp.floating):
        return 0
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(_MASTER_DTYPE).itemsize


def update_master(step: Step) -> Step:
    """The master-weights pass: under ``master_weights="optimizer"`` the optimizer
    updates the fp32 master in its state and the parameters are the new master
    cast down (:func:`master_update`); else the update is left as it is."""
    optimizer = step.optimizer
    if optimizer is None or step.recipe.master_weights != "optimizer":
        return step

    def update(params: Any, opt_state: Any, grads: Any) -> tuple[Any, Any]:
        return master_update(optimizer, grads, opt_state, params)

    return replace(step, update=update)
