"""What :func:`spmdkit.runtime.train.train` trains: the described model, its values,
and how the trained values go back to the user in the form given.

Two ways in, one step (``sk.train_step(info, optimizer, plan)``, whose loss is
:attr:`~spmdkit.introspect.ModelInfo.train_loss`: state, RNG and aux as the model has them):

- ``train(loss, model, ...)``: the user's loss and the model's values (an NNX
  module, a linen variables dict, a params pytree), described here;
- ``train(info, values, ...)``: the model already described (``sk.describe``) and
  its values as :func:`~spmdkit.compile.annotate.init_sharded` hands them out (an
  NNX ``nnx.State`` of parameters, a linen ``{"params": ...}`` dict with or
  without its other collections), or an NNX module. The model's state is the
  given one, else ``info.init_state_fn()``. This is the path from ``init_sharded``
  for a model with dropout, batch statistics or any RNG.

The calls that cannot work are refused with the call that does:
``train(info.loss_fn, ...)`` for a model with state or RNG (that loss is the
planner's trace on placeholder state and keys), ``train(info.train_loss, ...)``
(a :class:`~spmdkit.step.loss.Loss` without the model it came from), and an NNX loss
``loss(model, batch)`` given an ``nnx.State`` where it expects a module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
from flax import nnx

from spmdkit.errors import SpmdError, TrainError
from spmdkit.introspect import ModelInfo, describe
from spmdkit.introspect.losses import STATE_FILTER, planner_stand_in
from spmdkit.planner import Plan
from spmdkit.step.grad import init_fp8_state
from spmdkit.step.loss import Loss

__all__ = ["Parts", "model_parts", "with_fp8_state"]

_RIGHT_CALL = "train(info, params, optimizer, data, steps=..., plan=plan)"


@dataclasses.dataclass
class Parts:
    """The described model, its concrete parameters and state, and how to hand
    the trained values back in the form they were given: ``write_back(params,
    state)`` the model's, ``opt_back(opt_state)`` the optimizer state's (each
    subtree shaped as the parameters in their given form, as
    ``optimizer.init(given)`` makes it)."""

    info: ModelInfo
    params: Any
    state: Any
    write_back: Callable[[Any, Any], Any]
    opt_back: Callable[[Any], Any] = lambda opt_state: opt_state


def model_parts(loss: Any, model: Any, example: Any) -> Parts:
    """The model ``train`` runs (module docstring), from ``train``'s first two
    arguments and the data's first batch.

    Raises:
      TrainError: a call that cannot train the model (module docstring), or values
        that are not the described model's.

    Example::

        >>> parts = model_parts(info, sk.init_sharded(info, plan), batch)
        >>> parts.info is info
        True
    """
    if isinstance(loss, ModelInfo):
        return _described(loss, model)
    _refuse(loss, model)
    if isinstance(model, nnx.State):
        try:
            info = describe(model, loss=loss, batch=example)
            info.has_aux  # noqa: B018 -- one abstract trace of the loss on the State
        except SpmdError:
            raise
        except (TypeError, AttributeError) as e:
            raise TrainError(
                op="train",
                must="an NNX model's parameters (an nnx.State) train with the model they "
                "were split from",
                given=f"{_name(loss)}(params, batch) on an nnx.State failed: "
                f"{type(e).__name__}: {e}",
                fix=f"{_RIGHT_CALL} with info = sk.describe(build, loss={_name(loss)}, "
                "batch=batch) and params = sk.init_sharded(info, plan); or pass the "
                "nnx.Module itself",
            ) from e
    else:
        info = describe(model, loss=loss, batch=example)
    if isinstance(model, nnx.Module):
        return _module_parts(info, model)
    if info.has_state:  # a linen variables dict: params trained, collections carried
        state = {k: v for k, v in model.items() if k != "params"}
        return Parts(info, {"params": model["params"]}, state, lambda p, s: {**p, **s})
    return Parts(info, model, None, lambda p, s: p)


def _refuse(loss: Any, model: Any) -> None:
    """Raise for the calls that cannot train the model (module docstring)."""
    if isinstance(model, ModelInfo):
        raise TrainError(
            op="train",
            must="the model is described first, its values second",
            given=f"train({_name(loss)}, <ModelInfo>): a ModelInfo holds no values",
            fix=f"{_RIGHT_CALL} with params = sk.init_sharded(info, plan)",
        )
    if isinstance(loss, Loss):
        raise TrainError(
            op="train",
            must="the loss comes with the model it was described from",
            given=f"{loss!r}: a described model's train loss, without the model",
            fix=_RIGHT_CALL + " (pass the ModelInfo; its train_loss is what runs)",
        )
    if not callable(loss):
        raise TrainError(
            op="train",
            must="the first argument is a loss or a described model (sk.describe)",
            given=type(loss).__name__,
            fix=f"{_RIGHT_CALL}, or train(loss, model, optimizer, data, ...)",
        )
    stand_in = planner_stand_in(loss)
    if stand_in is not None:
        raise TrainError(
            op="train",
            must="the step runs the model's train loss (its dropout keys drawn per step, "
            "its state carried)",
            given=f"{stand_in}: the planner's trace of the loss, on placeholder "
            "state and one fixed key",
            fix=_RIGHT_CALL + " (info.train_loss carries the state and RNG)",
        )


def _described(info: ModelInfo, values: Any) -> Parts:
    """The parts of an already described model and its values."""
    if isinstance(values, ModelInfo) or values is None:
        raise TrainError(
            op="train",
            must="a described model is trained from its values",
            given=f"train(info, {type(values).__name__})",
            fix=f"{_RIGHT_CALL} with params = sk.init_sharded(info, plan)",
        )
    if isinstance(values, nnx.Module):
        return _module_parts(info, values)
    given_state = None
    if info.kind == "linen" and isinstance(values, Mapping) and "params" in values:
        given_state = {k: v for k, v in values.items() if k != "params"} or None
        values = {"params": values["params"]}
    pure = nnx.to_pure_dict(values) if isinstance(values, nnx.State) else values
    want = info.abstract_params
    want = nnx.to_pure_dict(want) if isinstance(want, nnx.State) else want
    if jax.tree.structure(pure) != jax.tree.structure(want):
        raise TrainError(
            op="train",
            must=f"the values are {info.name}'s parameters, as sk.init_sharded(info, plan) "
            "makes them",
            given=f"{type(values).__name__} {_brief(jax.tree.structure(pure))}; "
            f"the model's are {_brief(jax.tree.structure(want))}",
            fix=f"{_RIGHT_CALL} with params = sk.init_sharded(info, plan)",
        )
    state = _state(info, given_state)
    if isinstance(values, nnx.State):
        template = values

        def into_state(p: Any, s: Any) -> nnx.State:
            filled = jax.tree.map(lambda x: x, template)
            nnx.replace_by_pure_dict(filled, p)
            return filled

        structure = jax.tree.structure(pure)
        return Parts(
            info,
            pure,
            state,
            into_state,
            lambda opt_state: _params_form(opt_state, structure, lambda p: into_state(p, None)),
        )
    if given_state is not None:
        return Parts(info, pure, state, lambda p, s: {**p, **s})
    return Parts(info, pure, state, lambda p, s: p)


def _state(info: ModelInfo, given: Any) -> Any:
    """The model's initial state: the given collections, else the initialiser's."""
    if not info.has_state:
        return None
    if given is not None:
        return given
    if info.init_state_fn is None:
        raise TrainError(
            op="train",
            must=f"{info.name}'s state ({info.state[0].path}, ...) starts from a value",
            given="parameters alone, and a model described from an instance "
            "(no initialiser for its state)",
            fix="pass the nnx.Module (or the linen variables dict with its collections) "
            "as train's second argument",
        )
    state = info.init_state_fn()
    return nnx.to_pure_dict(state) if isinstance(state, nnx.State) else state


def _params_form(opt_state: Any, structure: Any, into: Callable[[Any], Any]) -> Any:
    """``opt_state`` with each subtree of the (pure) parameters' ``structure``
    (Adam's moments, the fp32 master) put into the form the parameters were given
    in by ``into``: the optimizer state ``optimizer.init`` makes of the given form,
    so ``result.planned`` takes ``result.params`` and ``result.opt_state`` together."""

    def shaped(x: Any) -> bool:
        return jax.tree.structure(x) == structure

    return jax.tree.map(lambda x: into(x) if shaped(x) else x, opt_state, is_leaf=shaped)


def _module_parts(info: ModelInfo, model: nnx.Module) -> Parts:
    # pure dicts: checkpoints name a parameter by its path ("l1/kernel")
    _, params, state, _ = nnx.split(model, nnx.Param, STATE_FILTER, ...)

    def into_module(p: Any, s: Any) -> nnx.Module:
        for template, values in ((params, p), (state, s)):
            if values is not None:
                filled = jax.tree.map(lambda x: x, template)
                nnx.replace_by_pure_dict(filled, values)
                nnx.update(model, filled)
        return model

    pure_state = nnx.to_pure_dict(state) if info.has_state else None
    return Parts(info, nnx.to_pure_dict(params), pure_state, into_module)


def with_fp8_state(parts: Parts, plan: Plan, example: Any) -> Parts:
    """Under delayed float8 scaling (``plan.recipe.fp8_scaling == "delayed"``) the
    step's state is the amax histories (``spmdkit.step.grad.init_fp8_state``, empty:
    the first step scales as current scaling does): carried, checkpointed and
    restored as ``model_state``, returned in ``TrainResult.model_state``, not
    written into the model."""
    if plan.recipe.fp8_scaling != "delayed":
        return parts
    if parts.state is not None:
        raise TrainError(
            op="train",
            must="with fp8_scaling='delayed' the model has no mutable state of its own "
            "(the amax histories are the step's state)",
            given=f"a model with state {sorted(s.path for s in parts.info.state)[:3]}",
            fix="plan with sk.Recipe(compute_dtype='float8') (current scaling)",
        )
    info = parts.info
    key = () if info.abstract_key is None else (info.abstract_key,)
    exclude = plan.recipe.fp8_exclude
    state = init_fp8_state(info, info.abstract_params, example, *key, exclude=exclude)
    write_back = parts.write_back
    return dataclasses.replace(parts, state=state, write_back=lambda p, s: write_back(p, None))


def _name(fn: Any) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def _brief(tree: Any) -> str:
    text = str(tree)
    return text if len(text) <= 120 else text[:117] + "..."
