"""``sk.tune``: auto's plan, its candidates timed on the mesh's own devices.

``sk.plan(model, mesh, "auto")`` ranks layouts by a price: a model of the devices'
compute, memory and links. Where the mesh is made of real devices, the step can be
run instead of modelled. :func:`tune` plans with ``strategy="auto"`` and a step
timer (:class:`~spmdkit.planner.options.SearchOptions`'s ``measure``; the planner's
side is :mod:`spmdkit.planner.measured`): auto's priced pick, the best candidate of
each preset that fits the memory budget and auto's other runner-ups (one per
distinct layout, at most ``candidates``) are each compiled as ``train`` runs them
(``sk.jit(sk.train_step(info, optimizer, plan), plan, donate_state=True)``) and
timed, and the fastest measured is returned, with a ``measured`` note listing each
one's price and measured step.

Each candidate is timed in its own block with only its own arrays alive: its
parameters, optimizer state (and model state) built with its shardings, ``warmup``
untimed steps, then ``steps`` timed steps, each fed the previous one's outputs (the
state donated, as in training); then its arrays are dropped before the next one's
are built, so a step's temporaries reuse freed pages as they do in a training
process that holds one plan, and a large model's candidates never share the
devices' memory. A block runs at least ``steps`` timed steps and at least
``min_time_s`` seconds of them, as ``timeit`` sizes its loops, so a step of a few
milliseconds is timed over many steps rather than three. The candidates are timed
in ``passes`` passes, the order reversed each pass (each step compiled once), and
compared pass by pass (:func:`paired_scores`): in each pass a candidate's median
step over the geometric mean of all candidates' median steps in that pass, and
the median of those ratios over the passes. The median within a pass keeps its
stray slow steps out; the ratio within a pass cancels a load that comes and goes
during the run (it slows every block of a pass alike); the median over passes
keeps out the pass whose block the host's other work disturbed. Candidates that
score within ``runoff`` of the fastest are then timed again among themselves, in
as many passes, and that runoff orders them. Timing costs a compile
per candidate: tune on the mesh you will train on, once per model and batch shape.

:func:`time_plans` is the timer, usable on any list of plans of one model.
"""

from __future__ import annotations

import gc
import resource
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh

from spmdkit.compile.annotate import init_sharded
from spmdkit.compile.function import jit
from spmdkit.errors import SpmdError
from spmdkit.introspect import ModelInfo, describe
from spmdkit.planner import Plan
from spmdkit.planner import plan as make_plan
from spmdkit.planner.options import CostModel, SearchOptions
from spmdkit.step.grad import train_step
from spmdkit.step.master import opt_init
from spmdkit.step.recipe import Recipe

__all__ = ["StepTimes", "paired_scores", "time_plans", "timed_step", "tune", "with_runoff"]


@dataclass(frozen=True)
class StepTimes:
    """One plan's timed steps: per step the wall-clock seconds, the process's CPU
    seconds, its system CPU seconds and its minor page faults; ``per_pass`` is how
    many of the steps each pass timed, in order (empty: one pass)."""

    wall: tuple[float, ...]
    cpu: tuple[float, ...]
    sys: tuple[float, ...]
    faults: tuple[float, ...]
    per_pass: tuple[int, ...] = ()

    @property
    def median_s(self) -> float:
        """The median wall-clock step."""
        return statistics.median(self.wall)

    @property
    def best_s(self) -> float:
        """The least wall-clock step: the one other work on the host disturbed least."""
        return min(self.wall)

    def pass_medians(self, clock: str = "wall") -> tuple[float, ...]:
        """Each pass's median step on ``clock`` (``"wall"``, ``"cpu"``, ``"sys"`` or
        ``"faults"``), in order."""
        values = getattr(self, clock)
        out, start = [], 0
        for n in self.per_pass or (len(values),):
            out.append(statistics.median(values[start : start + n]))
            start += n
        return tuple(out)

    @property
    def pass_medians_s(self) -> tuple[float, ...]:
        """Each pass's median wall-clock step, in order."""
        return self.pass_medians("wall")

    @property
    def score_s(self) -> float:
        """The least of the passes' median steps: the median keeps a pass's stray
        slow steps out, the least the pass the host's other work disturbed most
        (one plan alone; :func:`paired_scores` compares plans timed together)."""
        return min(self.pass_medians_s)


