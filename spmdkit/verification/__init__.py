"""Verification: read the compiled program back and compare it with the prediction.

Stage 5 of the pipeline (trace → propagate → plan → enforce/compile → **verify**
→ run). ``hlo`` parses collectives out of compiled HLO text, ``report``
summarizes a compiled step (collectives, bytes, memory) and compares it with a
:class:`~spmdkit.propagation.Propagation`; ``verify`` runs that comparison for a
step compiled by ``sk.jit`` (what ``plan.verify`` does).
"""

# The ``verify`` module is imported before the ``verify`` function so that the
# package attribute ``verify`` is the function (importing a submodule sets the
# package attribute of its name).
from spmdkit.verification.verify import PlannedProgram, as_on_cpu, verify_plan  # isort: skip
from spmdkit.verification.hlo import (
    HloCollective,
    check_plan,
    compiled_collectives,
    parse_collectives,
    parse_replica_groups,
    summarize,
)
from spmdkit.verification.report import CompiledReport, VerifyReport, executions, report, verify

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
