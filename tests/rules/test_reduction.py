"""Reduction family: notation goldens and axis handling."""

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
