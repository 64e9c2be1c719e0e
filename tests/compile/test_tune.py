"""``sk.tune``: auto's candidates timed on the mesh's own devices."""

import gc
import math
import re

import jax
import optax
import pytest

import spmdkit as sk
from spmdkit.compile.tune import StepTimes, paired_scores, time_plans, with_runoff
from spmdkit.errors import SpmdError
from spmdkit.planner.notes import quiet_notes


@pytest.fixture(scope="module")
def tiny_infos():
    """Tiny GPT, described once (batch 8)."""
    from models import get_model

    return {"gpt": sk.describe(get_model("gpt"), config="tiny", batch_size=8)}


@pytest.mark.slow  # the README command's budget
def test_tune_times_candidates_on_the_devices_and_keeps_the_fastest(tiny_infos):
    """Two candidates of tiny GPT on 2×4 CPU devices, one step each: the plan says
    what it timed, and the pick is the one with the least measured step."""
    mesh = sk.make_mesh(data=2, model=4)
    with quiet_notes():
        p = sk.tune(
            tiny_infos["gpt"],
            mesh,
            cost_model=sk.CostModel(estimator="analytic"),
            candidates=2,
            steps=1,
            warmup=0,
            passes=1,
            min_time_s=0,
        )
    (note,) = [n for n in p.notes if n.kind == "measured"]
    assert "timed 2 candidates" in note.message
    units = {"s": 1.0, "ms": 1e-3, "µs": 1e-6, "us": 1e-6}
    timed = {
        label: float(value) * units[unit]
        for label, value, unit in re.findall(
            r"([\w\[\]=+, .-]+?): priced [\d.]+ \S+, measured ([\d.]+) (\S+?)[;)]", note.message
        )
    }
    assert len(timed) == 2, note.message
    fastest = min(timed, key=timed.get)
    assert fastest.strip().split("+")[0] == p.chosen


@pytest.mark.slow
def test_time_plans_runs_each_plan_for_its_steps_and_passes(tiny_infos):
    mesh = sk.make_mesh(data=8)
    info = tiny_infos["gpt"]
    plans = [sk.plan(info, mesh, s, estimator="analytic") for s in ("dp", "fsdp")]
    times = time_plans(info, plans, optax.sgd(0.1), steps=2, warmup=0, passes=2, min_time_s=0)
    assert [len(t.wall) for t in times] == [4, 4]
    for t in times:
        assert t.per_pass == (2, 2)
        assert 0 < t.best_s <= t.score_s <= max(t.pass_medians_s)
        assert all(c >= 0 for c in t.cpu)
    # each plan's block leaves none of its arrays alive (params, state, batch, outputs)
    gc.collect()
    before = {id(x) for x in jax.live_arrays()}
    time_plans(info, plans[:1], optax.sgd(0.1), steps=1, warmup=0, passes=1, min_time_s=0)
    gc.collect()
    assert {id(x) for x in jax.live_arrays()} <= before
    # sized by time: each pass runs steps until they add up to min_time_s
    (t,) = time_plans(info, plans[:1], optax.sgd(0.1), steps=1, warmup=0, passes=2, min_time_s=0.2)
    assert len(t.per_pass) == 2 and sum(t.per_pass) == len(t.wall)
    start = 0
    for n in t.per_pass:
        block = t.wall[start : start + n]
        assert sum(block) >= 0.2 and sum(block[:-1]) < 0.2
        start += n


