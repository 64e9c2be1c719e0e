"""What :func:`~spmdkit.planner.search.plan` is asked, as two values.

A plan is searched under a *cost model* (:class:`CostModel`: how a candidate is
priced — the link and device model, the estimator, the memory budget) with
*search options* (:class:`SearchOptions`: which levers the search may pull and
how it reports — pipelines, float8, the fp32 master in the optimizer state,
over-budget plans, strict notes, logical-name aliases). Both are frozen and
validate themselves when built, so a bad option raises before any tracing;
``plan``'s keywords of the same names build them (:func:`given`).
"""

from __future__ import annotations

import contextlib
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

from spmdkit.pipeline import Pipeline, PipelineError
from spmdkit.planner.logical import ACTIVATION_ALIASES, PlanError, check_aliases
from spmdkit.topology import Topology

__all__ = ["ESTIMATORS", "CostModel", "PipelineOptionError", "SearchOptions", "given"]

Options = TypeVar("Options", "CostModel", "SearchOptions")


class PipelineOptionError(PlanError, PipelineError):
    """``pipeline=`` is none of None, ``"auto"`` or a :class:`~spmdkit.pipeline.Pipeline`:
    a bad option of the plan and a bad pipeline request both, so either is caught.

    Broken example: ``sk.plan(spec, mesh, "dp", pipeline={"stages": 2})``.
    """


#: The estimators a plan can be priced with (:class:`CostModel`).
ESTIMATORS = ("propagate", "analytic")


@dataclass(frozen=True)
class CostModel:
    """How :func:`~spmdkit.planner.search.plan` prices a candidate.

    Attributes:
      topology: the link model for collectives and the device's peak FLOP/s per
        dtype (None: :func:`~spmdkit.topology.topology_for` the mesh).
      estimator: ``"propagate"`` (the plan's cost from propagating its specs
        through the traced train step) or ``"analytic"`` (the per-parameter
        model only).
      memory_budget: per-device bytes (None: 80 GiB, one H100).
      peak_flops: per-device FLOP/s overriding the topology's achievable rates.

    Example::

        >>> costs = sk.CostModel(estimator="analytic", memory_budget=16 * 2**30)
        >>> p = sk.plan(info, mesh, cost_model=costs)  # doctest: +SKIP
    """

    topology: Topology | None = None
    estimator: str = "propagate"
    memory_budget: float | None = None
    peak_flops: float | None = None

    def __post_init__(self) -> None:
        if self.estimator not in ESTIMATORS:
            raise PlanError(
                op="plan",
                must="estimator is 'propagate' or 'analytic'",
                given=repr(self.estimator),
                fix="pass estimator='propagate' (default) or 'analytic'",
            )
        for name in ("memory_budget", "peak_flops"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, numbers.Real) or value <= 0
            ):
                raise PlanError(
                    op="plan",
                    must=f"{name} is a positive number or None",
                    given=repr(value),
                    fix=f"pass {name}=None for the default, or a positive number",
                )


