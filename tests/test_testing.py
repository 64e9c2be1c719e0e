"""The validation toolkit: pieces and reassembly, and that it catches wrong rules."""

import math

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit.rule import Inferred, Rule
from spmdkit.testing import (
    assemble,
    check_forward_case,
    check_jit,
    check_rule,
    enumerate_specs,
    local_pieces,
    undeclared_replications,
)

T = sk.TensorSpec


@pytest.mark.parametrize(
    "spec",
    [
        T((8, 4), P("b", "a")),
        T((8, 4), P(("a", "b"))),
        T((8, 4), partial={"a": "sum", "b": "max"}),
        T((8, 4), P("b"), partial={"a": "avg"}),
        T((8, 4), P(None, "a"), partial={"b": "min"}),
    ],
)
def test_pieces_reassemble_to_the_value(spec, mesh2d):
    rng = np.random.default_rng(0)
    value = rng.standard_normal((8, 4)).astype(np.float32)
    pieces = local_pieces(value, spec, mesh2d, rng=rng)
    assert pieces.shape == (2, 4, *spec.local_shape(mesh2d))
    got, why = assemble(pieces, spec, mesh2d)
    assert why is None
    np.testing.assert_allclose(got, value, rtol=1e-5, atol=1e-5)


def test_partial_splits_are_asymmetric(mesh1d):
    rng = np.random.default_rng(0)
    value = np.ones((4, 4), np.float32)
    pieces = local_pieces(value, T((4, 4), partial="x"), mesh1d, rng=rng)
    assert not np.allclose(pieces[0], pieces[1])
    assert not np.allclose(pieces[0], value / 4)
    maxes = local_pieces(value, T((4, 4), partial={"x": "max"}), mesh1d, rng=rng)
    assert (maxes < 1).any() and np.allclose(maxes.max(axis=0), value)


def test_replicated_claim_is_checked(mesh1d):
    rng = np.random.default_rng(0)
    value = rng.standard_normal((4,)).astype(np.float32)
    pieces = local_pieces(value, T((4,), partial="x"), mesh1d, rng=rng)
    got, why = assemble(pieces, T((4,)), mesh1d)
    assert got is None and "replicated" in why


def test_enumerate_specs_covers_every_kind(mesh2d):
    specs = enumerate_specs((8, 4), mesh2d)
    texts = {str(s) for s in specs}
    assert "[8,4]" in texts and "[8@(a,b),4]" in texts and "[8@b,4@a]" in texts
    assert "[8,4]{max:a,sum:b}" in texts
    assert all(s.is_even(mesh2d) for s in specs)
    assert len(specs) == 7 * 7 - 1  # b on dim 1 (size 4) with a on dim 1 would be 8-way


class _ShardedSoftmax(Rule):
    """Wrong on purpose: claims softmax runs with its axis sharded."""

    name = "t_bad_softmax"
    examples = (sk.Example(((8, 8),)),)

    @staticmethod
    def impl(x):
        return jnp.exp(x) / jnp.sum(jnp.exp(x), axis=-1, keepdims=True)

    def forward(self, ctx, inputs):
        (x,) = inputs
        return Inferred((x.without_partial(),), (x.without_partial(),))


class _SumAsSharded(Rule):
    """Wrong on purpose: claims a sum over a sharded dim leaves a replicated result."""

    name = "t_bad_sum"
    examples = (sk.Example(((8, 8),)),)

    @staticmethod
    def impl(x):
        return jnp.sum(x, axis=1)

    def forward(self, ctx, inputs):
        (x,) = inputs
        return Inferred((x.without_partial(),), (T((8,), (x.dims[0],)),))


@pytest.fixture
def bad_rules():
    rules = [_ShardedSoftmax(), _SumAsSharded()]
    for r in rules:
        sk.register_rule(r)
    yield rules
    for r in rules:
        sk.unregister_rule(r.name)


def test_sweep_reports_wrong_rules(bad_rules, mesh1d):
    for rule in bad_rules:
        report = check_rule(rule, mesh=mesh1d, grads=False, missing=False)
        assert not report.ok
        assert report.wrong
        assert rule.name in str(report)


