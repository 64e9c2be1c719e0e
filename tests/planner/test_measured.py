"""Auto's pick by a step timer (``SearchOptions.measure``): which candidates it
times, that it keeps the fastest measured, and the ``measured`` note."""

import pytest

import spmdkit as sk
from spmdkit.planner import PRESETS, PlanError, plan
from spmdkit.planner.notes import quiet_notes


def _uses(p, axis: str) -> bool:
    """Whether any parameter of ``p`` is split over ``axis``."""
    return any(axis in str(spec) for spec in p.params.values())


@pytest.fixture(scope="module")
def mesh():
    return sk.make_mesh(data=2, model=4)


#: The analytic estimator where the test is about the choice, not the prices.
ANALYTIC = sk.CostModel(estimator="analytic")


def _auto(info, mesh, timer, cost_model=None, **kw):
    with quiet_notes():
        return plan(
            info, mesh, "auto", cost_model=cost_model, options=sk.SearchOptions(measure=timer, **kw)
        )


@pytest.mark.parametrize("favour, costs", [("model", None), ("data", ANALYTIC)])
def test_auto_keeps_the_candidate_the_timer_measures_fastest(tiny_infos, mesh, favour, costs):
    """A timer that makes every plan splitting a weight over ``favour`` fast: auto
    picks one of those, whatever the price ranked first, and says so."""
    seen = []

    def timer(plans):
        seen.extend(plans)
        return [1.0 if _uses(p, favour) else 2.0 + i for i, p in enumerate(plans)]

    info = tiny_infos["gpt"]
    with quiet_notes():
        priced = plan(info, mesh, "auto", cost_model=costs)
    p = _auto(info, mesh, timer, costs)
    assert _uses(p, favour)
    assert 2 <= len(seen) <= 8
    assert all(q.mesh.shape == mesh.shape for q in seen)
    # one plan per distinct layout, the priced pick first
    assert seen[0].params == priced.params and seen[0].activation == priced.activation
    keys = [
        (*(tuple(t.items()) for t in (q.params, q.opt, q.grads, q.activation)), q.recipe)
        for q in seen
    ]
    assert len(set(keys)) == len(keys)
    (note,) = [n for n in p.notes if n.kind == "measured"]
    assert "priced" in note.message and "measured" in note.message
    assert note.message.count("measured ") >= len(seen)
    if p.params != priced.params:
        assert "over its priced pick" in note.message
    assert p.cost is not None and p.chosen in note.message


def test_the_timed_candidates_include_the_best_of_every_preset_that_fits(tiny_infos, mesh):
    """The price is what is being checked: presets it ranked too low to propagate
    are timed too (dp and ep, which lay tiny GPT out alike, once)."""
    labels = []

    def timer(plans):
        labels.append(len(plans))
        return [1.0 + i for i in range(len(plans))]

    p = _auto(tiny_infos["gpt"], mesh, timer, ANALYTIC, measure_candidates=len(PRESETS) + 4)
    (note,) = [n for n in p.notes if n.kind == "measured"]
    for name in ("fsdp", "zero1", "zero2", "megatron", "megatron_sp", "tp_fsdp"):
        assert f"{name}" in note.message, name
    assert "kept its priced pick" in note.message  # the first timed was the fastest


def test_one_candidate_keeps_the_priced_pick(tiny_infos, mesh):
    with quiet_notes():
        priced = plan(tiny_infos["gpt"], mesh, "auto", cost_model=ANALYTIC)
    one = [1.0]
    p = _auto(
        tiny_infos["gpt"], mesh, lambda plans: one * len(plans), ANALYTIC, measure_candidates=1
    )
    assert p.params == priced.params and p.chosen == priced.chosen


@pytest.mark.parametrize(
    "answer, match",
    [
        (lambda plans: [1.0], "one positive, finite step time per plan"),
        (lambda plans: [0.0] * len(plans), "bad: \\[0.0"),
        (lambda plans: [float("nan")] * len(plans), "bad"),
    ],
)
def test_a_timer_that_answers_wrong_is_a_plan_error(tiny_infos, mesh, answer, match):
    with pytest.raises(PlanError, match=match):
        _auto(tiny_infos["gpt"], mesh, answer, ANALYTIC, measure_candidates=2)


@pytest.mark.parametrize(
    "kw, match",
    [({"measure": 3}, "measure is None or a callable"), ({"measure_candidates": 0}, "positive")],
)
def test_measure_options_are_checked(kw, match):
    with pytest.raises(PlanError, match=match):
        sk.SearchOptions(**kw)
