"""Planner: logical-axis rules, presets, plans as plain data, their cost, the search.

Stage 3 of the pipeline (trace → propagate → **plan** → enforce/compile → verify
→ run). :func:`plan` turns a described model and a mesh into a :class:`Plan`:
specs for every parameter, optimizer state and activation boundary, with its
estimated :class:`Cost`.
"""

from spmdkit.planner.plan import (
    BATCH_NAMES,
    PARAM_NAMES,
    PRESETS,
    Cost,
    LogicalRules,
    Plan,
    PlanError,
    UnknownLogicalAxisError,
    axis_roles,
    plan,
    preset_rules,
)

__all__ = [
    "BATCH_NAMES",
    "PARAM_NAMES",
    "PRESETS",
    "Cost",
    "LogicalRules",
    "Plan",
    "PlanError",
    "UnknownLogicalAxisError",
    "axis_roles",
    "plan",
    "preset_rules",
]
