"""The training loop: sharded state, gradient accumulation, checkpoints, exact resume.

:func:`train` runs ``steps`` optimizer steps of one jitted step function whose
parameter and optimizer-state shardings come from a plan (or are given
explicitly), with the previous state donated every step. With a checkpoint
manager it saves periodically (asynchronously) and, with ``resume=True``,
continues from the latest complete checkpoint — restoring onto *this* run's mesh
and shardings, whatever they were at save time — including the data position.

Exactness of resume: the step function, the data order and the per-step RNG key
(``fold_in(rng, step)``) depend only on the step number and the restored state, so
N steps, a restore, then M steps give bit-identical losses to N+M uninterrupted
steps on the same mesh (within float reduction-order tolerance on another mesh).

Batches are trees (:mod:`spmdkit.runtime.data`): their array leaves are the
compiled step's traced inputs; the rest (strings, ids, ``None``, objects) reaches
``loss_fn`` untouched as a *static* part of the step, compared by value — a
non-tensor value that changes every batch compiles a step every batch, so keep
per-example ids out of the loss or make them integer arrays.
``TrainResult.compiles`` counts the compiled steps.

Checkpoints hold the parameters and, unless ``save_opt_state=False``, the
optimizer state; ``restore_opt_state=False`` (or a checkpoint without one) puts
the restored parameters into a freshly initialised optimizer state.

Mutable model state (batch statistics) is carried from step to step, never
differentiated nor handed to the optimizer, and checkpointed as ``model_state``:
an NNX module's non-``Param`` variables (``nnx.BatchStat``; the RNG streams
excepted) are found and updated by themselves; for a params pytree, pass
``state=`` and write the loss as ``loss_fn(params, batch, state) -> (loss,
new_state)`` (linen: ``module.apply(..., mutable=["batch_stats"])``'s updates).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, TextIO

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from spmdkit.errors import SpmdError
from spmdkit.recipe import Recipe, check_offload, recipe_of, to_memory, value_and_grad
from spmdkit.runtime.checkpoint import Manager, abstract_target
from spmdkit.runtime.data import BatchSkeleton, split_batch

__all__ = ["TrainError", "TrainResult", "train"]

#: An NNX module's mutable state: its variables but parameters and RNG streams, the
#: split ``spmdkit.flax.model.STATE_FILTER`` makes (applied after ``nnx.Param``).
_STATE_FILTER = nnx.Not(nnx.RngState)


class TrainError(SpmdError, ValueError):
    """The training loop was configured inconsistently.

    Broken example: ``train(..., resume=True)`` without ``ckpt=``.
    """


@dataclasses.dataclass
class TrainResult:
    """What :func:`train` returns.

    Attributes:
      params: the trained parameters (for an NNX module: the module, updated in place).
      opt_state: the final optimizer state.
      step: the number of optimizer steps done in total (including restored ones).
      history: one dict per step run here: ``{"step", "loss", "grad_norm", ...aux}``.
      start_step: the step training started from (the restored step, or 0).
      compiles: how many times the step was traced and compiled (one per batch
        shape and non-tensor value).
      model_state: the final mutable model state (batch statistics; for an NNX
        module, also written back into it), or None for a model without any.
    """

    params: Any
    opt_state: Any
    step: int
    history: list[dict[str, float]]
    start_step: int = 0
    compiles: int = 0
    model_state: Any = None

    @property
    def losses(self) -> list[float]:
        """The loss of every step run here, in order."""
        return [h["loss"] for h in self.history]


def _shardings_of(tree: Any) -> Any:
    return jax.tree.map(lambda x: x.sharding, tree)


def _opt_shardings_like_params(abstract_opt: Any, param_sh: Any, abstract_params: Any) -> Any:
    """Optimizer-state shardings when no plan gives them: a leaf whose path ends with a
    parameter's path and has its shape (adam's ``mu/l1/kernel``) takes that parameter's
    sharding; other leaves (step counts, scalars) are replicated on the params' mesh."""
    params = {
        _path(p): (x.shape, s)
        for (p, x), s in zip(
            jax.tree_util.tree_flatten_with_path(abstract_params)[0],
            jax.tree.leaves(param_sh),
            strict=True,
        )
    }
    meshes = [s.mesh for _, s in params.values() if isinstance(s, NamedSharding)]
    if not meshes:
        return None
    replicated = NamedSharding(meshes[0], PartitionSpec())

    def pick(path: tuple, x: Any) -> Any:
        name = _path(path)
        for p, (shape, sharding) in params.items():
            if (name == p or name.endswith("/" + p)) and tuple(shape) == tuple(x.shape):
                return sharding
        return replicated

    return jax.tree_util.tree_map_with_path(pick, abstract_opt)


