"""The user's loss, one per model kind, run on pure arrays (what :func:`describe` hands on).

A user writes one loss per model kind, and describing the model, planning it,
``sk.train_step`` and ``train`` all take that one:

- NNX: ``loss(model, batch)``; batch statistics are updated on the module and
  read back after the call; the module's RNG streams (``nnx.Rngs`` held by
  ``nnx.Dropout`` and friends) draw from the step's key;
- linen: ``loss(variables, batch)`` returning the loss, or ``(loss, updates)``
  as ``module.apply(variables, x, mutable=[...])`` hands the updates out;
- a params pytree (or a linen variables dict without its module):
  ``loss(params, batch)``, the same convention as linen when the dict holds
  collections besides ``params``.

Any of them may return ``(loss, aux)`` (with updates: ``((loss, aux),
updates)``), and may take the step's PRNG key as ``rng=`` (linen:
``apply(..., rngs={"dropout": rng})``).

Each kind becomes a *run* function ``run(params, batch, state, key) -> (out,
new_state)`` (``state``/``key`` ``None`` when the model has none, ``out`` the
loss's value with any updates taken out), from which :func:`model_losses` builds
the planner's scalar losses (``loss_fn``, ``state_loss_fn``: state and RNG
streams at placeholders, aux dropped) and :func:`train_loss` the
:class:`~spmdkit.step.loss.Loss` a train step runs (state, key and aux as they are).
"""

from __future__ import annotations

import math
import warnings
import zlib
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import errors as flax_errors
from flax import nnx

from spmdkit.batch import as_tree
from spmdkit.errors import SpmdError
from spmdkit.step.loss import Loss, note_placeholder_key, takes_rng
from spmdkit.util import path_str

__all__ = [
    "STATE_FILTER",
    "ModelError",
    "dict_run",
    "fresh_streams",
    "has_aux",
    "model_losses",
    "nnx_run",
    "placeholders",
    "planner_stand_in",
    "split_value",
    "train_loss",
]

#: The NNX variables that are mutable state: everything but parameters and the
#: RNG streams (``nnx.BatchStat``, caches, user variable types); the filter is
#: applied after ``nnx.Param`` in ``nnx.split``.
STATE_FILTER = nnx.Not(nnx.RngState)

#: ``run(params, batch, state, key) -> (out, new_state)`` (module docstring).
Run = Callable[[Any, Any, Any, Any], tuple[Any, Any]]


class ModelError(SpmdError, TypeError):
    """The object handed to the planner is not a model it can read, or its loss
    breaks the model kind's convention.

    Broken example: ``sk.plan(my_module, mesh)`` for an NNX module without ``loss=``
    and ``batch=``: the planner cannot trace a train step without them.
    """


# -- values ---------------------------------------------------------------------------


def split_value(out: Any) -> tuple[Any, Any]:
    """``(loss, aux)`` of a loss's value: ``(loss, aux)`` as returned, or
    ``(loss, None)`` for a loss alone.

    Example::

        >>> split_value((jnp.float32(1.0), {"acc": 0.5}))[1]
        {'acc': 0.5}
    """
    if isinstance(out, tuple) and len(out) == 2:
        return out[0], out[1]
    return out, None


def has_aux(run: Run, args: tuple) -> bool:
    """Whether the loss returns ``(loss, aux)``: read off its output's structure
    in an abstract trace (``args``: params, batch, state, key, abstract)."""
    out = jax.eval_shape(lambda *a: run(*a)[0], *args)
    return split_value(out)[1] is not None


# -- placeholders and RNG streams --------------------------------------------------------


def placeholders(tree: Any) -> Any:
    """Values for abstract state or RNG streams in a trace of the loss alone:
    zeros, and fixed keys (a key per stream)."""

    def zero(s: Any) -> Any:
        if jax.dtypes.issubdtype(s.dtype, jax.dtypes.prng_key):
            keys = jax.random.split(jax.random.key(0), max(math.prod(s.shape), 1))
            return keys.reshape(s.shape) if s.shape else keys[0]
        return jnp.zeros(s.shape, s.dtype)

    return jax.tree.map(zero, tree)


