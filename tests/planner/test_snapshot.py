"""plan.snapshot: MaxText's golden-dump layout, per tensor path."""

import json

from spmdkit.planner.snapshot import FORMAT, snapshot_dict, snapshot_diff


def test_the_snapshot_holds_named_logical_and_input_shardings(plans, tmp_path):
    p = plans["megatron"]
    path = tmp_path / "sub" / "megatron.json"
    p.snapshot(path)
    d = json.loads(path.read_text())
    assert d["format"] == FORMAT and d["strategy"] == "megatron"
    assert d["mesh"] == {"axis_names": ["data", "model"], "shape": {"data": 2, "model": 4}}
    for param, spec in p.params.items():
        shape, _, names = p.info[param]
        named = d["named_shardings"][f"params/{param}"]
        assert named["shape"] == list(shape) and named["mesh"] == d["mesh"]
        want = [e if e is None or isinstance(e, str) else list(e) for e in spec]
        assert named["partition_spec"] == want
        logical = d["logical_shardings"][f"params/{param}"]
        assert logical["partition_spec"] == (None if names is None else list(names))
        assert f"opt/{param}" in d["named_shardings"]
    assert set(d["input_shardings"]) == {f"batch/{f}" for f in p.batch_axes}
    assert snapshot_diff(d, snapshot_dict(p)) == []


def test_the_diff_names_each_tensor_with_both_specs(plans):
    a, b = snapshot_dict(plans["fsdp"]), snapshot_dict(plans["megatron"])
    lines = snapshot_diff(a, b)
    f, m = plans["fsdp"].params, plans["megatron"].params
    moved = [n for n in f if f[n] != m[n]]
    assert moved and len([x for x in lines if x.startswith("params/")]) == len(moved)
    assert any(" spec stored [" in x and " -> new [" in x for x in lines)