def _path(path: tuple) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def _nnx_adapter(
    model: nnx.Module, loss_fn: Callable
) -> tuple[Any, Any, Callable, Callable[..., nnx.Module]]:
    """Split an NNX module into pure dicts of params and of mutable state (None
    when it has none), a loss over them (with state: ``loss(p, batch, s) ->
    (out, new_s)``, the new state read back from the module after the call), and
    a function writing the final params (and state) back into the module."""
    graphdef, params_state, model_state, rest = nnx.split(model, nnx.Param, _STATE_FILTER, ...)
    params = nnx.to_pure_dict(params_state)
    state = nnx.to_pure_dict(model_state) if jax.tree.leaves(model_state) else None

    def filled(template: Any, values: Any) -> Any:
        out = jax.tree.map(lambda x: x, template)
        nnx.replace_by_pure_dict(out, values)
        return out

    def loss(p: Any, batch: Any, *s: Any, **kw: Any) -> Any:
        if state is None:
            return loss_fn(
                nnx.merge(graphdef, filled(params_state, p), model_state, rest), batch, **kw
            )
        module = nnx.merge(graphdef, filled(params_state, p), filled(model_state, s[0]), rest)
        out = loss_fn(module, batch, **kw)
        return out, nnx.to_pure_dict(nnx.split(module, nnx.Param, _STATE_FILTER, ...)[2])

    def write_back(p: Any, s: Any = None) -> nnx.Module:
        nnx.update(model, filled(params_state, p))
        if s is not None:
            nnx.update(model, filled(model_state, s))
        return model

    return params, state, loss, write_back


def _make_step(
    loss: Callable,
    optimizer: optax.GradientTransformation,
    *,
    accum_steps: int,
    remat: bool,
    has_aux: bool,
    use_rng: bool,
    recipe: Any = None,
    grad_specs: Any = None,
    has_state: bool = False,
) -> Callable:
    """The jitted step's body: ``step(params, opt_state, model_state, batch, key)
    -> (params, opt_state, model_state, metrics)`` (``model_state`` None without
    state). With a non-default ``recipe`` (a plan's), the gradient is
    :func:`spmdkit.recipe.value_and_grad` (per-layer recompute, compute dtype,
    micro-batches split inside the step, gradients constrained to
    ``grad_specs``) and, with ``offload_opt``, the optimizer state moves from host
    memory to the device for the update and back."""

    def scalar_loss(p: Any, batch: Any, *args: Any) -> Any:
        *state, key = args  # (key,) or (model_state, key)
        out = loss(p, batch, *state, **({"rng": key} if use_rng else {}))
        out, new_state = out if has_state else (out, None)
        value, aux = out if has_aux else (out, {})
        return ((value, dict(aux)), new_state) if has_state else (value, dict(aux))

    if remat:
        scalar_loss = jax.checkpoint(scalar_loss)
    rcp = recipe_of(recipe) if recipe is not None else Recipe()
    # a pipelined plan comes as the plan itself (its pipeline and mesh run the step)
    piped = getattr(recipe, "pipeline", None) is not None
    if rcp.is_default and grad_specs is None and not piped and not has_state:
        grad_fn = jax.value_and_grad(scalar_loss, has_aux=True)
    else:
        grad_fn = value_and_grad(
            scalar_loss,
            recipe if piped else rcp,
            grad_specs=grad_specs,
            has_aux=True,
            has_state=has_state,
        )

    def step(params: Any, opt_state: Any, model_state: Any, batch: Any, key: Any) -> tuple:
        if rcp.offload_opt:
            opt_state = to_memory(opt_state, jax.memory.Space.Device)
        state = (model_state,) if has_state else ()
        if accum_steps == 1:
            out, grads = grad_fn(params, batch, *state, key)
            (value, aux), state = (out[0], (out[1],)) if has_state else (out, ())
        else:
            value, aux, grads, state = _accumulate(grad_fn, params, batch, key, accum_steps, state)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        if rcp.offload_opt:
            opt_state = to_memory(opt_state, jax.memory.Space.Host)
        metrics = {"loss": value, "grad_norm": optax.tree.norm(grads), **aux}
        return params, opt_state, state[0] if has_state else None, metrics

    return step


