"""assert_plan_matches: a plan against its stored snapshot, readable diffs, rewrites."""

import pytest

from spmdkit.planner import plan
from spmdkit.testing import assert_plan_matches
from spmdkit.verification.snapshots import UPDATE_ENV
from tests.plan_model import toy_batch, toy_init, toy_loss


@pytest.fixture(scope="module")
def two():
    import spmdkit as sk

    mesh = sk.abstract_mesh(data=2, model=4)
    kw = {"loss": toy_loss, "batch": toy_batch(), "estimator": "analytic"}
    return plan(toy_init, mesh, "fsdp", **kw), plan(toy_init, mesh, "megatron", **kw)


def test_a_plan_matches_its_own_snapshot(two, tmp_path):
    fsdp, _ = two
    path = tmp_path / "fsdp.json"
    fsdp.snapshot(path)
    assert_plan_matches(fsdp, path)


def test_a_changed_layout_fails_naming_tensor_and_both_specs(two, tmp_path, monkeypatch):
    fsdp, megatron = two
    monkeypatch.delenv(UPDATE_ENV, raising=False)
    path = tmp_path / "pinned.json"
    fsdp.snapshot(path)
    with pytest.raises(AssertionError) as err:
        assert_plan_matches(megatron, path)
    text = str(err.value)
    assert "plan 'megatron' differs from the snapshot" in text and UPDATE_ENV in text
    moved = next(n for n in fsdp.params if fsdp.params[n] != megatron.params[n])
    line = next(x for x in text.splitlines() if x.strip().startswith(f"params/{moved}:"))
    assert "spec stored [" in line and "-> new [" in line, line


def test_rewriting_the_snapshot_by_argument_or_environment(two, tmp_path, monkeypatch):
    fsdp, megatron = two
    path = tmp_path / "pinned.json"
    with pytest.raises(AssertionError, match="no plan snapshot"):
        assert_plan_matches(fsdp, path, update=False)
    assert_plan_matches(fsdp, path, update=True)
    assert_plan_matches(fsdp, path)
    monkeypatch.setenv(UPDATE_ENV, "1")
    assert_plan_matches(megatron, path)  # rewritten
    monkeypatch.delenv(UPDATE_ENV)
    assert_plan_matches(megatron, path)
    with pytest.raises(AssertionError):
        assert_plan_matches(fsdp, path)