def test_tune_and_time_plans_refuse_an_abstract_mesh_and_bad_counts(tiny_infos):
    info = tiny_infos["gpt"]
    with pytest.raises(SpmdError, match="mesh of real devices"):
        sk.tune(info, sk.abstract_mesh(data=8))
    abstract = sk.plan(info, sk.abstract_mesh(data=8), "dp", estimator="analytic")
    with pytest.raises(SpmdError, match="real devices"):
        time_plans(info, [abstract], optax.sgd(0.1))
    with pytest.raises(SpmdError, match="steps is an int >= 1"):
        sk.tune(info, sk.make_mesh(data=8), steps=0)
    with pytest.raises(SpmdError, match="passes is an int >= 1"):
        time_plans(info, [], optax.sgd(0.1), passes=0)
    for bad in (-1.0, float("nan"), float("inf"), "0.2", True):
        with pytest.raises(SpmdError, match="min_time_s is a finite number"):
            time_plans(info, [], optax.sgd(0.1), min_time_s=bad)
    with pytest.raises(SpmdError, match="min_time_s is a finite number"):
        sk.tune(info, sk.make_mesh(data=8), min_time_s=-1)
    assert jax.device_count() == 8


def test_pass_medians_split_the_steps_by_pass():
    t = StepTimes(
        wall=(1.0, 3.0, 2.0, 5.0, 4.0),
        cpu=(2.0, 2.0, 2.0, 1.0, 9.0),
        sys=(0,) * 5,
        faults=(0,) * 5,
        per_pass=(3, 2),
    )
    assert t.pass_medians() == t.pass_medians_s == (2.0, 4.5)
    assert t.pass_medians("cpu") == (2.0, 5.0)
    assert t.score_s == 2.0


def _passes(*medians: float) -> StepTimes:
    """A plan timed one step a pass, those steps ``medians``."""
    n = len(medians)
    return StepTimes(tuple(medians), (0.0,) * n, (0.0,) * n, (0.0,) * n, per_pass=(1,) * n)


def test_paired_scores_compare_plans_within_each_pass():
    """B is 8% faster than A in two passes of three; in the other a disturbance hit
    B's block. The least pass median would pick A (its 1.0 beats B's 1.1); compared
    pass by pass, B wins, and a load that slows a whole pass cancels."""
    a, b = _passes(1.0, 1.2, 1.2), _passes(1.5, 1.1, 1.1)
    assert a.score_s < b.score_s
    sa, sb = paired_scores([a, b])
    assert sb < sa
    # a whole pass 10x slower (the host busy): the scores keep their order and ratio
    sa2, sb2 = paired_scores([_passes(1.0, 12.0, 1.2), _passes(1.5, 11.0, 1.1)])
    assert sb2 < sa2 and sa2 / sb2 == pytest.approx(sa / sb)
    # one plan: its median pass median
    assert paired_scores([_passes(3.0, 1.0, 2.0)]) == [2.0]
    assert paired_scores([]) == []
    with pytest.raises(SpmdError, match="same passes"):
        paired_scores([_passes(1.0), _passes(1.0, 2.0)])


def test_runoff_times_the_contenders_again_and_reorders_only_them():
    calls = []
    script = {4: [1.0, 1.1, 2.0, 1.05], 3: [1.3, 1.0, 1.2]}

    def timed(plans):
        calls.append(list(plans))
        return list(script[len(plans)])

    plans = ["a", "b", "c", "d"]
    seconds = with_runoff(timed, plans, 0.15)
    assert calls == [plans, ["a", "b", "d"]]  # c (2x the fastest) is not timed again
    assert seconds[2] == 2.0
    assert min(range(4), key=seconds.__getitem__) == 1  # b won the runoff
    # rescaled to the first round's geometric mean: c still the slowest
    first, again = [1.0, 1.1, 1.05], [seconds[0], seconds[1], seconds[3]]
    assert sum(map(math.log, again)) == pytest.approx(sum(map(math.log, first)))
    # no contender within the margin: timed once
    calls.clear()
    assert with_runoff(timed, plans, 0.01) == script[4] and len(calls) == 1


def test_tune_refuses_a_bad_runoff(tiny_infos):
    for bad in (-0.1, float("inf"), "0.1", None):
        with pytest.raises(SpmdError, match="runoff is a finite fraction"):
            sk.tune(tiny_infos["gpt"], sk.make_mesh(data=8), runoff=bad)
