"""spmdkit.planner.levers: the recipes auto searches, and the levers it takes only
when asked (float8, the fp32 master in the optimizer state)."""

from __future__ import annotations

import warnings

import spmdkit as sk
from spmdkit.introspect import describe
from spmdkit.models import get_model
from spmdkit.planner.analytic import ParamGroup
from spmdkit.planner.levers import auto_recipes, compute_choices
from spmdkit.planner.trace import trace_step


def _group(dtype: str) -> ParamGroup:
    return ParamGroup("w", ("w",), (4, 4), dtype, None, None, 128)


def test_compute_choices() -> None:
    fp32, bf16 = [_group("float32")], [_group("bfloat16")]
    assert compute_choices(fp32, allow_fp8=False, allow_master_weights=False) == [
        (None, "params"),
        ("bfloat16", "params"),
    ]
    assert compute_choices(fp32, allow_fp8=True, allow_master_weights=True) == [
        (None, "params"),
        ("bfloat16", "params"),
        ("bfloat16", "optimizer"),
        ("float8", "params"),
        ("float8", "optimizer"),
    ]
    # a bf16 model has no fp32 master to move into the optimizer state
    assert compute_choices(bf16, allow_fp8=True, allow_master_weights=True) == [
        (None, "params"),
        ("float8", "params"),
    ]


def test_auto_recipes_add_the_master_only_when_allowed() -> None:
    info = describe(get_model("llama"), config="tiny_scan", batch_size=8)
    trace = trace_step(info, None)
    groups = [_group("float32")]
    plain = auto_recipes(trace, groups)
    master = auto_recipes(trace, groups, allow_master_weights=True)
    assert not any(r.master_weights == "optimizer" for rnd in plain for r in rnd)
    moved = [r for r in master[0] if r.master_weights == "optimizer"]
    assert moved and all(r.compute_dtype == "bfloat16" for r in moved)
    # one master recipe per bf16 one, and nothing else changes
    bf16 = [r for r in plain[0] if r.compute_dtype == "bfloat16"]
    assert len(moved) == len(bf16)
    assert [r for r in master[0] if r.master_weights == "params"] == plain[0]
    # every divisor of the batch, no fixed cap (the search stops once one fits)
    assert sorted({r.microbatches for r in plain[0]}) == [1, 2, 4, 8]


def test_auto_takes_the_master_weights_only_when_allowed() -> None:
    """The search with the master allowed is a superset: never slower, and its
    candidates include master-weight recipes; without the flag, none."""
    info = describe(get_model("llama"), config="tiny_scan", batch_size=8)
    mesh = sk.abstract_mesh(data=4, model=2)
    kw = {"estimator": "analytic"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = sk.plan(info, mesh, "auto", **kw)
        allowed = sk.plan(info, mesh, "auto", allow_master_weights=True, **kw)
    labels = [plain.recipe.short(), *(n for n, _ in plain.alternatives)]
    assert not any("master→opt" in n for n in labels)
    labels = [allowed.recipe.short(), *(n for n, _ in allowed.alternatives)]
    assert any("master→opt" in n for n in labels)
    assert allowed.cost.step_time_s <= plain.cost.step_time_s
