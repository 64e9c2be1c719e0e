"""The train step: ``sk.value_and_grad`` and ``sk.train_step``, the user's loss
with a recipe's levers applied to it, each lever a pass (:mod:`spmdkit.step`),
applied in the one order :data:`ORDER` declares, without editing the model.

:func:`value_and_grad` is ``jax.value_and_grad`` of the loss with the passes
applied: the batch in a context-parallel plan's order, float8 weight matmuls,
each scanned layer recomputed under the recipe's policy (the loss traced to a
jaxpr and the layer scan's body wrapped in ``jax.checkpoint``: a
``jax.checkpoint`` around the whole loss saves nothing at the peak; a loss with
no scan has no layer boundary to recompute at, and a :class:`RecipeError` says
to scan the layers), the parameters cast to the compute dtype inside the
differentiated function (so gradients come back in the parameters' dtype), the
gradient by the loss's form, a plan's pipeline, and the micro-batches: the
batch split by :func:`spmdkit.batch.microbatches` (the one split: rows ``i,
i+n, ...``; the pipeline executor splits the same way), a ``lax.scan`` running
one micro-batch per step (a python loop when a non-tensor field is split per
example), PRNG keys after the batch folded with the micro-batch index, and the
gradients accumulated in the parameters' dtype (constrained to ``grad_specs``
when given: ZeRO-2).

:func:`train_step` builds the whole step (gradients and optimizer update, the
update passes after the gradient's); the planner traces it, ``sk.jit``
compiles it and ``train`` runs what ``sk.jit`` compiled, so what is planned is
what runs. Both take a described model (``sk.describe``) or its
:class:`~spmdkit.step.loss.Loss`, which says whether the loss carries state,
returns aux or draws random numbers (then the step takes a key last:
``step(params, opt_state, batch, key)``), or a plain function.

Mutable state (``has_state=True``): a model with batch statistics has a loss
``loss_fn(params, batch, state) -> (loss, new_state)``. The state is an input
and an output of the step, never differentiated and never seen by the
optimizer; with micro-batches it is threaded through them in order (micro-batch
``i`` reads what ``i - 1`` wrote), as consecutive steps would.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from spmdkit.batch import as_traced, as_tree, microbatches
from spmdkit.errors import RecipeError
from spmdkit.state import register_context
from spmdkit.step.cast import cast_params
from spmdkit.step.context import balanced_batch
from spmdkit.step.fp8 import HISTORY, float8_matmuls, fp8_state
from spmdkit.step.loss import Loss, as_loss
from spmdkit.step.master import check_stored, update_master
from spmdkit.step.offload import offload_opt_state
from spmdkit.step.passes import Pass, Step, StepPlan, run
from spmdkit.step.pipelined import pipeline_layers
from spmdkit.step.recipe import FP8_EXCLUDE, Recipe
from spmdkit.step.remat_scan import recompute_layers

__all__ = [
    "ORDER",
    "init_fp8_state",
    "recipes_used",
    "train_step",
    "value_and_grad",
]


# -- the gradient's own passes: by the loss's form, and per micro-batch ---------------


def differentiate(step: Step) -> Step:
    """The gradient pass: ``jax.value_and_grad`` of the loss as the passes before
    rewrote it, by its form: with model state (the new state rides as aux, not
    differentiated), with delayed float8 scaling's histories (their gradient is
    the updated histories), or plain."""
    fn, has_aux = step.fn, step.loss.has_aux
    if step.loss.has_state:
        return replace(step, grad=_state_value_and_grad(fn, has_aux))
    if step.recipe.fp8_scaling == "delayed":
        return replace(step, grad=_delayed_value_and_grad(fn, has_aux))
    return replace(step, grad=jax.value_and_grad(fn, has_aux=has_aux))


def accumulate_microbatches(step: Step) -> Step:
    """The micro-batch pass: the gradient run over ``recipe.microbatches``
    micro-batches and averaged (one: run once), its gradients constrained to the
    step's gradient layouts (the given ``grad_specs``, else the plan's)."""
    vg, n, given, plan = step.grad, step.recipe.microbatches, step.grad_specs, step.plan
    stateful = step.loss.has_state or step.recipe.fp8_scaling == "delayed"

    def grad(params: Any, batch: Any, *rest: Any) -> tuple[Any, Any]:
        specs = given if given is not None else _plan_grad_specs(plan, params)
        if n == 1:
            out, grads = vg(params, as_traced(batch), *rest)
            return out, _constrain(grads, specs)
        if stateful:
            return _accumulate_state(vg, n, specs, params, batch, rest)
        return _accumulate(vg, n, specs, params, batch, rest)

    return replace(step, grad=grad)


# -- the order ------------------------------------------------------------------------

#: The step's passes in the order they apply, each to what the ones before built.
#: Adding a lever is one module with one ``Step -> Step`` function and one line here.
ORDER: tuple[Pass, ...] = (
    # the batch in a CP plan's token order: first, so every pass sees it as planned
    Pass("context", balanced_batch),
    # float8 rewrites the user's own matmuls, inside the layers recompute wraps next
    Pass("fp8", float8_matmuls),
    # recompute traces the (float8) loss and checkpoints its layer scan's body
    Pass("remat", recompute_layers),
    # the cast sits outside the recomputed layers: they are traced on cast params
    Pass("cast", cast_params),
    # the gradient by the loss's form (model state, delayed float8 state, plain)
    Pass("grad", differentiate),
    # a pipelined plan replaces that gradient with the executor's (its own micro-batches)
    Pass("pipeline", pipeline_layers),
    # the recipe's micro-batches around whichever gradient the passes before made
    Pass("microbatches", accumulate_microbatches),
    # the update: the fp32 master in the optimizer state, then the state's host trips
    Pass("master", update_master),
    Pass("offload", offload_opt_state),
)


# the recipes of the sk.value_and_grad calls traced while a step is being checked
_SEEN: contextvars.ContextVar[list[Recipe] | None] = register_context(
    contextvars.ContextVar("spmdkit_recipes_seen", default=None),
    module=__name__,
    name="_SEEN",
    set_by="`recipes_used()` (`sk.jit`'s check)",
    read_by="`sk.value_and_grad`'s `grad_fn`, which appends its recipe",
    why="the recipes of the gradients traced inside the block.",
)


@contextlib.contextmanager
def recipes_used() -> Iterator[list[Recipe]]:
    """Collect the recipes of the :func:`value_and_grad` gradients traced inside.

    ``sk.jit`` traces a step under this to check that the step runs its plan's
    recipe (a recipe that is planned but not run would make every prediction
    wrong).

    Example::

        >>> with recipes_used() as seen:
        ...     jax.eval_shape(step, params, batch)
        >>> seen
        [Recipe(remat=full)]
    """
    seen: list[Recipe] = []
    token = _SEEN.set(seen)
    try:
        yield seen
    finally:
        _SEEN.reset(token)


def _recipe_and_plan(recipe: Recipe | StepPlan) -> tuple[Recipe, StepPlan | None]:
    """The recipe a step runs and the plan it came with (``None`` for a bare recipe)."""
    if isinstance(recipe, Recipe):
        return recipe, None
    if isinstance(recipe, StepPlan) and isinstance(recipe.recipe, Recipe):
        return recipe.recipe, recipe
    raise RecipeError(
        op="sk.value_and_grad",
        must="the second argument is a Recipe or a plan",
        given=type(recipe).__name__,
        fix="pass sk.value_and_grad(loss, plan) or sk.value_and_grad(loss, sk.Recipe(...))",
    )


def build(
    loss: Loss,
    recipe: Recipe | StepPlan,
    *,
    optimizer: Any = None,
    grad_specs: Any = None,
    for_update: bool = False,
) -> Step:
    """The step with every pass of :data:`ORDER` applied to ``loss``: its gradient
    (and, with an ``optimizer``, its update)."""
    rcp, plan = _recipe_and_plan(recipe)
    update = None if optimizer is None else _plain_update(optimizer)
    step = Step(
        recipe=rcp,
        loss=loss,
        fn=loss.fn,
        plan=plan,
        optimizer=optimizer,
        update=update,
        grad_specs=grad_specs,
        for_update=for_update,
    )
    return run(ORDER, step)


def _plain_update(optimizer: Any) -> Callable[..., tuple[Any, Any]]:
    """The optimizer's update applied to the parameters, in their dtypes."""

    def update(params: Any, opt_state: Any, grads: Any) -> tuple[Any, Any]:
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = jax.tree.map(lambda p, u: (p + u).astype(p.dtype), params, updates)
        return params, opt_state

    return update


