"""benchmarks/overhead.py's auto table: each plan's step runs as ``train`` runs it
(state donated, outputs fed to the next step) and is timed with only its own
arrays alive, which are gone when its block ends (slow step: three compiles of
gpt tiny's train step, about 20 CPU s on 2 cores)."""

import gc

import jax
import numpy as np
import optax
import pytest

import spmdkit as sk
from spmdkit.models import get_model
from tests.scripts import loaded_script


@pytest.fixture(scope="module")
def bench():
    with loaded_script("benchmarks/overhead.py") as module:
        yield module


@pytest.fixture(scope="module")
def case():
    spec = get_model("gpt")
    cfg = spec.config("tiny")
    batch = spec.batch(cfg, 8, np.random.default_rng(0))
    info = sk.describe(spec, config=cfg, batch=batch)
    opt = optax.adam(1e-3)
    plan = sk.plan(info, sk.make_mesh(data=2, model=4), "fsdp", optimizer=opt, estimator="analytic")
    return info, plan, opt, batch


def _live() -> set[int]:
    gc.collect()
    return {id(x) for x in jax.live_arrays()}


@pytest.mark.slow
@pytest.mark.parametrize("donate", [True, False])
def test_the_step_donates_its_state_as_train_does(bench, case, donate):
    info, plan, opt, batch = case
    before = _live()
    call = bench._train_run(info, plan, opt, batch, donate=donate)
    held = [x for x in jax.live_arrays() if id(x) not in before]
    n_params = len(jax.tree.leaves(info.abstract_params))
    out = call()
    deleted = sum(x.is_deleted() for x in held)
    # donated: the parameters and optimizer state the step consumed are gone, the
    # batch (not donated) stays; kept: nothing of the inputs is deleted
    assert (deleted >= n_params) if donate else (deleted == 0)
    assert not any(x.is_deleted() for x in jax.tree.leaves(out))
    del call, out, held
    assert _live() <= before


def test_a_run_of_some_cases_adds_its_rows_to_the_stored_table(bench):
    """``--auto-only`` on some cases keeps the stored rows of the others: new rows
    replace those of their model, config and mesh, in the cases' order."""

    def row(model, config, mesh, tag):
        return {"model": model, "config": config, "mesh": mesh, "tag": tag}

    two_by_four, eight = {"data": 2, "model": 4}, {"data": 8}
    kept = [row("moe", "tiny", two_by_four, "old"), row("gpt", "small", eight, "old")]
    new = [row("gpt", "small", eight, "new"), row("gpt", "tiny", eight, "new")]
    merged = bench.merged_auto_rows(kept, new)
    assert [(r["model"], r["config"], r["tag"]) for r in merged] == [
        ("gpt", "tiny", "new"),
        ("gpt", "small", "new"),
        ("moe", "tiny", "old"),
    ]


def test_auto_meshes_picks_the_meshes_a_run_measures(bench, monkeypatch):
    """``--auto-meshes`` runs the named meshes of the table only, and names the
    table's meshes when one is not among them; ``--auto-passes`` and
    ``--auto-budget`` reach the timer (5 passes and 30 s unless given)."""
    runs, timing = [], []

    def fake(name, size, shape, *, budget_s, passes):
        runs.append((name, size, shape))
        timing.append((passes, budget_s))
        return {"model": name, "config": size, "mesh": shape}

    monkeypatch.setattr(bench, "measure_auto", fake)
    monkeypatch.setattr(bench, "_auto_table", lambda rows: None)
    monkeypatch.setattr(bench, "measure_cpu_constants", lambda: {})
    args = bench._parse(["--auto-only", "--auto-models", "moe:small", "--auto-meshes", "data=8"])
    bench.run_auto_section(args)
    assert runs == [("moe", "small", {"data": 8})]
    assert timing == [(5, 30.0)]
    args = bench._parse(["--auto-only", "--auto-models", "moe:tiny", "--auto-meshes",
                         "data=8;data=2,model=4", "--auto-passes", "15",
                         "--auto-budget", "150"])  # fmt: skip
    bench.run_auto_section(args)
    assert runs[1:] == [("moe", "tiny", {"data": 8}), ("moe", "tiny", {"data": 2, "model": 4})]
    assert timing[1:] == [(15, 150.0)] * 2
    args = bench._parse(["--auto-only", "--auto-meshes", "data=4"])
    with pytest.raises(SystemExit, match=r"'data=2,model=4', 'data=8'"):
        bench.run_auto_section(args)