def test_jit_check_reports_wrong_collectives(bad_rules, mesh2d):
    report = check_jit("t_bad_sum", mesh=mesh2d, max_cases=None)
    assert not report.ok
    assert "not in the plan" in str(report)


def test_sweep_reports_missing_placements(mesh1d):
    conservative = sk.FactorRule(
        "t_exp_none", "a -> a", impl=jnp.exp, partial="NONE", examples=(sk.Example(((8,),)),)
    )
    report = check_rule(conservative, mesh=mesh1d, grads=False, missing=True)
    assert report.ok
    assert any("max:x" in str(m) for m in report.missing)


class _GuardedNeg(Rule):
    """Replicates every dim its axes do not divide, although negation is elementwise."""

    name = "t_guarded_neg"
    examples = (sk.Example(((6, 4),), uneven=True),)
    impl = staticmethod(jnp.negative)

    def forward(self, ctx, inputs):
        (x,) = inputs
        dims = [
            axes if n % math.prod(ctx.axis_sizes[a] for a in axes) == 0 else ()
            for axes, n in zip(x.dims, x.shape, strict=True)
        ]
        spec = T(x.shape, dims)
        return Inferred((spec,), (spec,))


class _DeclaredNeg(_GuardedNeg):
    name = "t_declared_neg"
    must_divide = (
        sk.MustDivide("every dim", "a test", lambda ctx, ins, gs: (frozenset(range(ins[0].ndim)),)),
    )


def test_a_silently_replicated_uneven_dim_is_reported(mesh1d):
    uneven = [T((6, 4), P("x"))]
    (why,) = undeclared_replications(_GuardedNeg(), uneven, mesh1d)
    assert "input 0 dim 0 (size 6) loses ['x']" in why
    assert undeclared_replications(_GuardedNeg(), [T((8, 4), P("x"))], mesh1d) == []
    assert undeclared_replications(_DeclaredNeg(), uneven, mesh1d) == []
    assert _DeclaredNeg().divisible_dims(None, tuple(uneven)) == (frozenset({0, 1}),)


@pytest.mark.slow
def test_sweep_fails_a_rule_that_replicates_an_uneven_dim(mesh1d):
    report = check_rule(_GuardedNeg(), mesh=mesh1d, grads=False, missing=False, max_cases=8)
    assert not report.ok and not report.wrong
    assert report.replicated and "REPLICATED" in str(report)
    assert check_rule(_DeclaredNeg(), mesh=mesh1d, grads=False, missing=False, max_cases=8).ok


def test_single_forward_case(mesh2d):
    rng = np.random.default_rng(0)
    x, w = (
        rng.standard_normal((8, 8)).astype(np.float32),
        rng.standard_normal((8, 4)).astype(np.float32),
    )
    failure, res = check_forward_case(
        "matmul", [T((8, 8), P("a", "b")), T((8, 4), P("b"))], mesh2d, values=[x, w]
    )
    assert failure is None
    assert str(res.outputs[0]) == "[8@a,4]{sum:b}"


_DIMS = st.sampled_from([4, 8])


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    data=st.data(),
    op=st.sampled_from(["add", "mul", "matmul", "reduce_sum", "reduce_max", "softmax", "exp"]),
    m=st.integers(0, 1),
)
def test_property_random_specs(data, op, m, mesh1d, mesh2d):
    """Random shapes and specs: every inferred spec is valid and the numeric check holds."""
    mesh = (mesh1d, mesh2d)[m]
    shape = (data.draw(_DIMS), data.draw(_DIMS))
    shapes = {"add": [shape, shape[1:]], "mul": [shape, shape], "matmul": [shape, shape[::-1]]}
    shapes = shapes.get(op, [shape])
    takes_axis = op.startswith("reduce") or op == "softmax"
    attrs = {"axis": data.draw(st.sampled_from([0, 1]))} if takes_axis else {}
    specs = [data.draw(st.sampled_from(enumerate_specs(s, mesh))) for s in shapes]
    rng = np.random.default_rng(0)
    values = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    failure, res = check_forward_case(op, specs, mesh, values=values, attrs=attrs)
    assert failure is None, str(failure)
    for s in (*res.inputs, *res.outputs):
        s.validate(mesh)
        assert not (s.used_axes - set(mesh.axis_names))
