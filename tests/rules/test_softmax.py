"""Softmax family: the softmax axis stays replicated; other dims pass."""

from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit.rules.softmax import softmax_notation

T = sk.TensorSpec


def test_softmax_notation():
    assert str(softmax_notation(((2, 8, 4),), axis=1)) == "d0 d1 d2 -> d0 d1 d2  [replicated: d1]"


def test_log_softmax_over_a_middle_axis():
    mesh = sk.abstract_mesh(x=2, y=4)
    r = sk.infer_forward("log_softmax", T((2, 8, 4), P("x", "y")), mesh=mesh, axis=1)
    assert str(r.inputs[0]) == "[2@x,8,4]"
    r = sk.infer_forward("log_softmax", T((2, 8, 4), P("x", None, "y")), mesh=mesh, axis=1)
    assert str(r.outputs[0]) == "[2@x,8,4@y]"
    assert r.reshards == ()
