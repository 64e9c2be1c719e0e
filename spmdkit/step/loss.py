"""The loss a train step runs: its calling convention, and randomness as a step input.

A user writes one loss per model kind (:func:`spmdkit.introspect.describe`): NNX
``loss(model, batch)``, linen ``loss(variables, batch)``, a function of a params
pytree ``loss(params, batch)``; each may return ``(loss, aux)`` and take a PRNG
key as ``rng=``. Describing the model turns it into a :class:`Loss`: a pure
function of arrays with its calling convention written down, which
:func:`spmdkit.step.grad.train_step` and :func:`spmdkit.step.grad.value_and_grad` run::

    fn(params, batch[, state][, key]) -> value              # value: loss, or (loss, aux)
    fn(params, batch, state[, key])   -> (value, new_state) # has_state

Randomness is a step input: a loss with ``rng=True`` draws its random numbers
(NNX ``Rngs`` streams, linen ``rngs={"dropout": key}``) from the key the step is
given, folded with the micro-batch index inside the step; the caller folds a
seed with the step number (``train`` does, and checkpoints the seed). A path that
would draw from one fixed key every step is refused, not run:
:func:`note_placeholder_key` records a loss traced on placeholder keys (the
planner's abstract traces do that, harmlessly) and ``sk.jit`` raises when the
step it compiles did (:func:`placeholder_keys`).
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import jax

from spmdkit.errors import SpmdError
from spmdkit.state import register_context

__all__ = [
    "Loss",
    "LossError",
    "as_loss",
    "is_key",
    "note_placeholder_key",
    "placeholder_keys",
    "takes_rng",
]


class LossError(SpmdError, TypeError):
    """A loss is called or combined against its calling convention.

    Broken example: ``sk.train_step(info, opt, plan)(params, opt_state, batch)``
    for a model with ``nnx.Dropout`` (the step needs its key:
    ``step(params, opt_state, batch, key)``).
    """


@dataclass(frozen=True)
class Loss:
    """A loss as a train step runs it (module docstring).

    Attributes:
      fn: ``fn(params, batch[, state][, key])``.
      has_state: takes the model's mutable state after the batch and returns
        ``(value, new_state)``.
      has_aux: its value is ``(loss, aux)``.
      rng: takes a PRNG key last and draws its random numbers from it.
      name: for messages.

    Example::

        >>> info = sk.describe(model, loss=loss, batch=batch)
        >>> info.train_loss
        Loss(MLP: rng, aux)
    """

    fn: Callable[..., Any]
    has_state: bool = False
    has_aux: bool = False
    rng: bool = False
    name: str = "loss"

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)

    def __repr__(self) -> str:
        flags = [
            n
            for n, on in (("state", self.has_state), ("rng", self.rng), ("aux", self.has_aux))
            if on
        ]
        return f"Loss({self.name}{': ' + ', '.join(flags) if flags else ''})"

    def check_key(self, rest: tuple, *, op: str, call: str) -> None:
        """Raise unless a loss that draws random numbers gets its key.

        Raises:
          LossError: ``rng`` and ``rest`` (the arguments after the batch and
            state) holds no PRNG key.
        """
        if self.rng and not any(is_key(x) for x in jax.tree.leaves(rest)):
            raise LossError(
                op=op,
                must="a loss that draws random numbers gets a key every step",
                given=f"{self!r} called without one",
                fix=f"pass the step's key last: {call}, key = "
                "jax.random.fold_in(jax.random.key(seed), step) (train does this)",
            )


def is_key(x: Any) -> bool:
    """Whether ``x`` is a typed PRNG key array (``jax.random.key``)."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def takes_rng(fn: Callable[..., Any]) -> bool:
    """Whether a user's loss takes a key: it has a parameter named ``rng``.

    Example::

        >>> takes_rng(lambda variables, batch, rng: ...), takes_rng(lambda m, b: ...)
        (True, False)
    """
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "rng" in params


def as_loss(loss: Any, *, has_state: bool = False, has_aux: bool = False) -> Loss:
    """A :class:`Loss` from a Loss, a described model (its ``train_loss``), or a
    plain function (with the flags given).

    Raises:
      LossError: flags given for a Loss that says otherwise.

    Example::

        >>> as_loss(info).rng, as_loss(my_loss, has_aux=True).has_aux
        (True, True)
    """
    found = getattr(loss, "train_loss", None)
    if isinstance(found, Loss):
        loss = found
    if not isinstance(loss, Loss):
        return Loss(loss, has_state=has_state, has_aux=has_aux, name=_name(loss))
    if (has_state and not loss.has_state) or (has_aux and not loss.has_aux):
        raise LossError(
            op="sk.train_step",
            must="the flags agree with the described loss",
            given=f"has_state={has_state}, has_aux={has_aux} for {loss!r}",
            fix="drop has_state= / has_aux=: a described model's loss carries its own",
        )
    return loss


def _name(fn: Any) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


# -- placeholder keys -----------------------------------------------------------------

_PLACEHOLDER: contextvars.ContextVar[list[str] | None] = register_context(
    contextvars.ContextVar("spmdkit_placeholder_keys", default=None),
    module=__name__,
    name="_PLACEHOLDER",
    set_by="`placeholder_keys()` (`sk.jit`'s check)",
    read_by="`note_placeholder_key()` (the losses), which appends",
    why="the losses traced inside the block that drew from a placeholder key.",
)


def note_placeholder_key(where: str) -> None:
    """Record that ``where`` drew random numbers from a placeholder key (a fixed
    key standing in for the step's, in an abstract trace)."""
    seen = _PLACEHOLDER.get()
    if seen is not None:
        seen.append(where)


@contextlib.contextmanager
def placeholder_keys() -> Iterator[list[str]]:
    """Collect the losses traced inside that drew from placeholder keys.

    Example::

        >>> with placeholder_keys() as seen:
        ...     jax.eval_shape(step, params, batch)
        >>> seen
        ['MLP: info.loss_fn']
    """
    seen: list[str] = []
    token = _PLACEHOLDER.set(seen)
    try:
        yield seen
    finally:
        _PLACEHOLDER.reset(token)