def _constrain(grads: Any, grad_specs: Any) -> Any:
    if grad_specs is None:
        return grads

    specs = (PartitionSpec, NamedSharding)
    is_spec = lambda x: isinstance(x, specs)  # noqa: E731
    return jax.tree.map(jax.lax.with_sharding_constraint, grads, grad_specs, is_leaf=is_spec)


def _fold_keys(rest: tuple, i: Any) -> tuple:
    """PRNG key leaves of ``rest`` folded with the micro-batch index."""

    def one(x: Any) -> Any:
        key = hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
        return jax.random.fold_in(x, i) if key else x

    return jax.tree.map(one, rest)


def _plan_grad_specs(plan: StepPlan | None, params: Any) -> Any:
    """A plan's per-path gradient specs (ZeRO-2) when it shards gradients, else None."""
    if plan is None or not plan.grads:
        return None
    mesh = plan.sharding_mesh
    return jax.tree.map(
        lambda spec: NamedSharding(mesh, spec),
        plan.grad_specs(params),
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )


# -- the entry points -----------------------------------------------------------------


def value_and_grad(
    loss_fn: Callable[..., Any] | Loss,
    recipe: Recipe | StepPlan,
    *,
    grad_specs: Any = None,
    has_aux: bool = False,
    has_state: bool = False,
) -> Callable[..., tuple[Any, Any]]:
    """``jax.value_and_grad(loss_fn)`` with a recipe applied (module docstring).

    Args:
      loss_fn: ``loss_fn(params, batch, *rest)`` → scalar loss (the mean over the
        batch's examples), or ``(loss, aux)`` with ``has_aux=True``; with
        ``has_state=True``, ``loss_fn(params, batch, state, *rest)`` →
        ``(value, new_state)`` where ``value`` is as above. Or a
        :class:`~spmdkit.step.loss.Loss` (a described model's ``info.train_loss``, or
        the model itself), which carries these flags and whether it takes a key.
      recipe: a :class:`~spmdkit.step.recipe.Recipe`, or a plan (a
        :class:`~spmdkit.step.passes.StepPlan`: its ``recipe``; its gradient
        specs when it shards gradients, ZeRO-2).
      grad_specs: a tree like the params of ``PartitionSpec`` / ``NamedSharding``
        the gradients are constrained to (accumulated in, with micro-batches);
        ``None``: the plan's, if a plan is given, else unconstrained.
      has_aux: as for ``jax.value_and_grad``; with micro-batches ``aux`` is the
        mean over them.
      has_state: the loss takes the model's mutable state after the batch and
        returns it updated (module docstring); it is not differentiated.

    A plan with a ``pipeline`` runs its layer stack pipelined over the pipe axis
    (:func:`spmdkit.pipeline.execute.pipelined_value_and_grad`; the pipeline's
    micro-batches, not the recipe's).

    Returns:
      ``f(params, batch, *rest) -> (loss, grads)`` (``((loss, aux), grads)``);
      with ``has_state``, ``f(params, batch, state, *rest) -> ((value,
      new_state), grads)``, ``new_state`` in the dtypes of ``state``.
      Gradients have the params' dtypes whatever the compute dtype. With
      micro-batches the batch is split by :func:`spmdkit.batch.microbatches`
      (micro-batch ``i`` takes rows ``i, i+n, ...``; a non-tensor field with one
      item per example is split too, and the micro-batches then run unrolled),
      PRNG-key leaves of ``rest`` are folded with ``i``, other ``rest`` leaves
      reach every micro-batch; the loss is the mean of the micro-batch losses,
      the gradient the mean of theirs (the full batch's, for a mean loss).

    Raises:
      RecipeError: the loss has no scanned layers to recompute, or a batch leaf
        does not divide into the micro-batches.
      LossError: a loss that draws random numbers is called without a key.

    Example::

        >>> grad_fn = sk.value_and_grad(loss, sk.Recipe(remat="full", microbatches=2))
        >>> loss_value, grads = grad_fn(params, batch)
    """
    loss = as_loss(loss_fn, has_state=has_state, has_aux=has_aux)
    return _grad_fn(build(loss, recipe, grad_specs=grad_specs))


