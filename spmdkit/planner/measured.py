"""Auto's pick by measured step time: the priced ranking checked on the devices.

A price is a model of the hardware; on a mesh of real devices the step itself
can be timed. With a step timer in :class:`~spmdkit.planner.options.SearchOptions`
(``measure``; :func:`spmdkit.tune` passes one that compiles and runs each plan's
train step), ``strategy="auto"`` ranks its candidates by price as always, then
takes a short list of them (:func:`measured_pool`): its priced pick, the best
candidate of every preset that fits the memory budget (presets the price ranks
too far down to propagate included: the price is what is being checked), then
its other runner-ups in ranked order, one per distinct layout. The timer runs
each; the fastest measured is the plan, and a ``measured`` note gives every
timed candidate's price and measured step, so a price that ranked them in
another order is visible.

The timer is a plain callable, so the planner itself never compiles or runs
anything (:mod:`spmdkit.compile.tune` owns the timing).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from spmdkit.planner.candidates import Candidate
from spmdkit.planner.logical import PRESETS, PlanError
from spmdkit.planner.notes import PlanNote
from spmdkit.util import fmt_time

if TYPE_CHECKING:
    from spmdkit.planner.plans import Plan

__all__ = ["StepTimer", "check_timings", "measured_choice", "measured_note", "measured_pool"]

#: ``timer(plans) -> seconds``: one measured step time per plan, in order.
StepTimer = Callable[[Sequence["Plan"]], Sequence[float]]


def measured_pool(
    best: Candidate,
    others: Sequence[Candidate],
    extra: Sequence[Candidate],
    budget: float,
    limit: int,
    layout: Callable[[Candidate], object],
) -> list[Candidate]:
    """The candidates auto times, at most ``limit``: ``best``, the best-ranked
    candidate of each preset within ``budget`` (from ``others``, ranked, then from
    ``extra``: those the price left unpropagated, in their order), then the rest of
    ``others`` within budget, ranked; one per ``layout(candidate)`` (two names that
    lay every array out alike compile one program)."""
    fits = [c for c in others if c.cost.peak_bytes <= budget]
    spare = [c for c in extra if c.cost.peak_bytes <= budget]
    out: list[Candidate] = []
    seen: set = set()

    def add(c: Candidate) -> None:
        if len(out) >= limit:
            return  # a full pool builds no more plans
        key = layout(c)
        if key not in seen:
            seen.add(key)
            out.append(c)

    add(best)
    for name in PRESETS:
        c = next((c for c in [*fits, *spare] if c.name == name), None)
        if c is not None:
            add(c)
    for c in fits:
        add(c)
    return out


def check_timings(seconds: Sequence[float], plans: int) -> list[float]:
    """The timer's answer as floats, one positive finite time per plan.

    Raises:
      PlanError: another count, or a time that is not a positive finite number.
    """
    out = [float(s) for s in seconds]
    bad = [s for s in out if not (s > 0 and s != float("inf"))]
    if len(out) != plans or bad:
        raise PlanError(
            op="plan(strategy='auto', measure=...)",
            must="the step timer returns one positive, finite step time per plan given",
            given=f"{len(out)} times for {plans} plans" + (f", bad: {bad[:3]}" if bad else ""),
            fix="return a list of seconds in the order of the plans (spmdkit.tune's timer does)",
        )
    return out


def measured_note(
    timed: Sequence[Candidate], seconds: Sequence[float], chosen: int, priced: int
) -> list[PlanNote]:
    """The ``measured`` note: each timed candidate's priced and measured step, the
    chosen one (``chosen``, an index of ``timed``) and the priced pick's
    (``priced``)."""
    rows = "; ".join(
        f"{c.label}: priced {fmt_time(c.cost.step_time_s)}, measured {fmt_time(s)}"
        for c, s in zip(timed, seconds, strict=True)
    )
    if chosen == priced:
        head = f"auto timed {len(timed)} candidates on the mesh's devices and kept its priced pick"
    else:
        head = (
            f"auto timed {len(timed)} candidates on the mesh's devices and chose "
            f"{timed[chosen].label!r} ({fmt_time(seconds[chosen])} a step) over its priced pick "
            f"{timed[priced].label!r} ({fmt_time(seconds[priced])})"
        )
    return [
        PlanNote(
            "measured",
            f"{head} ({rows}).",
            "nothing to do; the plan's cost is still its price (plan.cost), and "
            "sk.plan(..., 'auto') without a timer keeps the priced pick",
        )
    ]


def _layout_key(plan: Plan) -> tuple:
    """What a step compiled for ``plan`` depends on: every array's layout, the
    recipe, the pipeline and the context axes (dp and ep on a model without
    experts lay every array out alike and compile one program)."""
    tables = (plan.params, plan.opt, plan.grads, plan.state, plan.activation)
    return (
        *(tuple(sorted((k, str(v)) for k, v in t.items())) for t in tables),
        str(plan.mesh.shape),
        plan.recipe,
        str(plan.pipeline),
        str(plan.context),
    )


def measured_choice(
    best: Candidate,
    others: Sequence[Candidate],
    extra: Sequence[Candidate],
    *,
    budget: float,
    limit: int,
    build: Callable[[Candidate], Plan],
    recost: Callable[[Candidate], Candidate] | None,
    timer: StepTimer,
) -> tuple[Candidate, list[Candidate], list[PlanNote]]:
    """Auto's pick by ``timer`` (module docstring): the fastest measured of
    :func:`measured_pool` (``extra``'s candidates re-costed by ``recost`` first, so
    every timed one shows the same kind of price), the runner-ups with the priced
    pick first, and the ``measured`` note. ``build`` makes a candidate's plan."""
    built: dict[int, Plan] = {}

    def plan_of(c: Candidate) -> Plan:
        if id(c) not in built:
            built[id(c)] = build(c)
        return built[id(c)]

    pool = measured_pool(best, others, extra, budget, limit, lambda c: _layout_key(plan_of(c)))
    spare = {id(c) for c in extra}
    if recost is not None:
        pool = [recost(c) if id(c) in spare else c for c in pool]
    seconds = check_timings(timer([plan_of(c) for c in pool]), len(pool))
    fastest = min(range(len(pool)), key=lambda i: (seconds[i], i))
    pick = pool[fastest]
    rest = [best, *(c for c in others if c.label != pick.label)] if fastest else list(others)
    return pick, rest, measured_note(pool, seconds, fastest, 0)
