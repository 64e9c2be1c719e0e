"""Planner: logical-axis rules, presets, plans as plain data, their cost, the search.

Stage 3 of the pipeline (trace → propagate → **plan** → enforce/compile → verify
→ run). :func:`plan` turns a described model and a mesh into a :class:`Plan`:
specs for every parameter, optimizer state and activation boundary, with its
estimated :class:`Cost`.

Modules: ``logical`` (rule tables, presets, axis roles), ``naming`` (a logical
name for every parameter: given by path, the model's, or inferred from the
traced loss; the tensor-parallel placement check), ``plans`` (``Plan`` and
``Cost`` as plain data: shardings, JSON, the printed table), ``analytic`` (the
per-parameter cost model), ``trace`` (the train step traced once per model),
``candidates`` (the layouts considered and their cost by propagation),
``notes`` (what a plan does that nobody asked for, as ``PlanNote`` s),
``options`` (``CostModel`` and ``SearchOptions``: what ``plan`` is asked),
``provenance`` (what a plan's layouts and cost are made of, per group),
``explain`` (``plan.explain``), ``compare`` (:func:`diff`: two plans compared),
``search`` (:func:`plan` and the search), ``pipeline`` (pipelined plans: the
pipe meshes and configurations searched, their cost, the plan).
"""

from spmdkit.planner.compare import PlanDiff, diff
from spmdkit.planner.logical import (
    BATCH_NAMES,
    PARAM_NAMES,
    PRESETS,
    LogicalRules,
    OverBudgetError,
    PlanError,
    UnknownLogicalAxisError,
    axis_roles,
    preset_rules,
)
from spmdkit.planner.notes import PlanNote, PlanNoteError, PlanNoteWarning
from spmdkit.planner.options import CostModel, SearchOptions
from spmdkit.planner.plans import Cost, Plan, PlannedStep
from spmdkit.planner.search import plan

__all__ = [
    "BATCH_NAMES",
    "PARAM_NAMES",
    "PRESETS",
    "Cost",
    "CostModel",
    "LogicalRules",
    "OverBudgetError",
    "Plan",
    "PlanError",
    "PlanNote",
    "PlanNoteError",
    "PlanDiff",
    "PlanNoteWarning",
    "PlannedStep",
    "SearchOptions",
    "UnknownLogicalAxisError",
    "axis_roles",
    "diff",
    "plan",
    "preset_rules",
]
