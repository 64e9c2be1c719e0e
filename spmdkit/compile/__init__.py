"""Compile: ``sk.jit`` (a plan's shardings and donation) and the enforced replay.

Stage 4 of the pipeline (trace → propagate → plan → **enforce/compile** → verify
→ run). A :class:`PlannedFunction` verifies itself (``step.verify``, what
``plan.verify`` runs) through :mod:`spmdkit.verification`; ``verify_plan`` is
re-exported from there for callers of its old place.
"""

from spmdkit.compile.jit import ROLES, STATE_ROLES, PlannedFunction, infer_role, jit
from spmdkit.verification.verify import verify_plan

__all__ = ["ROLES", "STATE_ROLES", "PlannedFunction", "infer_role", "jit", "verify_plan"]