def paired_scores(timed: Sequence[StepTimes], clock: str = "wall") -> list[float]:
    """Each plan's step, compared with the others' in the same passes (what
    :func:`tune` ranks by): in each pass, a plan's median step over the geometric
    mean of every plan's median step in that pass; a plan's score is the median of
    those ratios over the passes, times the median pass's geometric mean (so it
    reads as seconds). A load that comes and goes moves every plan's steps of a pass
    alike and cancels in the ratio; the median over passes keeps out a pass that
    one plan's block had disturbed.

    Args:
      timed: plans timed in the same passes (:func:`time_plans`' answer).
      clock: ``"wall"`` or ``"cpu"`` (as :meth:`StepTimes.pass_medians`).

    Raises:
      SpmdError: the plans were timed in different numbers of passes.

    Example::

        >>> a = StepTimes((1.0, 2.0), (0, 0), (0, 0), (0, 0), per_pass=(1, 1))
        >>> b = StepTimes((2.0, 4.0), (0, 0), (0, 0), (0, 0), per_pass=(1, 1))
        >>> [round(s, 3) for s in paired_scores([a, b])]
        [1.5, 3.0]
    """
    medians = [t.pass_medians(clock) for t in timed]
    if not medians:
        return []
    passes = {len(m) for m in medians}
    if len(passes) != 1:
        raise SpmdError(
            op="paired_scores",
            must="every plan was timed in the same passes",
            given=f"pass counts {sorted(passes)}",
            fix="score the answer of one time_plans call",
        )
    means = [_geomean([m[k] for m in medians]) for k in range(passes.pop())]
    scale = statistics.median(means)
    return [
        scale * statistics.median(x / g for x, g in zip(m, means, strict=True)) for m in medians
    ]


def _example_batch(info: ModelInfo, batch: Any) -> Any:
    """``batch`` if it holds arrays, else zeros of the described (abstract) batch:
    token ids and labels of 0 are valid, and the step's work does not depend on the
    values."""
    leaves = jax.tree.leaves(batch)
    if leaves and not any(isinstance(x, jax.ShapeDtypeStruct) for x in leaves):
        return batch
    return jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), info.batch)


def timed_step(
    info: ModelInfo,
    plan: Plan,
    optimizer: optax.GradientTransformation,
    batch: Any,
    step: Callable[..., Any] | None = None,
    *,
    donate: bool = True,
) -> Callable[[], Any]:
    """A one-step call of ``sk.jit(sk.train_step(info, optimizer, plan), plan,
    donate_state=donate)`` (or ``step``, one made so before), as ``train`` runs it
    (which donates): the parameters (``init_sharded``), the optimizer state (and the
    model's state, when it has some) placed with the plan's shardings, donated to
    each step (unless ``donate`` is False) and replaced by its outputs; ``batch``
    placed once. Run once before it is returned
    (compiling the step on its first call). Dropping the call (and collecting)
    frees its arrays; the call's ``step`` attribute is the compiled step.

    Example::

        >>> call = timed_step(info, plan, optax.adam(1e-3), batch)
        >>> loss = call()[-1]  # doctest: +SKIP
    """
    params = init_sharded(info, plan)
    init = opt_init(optimizer, plan.recipe)
    opt_state = jax.jit(init, out_shardings=plan.opt_shardings(jax.eval_shape(init, params)))(
        params
    )
    carried = [params, opt_state]
    if info.has_state:
        state = info.init_state_fn()
        carried.append(
            jax.device_put(state, plan.state_sharding(jax.eval_shape(lambda s: s, state)))
        )
    placed = jax.device_put(batch, plan.batch_sharding(batch))
    del params, opt_state
    compiled = step
    if compiled is None:
        compiled = jit(train_step(info, optimizer, plan), plan, donate_state=donate)

    def call() -> Any:
        out = compiled(*carried, placed)
        carried[:] = out[:-1]  # the outputs carry on (donated inputs are gone)
        return out

    jax.block_until_ready(call())
    call.step = compiled  # type: ignore[attr-defined]
    return call


