"""The numeric sweep catches wrong claims, missing placements and undeclared replications."""

import math

import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit.engine.rule import Inferred, Rule
from spmdkit.testing import check_rule, undeclared_replications

T = sk.TensorSpec


def test_sweep_reports_wrong_rules(bad_rules, mesh1d):
    for rule in bad_rules:
        report = check_rule(rule, mesh=mesh1d, grads=False, missing=False)
        assert not report.ok
        assert report.wrong
        assert rule.name in str(report)


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