def _grad_fn(step: Step) -> Callable[..., tuple[Any, Any]]:
    """The built step's gradient as ``sk.value_and_grad`` returns it: its recipe
    noted for ``sk.jit``'s check, the key checked."""
    grad, loss, rcp = step.grad, step.loss, step.recipe

    def grad_fn(params: Any, batch: Any, *rest: Any) -> tuple[Any, Any]:
        seen = _SEEN.get()
        if seen is not None:
            seen.append(rcp)
        loss.check_key(rest, op="sk.value_and_grad", call="grad_fn(params, batch, key)")
        return grad(params, batch, *rest)

    grad_fn.recipe = rcp  # type: ignore[attr-defined]
    return functools.wraps(loss.fn)(grad_fn)


def _delayed_value_and_grad(loss: Callable, has_aux: bool) -> Callable:
    """``f(params, batch, state, *rest) -> ((value, new_state), grads)`` for delayed
    float8 scaling: ``state`` holds the amax histories (:func:`init_fp8_state`),
    and its gradient is the updated histories (``spmdkit.step.fp8.fp8_dot_delayed``)."""
    vg = jax.value_and_grad(loss, argnums=(0, 2), has_aux=has_aux)

    def f(params: Any, batch: Any, state: Any, *rest: Any) -> tuple[tuple[Any, Any], Any]:
        value, (grads, new_state) = vg(params, batch, state, *rest)
        return (value, new_state), grads

    return f


