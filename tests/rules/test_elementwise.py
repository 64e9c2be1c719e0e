"""Elementwise family: broadcast notation and the partial policy per op."""

import pytest
from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit.rules.elementwise import broadcast_notation

T = sk.TensorSpec
MESH = sk.abstract_mesh(x=4, y=2)


@pytest.mark.parametrize(
    ("shapes", "text"),
    [
        (((8, 4), (8, 4)), "d0 d1, d0 d1 -> d0 d1"),
        (((8, 4), (4,)), "d0 d1, d1 -> d0 d1"),
        (((8, 1), (1, 4)), "d0 1, 1 d1 -> d0 d1"),
        (((1,), (1,)), "d0, d0 -> d0"),
        (((2, 8, 4), (8, 1), ()), "d0 d1 d2, d1 1,  -> d0 d1 d2"),
    ],
)
def test_broadcast_notation(shapes, text):
    assert broadcast_notation(shapes) == text


def test_policies_are_declared_per_op():
    policies = {op: sk.get_rule(op).partial for op in ("add", "mul", "exp", "neg", "lt", "where")}
    assert policies == {
        "add": "ADDITIVE",
        "mul": "MULTIPLICATIVE",
        "exp": "MONOTONE",
        "neg": "NEGATE",
        "lt": "NONE",
        "where": "SELECT",
    }


def test_where_keeps_the_condition_replicated_over_partial_axes():
    r = sk.infer_forward(
        "where",
        T((8,), partial="x", dtype="bool"),
        T((8,), partial="x"),
        T((8,), partial="x"),
        mesh=MESH,
    )
    assert [str(s) for s in r.inputs] == ["bool[8]", "[8]", "[8]"]
    assert str(r.outputs[0]) == "[8]"
    r = sk.infer_forward(
        "where", T((8,), P("y"), dtype="bool"), T((8,), partial="x"), T((8,)), mesh=MESH
    )
    assert str(r.outputs[0]) == "[8@y]{sum:x}"


def test_max_of_max_partials_stays_max_partial():
    r = sk.infer_forward(
        "max", T((8,), partial={"x": "max"}), T((8,), partial={"x": "max"}), mesh=MESH
    )
    assert str(r.outputs[0]) == "[8]{max:x}"


def test_mixed_reduce_ops_do_not_combine():
    # max over x from one operand, sum over y from the other: they do not commute
    r = sk.infer_forward("mul", T((8,), partial={"y": "sum"}), T((8,)), mesh=MESH)
    assert str(r.outputs[0]) == "[8]{sum:y}"
    r = sk.infer_forward(
        "add", T((8,), partial={"x": "max"}), T((8,), partial={"y": "sum"}), mesh=MESH
    )
    assert len(r.outputs[0].partial) == 1
