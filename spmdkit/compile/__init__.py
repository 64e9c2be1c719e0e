"""Compile: a plan turned into JAX: sharded parameters, ``sk.jit``, the enforced replay.

Stage 4 of the pipeline (trace → propagate → plan → **annotate/compile** →
verify → run). ``annotate`` creates parameters with the plan's shardings
(``sk.init_sharded``, ``@sk.shard``); ``jit`` compiles a step with the plan's
shardings and donation; ``enforce`` replays it with every propagated layout
pinned. A :class:`PlannedFunction` verifies itself (``step.verify``, what
``plan.verify`` runs) through :mod:`spmdkit.verification`; ``verify_plan`` is
re-exported from there for callers of its old place.
"""

from spmdkit.compile.annotate import init_sharded, shard
from spmdkit.compile.function import (
    ROLES,
    STATE_ROLES,
    PlannedFunction,
    UnplannedBatchWarning,
    infer_role,
    jit,
)
from spmdkit.verification.planned import verify_plan

__all__ = [
    "ROLES",
    "STATE_ROLES",
    "PlannedFunction",
    "UnplannedBatchWarning",
    "infer_role",
    "init_sharded",
    "jit",
    "shard",
    "verify_plan",
]