def _accumulate(
    grad_fn: Callable, params: Any, batch: Any, key: Any, accum_steps: int, state: tuple = ()
) -> tuple[Any, Any, Any, tuple]:
    """Loss, aux and gradients averaged over the micro-batches stacked on the leading
    dim of every array leaf, and the model state (``state``: ``()`` or
    ``(model_state,)``) threaded through them in order. Non-tensor leaves reach each
    micro-batch untouched, or split (a :class:`~spmdkit.runtime.data.PerMicrobatch`
    gives micro-batch ``i`` its ``i``-th item; then the micro-batches are unrolled
    instead of scanned)."""
    leaves, skeleton = split_batch(batch)

    def micro(i: Any, mb: list[Any], st: tuple) -> Any:
        out, g = grad_fn(params, skeleton.fill(mb, micro=i), *st, jax.random.fold_in(key, i))
        return (out[0], g, (out[1],)) if st else (out, g, ())

    (v0, aux0), _, _ = jax.eval_shape(lambda mb: micro(0, mb, state), [x[0] for x in leaves])
    carry = (
        jax.tree.map(jnp.zeros_like, params),
        jnp.zeros(v0.shape, v0.dtype),
        jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), aux0),
        state,
    )

    def add(carry: Any, i: Any, mb: list[Any]) -> Any:
        gsum, vsum, asum, st = carry
        (v, a), g, st = micro(i, mb, st)
        return jax.tree.map(jnp.add, gsum, g), vsum + v, jax.tree.map(jnp.add, asum, a), st

    if skeleton.per_micro:
        for i in range(accum_steps):
            carry = add(carry, i, [x[i] for x in leaves])
    else:
        xs = (jnp.arange(accum_steps), leaves)
        carry, _ = jax.lax.scan(lambda c, x: (add(c, *x), None), carry, xs)
    gsum, vsum, asum, state = carry
    grads = jax.tree.map(lambda g: g / accum_steps, gsum)
    mean_aux = jax.tree.map(lambda a: a / accum_steps, asum)
    return vsum / accum_steps, mean_aux, grads, state


class _BatchTreeStep:
    """The jitted step called with a batch tree: array leaves are traced, the rest is
    a static :class:`~spmdkit.runtime.data.BatchSkeleton`; counts the compiles."""

    def __init__(self, step: Callable, **jit_kwargs: Any) -> None:
        self.compiles = 0

        def traced(
            params: Any, opt_state: Any, state: Any, leaves: Any, key: Any, skel: BatchSkeleton
        ) -> Any:
            self.compiles += 1
            return step(params, opt_state, state, skel.fill(leaves), key)

        self._jitted = jax.jit(traced, static_argnums=5, **jit_kwargs)

    def __call__(self, params: Any, opt_state: Any, state: Any, batch: Any, key: Any) -> Any:
        leaves, skeleton = split_batch(batch)
        return self._jitted(params, opt_state, state, leaves, key, skeleton)


def _batches(data: Any) -> Iterator[Any]:
    """Endless batches: iterate the loader again (next epoch) whenever it runs out.
    One empty pass is allowed (a position restored at the very end of an epoch)."""
    empties = 0
    while True:
        empty = True
        for batch in data:
            empty = False
            yield batch
        empties = empties + 1 if empty else 0
        if empties == 2:
            raise TrainError(
                op="train",
                must="the data yields at least one batch per epoch",
                given="an empty epoch",
                fix="use a smaller batch_size or last_batch='pad'",
            )


