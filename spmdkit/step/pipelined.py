"""The pipeline pass: a plan with a pipeline runs its layer stack pipelined over
its pipe axis (:func:`spmdkit.pipeline.execute.pipelined_value_and_grad`, the
pipeline's micro-batches rather than the recipe's), in place of the gradient the
passes before made; the plan's layouts are what the pipeline takes at its
inputs and reduce-scatters its gradients to."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import jax

from spmdkit.context_parallel import ContextShard, plan_context
from spmdkit.errors import RecipeError
from spmdkit.pipeline import Pipeline
from spmdkit.pipeline.execute import pipelined_value_and_grad
from spmdkit.pipeline.layouts import update_specs
from spmdkit.spec import axis_sizes
from spmdkit.step.loss import Loss
from spmdkit.step.passes import Step, StepPlan
from spmdkit.step.recipe import Recipe
from spmdkit.util import path_str

__all__ = ["pipeline_layers"]


def pipeline_layers(step: Step) -> Step:
    """The pipeline pass: with a pipelined plan, the gradient of the loss as the
    passes before rewrote it, run by the pipeline executor; else the step as it is.

    Raises:
      RecipeError: a loss with model state or a key, recompute of one layer in
        ``k``, or an aux with arrays, under a pipeline.
    """
    plan, pipe = step.plan, step.pipeline
    if plan is None or pipe is None:
        return step
    _check_pipelined(step.loss, pipe, step.recipe)
    batch_axes = tuple(plan.activation.get("batch", ()))
    where = (plan.sharding_mesh, batch_axes, _plan_layouts(plan, step.for_update))
    context = {**_pipelined_context(plan), **_pipelined_experts(plan)}
    grad = _pipelined(step.fn, pipe, where, step.loss.has_aux, context)
    return replace(step, grad=grad)


def _check_pipelined(loss: Loss, pipe: Pipeline, recipe: Recipe) -> None:
    """A pipelined plan's loss carries no model state and draws no random numbers
    (its micro-batches would share one key); its stages recompute every layer alike."""
    if recipe.remat_every != 1:
        raise RecipeError(
            op="sk.value_and_grad",
            must="a pipelined plan recomputes every layer of its stages alike",
            given=f"remat_every={recipe.remat_every} with {pipe!r}",
            fix="pass remat_every=1 with a pipeline, or plan without one",
        )
    if loss.has_state or loss.rng:
        what = "mutable model state" if loss.has_state else "random numbers (a key)"
        raise RecipeError(
            op="sk.value_and_grad",
            must="a pipelined plan's loss carries no mutable model state and takes no key",
            given=f"{loss!r}: {what}, with {pipe!r}",
            fix="plan without a pipeline, or keep the state and dropout out of the pipelined loss",
        )


def _plan_layouts(plan: StepPlan, update: bool = False) -> Callable[[Any], tuple[Any, Any]]:
    """``params -> (param specs, grad specs)`` of a plan (what the pipeline takes as
    given at its inputs and reduce-scatters its gradients to); ``update``: for the
    optimizer update (:func:`spmdkit.pipeline.layouts.update_specs`)."""
    grads = functools.partial(update_specs, plan) if update else plan.grad_specs
    return lambda params: (plan.param_specs(params), grads(params))


def _pipelined_context(plan: StepPlan) -> dict[str, Any]:
    """A pipelined plan's context parallelism, as the executor takes it: its axes,
    strategy and order, and per batch field the dim named ``seq``."""
    cp = plan_context(plan)
    if cp is None:
        return {}
    sizes = axis_sizes(plan.sharding_mesh)
    shard = ContextShard(
        tuple(cp.axes), tuple(sizes[a] for a in cp.axes), cp.load_balanced, cp.attention
    )
    names = dict(plan.batch_axes)
    seq = {k: tuple(v).index("seq") for k, v in names.items() if "seq" in tuple(v)}
    return {"context": shard, "seq_dims": seq}


def _pipelined_experts(plan: StepPlan) -> dict[str, Any]:
    """A pipelined plan's routed experts, as the executor takes them: per parameter,
    the dim its logical names call ``expert`` (None for the others)."""
    info = plan.info or {}
    if not any("expert" in tuple(names or ()) for _, _, names in info.values()):
        return {}

    def dims(params: Any) -> Any:
        def one(kp: tuple, x: Any) -> int | None:
            path = path_str(kp)  # the plan's path, or the longest one it ends with
            ends = (p for p in info if path.endswith("/" + p))
            key = path if path in info else max(ends, key=len, default=None)
            names = tuple(info[key][2] or ()) if key is not None else ()
            return names.index("expert") if "expert" in names else None

        return jax.tree_util.tree_map_with_path(one, params)

    return {"experts": dims}


def _pipelined(
    loss: Callable, pipe: Pipeline, where: tuple, has_aux: bool, context: dict[str, Any]
) -> Callable:
    """The pipelined gradient (``where``: the mesh and the batch's axes;
    ``context``: its context parallelism); with ``has_aux``, an aux with no arrays
    (train's empty metrics) passes through, any other is a :class:`RecipeError`."""
    if not has_aux:
        return pipelined_value_and_grad(loss, pipe, *where, **context)
    if pipe.return_output:
        raise RecipeError(
            op="sk.value_and_grad",
            must="has_aux=False when the pipeline returns the last stage's outputs",
            given=f"has_aux=True with {pipe!r}",
            fix="drop has_aux (the value is then (loss, outputs)) or pass return_output=False",
        )
    vg = pipelined_value_and_grad(lambda *a: loss(*a)[0], pipe, *where, **context)

    def f(*args: Any) -> tuple:
        aux = jax.eval_shape(loss, *args)[1]
        if jax.tree.leaves(aux):
            raise RecipeError(
                op="sk.value_and_grad",
                must="a pipelined plan's loss returns no aux arrays (the head and loss "
                "run per micro-batch on the last stage)",
                given=f"aux {jax.tree.structure(aux)}",
                fix="return the loss alone, and compute metrics in an evaluation step",
            )
        value, grads = vg(*args)
        return (value, aux), grads

    return f