def fresh_streams(abstract_rng: Any, key: Any) -> Any:
    """An NNX module's RNG streams drawn from the step's key: each stream's key is
    ``fold_in(key, crc32(path))`` and its count starts at 0, so streams differ
    from each other and from step to step, and every call in the step (each
    ``nnx.Dropout``) advances its stream as eager code would.

    Example::

        >>> model = nnx.merge(graphdef, params, state, fresh_streams(abstract_rng, key))
    """

    def one(kp: tuple, s: Any) -> Any:
        if jax.dtypes.issubdtype(s.dtype, jax.dtypes.prng_key):
            k = jax.random.fold_in(key, zlib.crc32(path_str(kp).encode()))
            return jnp.broadcast_to(k, s.shape)
        return jnp.zeros(s.shape, s.dtype)

    return jax.tree_util.tree_map_with_path(one, abstract_rng)


# -- one run function per model kind ------------------------------------------------------


def nnx_run(graphdef: Any, loss: Callable, abstract_state: Any, abstract_rng: Any) -> Run:
    """The run function of an NNX loss ``loss(model, batch[, rng=key])``: the module
    merged from the arguments (``nnx.State`` s or their pure dicts; fresh variables
    at this trace level, so layers may update them in place), its streams from
    ``key`` (:func:`fresh_streams`), the new state read back from it after the call."""
    rng_kw = takes_rng(loss)
    stateful = bool(jax.tree.leaves(abstract_state))

    def run(params: Any, batch: Any, state: Any, key: Any) -> tuple[Any, Any]:
        s = jax.tree.map(lambda x: x, state) if stateful else abstract_state
        rng = fresh_streams(abstract_rng, key) if key is not None else placeholders(abstract_rng)
        model = nnx.merge(graphdef, params, s, rng)
        out = loss(model, as_tree(batch), **({"rng": key} if rng_kw else {}))
        if not stateful:
            return out, None
        new = nnx.split(model, nnx.Param, STATE_FILTER, ...)[2]
        # in the form it came: an nnx.State, or a pure dict (train's, and checkpoints')
        return out, new if isinstance(state, nnx.State) else nnx.to_pure_dict(new)

    return run


def dict_run(loss: Callable, collections: tuple[str, ...], name: str) -> Run:
    """The run function of a loss over a variables dict (linen's, or a params
    pytree when ``collections`` is empty): ``loss({**params, **state}, batch[,
    rng=key])`` returning the value, or ``(value, updates)`` for the mutable
    ``collections`` (a loss returning no updates keeps the state, warned once)."""
    rng_kw = takes_rng(loss)
    warned: list[bool] = []

    def run(params: Any, batch: Any, state: Any, key: Any) -> tuple[Any, Any]:
        variables = {**params, **state} if collections else params
        try:
            out = loss(variables, as_tree(batch), **({"rng": key} if rng_kw else {}))
        except flax_errors.InvalidRngError as e:
            raise _no_rng_error(name, rng_kw, e) from e
        if not collections:
            return out, None
        if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], Mapping)):
            if not warned:
                warned.append(True)
                warnings.warn(
                    f"describe({name}): the loss returns no updated state, so the model's "
                    f"{'/'.join(collections)} collections stay as initialised; return "
                    "`(loss, updates)` from `module.apply(variables, x, "
                    f"mutable={list(collections)})` to update them",
                    stacklevel=2,
                )
            return out, state
        value, updates = out
        return value, _updated_state(state, dict(updates), name)

    return run


def _no_rng_error(name: str, rng_kw: bool, e: Exception) -> ModelError:
    """The error for a linen loss whose ``apply`` draws from an RNG stream it was
    not given (flax's ``InvalidRngError``)."""
    given = (
        "a loss with rng= whose apply does not pass it for every stream"
        if rng_kw
        else "a loss without an rng argument"
    )
    return ModelError(
        op=f"describe({name})",
        must="a linen loss that draws random numbers (nn.Dropout) takes the step's key as "
        "rng= and hands it to apply",
        given=f"{given}: {str(e).splitlines()[0]}",
        fix="def loss(variables, batch, rng): ... module.apply(variables, x, "
        "rngs={'dropout': rng}) (train and sk.train_step pass a fresh key each step)",
    )


