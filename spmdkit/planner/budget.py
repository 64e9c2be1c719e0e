"""When nothing fits: the error ``sk.plan(..., "auto")`` raises, and what to change.

Auto ranks candidates that fit the memory budget by step time and, when none
fits, by memory. Returning the nearest plan that cannot run only moves the
failure to the first step (an out-of-memory after minutes of compilation), so
:func:`over_budget_error` turns it into an
:class:`~spmdkit.planner.logical.OverBudgetError` that names the closest
candidates, their memory per device, and the levers that would make the closest
one fit, sized from its memory breakdown (the analytic model's shares, scaled to
its estimate):

- **fewer sequences per device**, when its activations exceed the excess (they
  scale with the sequences a device holds);
- **more devices**, when sharding its parameters, gradients and optimizer state
  further would free enough (they scale with one over the devices they are
  sharded over, where the axes divide them);
- **optimizer offload**, when it keeps its optimizer state on the device and
  that state exceeds the excess;
- **pipelines**, when they were not searched and the model has a layer stack.

``allow_over_budget=True`` returns the closest plan instead (with a warning).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from spmdkit.planner.candidates import Candidate
from spmdkit.planner.logical import OverBudgetError
from spmdkit.planner.plans import Cost
from spmdkit.util import fmt_bytes

__all__ = ["CLOSEST", "Budget", "faster_fits", "over_budget_error", "shrink_rest"]

#: How many of the closest candidates the error names.
CLOSEST = 3

#: Memory kinds that shrink with more devices to shard over.
_STATE = ("params", "grads", "opt_state", "compute_copy", "gathered_stage", "opt_update")


@dataclass(frozen=True)
class Budget:
    """What the levers are sized against: one planner's budget and problem.

    Attributes:
        bytes: the per-device memory budget.
        devices: the mesh's devices.
        batch_size: the step's global batch (sequences).
        analytic: a candidate's analytic cost (its memory by kind).
        pipelines: whether pipelines could be searched and were not.
    """

    bytes: float
    devices: int
    batch_size: int
    analytic: Callable[[Candidate], Cost]
    pipelines: bool = False


def _largest(memory: dict, n: int = 3) -> str:
    """The ``n`` largest kinds of a memory breakdown, as text (those under 1% left out)."""
    top = sorted(memory.items(), key=lambda kv: -kv[1])[:n]
    floor = 0.01 * sum(memory.values())
    return ", ".join(f"{k} {fmt_bytes(v)}" for k, v in top if v > floor)


def _levers(budget: Budget, c: Candidate) -> list[str]:
    """What would make ``c`` fit (module docstring), most direct first."""
    peak = float(c.cost.peak_bytes)
    memory = budget.analytic(c).memory
    scale = peak / max(sum(memory.values()), 1)
    acts = memory.get("activations", 0) * scale
    state = sum(memory.get(k, 0) for k in _STATE) * scale
    opt = memory.get("opt_state", 0) * scale
    excess = peak - budget.bytes
    devices, batch = budget.devices, budget.batch_size
    out = []
    if acts > excess:
        per_device = batch / devices * (1 - excess / acts)
        out.append(
            f"fewer sequences per device: about {per_device:.3g} or fewer (batch_size <= "
            f"{max(int(per_device * devices), 1)}; now {batch / devices:.3g} per device)"
        )
    if budget.bytes > peak - state:
        factor = state / (budget.bytes - (peak - state))
        out.append(
            f"more devices: about {factor:.2g}x as many ({math.ceil(devices * factor)}), "
            f"to shard its parameters, gradients and optimizer state ({fmt_bytes(state)} "
            "per device) further"
        )
    if not c.recipe.offload_opt and opt > excess:
        out.append("optimizer offload: recipe=sk.Recipe(offload_opt=True, ...)")
    if budget.pipelines:
        out.append("pipelines: pipeline='auto' (each stage holds a share of the layers)")
    return out


def over_budget_error(budget: Budget, ranked: list[Candidate]) -> OverBudgetError:
    """The :class:`OverBudgetError` for candidates ``ranked`` closest first, none
    of which fits ``budget.bytes`` (module docstring).

    Args:
        budget: the budget and what the levers are sized against.
        ranked: the candidates, nearest to fitting first (one per label).
    """
    closest = ranked[:CLOSEST]
    given = "; ".join(
        f"{c.label} needs {fmt_bytes(c.cost.peak_bytes)} ({_largest(dict(c.cost.memory))})"
        for c in closest
    )
    levers = _levers(budget, closest[0])
    fix = "make the closest fit with " + "; or ".join(levers) + "; or" if levers else ""
    fix += " pass allow_over_budget=True to get the closest plan anyway"
    return OverBudgetError(
        op="plan(strategy='auto')",
        must=f"some candidate fits the memory budget of {fmt_bytes(budget.bytes)} per device",
        given=f"none of {len(ranked)} candidates does; the closest: {given}",
        fix=fix.strip(),
        candidates=tuple((c.label, c.cost) for c in closest),
    )


def faster_fits(cands: Sequence[Candidate], room: float) -> list[Candidate]:
    """The candidates faster than the fastest that fits ``room`` and over it by no
    more than more micro-batches shrink (:func:`shrink_rest` within it): those a
    larger count could still make fit (Megatron-LM's MoE layout fits at more
    micro-batches than the FSDP plans that fit first)."""
    best = min((c.cost.step_time_s for c in cands if c.cost.peak_bytes <= room), default=0.0)
    return [
        c
        for c in cands
        if c.cost.step_time_s < best and c.cost.peak_bytes > room and shrink_rest(c.cost) <= room
    ]


def shrink_rest(cost: Cost) -> float:
    """A cost's memory less what more micro-batches change (activations, the
    expert exchange's token buffers and those its grad reads, the offloaded
    optimizer update they hide, and plain attention's score matrices)."""
    memory = cost.memory
    shrinks = ("activations", "moe_buffers", "moe_kept", "opt_update", "attention_scores")
    return cost.peak_bytes - sum(memory.get(k, 0) for k in shrinks)