def _block(call: Callable[[], Any], steps: int, min_time_s: float) -> dict[str, list[float]]:
    """At least ``steps`` timed steps of ``call`` and at least ``min_time_s`` seconds
    of them."""
    out: dict[str, list[float]] = {"wall": [], "cpu": [], "sys": [], "faults": []}
    while len(out["wall"]) < steps or sum(out["wall"]) < min_time_s:
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        c0, t0 = time.process_time(), time.perf_counter()
        jax.block_until_ready(call())
        out["wall"].append(time.perf_counter() - t0)
        out["cpu"].append(time.process_time() - c0)
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        out["sys"].append(r1.ru_stime - r0.ru_stime)
        out["faults"].append(float(r1.ru_minflt - r0.ru_minflt))
    return out


def time_plans(
    info: ModelInfo,
    plans: Sequence[Plan],
    optimizer: optax.GradientTransformation,
    batch: Any = None,
    *,
    steps: int = 3,
    warmup: int = 1,
    passes: int = 2,
    min_time_s: float = 0.25,
) -> list[StepTimes]:
    """Each plan's train step timed on its mesh's devices (module docstring): per
    pass, every plan in turn (the order reversed each pass, so a load that drifts
    over the run reaches every plan alike) has its arrays built, ``warmup``
    untimed steps and at least ``steps`` timed ones (and at least ``min_time_s``
    seconds of them), and its arrays dropped before the next plan's are built; each
    step is compiled once, on its first pass.

    Args:
      info: the described model (``sk.describe``).
      plans: plans of that model, on meshes of real devices.
      optimizer: the optimizer the steps update with.
      batch: a batch of arrays (None: zeros of ``info.batch``).
      steps: timed steps per plan and pass, at least (at least 1).
      warmup: untimed steps per plan and pass, after the one that builds it.
      passes: how many times every plan is timed (at least 1).
      min_time_s: seconds of timed steps per plan and pass, at least (>= 0): more
        steps are run until they add up to it.

    Returns:
      One :class:`StepTimes` per plan, in order (its ``per_pass`` the steps each
      pass timed).

    Raises:
      SpmdError: a plan on an abstract mesh, or a count out of range.

    Example::

        >>> [t.best_s for t in time_plans(info, [fsdp, megatron], optax.adam(1e-3))]
        [0.19, 0.14]  # doctest: +SKIP
    """
    _check_counts("time_plans", steps=steps, warmup=warmup, passes=passes)
    _check_seconds("time_plans", min_time_s)
    for p in plans:
        if not isinstance(p.mesh, Mesh):
            raise SpmdError(
                op="time_plans",
                must="every plan is on a mesh of real devices (jax.sharding.Mesh)",
                given=f"a plan on {type(p.mesh).__name__} {dict(p.mesh.shape)}",
                fix="plan on sk.make_mesh(...) to time it; an abstract mesh is priced only",
            )
    example = _example_batch(info, batch)
    compiled: dict[int, Any] = {}
    times: list[dict[str, list[float]]] = [
        {"wall": [], "cpu": [], "sys": [], "faults": [], "per_pass": []} for _ in plans
    ]
    order = list(range(len(plans)))
    for k in range(passes):
        for i in order if k % 2 == 0 else order[::-1]:
            call = timed_step(info, plans[i], optimizer, example, compiled.get(i))
            compiled[i] = call.step  # type: ignore[attr-defined]
            for _ in range(warmup):
                jax.block_until_ready(call())
            block = _block(call, steps, min_time_s)
            for key, values in block.items():
                times[i][key] += values
            times[i]["per_pass"].append(len(block["wall"]))
            del call
            gc.collect()
    compiled.clear()
    jax.clear_caches()  # the compiled steps' executables are held by jax's caches too
    gc.collect()
    keys = ("wall", "cpu", "sys", "faults", "per_pass")
    return [StepTimes(*(tuple(t[k]) for k in keys)) for t in times]