def train(
    loss_fn: Callable[..., Any],
    params: Any,
    optimizer: optax.GradientTransformation,
    data: Any,
    *,
    steps: int,
    plan: Any | None = None,
    shardings: tuple[Any, Any] | None = None,
    accum_steps: int = 1,
    remat: bool = False,
    has_aux: bool = False,
    state: Any = None,
    rng: jax.Array | None = None,
    ckpt: Manager | None = None,
    resume: bool = False,
    save_opt_state: bool = True,
    restore_opt_state: bool | None = None,
    config: Any | None = None,
    log_every: int = 10,
    progress: bool = True,
    out: TextIO | None = None,
) -> TrainResult:
    """Train for ``steps`` optimizer steps (in total, counting restored ones).

    Args:
      loss_fn: ``loss_fn(params_or_module, batch[, rng=key])`` → scalar loss, or
        ``(loss, aux_dict)`` with ``has_aux=True``; with ``state=``,
        ``loss_fn(params, batch, state[, rng=key]) -> (that, new_state)``.
      params: a pytree of arrays, or an ``nnx.Module`` (its ``nnx.Param`` s are
        trained, its other variables but the RNG streams (``nnx.BatchStat``) are
        carried as mutable state; both are written back into it). Arrays are
        donated: use the result.
      optimizer: an optax transformation.
      data: a :class:`spmdkit.runtime.data.ShardedLoader` (its position is checkpointed),
        or any re-iterable of global batches (dicts).
      steps: the total number of optimizer steps to reach.
      plan: a plan; ``plan.state_shardings(abstract_params, abstract_opt_state)``
        gives the parameter and optimizer-state shardings (ZeRO-1/FSDP specs for the
        optimizer state live there) and ``plan.mesh`` / ``plan.to_json()`` are saved
        in checkpoints. Its recipe runs (:func:`spmdkit.recipe.value_and_grad`:
        per-layer recompute, compute dtype, micro-batches split inside the step);
        its gradient specs constrain the gradients (ZeRO-2); with ``offload_opt``
        the optimizer state lives in ``pinned_host`` memory between steps.
      shardings: ``(param_shardings, opt_state_shardings)`` pytrees instead of a plan
        (``opt_state_shardings=None``: each optimizer leaf mirroring a parameter takes
        that parameter's sharding, the rest are replicated).
        With neither, the params' current shardings are kept.
      accum_steps: micro-batches per step (gradients averaged); the loader splits each
        batch (``microbatches`` is set on a ShardedLoader that has 1).
      remat: wrap the whole loss in ``jax.checkpoint`` (this does not lower the
        peak: the backward recomputes the whole forward at once); per-layer
        recompute is a plan's ``Recipe(remat="full")``.
      has_aux: ``loss_fn`` returns ``(loss, metrics_dict)``.
      state: mutable model state for a params pytree (linen's ``batch_stats``
        collections): carried between steps, laid out by the plan
        (``plan.state_sharding``; replicated with ``shardings=``; as placed
        otherwise), checkpointed as ``model_state``; not differentiated.
      rng: a PRNG key; ``loss_fn`` then gets ``rng=fold_in(rng, step)``.
      ckpt: a :class:`spmdkit.runtime.checkpoint.Manager`; saves on its interval and at the end.
      resume: continue from ``ckpt``'s latest complete checkpoint, if any.
      save_opt_state: checkpoints hold the optimizer state (``False``: parameters,
        RNG and data position only — for export and inference).
      restore_opt_state: on resume, restore the optimizer state (``True``: it must be
        there), start a fresh one from the restored parameters (``False``), or
        restore it when the checkpoint has one (``None``, the default).
      config: the model config (dataclass or dict), saved in every checkpoint.
      log_every: steps between progress lines (and metric fetches).
      progress: print progress lines (process 0 only).
      out: stream for progress lines (default stderr).

    Returns:
      :class:`TrainResult`.

    Example::

        >>> res = train(loss, model, optax.adam(1e-3), loader, steps=100, plan=plan,
        ...             ckpt=Manager("/tmp/run", save_interval_steps=50), resume=True)
        >>> res.losses[-1]
    """
    _check_args(steps, accum_steps, resume=resume, ckpt=ckpt, plan=plan, shardings=shardings)
    out = out if out is not None else sys.stderr
    params, state, loss, write_back = _model_parts(loss_fn, params, state)
    recipe = getattr(plan, "recipe", None) or Recipe()
    accum_steps = _recipe_accum(recipe, accum_steps, remat=remat, data=data)
    _set_microbatches(data, accum_steps)
    abstract, param_sh, opt_sh, mesh = _state_shardings(params, optimizer, plan, shardings)
    model_sh = _model_state_shardings(state, plan, mesh)
    grad_specs = _grad_shardings(plan, abstract[0], mesh)
    opt_sh = _offloaded(recipe, opt_sh, mesh)

    # under the mesh context optax's scalar states and the step's replicated metrics
    # are created on the mesh, not on one device
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        if rng is not None and mesh is not None:
            # one replicated copy on the mesh: a global array every process can save
            rng = jax.device_put(rng, NamedSharding(mesh, PartitionSpec()))
        resume_from = ckpt if resume and ckpt.latest_step() is not None else None
        train_state, start, opt_sh = _initial_state(
            params, optimizer, data, rng, resume_from, abstract, (param_sh, opt_sh),
            restore_opt=restore_opt_state, model_state=(state, model_sh),
        )  # fmt: skip
        step_fn = _BatchTreeStep(
            _make_step(
                loss,
                optimizer,
                accum_steps=accum_steps,
                remat=remat,
                has_aux=has_aux,
                use_rng=rng is not None,
                recipe=plan if getattr(plan, "pipeline", None) is not None else recipe,
                grad_specs=grad_specs,
                has_state=state is not None,
            ),
            out_shardings=(param_sh, opt_sh, model_sh, None),
            donate_argnums=(0, 1, 2),
        )
        show = progress and jax.process_index() == 0
        loop = _Loop(step_fn, data, train_state, start=start, show=show, out=out)
        items = None if save_opt_state else tuple(k for k in train_state if k != "opt_state")
        save = _saver(ckpt, plan, mesh, data, config=config, items=items)
        loop.run(steps, log_every=log_every, ckpt=ckpt, save=save)
        params, final_state = loop.state["params"], loop.state.get("model_state")
        return TrainResult(
            params=write_back(params, final_state) if write_back is not None else params,
            opt_state=loop.state["opt_state"],
            step=loop.step,
            history=loop.history,
            start_step=loop.start,
            compiles=step_fn.compiles,
            model_state=final_state,
        )