def init_fp8_state(
    loss_fn: Callable[..., Any] | Loss,
    params: Any,
    batch: Any,
    *rest: Any,
    history: int = HISTORY,
    exclude: Sequence[str] = FP8_EXCLUDE,
) -> dict[str, jax.Array]:
    """The amax histories a step with ``Recipe(compute_dtype="float8",
    fp8_scaling="delayed")`` carries, initially empty (zeros: the first step scales
    as current scaling does): one ``float32[..., 3, history]`` per weight matmul
    of the loss (``spmdkit.step.fp8.fp8_state``). The step takes and returns it as
    state: ``step(params, opt_state, fp8_state, batch) -> (params, opt_state,
    fp8_state, loss)``.

    Args:
      loss_fn: as for :func:`value_and_grad` (a loss without state of its own).
      params: the step's parameters (arrays or shape structs).
      batch: the step's batch (arrays or shape structs).
      *rest: the loss's other arguments, if any.
      history: amax steps kept per operand (the scale's window).
      exclude: the recipe's ``fp8_exclude`` (what it keeps in bf16 has no history).

    Example::

        >>> state = init_fp8_state(info, params, batch)
        >>> params, opt_state, state, loss = step(params, opt_state, state, batch)
    """
    loss = as_loss(loss_fn)
    kw = {"history": history, "exclude": exclude}
    return fp8_state(lambda p, b, *r: loss.fn(p, as_tree(b), *r), params, batch, *rest, **kw)