def _geomean(values: Sequence[float]) -> float:
    return float(np.exp(np.mean(np.log(values))))


def _finite_at_least_zero(value: object) -> bool:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    return ok and 0 <= value < float("inf")


def _check_seconds(op: str, min_time_s: object) -> None:
    if not _finite_at_least_zero(min_time_s):
        raise SpmdError(
            op=op,
            must="min_time_s is a finite number of seconds >= 0",
            given=repr(min_time_s),
            fix="pass e.g. min_time_s=0.25 (0: exactly `steps` timed steps)",
        )


def _check_counts(op: str, **counts: object) -> None:
    least = {"warmup": 0}
    for name, value in counts.items():
        low = least.get(name, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise SpmdError(
                op=op,
                must=f"{name} is an int >= {low}",
                given=repr(value),
                fix=f"pass e.g. {name}={max(low, 2)}",
            )


def tune(
    model: object,
    mesh: Mesh,
    *,
    optimizer: optax.GradientTransformation | None = None,
    config: object = None,
    batch: Any = None,
    batch_size: int = 8,
    loss: Callable | None = None,
    recipe: Recipe | None = None,
    rules: Any = None,
    names: Mapping[str, tuple | None] | None = None,
    cost_model: CostModel | None = None,
    options: SearchOptions | None = None,
    candidates: int = 8,
    steps: int = 3,
    warmup: int = 1,
    passes: int = 3,
    min_time_s: float = 0.25,
    runoff: float = 0.15,
) -> Plan:
    """Plan ``model`` with ``strategy="auto"`` on ``mesh``'s devices, choosing among
    auto's candidates by their measured step (module docstring).

    Args:
      model: as :func:`spmdkit.plan` (a model spec, an NNX module, a ``ModelInfo``...).
      mesh: a mesh of real devices (``sk.make_mesh``).
      optimizer: the optimizer the steps update with (default ``optax.adam(1e-3)``).
      config: as :func:`spmdkit.plan`.
      batch: as :func:`spmdkit.plan`; a batch of arrays is also what the steps are
        timed on (else zeros of the model's batch).
      batch_size: as :func:`spmdkit.plan`.
      loss: as :func:`spmdkit.plan`.
      recipe: as :func:`spmdkit.plan` (given: fixed for every candidate).
      rules: as :func:`spmdkit.plan`.
      names: as :func:`spmdkit.plan`.
      cost_model: as :func:`spmdkit.plan` (how the candidates are priced and ranked
        before timing).
      options: :class:`~spmdkit.planner.options.SearchOptions` (pipelines, float8,
        ...); its ``measure`` is set here.
      candidates: how many candidates are timed at most.
      steps: timed steps per candidate and pass, at least (:func:`time_plans`).
      warmup: untimed steps per candidate and pass before them.
      passes: passes over the candidates, the order reversed each pass.
      min_time_s: seconds of timed steps per candidate and pass, at least.
      runoff: candidates whose score is within this fraction of the fastest's
        (0.15: 15%) are timed again, among themselves, in ``passes`` more passes,
        and ranked by that runoff (>= 0; 0 times only a tie again).

    Returns:
      The fastest measured candidate's :class:`~spmdkit.planner.Plan` (its cost the
      price; the ``measured`` note has every timed candidate's figures).

    Raises:
      SpmdError: an abstract mesh, several processes (``jax.distributed``: each
        would time its own devices), or a count out of range; what ``sk.plan`` raises.

    Example::

        >>> plan = sk.tune(get_model("gpt"), sk.make_mesh(data=2, model=4), config="small")
        >>> [n.kind for n in plan.notes]  # doctest: +SKIP
        ['measured']
    """
    _check_counts("tune", steps=steps, warmup=warmup, passes=passes)
    _check_seconds("tune", min_time_s)
    _check_runoff(runoff)
    if not isinstance(mesh, Mesh):
        raise SpmdError(
            op="tune",
            must="mesh is a mesh of real devices (jax.sharding.Mesh), whose steps can run",
            given=type(mesh).__name__,
            fix="pass sk.make_mesh(...); to plan an abstract mesh use sk.plan(..., 'auto')",
        )
    if jax.process_count() > 1:
        raise SpmdError(
            op="tune",
            must="one process: each process would time the candidates on its own devices "
            "and could pick another plan than the others",
            given=f"{jax.process_count()} processes",
            fix="tune on one host's mesh, save the plan (plan.to_json()) and load it on "
            "every process (Plan.from_json(text, mesh=mesh))",
        )
    opt = optax.adam(1e-3) if optimizer is None else optimizer
    info = describe(model, config=config, batch=batch, batch_size=batch_size, loss=loss)

    def timer(plans: Sequence[Plan]) -> list[float]:
        def timed(subset: Sequence[Plan]) -> list[float]:
            return paired_scores(
                time_plans(
                    info,
                    subset,
                    opt,
                    batch,
                    steps=steps,
                    warmup=warmup,
                    passes=passes,
                    min_time_s=min_time_s,
                )
            )

        return with_runoff(timed, list(plans), runoff)

    opts = replace(options or SearchOptions(), measure=timer, measure_candidates=candidates)
    return make_plan(
        info,
        mesh,
        "auto",
        optimizer=opt,
        recipe=recipe,
        rules=rules,
        names=names,
        cost_model=cost_model,
        options=opts,
    )


def with_runoff(
    timed: Callable[[Sequence[Plan]], list[float]], plans: list[Plan], runoff: float
) -> list[float]:
    """``timed(plans)``, then the plans within ``runoff`` of the fastest timed again
    among themselves (when there are two or more) and their scores replaced by the
    runoff's, rescaled to the same geometric mean as their first scores: the runoff
    reorders the contenders only, never against a plan it did not time again
    (:func:`tune`'s ranking).

    Args:
      timed: ``plans -> scores`` (seconds, one per plan, e.g. :func:`paired_scores`
        of :func:`time_plans`).
      plans: the plans, in order.
      runoff: how close to the fastest a plan must score to be timed again (0.15:
        within 15%).

    Returns:
      One score per plan, in order.

    Example::

        >>> with_runoff(lambda ps: [1.0, 1.05, 2.0][: len(ps)], ["a", "b", "c"], 0.15)
        [1.0, 1.05, 2.0]
    """
    seconds = timed(plans)
    if len(plans) < 2:
        return seconds
    best = min(seconds)
    close = [i for i, s in enumerate(seconds) if s <= best * (1 + runoff)]
    if len(close) < 2:
        return seconds
    again = timed([plans[i] for i in close])
    first = [seconds[i] for i in close]
    scale = _geomean(first) / _geomean(again)
    for i, s in zip(close, again, strict=True):
        seconds[i] = s * scale
    return seconds


def _check_runoff(runoff: object) -> None:
    if not _finite_at_least_zero(runoff):
        raise SpmdError(
            op="tune",
            must="runoff is a finite fraction >= 0 (how close to the fastest a candidate "
            "must score to be timed again)",
            given=repr(runoff),
            fix="pass e.g. runoff=0.15 (0: only ties are timed again)",
        )