def _updated_state(state: dict, updates: dict, name: str) -> dict:
    """The state with the collections a linen loss returned swapped in."""
    unknown = sorted(set(updates) - set(state))
    if unknown:
        raise ModelError(
            op=f"describe({name})",
            must="a loss returning (loss, updates) returns mutable collections of the model",
            given=f"updates for {unknown}; the model's state collections are {sorted(state)}",
            fix="return the second value of module.apply(..., mutable=[...]) as is; "
            "aux values go with the loss: ((loss, aux), updates)",
        )
    out = {}
    for k, old in state.items():
        new = updates.get(k, old)
        if jax.tree.structure(new) != jax.tree.structure(old):
            raise ModelError(
                op=f"describe({name})",
                must=f"the updated {k!r} collection has the variables the model initialised",
                given=f"{jax.tree.structure(new)}",
                fix=f"return module.apply(..., mutable={list(state)})'s updates unchanged",
            )
        out[k] = new
    return out


# -- the losses a described model hands on ---------------------------------------------------


def model_losses(
    run: Run, *, abstract_state: Any, rng: bool, name: str
) -> tuple[Callable[..., Any], Callable[..., Any] | None]:
    """``(loss_fn, state_loss_fn)``, the planner's losses (module docstring):
    ``loss_fn(params, batch) -> loss`` on placeholder state, and, for a model
    with state, ``state_loss_fn(params, batch, state) -> (loss, new_state)``.
    Both drop aux and draw from placeholder keys (noted:
    :func:`spmdkit.step.loss.note_placeholder_key`, so ``sk.jit`` refuses a step that
    would run them)."""

    def key() -> Any:
        if not rng:
            return None
        note_placeholder_key(f"{name}: info.loss_fn")
        return jax.random.key(0)

    def loss_fn(params: Any, batch: Any) -> Any:
        state = placeholders(abstract_state) if abstract_state is not None else None
        return split_value(run(params, batch, state, key())[0])[0]

    if abstract_state is None:
        return _stands_in(loss_fn, f"{name}: info.loss_fn", rng=rng, state=False), None

    def state_loss_fn(params: Any, batch: Any, state: Any) -> tuple[Any, Any]:
        out, new_state = run(params, batch, state, key())
        return split_value(out)[0], new_state

    return (
        _stands_in(loss_fn, f"{name}: info.loss_fn", rng=rng, state=True),
        _stands_in(state_loss_fn, f"{name}: info.state_loss_fn", rng=rng, state=True),
    )


_STAND_IN = "_spmdkit_stands_in"


def _stands_in(fn: Callable, where: str, *, rng: bool, state: bool) -> Callable:
    """Mark a planner's loss that stands in for the train loss (placeholder keys
    or state), so the training loop can refuse it by name."""
    if rng or state:
        setattr(fn, _STAND_IN, where)
    return fn


def planner_stand_in(fn: Any) -> str | None:
    """Where ``fn`` comes from when it is a planner's loss (``info.loss_fn``,
    ``info.state_loss_fn``) of a model with state or RNG: a trace on
    placeholders that a training loop must not run; None for any other function.

    Example::

        >>> planner_stand_in(info.loss_fn)  # a model with nnx.Dropout
        'MLP: info.loss_fn'
    """
    where = getattr(fn, _STAND_IN, None)
    return where if isinstance(where, str) else None


def train_loss(run: Run, *, stateful: bool, rng: bool, aux: bool, name: str) -> Loss:
    """The :class:`~spmdkit.step.loss.Loss` a train step runs: ``fn(params, batch[,
    state][, key])`` with the loss's aux and the new state as they are."""

    def fn(params: Any, batch: Any, *rest: Any) -> Any:
        state = rest[0] if stateful else None
        key = rest[-1] if rng else None
        out, new_state = run(params, batch, state, key)
        value, extra = split_value(out)
        value = (value, extra) if aux else value
        return (value, new_state) if stateful else value

    return Loss(fn, has_state=stateful, has_aux=aux, rng=rng, name=name)
