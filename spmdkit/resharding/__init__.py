"""Resharding: moving a tensor from one spec to another.

``plan`` searches the cheapest order of collectives between two specs and
prices it under a :class:`~spmdkit.topology.Topology`; ``execute`` runs a plan
on a ``jax.Array`` with one ``shard_map`` collective per step.
"""

from spmdkit.resharding.execute import empty_array, reshard, run_plan, step_fn
from spmdkit.resharding.plan import (
    KINDS,
    Collective,
    ReshardPlan,
    clear_cache,
    plan_reshard,
)

__all__ = [
    "KINDS",
    "Collective",
    "ReshardPlan",
    "clear_cache",
    "empty_array",
    "plan_reshard",
    "reshard",
    "run_plan",
    "step_fn",
]