def _state_value_and_grad(loss: Callable, has_aux: bool) -> Callable:
    """``f(params, batch, state, *rest) -> ((value, new_state), grads)`` for a loss
    returning ``(value, new_state)``: the new state rides as ``jax.value_and_grad``'s
    aux (not differentiated) and comes back in the dtypes of ``state``."""

    def split(params: Any, batch: Any, state: Any, *rest: Any) -> tuple[Any, tuple[Any, Any]]:
        value, new_state = loss(params, batch, state, *rest)
        new_state = jax.tree.map(lambda n, o: jnp.asarray(n).astype(o.dtype), new_state, state)
        loss_value, aux = value if has_aux else (value, None)
        return loss_value, (aux, new_state)

    vg = jax.value_and_grad(split, has_aux=True)

    def f(params: Any, batch: Any, state: Any, *rest: Any) -> tuple[tuple[Any, Any], Any]:
        (loss_value, (aux, new_state)), grads = vg(params, batch, state, *rest)
        value = (loss_value, aux) if has_aux else loss_value
        return (value, new_state), grads

    return f


def _accumulate_state(
    vg: Callable, n: int, specs: Any, params: Any, batch: Any, rest: tuple
) -> tuple[Any, Any]:
    """:func:`_accumulate` for a loss with state: the state is threaded through the
    micro-batches in order (the scan's carry) and returned as the last one left it."""
    state, others = rest[0], rest[1:]

    def step(params: Any, mb: Any, carried: Any, *more: Any) -> tuple[Any, Any, Any]:
        (value, new_state), grads = vg(params, mb, carried, *more)
        return value, grads, new_state

    value, grads, state = _accumulate(step, n, specs, params, batch, others, state=state)
    return (value, state), grads


def _accumulate(
    vg: Callable,
    n: int,
    specs: Any,
    params: Any,
    batch: Any,
    rest: tuple,
    *,
    state: Any = None,
) -> Any:
    """Run ``vg`` over ``n`` micro-batches (:func:`spmdkit.batch.microbatches`) in a
    ``lax.scan``, or a python loop when they differ in non-tensor values; the
    mean loss and gradients, summed in the parameters' dtype."""
    mb = microbatches(batch, n, op="sk.value_and_grad", error=RecipeError)
    carried = (state,) if state is not None else ()

    def run(i: Any, rows: list, st: Any) -> Any:
        return vg(params, as_traced(mb.batch(i, rows)), *st, *_fold_keys(rest, i))

    out_shape = jax.eval_shape(lambda st, rows: run(0, rows, st), carried, mb.rows(0))[0]

    def add(carry: tuple, i: Any, rows: list) -> tuple:
        gsum, osum, *st = carry
        got = run(i, rows, st)
        out, grads = got[:2]
        gsum = _constrain(jax.tree.map(jnp.add, gsum, grads), specs)
        return (gsum, jax.tree.map(jnp.add, osum, out), *got[2:])

    carry = (
        _constrain(jax.tree.map(jnp.zeros_like, params), specs),
        jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), out_shape),
        *carried,
    )
    if mb.unrolled:
        for i in range(n):
            carry = add(carry, i, mb.rows(i))
    else:
        xs = (jnp.arange(n), list(mb.stacked))
        carry, _ = jax.lax.scan(lambda c, x: (add(c, *x), None), carry, xs)
    gsum, osum, *st = carry
    grads = jax.tree.map(lambda g: (g / n).astype(g.dtype), gsum)
    out = jax.tree.map(lambda o: (o / n).astype(o.dtype), osum)
    if state is not None:
        return out, _constrain(grads, specs), st[0]
    return out, _constrain(grads, specs)