def _model_parts(
    loss_fn: Callable, params: Any, state: Any
) -> tuple[Any, Any, Callable, Callable[..., Any] | None]:
    """``(params, model state, loss, write_back)``: an NNX module split into pure
    dicts (:func:`_nnx_adapter`), a pytree as given (``write_back`` None)."""
    if not isinstance(params, nnx.Module):
        return params, state, loss_fn, None
    if state is not None:
        raise TrainError(
            op="train",
            must="an NNX module brings its own state",
            given="an nnx.Module with state=",
            fix="drop state= (the module's nnx.BatchStat variables are its state)",
        )
    return _nnx_adapter(params, loss_fn)


def _offloaded(recipe: Recipe, opt_sh: Any, mesh: Any) -> Any:
    """The optimizer-state shardings, in host memory when the recipe offloads it
    (a backend without ``pinned_host`` memory raises :class:`RecipeError`)."""
    if not recipe.offload_opt:
        return opt_sh
    check_offload(recipe, mesh.devices.flat[0] if mesh is not None else None)
    return jax.tree.map(lambda s: s.with_memory_kind("pinned_host"), opt_sh)


def _check_args(
    steps: Any, accum_steps: Any, *, resume: bool, ckpt: Any, plan: Any, shardings: Any
) -> None:
    op = "train"
    if not isinstance(steps, int) or steps < 0:
        raise TrainError(op=op, must="steps is an int >= 0", given=repr(steps), fix="steps=100")
    if not isinstance(accum_steps, int) or accum_steps < 1:
        raise TrainError(
            op=op, must="accum_steps is a positive int", given=repr(accum_steps), fix="1 or more"
        )
    if resume and ckpt is None:
        raise TrainError(
            op=op,
            must="resume=True comes with a checkpoint manager",
            given="ckpt=None",
            fix="pass ckpt=spmdkit.runtime.checkpoint.Manager(directory)",
        )
    if plan is not None and shardings is not None:
        raise TrainError(
            op=op,
            must="shardings come from a plan or are given, not both",
            given="plan= and shardings=",
            fix="drop one of them",
        )


def _recipe_accum(recipe: Recipe, accum_steps: int, *, remat: bool, data: Any) -> int:
    """The loader-side accumulation steps once the plan's recipe is taken into
    account: a recipe with micro-batches splits each batch inside the step, so
    the loader does not (``accum_steps`` may only repeat the recipe's count)."""
    if remat and recipe.remat != "none":
        raise TrainError(
            op="train",
            must="recompute comes from the plan's recipe or from remat=True, not both",
            given=f"remat=True and a plan with remat={recipe.remat!r}",
            fix="drop remat=True (the recipe recomputes each layer)",
        )
    n = recipe.microbatches
    if n == 1:
        return accum_steps
    if accum_steps not in (1, n):
        raise TrainError(
            op="train",
            must="accum_steps is 1 or the plan's micro-batch count",
            given=f"accum_steps={accum_steps}, plan.recipe.microbatches={n}",
            fix=f"drop accum_steps (the plan splits each batch into {n} micro-batches), "
            "or plan with the count you want",
        )
    if getattr(data, "microbatches", 1) != 1:
        raise TrainError(
            op="train",
            must="the loader yields whole batches when the plan has micro-batches",
            given=f"loader microbatches={data.microbatches}, plan.recipe.microbatches={n}",
            fix="leave microbatches=1 on the loader; the step splits each batch",
        )
    return 1


