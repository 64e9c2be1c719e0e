"""Propagation: a traced step's equations → the rule registry → a spec for every value.

Stage 2 of the pipeline (trace → **propagate** → plan → enforce/compile → verify
→ run). :func:`propagate` flattens a step's jaxpr, asks the registry for each
equation's rule, chooses layouts and the reshards between them, and returns a
:class:`Propagation`: per-equation records, collective bytes, memory and the
program the enforced replay runs.
"""

from spmdkit.propagation.engine import (
    EqnRecord,
    Program,
    Propagation,
    propagate,
    register_primitive,
    trace,
    trace_with_tree,
)
from spmdkit.propagation.memory import MemoryEstimate, estimate_memory, liveness

__all__ = [
    "EqnRecord",
    "MemoryEstimate",
    "Program",
    "Propagation",
    "estimate_memory",
    "liveness",
    "propagate",
    "register_primitive",
    "trace",
    "trace_with_tree",
]
