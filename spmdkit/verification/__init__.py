"""Verification: read the compiled program back and compare it with the prediction.

Stage 5 of the pipeline (trace → propagate → plan → enforce/compile → **verify**
→ run). ``hlo`` parses collectives out of compiled HLO text, ``report``
summarizes a compiled step (collectives, bytes, memory) and compares it with a
:class:`~spmdkit.propagation.Propagation`; ``planned`` runs that comparison for a
step compiled by ``sk.jit`` (what ``plan.verify`` does); ``snapshots`` checks a
plan against a stored ``plan.snapshot`` (``spmdkit.testing.assert_plan_matches``).
"""

from spmdkit.verification.compiled import CompiledReport, VerifyReport, executions, report, verify
from spmdkit.verification.hlo import (
    HloCollective,
    check_plan,
    compiled_collectives,
    parse_collectives,
    parse_replica_groups,
    summarize,
)
from spmdkit.verification.planned import PlannedProgram, as_on_cpu, verify_plan

__all__ = [
    "CompiledReport",
    "HloCollective",
    "PlannedProgram",
    "VerifyReport",
    "as_on_cpu",
    "check_plan",
    "compiled_collectives",
    "executions",
    "parse_collectives",
    "parse_replica_groups",
    "report",
    "summarize",
    "verify",
    "verify_plan",
]
