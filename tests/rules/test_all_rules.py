"""Every registered rule through the same checks (adding a rule adds its tests).

* numeric sweep, forward and grad, on the 1-D (x=4) and 2-D (a=2, b=4) meshes;
* jit check: compiled HLO collectives equal the predicted ones.
"""

import pytest

import spmdkit as sk
from spmdkit.testing import check_jit, check_rule

OPS = sk.registered_ops()


@pytest.mark.parametrize("op", OPS)
def test_numeric_sweep_1d(op, mesh1d):
    report = check_rule(op, mesh=mesh1d, max_cases=40, max_grad_cases=12, missing=False)
    assert report.ok, str(report)
    assert report.forward_cases > 0


@pytest.mark.parametrize("op", OPS)
def test_numeric_sweep_2d(op, mesh2d):
    report = check_rule(op, mesh=mesh2d, max_cases=30, max_grad_cases=10, missing=False, seed=1)
    assert report.ok, str(report)


@pytest.mark.parametrize("op", OPS)
def test_jit_collectives_match_prediction(op, mesh2d):
    report = check_jit(op, mesh=mesh2d, max_cases=3)
    assert report.ok, str(report)
