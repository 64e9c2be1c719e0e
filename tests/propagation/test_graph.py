"""Tracing and the flattened program."""

from spmdkit.propagation import trace
from tests.propagation.programs import (
    PARAMS,
    X,
    Y,
    sgd_step,
)


def test_trace_is_abstract():
    closed = trace(sgd_step, PARAMS, X, Y)
    names = [e.primitive.name for e in closed.jaxpr.eqns]
    assert "dot_general" in names
    assert len(closed.jaxpr.invars) == 5