@dataclass(frozen=True)
class SearchOptions:
    """What :func:`~spmdkit.planner.search.plan`'s search may do, and how it reports.

    Attributes:
      pipeline: None (no pipelines), ``"auto"`` (``strategy="auto"`` costs
        pipelined plans too) or a :class:`~spmdkit.pipeline.Pipeline`.
      aliases: logical name → logical name treated alike in every rule table,
        kept as ``(name, name)`` pairs in the order given (:attr:`alias_map`).
      allow_fp8: auto may try float8 compute.
      allow_master_weights: auto may try bf16 parameters with the fp32 master
        in the optimizer state.
      allow_over_budget: auto returns the closest plan, with a warning, when none
        fits the memory budget.
      strict: a plan with notes raises instead of warning.
      allow_local_statistics: with ``pipeline="auto"``, a pipelined candidate may
        split its batch over mesh axes although a layer combines a micro-batch's
        rows (a mixture-of-experts router's load-balancing statistics): its
        pipeline then computes them over each device's rows
        (``Pipeline(local_statistics=True)``, as Megatron-LM computes MoE load
        balancing per data-parallel rank). Off by default: the statistics, and so
        the loss, then differ from the unsplit step's, so auto never picks it
        unasked. Only through ``options`` (no ``plan`` keyword).
      measure: a step timer, ``timer(plans) -> seconds`` (one measured step time
        per plan, in order): ``strategy="auto"`` then times up to
        ``measure_candidates`` of its candidates and keeps the fastest measured
        (:mod:`spmdkit.planner.measured`, with a ``measured`` note). None (default):
        the priced pick. :func:`spmdkit.tune` passes one that compiles and runs
        each plan's train step on the mesh's devices. Only through ``options``.
      measure_candidates: how many candidates a ``measure`` timer gets at most
        (auto's priced pick, then the best of each preset, then the runner-ups).

    Example::

        >>> opts = sk.SearchOptions(pipeline="auto", aliases={"q_heads": "heads"})
        >>> p = sk.plan(info, mesh, options=opts)  # doctest: +SKIP
    """

    pipeline: Pipeline | str | None = None
    aliases: tuple[tuple[str, str], ...] = field(default=())
    allow_fp8: bool = False
    allow_master_weights: bool = False
    allow_over_budget: bool = False
    strict: bool = False
    allow_local_statistics: bool = False
    measure: Callable[[Sequence[Any]], Sequence[float]] | None = field(default=None, compare=False)
    measure_candidates: int = 8

    def __post_init__(self) -> None:
        if self.measure is not None and not callable(self.measure):
            raise PlanError(
                op="plan",
                must="measure is None or a callable timer(plans) -> seconds",
                given=type(self.measure).__name__,
                fix="pass spmdkit.tune(...) to time auto's candidates, or leave measure None",
            )
        n = self.measure_candidates
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise PlanError(
                op="plan",
                must="measure_candidates is a positive int",
                given=repr(n),
                fix="pass e.g. measure_candidates=8",
            )
        pairs = self.aliases
        if isinstance(pairs, (tuple, list)):
            with contextlib.suppress(TypeError, ValueError):  # check_aliases says what
                pairs = dict(pairs)
        object.__setattr__(self, "aliases", tuple(check_aliases(pairs).items()))
        if self.pipeline is not None and not (
            self.pipeline == "auto" or isinstance(self.pipeline, Pipeline)
        ):
            raise PipelineOptionError(
                op="plan",
                must="pipeline is None, 'auto' or a spmdkit.Pipeline",
                given=repr(self.pipeline),
                fix="pass pipeline='auto' or Pipeline(stages=..., microbatches=...)",
            )

    @property
    def alias_map(self) -> dict[str, str]:
        """Every alias the planner applies: MaxText's activation names
        (:data:`~spmdkit.planner.logical.ACTIVATION_ALIASES`), then :attr:`aliases`."""
        return {**ACTIVATION_ALIASES, **dict(self.aliases)}


def given(value: Options | None, built: Options) -> Options:
    """``value``, or where it is None ``built`` (the value ``plan``'s keywords of
    the same names make): the thin layer that keeps those keywords working.

    Raises:
      PlanError: ``value`` is not of ``built``'s type, or it is given with one of
        its keywords set off its default.
    """
    cls = type(built)
    if value is None:
        return built
    if not isinstance(value, cls):
        raise PlanError(
            op="plan",
            must=f"the value is a spmdkit.{cls.__name__}",
            given=type(value).__name__,
            fix=f"pass sk.{cls.__name__}(...) or its fields as keywords",
        )
    default = cls()
    clash = [f.name for f in fields(cls) if getattr(built, f.name) != getattr(default, f.name)]
    if clash:
        raise PlanError(
            op="plan",
            must=f"each option given once: as a {cls.__name__} field or as a keyword",
            given=f"a {cls.__name__} and the keywords {', '.join(clash)}",
            fix=f"set {', '.join(clash)} in the {cls.__name__} only",
        )
    return value