def _model_state_shardings(state: Any, plan: Any, mesh: Any) -> Any:
    """Where the mutable model state lives: the plan's state layout, replicated on
    the mesh when shardings are given without a plan, or as the arrays are placed
    (None without state)."""
    if state is None:
        return None
    abstract = jax.eval_shape(lambda s: s, state)
    if plan is not None:
        return plan.state_sharding(abstract)
    if mesh is not None:
        return jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), abstract)
    return _shardings_of(state)


def _grad_shardings(plan: Any, abstract_params: Any, mesh: Any) -> Any:
    """The plan's gradient shardings (ZeRO-2) when it shards gradients, else None."""
    if not getattr(plan, "grads", None) or mesh is None:
        return None
    return jax.tree.map(
        lambda spec: NamedSharding(mesh, spec),
        plan.grad_specs(abstract_params),
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )


def _set_microbatches(data: Any, accum_steps: int) -> None:
    """A loader that splits batches is told how many micro-batches a step takes."""
    if accum_steps > 1 and hasattr(data, "microbatches"):
        if data.microbatches == 1:
            data.microbatches = accum_steps
        elif data.microbatches != accum_steps:
            raise TrainError(
                op="train",
                must="the loader's microbatches equals accum_steps",
                given=f"microbatches={data.microbatches}, accum_steps={accum_steps}",
                fix="leave microbatches=1 on the loader; train sets it",
            )


def _state_shardings(
    params: Any, optimizer: optax.GradientTransformation, plan: Any, shardings: Any
) -> tuple[tuple[Any, Any], Any, Any, Any]:
    """``(abstract params, abstract optimizer state)``, their shardings on this run's
    mesh, and that mesh."""
    abstract_params = jax.eval_shape(lambda p: p, params)
    abstract_opt = jax.eval_shape(optimizer.init, abstract_params)
    if plan is not None:
        param_sh, opt_sh = plan.state_shardings(abstract_params, abstract_opt)
    elif shardings is not None:
        param_sh, opt_sh = shardings
    else:
        param_sh, opt_sh = _shardings_of(params), None
    if opt_sh is None:
        opt_sh = _opt_shardings_like_params(abstract_opt, param_sh, abstract_params)
    # the mesh the shardings live on (a plan may hand out Auto-axis shardings for an
    # Explicit plan.mesh: the context must be theirs)
    leaves = [s for s in jax.tree.leaves(param_sh) if isinstance(s, NamedSharding)]
    mesh = leaves[0].mesh if leaves else getattr(plan, "mesh", None)
    return (abstract_params, abstract_opt), param_sh, opt_sh, mesh


def _initial_state(
    params: Any,
    optimizer: optax.GradientTransformation,
    data: Any,
    rng: jax.Array | None,
    ckpt: Manager | None,
    abstract: tuple[Any, Any],
    state_sh: tuple[Any, Any],
    *,
    restore_opt: bool | None = None,
    model_state: tuple[Any, Any] = (None, None),
) -> tuple[dict[str, Any], int | None, Any]:
    """The state to start from (params, opt_state, model_state, rng), the step it
    was saved at (None when fresh) and the optimizer state's shardings.

    With ``ckpt``: its latest checkpoint, placed as this run shards it, and the
    loader moved to where it was (the optimizer state as ``restore_opt`` says).
    Otherwise ``params`` (and the model state) placed and the optimizer state
    initialised. ``model_state``: ``(mutable model state or None, its shardings)``."""
    param_sh, opt_sh = state_sh
    mstate, mstate_sh = model_state
    if ckpt is None:
        params = jax.device_put(params, param_sh)
        opt_state = jax.jit(optimizer.init, out_shardings=opt_sh)(params)
        state = {"params": params, "opt_state": opt_state}
        if mstate is not None:
            state["model_state"] = jax.device_put(mstate, mstate_sh)
        if rng is not None:
            state["rng"] = rng
        return state, None, _shardings_of(opt_state)
    abstract_params, abstract_opt = abstract
    target_params = abstract_target(abstract_params, param_sh)
    if opt_sh is None:
        opt_sh = jax.jit(optimizer.init).lower(target_params).compile().output_shardings
    target = {"params": target_params, "opt_state": abstract_target(abstract_opt, opt_sh)}
    if mstate is not None:
        target["model_state"] = abstract_target(jax.eval_shape(lambda s: s, mstate), mstate_sh)
    if rng is not None:
        target["rng"] = jax.ShapeDtypeStruct(rng.shape, rng.dtype, sharding=rng.sharding)
    if restore_opt is None:
        saved = ckpt.saved_shapes()
        restore_opt = any(p.startswith("opt_state/") or p == "opt_state" for p in saved)
    items = tuple(k for k in target if restore_opt or k != "opt_state")
    restored = ckpt.restore(target=target, items=items)
    if hasattr(data, "set_state"):
        data.set_state(restored.data_state)
    state = dict(restored.state)
    if not restore_opt:  # the restored parameters go into a fresh optimizer state
        state["opt_state"] = jax.jit(optimizer.init, out_shardings=opt_sh)(state["params"])
    return state, restored.step, opt_sh


