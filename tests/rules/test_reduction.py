"""Reduction family: notation goldens and axis handling."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit.rules.reduction import reduce_notation

T = sk.TensorSpec


@pytest.mark.parametrize(
    ("shape", "attrs", "text"),
    [
        ((8, 4, 2), {"axis": 1}, "r0 r1 r2 -> r0 r2"),
        ((8, 4), {"axis": (0,), "keepdims": True}, "r0 r1 -> 1 r1"),
        ((8, 4), {"axis": -1}, "r0 r1 -> r0"),
        ((8, 4), {}, "r0 r1 -> "),
    ],
)
def test_reduce_notation(shape, attrs, text):
    assert reduce_notation((shape,), **attrs) == text


def test_full_reduction_of_a_2d_sharded_tensor():
    mesh = sk.abstract_mesh(x=2, y=4)
    r = sk.infer_forward("reduce_sum", T((8, 4), P("x", "y")), mesh=mesh)
    assert str(r.outputs[0]) == "[]{sum:x,sum:y}"


def test_bad_axis_is_a_conflict():
    with pytest.raises(sk.ShardingConflictError):
        sk.infer_forward("reduce_sum", T((8, 4)), mesh=sk.abstract_mesh(x=2), axis=5)


@pytest.mark.parametrize(
    ("op", "passes"),
    [
        ("cumsum", {"sum", "avg"}),
        ("cummax", {"max"}),
        ("cummin", {"min"}),
        ("cumprod", set()),
        ("cumlogsumexp", set()),
    ],
)
def test_a_pending_reduction_passes_a_scan_of_its_own_op(op, passes):
    mesh = sk.abstract_mesh(x=4)
    for pending in ("sum", "avg", "max", "min"):
        r = sk.infer_forward(op, T((8, 4), partial={"x": pending}), mesh=mesh, axis=0)
        assert dict(r.outputs[0].partial) == ({"x": pending} if pending in passes else {})


def _cumsum_example():
    return [sk.Example(((8, 4),), attrs={"axis": 0}), sk.Example(((4, 8),), attrs={"axis": 1})]


def test_cumsum_passes_check_rule_with_max_and_min_partial_inputs(mesh1d):
    """Every input layout of each example (max- and min-partial ones included), and
    the same sweep refuses the policy cumsum had as a built-in (LINEAR: a pending max
    passed through, so a running sum of the devices' pieces was maxed afterwards)."""
    from spmdkit.testing import check_rule, enumerate_specs

    partials = {p for s in enumerate_specs((8, 4), mesh1d) for _, p in s.partial}
    assert {"max", "min"} <= partials  # the sweep below runs them all (max_cases=None)
    report = check_rule(
        "cumsum", mesh=mesh1d, examples=_cumsum_example(), max_cases=None, grads=False
    )
    assert report.ok, str(report)
    rule = sk.get_rule("cumsum")
    linear = sk.FactorRule("cumsum_linear", rule.notation, impl=rule.impl, partial="LINEAR")
    wrong = check_rule(
        linear, mesh=mesh1d, examples=_cumsum_example(), max_cases=None, grads=False, missing=False
    )
    given = {p for case in wrong.wrong for s in case.given for _, p in s.partial}
    assert given == {"max", "min"}, str(wrong)


def test_top_k_keeps_each_devices_rows_and_runs_them_per_device(mesh1d, mesh2d):
    """A router's top-k of each token's scores: the rows (tokens) stay where they
    are, only the dim it selects along is gathered. Numerically right against the
    unsharded op on every layout, and the program it runs (per device, under
    shard_map) compiles to the predicted collectives: none for sharded rows. Left
    to XLA's partitioner the TopK custom call gathers the rows too, which is why
    the rule runs its own program."""
    from jax.sharding import NamedSharding

    from spmdkit.testing import check_jit, check_rule
    from spmdkit.verification.hlo import parse_collectives

    rows = sk.infer_forward("top_k", T((16, 32), P("x")), mesh=mesh1d, k=2)
    assert [o.dims for o in rows.outputs] == [(("x",), ())] * 2
    assert not rows.reshards and not rows.collectives
    along = sk.infer_forward("top_k", T((16, 32), P(None, "x")), mesh=mesh1d, k=2)
    assert along.inputs[0].dims == ((), ())  # the selected dim gathered
    three = sk.infer_forward("top_k", T((4, 8, 32), P("a", "b")), mesh=mesh2d, k=3)
    assert three.outputs[0].dims == (("a",), ("b",), ())
    examples = [
        sk.Example(((8, 16),), attrs={"k": 2}),
        sk.Example(((4, 8, 6),), attrs={"k": 3}),
    ]
    for mesh in (mesh1d, mesh2d):
        report = check_rule("top_k", mesh=mesh, examples=examples, max_cases=None, grads=False)
        assert report.ok, str(report)
        jit = check_jit("top_k", mesh=mesh, examples=examples, max_cases=None)
        assert jit.ok, str(jit)
    # the fact the rule works around: XLA gathers a row-sharded operand whole
    amesh = jax.sharding.Mesh(mesh1d.devices, mesh1d.axis_names)
    x = jax.ShapeDtypeStruct((16, 32), jnp.float32, sharding=NamedSharding(amesh, P("x")))
    text = jax.jit(lambda v: jax.lax.top_k(v, 2)).lower(x).compile().as_text()
    assert [c.kind for c in parse_collectives(text)] == ["all_gather"]
