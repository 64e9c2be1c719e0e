"""Compile: ``sk.jit`` (a plan's shardings and donation) and the enforced replay.

Stage 4 of the pipeline (trace → propagate → plan → **enforce/compile** → verify
→ run).
"""

from spmdkit.compile.jit import ROLES, PlannedFunction, infer_role, jit, verify_plan

__all__ = ["ROLES", "PlannedFunction", "infer_role", "jit", "verify_plan"]
