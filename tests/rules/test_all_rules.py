"""Every registered rule through the same checks (adding a rule adds its tests).

* numeric sweep, forward and grad, on the 1-D (x=4) and 2-D (a=2, b=4) meshes,
  even shapes and uneven ones (padded blocks);
* jit check: compiled HLO collectives equal the predicted ones.

Each check runs twice over: a sample in the default run (``[<op>-sample]``) and the
full sample in the slow step (``[<op>-full]``, ``python -m pytest -m slow``). The sweeps
spend their time compiling: the unsharded reference per example (shared by an op's
sweeps, which run one after another) and one program per example and sweep whose
size grows with the sample.
"""

import dataclasses

import pytest

import spmdkit as sk
from spmdkit.testing import check_jit, check_rule

OPS = sk.registered_ops()


@pytest.fixture(scope="module", params=OPS)
def op(request):
    """The op under test: a module-scoped parameter, so pytest runs each op's checks
    one after another (on one xdist worker, mostly), reusing its compiled reference."""
    return request.param


def _sizes(sample, full):
    """The sweep's sample sizes: ``sample`` in the default run, ``full`` under ``slow``."""
    return pytest.mark.parametrize(
        "size",
        [pytest.param(sample, id="sample"), pytest.param(full, id="full", marks=pytest.mark.slow)],
    )


def _even_examples(op):
    """The rule's examples on even shapes (uneven ones have their own sweeps below);
    None (the rule's own list) when it has no even example."""
    even = [e for e in sk.get_rule(op).examples if not e.uneven]
    return even or None


@_sizes((8, 3), (24, 8))
def test_numeric_sweep_1d(op, size, mesh1d):
    cases, grad_cases = size
    report = check_rule(
        op,
        mesh=mesh1d,
        examples=_even_examples(op),
        max_cases=cases,
        max_grad_cases=grad_cases,
        missing=False,
    )
    assert report.ok, str(report)
    assert report.forward_cases > 0


@_sizes((8, 3), (20, 8))
def test_numeric_sweep_2d(op, size, mesh2d):
    cases, grad_cases = size
    report = check_rule(
        op,
        mesh=mesh2d,
        examples=_even_examples(op),
        max_cases=cases,
        max_grad_cases=grad_cases,
        missing=False,
        seed=1,
    )
    assert report.ok, str(report)


@_sizes(2, 3)
def test_jit_collectives_match_prediction(op, size, mesh2d):
    report = check_jit(op, mesh=mesh2d, max_cases=size)
    assert report.ok, str(report)


def _uneven_examples(rule):
    """The rule's uneven examples; for a factor rule without any, its examples
    with every dim of 8 made 6 (which 4 does not divide)."""
    own = [e for e in rule.examples if e.uneven]
    if own or not isinstance(rule, sk.FactorRule):
        return own
    return [
        dataclasses.replace(
            e, uneven=True, shapes=tuple(tuple(6 if n == 8 else n for n in s) for s in e.shapes)
        )
        for e in rule.examples
        if e.values is None
    ]


@_sizes((3, 2), (6, 3))
def test_uneven_sweep_1d(op, size, mesh1d):
    examples = _uneven_examples(sk.get_rule(op))
    if not examples:
        pytest.skip(f"{op} has no uneven example (its shapes must divide)")
    cases, grad_cases = size
    report = check_rule(
        op,
        mesh=mesh1d,
        examples=examples,
        max_cases=cases,
        max_grad_cases=grad_cases,
        missing=False,
        seed=2,
    )
    assert report.ok, str(report)


@_sizes((2, 1), (4, 2))
def test_uneven_sweep_2d(op, size, mesh2d):
    examples = _uneven_examples(sk.get_rule(op))
    if not examples:
        pytest.skip(f"{op} has no uneven example (its shapes must divide)")
    cases, grad_cases = size
    report = check_rule(
        op,
        mesh=mesh2d,
        examples=examples,
        max_cases=cases,
        max_grad_cases=grad_cases,
        missing=False,
        seed=3,
    )
    assert report.ok, str(report)


#: Dims of the 2 × 3 sweep: the examples' 8s become 32 and their 4s become 64, which the
#: mesh axis of 3 does not divide (the held-out PaddlePaddle cases' sizes).
_SCALE = {8: 32, 4: 64, 6: 32}


def _scaled_examples(rule):
    """The rule's examples with dims of 32 and 64, uneven over the axis of 3; a rule
    whose examples are tied to their shapes (values, shape attributes) keeps its own."""
    if not isinstance(rule, sk.FactorRule):
        return [dataclasses.replace(e, uneven=True) for e in rule.examples]
    return [
        dataclasses.replace(
            e, uneven=True, shapes=tuple(tuple(_SCALE.get(n, n) for n in s) for s in e.shapes)
        )
        if e.values is None
        else dataclasses.replace(e, uneven=True)
        for e in rule.examples
    ]


@pytest.fixture(scope="module")
def mesh2x3():
    """Axes ``a`` (2) and ``c`` (3): six of the eight devices, an axis that divides
    neither 32 nor 64."""
    return sk.make_mesh(a=2, c=3)


@pytest.mark.slow
def test_numeric_sweep_2x3(op, mesh2x3):
    report = check_rule(
        op,
        mesh=mesh2x3,
        examples=_scaled_examples(sk.get_rule(op)),
        max_cases=10,
        max_grad_cases=4,
        missing=False,
        seed=5,
    )
    assert report.ok, str(report)
    assert report.forward_cases > 0
