"""Propagation: a traced step's equations → the rule registry → a spec for every value.

Stage 2 of the pipeline (trace → **propagate** → plan → enforce/compile → verify
→ run). :func:`propagate` flattens a step's jaxpr, asks the registry for each
equation's rule, chooses layouts and the reshards between them, and returns a
:class:`Propagation`: per-equation records, collective bytes, memory and the
program the enforced replay runs.

Modules, in import order (each imports only those above it):
``graph`` (tracing, the flattened program IR), ``steps`` (the propagator's
per-equation hand-off), ``primitives`` (primitive → registered rule),
``pricing`` (reshard and FLOP costs), ``control`` (scan / while / cond),
``choose`` (alternatives and hints), ``propagator`` (the forward sweep),
``pinning`` (what the enforced replay pins), ``memory`` (liveness),
``cse`` (which values XLA computes once), ``records`` (EqnRecord, Propagation),
``driver`` (:func:`propagate`).
"""

from spmdkit.propagation.driver import propagate
from spmdkit.propagation.graph import trace, trace_with_tree
from spmdkit.propagation.memory import MemoryEstimate, estimate_memory, liveness
from spmdkit.propagation.pinning import Program
from spmdkit.propagation.records import EqnRecord, Propagation

__all__ = [
    "EqnRecord",
    "MemoryEstimate",
    "Program",
    "Propagation",
    "estimate_memory",
    "liveness",
    "propagate",
    "trace",
    "trace_with_tree",
]
