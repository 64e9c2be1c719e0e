"""The one interface every lever of the step implements: a pass ``Step -> Step``.

:class:`Step` is the train step as the passes before one built it: the user's
loss as they rewrote it (``fn``), the gradient once a pass made one (``grad``),
the optimizer update (``update``), and what every pass reads: the
:class:`~spmdkit.step.recipe.Recipe`, the plan (a :class:`StepPlan`, or ``None``
for a bare recipe) and the :class:`~spmdkit.step.loss.Loss` the user gave. A
:class:`Pass` names one lever's function; :data:`spmdkit.step.grad.ORDER` lists
them in the order they apply, and :func:`run` applies them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, runtime_checkable

from jax.sharding import PartitionSpec

from spmdkit.context_parallel import ContextSplit
from spmdkit.pipeline import Pipeline
from spmdkit.spec import MeshLike
from spmdkit.step.loss import Loss
from spmdkit.step.recipe import Recipe

__all__ = ["Pass", "Step", "StepPlan", "run"]


@runtime_checkable
class StepPlan(Protocol):
    """What the step reads of a plan: :class:`spmdkit.planner.plans.Plan` is one.

    The step sits below the planner (the planner traces the step it plans), so it
    names the plan by what it reads, not by its class.
    """

    @property
    def recipe(self) -> Recipe: ...
    @property
    def pipeline(self) -> Pipeline | None: ...
    @property
    def grads(self) -> Mapping[str, PartitionSpec]: ...
    @property
    def opt(self) -> Mapping[str, PartitionSpec]: ...
    @property
    def activation(self) -> Mapping[str, tuple[str, ...]]: ...
    @property
    def batch_axes(self) -> Mapping[str, tuple]: ...
    @property
    def context(self) -> ContextSplit | None: ...
    @property
    def sharding_mesh(self) -> MeshLike: ...
    @property
    def info(self) -> Mapping[str, tuple]: ...
    def param_specs(self, abstract_params: Any) -> Any: ...
    def grad_specs(self, abstract_params: Any) -> Any: ...
    def opt_specs(self, abstract_opt_state: Any) -> Any: ...


@dataclass(frozen=True)
class Step:
    """The train step as the passes so far built it (module docstring).

    Attributes:
      recipe: the levers to apply.
      loss: the user's loss as given (state, aux, key: its form).
      fn: ``fn(params, batch, *rest)``, the loss as the passes so far rewrote it.
      plan: the plan the step runs, or ``None`` for a bare recipe.
      grad: ``grad(params, batch, *rest) -> (value, grads)`` once a pass made it.
      optimizer: the optax ``GradientTransformation`` (``None``: gradients only).
      update: ``update(params, opt_state, grads) -> (params, opt_state)`` with an
        optimizer.
      grad_specs: the gradient layouts given (``None``: the plan's, if any).
      for_update: the gradients feed the optimizer update (``sk.train_step``).
    """

    recipe: Recipe
    loss: Loss
    fn: Callable[..., Any]
    plan: StepPlan | None = None
    grad: Callable[..., Any] | None = None
    optimizer: Any = None
    update: Callable[..., Any] | None = None
    grad_specs: Any = None
    for_update: bool = False

    @property
    def pipeline(self) -> Pipeline | None:
        """The plan's pipeline, if it pipelines its layers."""
        return None if self.plan is None else self.plan.pipeline


class Pass(NamedTuple):
    """One lever of the step: its name and its function ``Step -> Step``."""

    name: str
    apply: Callable[[Step], Step]


def run(passes: Sequence[Pass], step: Step) -> Step:
    """``step`` with ``passes`` applied in order, each to what the one before built.

    Example::

        >>> run((Pass("double", lambda s: dataclasses.replace(s, fn=twice(s.fn))),), step)
    """
    for p in passes:
        step = p.apply(step)
    return step