def _saver(
    ckpt: Manager | None,
    plan: Any,
    mesh: Any,
    data: Any,
    *,
    config: Any = None,
    items: tuple[str, ...] | None = None,
) -> Callable[..., Any] | None:
    """``save(step, state, force=...)`` recording the plan, mesh, loader position and
    model config; with ``items``, only those top-level keys of the state."""
    if ckpt is None:
        return None
    return functools.partial(
        ckpt.save,
        plan=plan,
        mesh=plan.mesh if getattr(plan, "mesh", None) is not None else mesh,
        data=data if hasattr(data, "state") else None,
        config=config,
        items=items,
    )


class _Loop:
    """The step loop: runs the compiled step, keeps the metric history (fetched
    every ``log_every`` steps), prints progress and saves on the manager's interval."""

    def __init__(
        self,
        step_fn: Callable[..., Any],
        data: Any,
        state: dict[str, Any],
        *,
        start: int | None,
        show: bool,
        out: TextIO,
    ) -> None:
        self.step_fn, self.data, self.state = step_fn, data, state
        self.start = self.step = start or 0
        self.saved = start  # the restored step counts as saved
        self.show, self.out = show, out
        self.history: list[dict[str, float]] = []
        self.pending: list[tuple[int, dict[str, Any]]] = []

    def flush(self) -> None:
        for s, m in self.pending:
            self.history.append({"step": s, **{k: float(np.asarray(v)) for k, v in m.items()}})
        self.pending.clear()

    def log(self, steps: int, t0: float) -> None:
        h = self.history[-1]
        rate = (self.step - self.start) / max(time.perf_counter() - t0, 1e-9)
        extra = "  ".join(f"{k} {v:.4g}" for k, v in h.items() if k not in ("step",))
        bar = _bar(self.step, steps)
        self.out.write(f"{bar} step {self.step}/{steps}  {extra}  {rate:.2f} step/s\n")
        self.out.flush()

    def run(
        self, steps: int, *, log_every: int, ckpt: Manager | None, save: Callable[..., Any] | None
    ) -> None:
        key = self.state.get("rng")
        key = key if key is not None else jax.random.key(0)
        it = _batches(self.data)
        t0 = time.perf_counter()
        while self.step < steps:
            batch = next(it)
            params, opt_state, model_state, metrics = self.step_fn(
                self.state["params"],
                self.state["opt_state"],
                self.state.get("model_state"),
                batch,
                jax.random.fold_in(key, self.step),
            )
            self.state.update(params=params, opt_state=opt_state)
            if model_state is not None:
                self.state["model_state"] = model_state
            self.step += 1
            self.pending.append((self.step, metrics))
            if ckpt is not None and ckpt.should_save(self.step):
                save(self.step, dict(self.state), force=False)
                self.saved = self.step
            if self.step % log_every == 0 or self.step == steps:
                self.flush()
                if self.show:
                    self.log(steps, t0)
        self.flush()
        if ckpt is not None and self.step > self.start:
            if self.saved != self.step:
                save(self.step, dict(self.state), force=True)
            ckpt.wait()


def _bar(step: int, total: int, width: int = 20) -> str:
    filled = int(width * step / max(total, 1))
    return "[" + "#" * filled + "." * (width - filled) + "]"
