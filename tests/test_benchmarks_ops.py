"""benchmarks/ops.py: a quick run on tiny shapes gives a well-formed report, the
vocab-parallel cross-entropy backward moves nothing, a missing op is reported as
n/a instead of stopping the run, and the agreement check tells equal from unequal."""

import json

import pytest

from tests.scripts import loaded_script

SIDE_KEYS = {"bytes", "collectives", "peak_bytes", "memory", "compile_s"}
PASSES = ("forward", "forward+backward", "backward")


@pytest.fixture(scope="module")
def bench():
    with loaded_script("benchmarks/ops.py") as module:
        yield module


def _check_side(side):
    assert set(side) == set(PASSES)
    for pass_ in PASSES:
        cost = side[pass_]
        assert set(cost) >= SIDE_KEYS
        assert cost["bytes"] == sum(v["payload_bytes"] for v in cost["collectives"].values())
        mem = cost["memory"]
        assert cost["peak_bytes"] == mem["temp"] + mem["argument"] + mem["output"] - mem["alias"]
        assert cost["peak_bytes"] > 0


@pytest.mark.slow
@pytest.mark.heavy
def test_quick_run(bench, tmp_path, monkeypatch, capsys):
    real_cases = bench._cases

    def cases(shapes):
        picked = [c for c in real_cases(shapes) if c.op in ("softmax_cross_entropy", "index_put")]

        def plain_raises(mesh):
            raise ValueError("plain side broken on purpose")

        broken = picked[0]._replace(
            explicit=False,
            op="missing_op",
            spmdkit=lambda mesh: bench._op("no_such_op_in_spmdkit"),
            plain=plain_raises,
        )
        return [*picked, broken]

    monkeypatch.setattr(bench, "_cases", cases)
    out = tmp_path / "ops.json"
    assert bench.main(["--quick", "--no-check", "--no-planned", "--out", str(out)]) == 0
    report = json.loads(out.read_text())

    assert report["meta"]["quick"] is True
    assert report["meta"]["mesh"]["data"] == 2 and report["meta"]["mesh"]["model"] == 4
    rows = {(r["op"], r["variant"]): r for r in report["rows"]}
    ce_auto = ("softmax_cross_entropy", "vocab_parallel")
    ce_explicit = ("softmax_cross_entropy", "vocab_parallel explicit")
    index_put = ("index_put", "local_update")
    assert set(rows) == {ce_auto, ce_explicit, index_put, ("missing_op", "vocab_parallel")}
    for key in (ce_auto, index_put):
        _check_side(rows[key]["spmdkit"])
        _check_side(rows[key]["plain"])
    _check_side(rows[ce_explicit]["spmdkit"])
    # under Explicit axes plain optax cannot gather along the vocab-sharded class dim
    assert rows[ce_explicit]["plain"]["na"].startswith("ShardingTypeError")

    for key in (ce_auto, ce_explicit):
        ce = rows[key]["spmdkit"]
        assert ce["backward"]["bytes"] == 0
        assert ce["backward"]["collectives"] == {}
        # the forward moves only per-row scalars: all-reduces, no gather of the logits
        assert set(ce["forward"]["collectives"]) == {"all_reduce"}
        assert ce["forward+backward"]["bytes"] <= ce["forward"]["bytes"]
    # index_put local update: the forward moves nothing
    assert rows[index_put]["spmdkit"]["forward"]["bytes"] == 0

    missing = rows[("missing_op", "vocab_parallel")]
    assert missing["spmdkit"] == {"na": missing["spmdkit"]["na"]}
    assert missing["spmdkit"]["na"].startswith("AttributeError")
    assert missing["plain"] == {"na": "ValueError: plain side broken on purpose"}
    printed = capsys.readouterr().out
    assert "n/a [1]" in printed and "n/a [3]" in printed
    assert "no_such_op_in_spmdkit" in printed and "broken on purpose" in printed


@pytest.mark.slow
def test_agreement_cross_entropy(bench):
    """The two sides of the cross-entropy row compute the same loss and gradient."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    key = ("softmax_cross_entropy", "vocab_parallel")
    (case,) = [c for c in bench._cases(bench.QUICK) if (c.op, c.variant) == key]
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    agree = bench.agreement(case, mesh)
    assert agree["forward_rel_err"] < 1e-5
    assert agree["grad_rel_err"] < 1e-5
    # twice the loss: outputs off by 1/2 of the plain value, grads of ½·(2L)² by 3/4
    doubled = case._replace(plain=lambda m: lambda z, y: 2 * bench._plain_cross_entropy(z, y))
    wrong = bench.agreement(doubled, mesh)
    assert wrong["forward_rel_err"] == pytest.approx(0.5, rel=1e-4)
    assert wrong["grad_rel_err"] == pytest.approx(0.75, rel=1e-4)


def test_every_op_resolves(bench):
    """Every benchmarked op name is a callable of spmdkit.ops (also after its module
    is imported, when the package attribute of the same name is the module)."""

    for case in bench._cases(bench.QUICK):
        assert callable(bench._op(case.op))
    with pytest.raises(AttributeError):
        bench._op("no_such_op_in_spmdkit")


def test_attention_memory_section(bench, tmp_path, capsys):
    """--attention-memory runs only that section: plain vs blockwise value-and-grad,
    the blockwise residuals O(S) (q, k, v, output, log-sum-exp) and its peak lower."""
    out = tmp_path / "attn.json"
    assert bench.main(["--attention-memory", "--quick", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    (row,) = report["rows"]
    s = row["shape"]
    q_bytes = s["batch"] * s["seq"] * s["heads"] * s["head_dim"] * 4
    kv_bytes = q_bytes // s["heads"] * s["kv_heads"]
    lse_bytes = s["batch"] * s["seq"] * s["heads"] * 4
    assert row["blockwise"]["residual_bytes"] == 2 * q_bytes + 2 * kv_bytes + lse_bytes
    assert row["xla"]["residual_bytes"] > s["seq"] ** 2 * s["heads"] * 4  # the probabilities
    assert row["xla"]["peak_bytes"] > row["blockwise"]["peak_bytes"] > 0
    assert row["peak_ratio"] == row["xla"]["peak_bytes"] / row["blockwise"]["peak_bytes"]
    printed = capsys.readouterr().out
    assert "blockwise" in printed and "softmax_cross_entropy" not in printed


@pytest.mark.slow
def test_planned_region_against_the_jnp_decomposition(bench):
    """The planned section: the vocab-parallel loss as a region moves per-row scalars,
    the jnp decomposition under the same propagation moves more."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    key = ("softmax_cross_entropy", "vocab_parallel")
    (case,) = [c for c in bench._cases(bench.QUICK) if (c.op, c.variant) == key]
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    region, jnp_ = bench._planned(case, "region", mesh), bench._planned(case, "plain", mesh)
    assert set(region["strategies"]) == {"softmax_cross_entropy", "softmax_cross_entropy:grad"}
    assert jnp_["strategies"] == {}
    assert 0 < region["bytes"] < jnp_["bytes"]
    assert abs(region["bytes"] - region["predicted_bytes"]) <= 0.1 * region["bytes"]