def train_step(
    loss_fn: Callable[..., Any] | Loss,
    optimizer: Any,
    recipe: Recipe | StepPlan,
    *,
    grad_specs: Any = None,
    has_state: bool = False,
) -> Callable[..., tuple[Any, ...]]:
    """``step(params, opt_state, batch, *rest) -> (params, opt_state, value)`` for a recipe.

    With state (``has_state=True``, or a described model with batch statistics,
    module docstring): ``step(params, opt_state, state, batch, *rest) ->
    (params, opt_state, state, value)``; the state is updated by the loss, not by
    the optimizer. Delayed float8 scaling (``Recipe(compute_dtype="float8",
    fp8_scaling="delayed")``) makes the amax histories that state
    (:func:`init_fp8_state`). ``rest`` reaches the loss after the batch (and state): a loss
    that draws random numbers takes the step's key there (micro-batch ``i``
    gets it folded with ``i``). ``value`` is the loss, or ``(loss, aux)`` for a
    loss with aux.

    The gradients come from :func:`value_and_grad` (recompute, compute dtype,
    micro-batches, gradient specs); with ``offload_opt`` the optimizer state
    arrives from host memory, moves to the device for the update and goes back.
    ``sk.jit`` compiles it and ``train`` runs exactly that; the planner traces the
    same function of the described model's loss.

    Args:
      loss_fn: a described model (``sk.describe(...)``; its ``train_loss``), a
        :class:`~spmdkit.step.loss.Loss`, or ``loss_fn(params, batch, *rest)`` →
        scalar mean loss (with ``has_state``: ``loss_fn(params, batch, state,
        *rest) -> (loss, new_state)``).
      optimizer: an optax ``GradientTransformation``.
      recipe: a :class:`~spmdkit.step.recipe.Recipe` or a plan (a
        :class:`~spmdkit.step.passes.StepPlan`).
      grad_specs: as for :func:`value_and_grad`.
      has_state: the loss carries mutable model state.

    Raises:
      LossError: the loss draws random numbers and the step gets no key.

    Example::

        >>> step = sk.jit(train_step(info, optax.adam(1e-3), plan), plan, donate_state=True)
        >>> params, opt_state, loss_value = step(params, opt_state, batch, key)
    """
    loss = as_loss(loss_fn, has_state=has_state)
    rcp, plan = _recipe_and_plan(recipe)
    pipe = None if plan is None else plan.pipeline
    if pipe is not None and pipe.return_output:
        raise RecipeError(
            op="sk.train_step",
            must="a training step's pipeline has return_output=False (the step returns "
            "the loss; the last stage's outputs are for evaluation)",
            given=f"{pipe!r}",
            fix="use sk.value_and_grad(loss, plan), which returns ((loss, outputs), grads), "
            "or plan the step with Pipeline(..., return_output=False)",
        )
    built = build(loss, recipe, optimizer=optimizer, grad_specs=grad_specs, for_update=True)
    grad_fn, update = _grad_fn(built), built.update
    stateful = loss.has_state or rcp.fp8_scaling == "delayed"
    call = "step(params, opt_state, " + ("state, " if stateful else "") + "batch, key)"

    def step(params: Any, opt_state: Any, batch: Any, *rest: Any) -> tuple[Any, Any, Any]:
        loss.check_key(rest, op="sk.train_step", call=call)
        check_stored(params, rcp, op="sk.train_step")
        value, grads = grad_fn(params, batch, *rest)
        params, opt_state = update(params, opt_state, grads)
        return params, opt_state, value

    def state_step(
        params: Any, opt_state: Any, state: Any, batch: Any, *rest: Any
    ) -> tuple[Any, Any, Any, Any]:
        loss.check_key(rest, op="sk.train_step", call=call)
        check_stored(params, rcp, op="sk.train_step")
        (value, state), grads = grad_fn(params, batch, state, *rest)
        params, opt_state = update(params, opt_state, grads)
        return params, opt_state, state, value

    out = state_step if stateful else step
    out.recipe = rcp  # type: ignore[attr-defined]
    out.loss = loss  # type: ignore[attr-defined]
    return out
