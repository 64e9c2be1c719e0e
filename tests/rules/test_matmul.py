"""Contraction family: notation goldens for matmul, dot_general, einsum."""

import pytest
from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit.rules.matmul import dot_general_notation, einsum_notation, matmul_notation

T = sk.TensorSpec


@pytest.mark.parametrize(
    ("shapes", "attrs", "text"),
    [
        (((8, 4), (4, 2)), {}, "... m k, ... k n -> m n"),
        (((3, 8, 4), (4, 2)), {}, "... m k, ... k n -> ... m n"),
        (((4,), (4, 2)), {}, "k, ... k n -> n"),
        (((8, 4), (4,)), {}, "... m k, k -> m"),
        (((4,), (4,)), {}, "k, k -> "),
        (((4, 8), (2, 4)), {"transpose_x": True, "transpose_y": True}, "... k m, ... n k -> m n"),
    ],
)
def test_matmul_notation(shapes, attrs, text):
    assert matmul_notation(shapes, **attrs) == text


def test_dot_general_notation():
    dn = (((2,), (1,)), ((0,), (0,)))
    assert dot_general_notation(((2, 8, 4), (2, 4, 6)), dimension_numbers=dn) == (
        "b0 m0 k0, b0 k0 n0 -> b0 m0 n0"
    )


def test_einsum_notation_and_ellipsis():
    assert einsum_notation(((2, 3), (3, 4)), equation="ij,jk->ik") == "i j, j k -> i k"
    assert einsum_notation(((5, 2, 3), (3, 4)), equation="...ij,jk->...ik") == (
        "... i j, j k -> ... i k"
    )
    with pytest.raises(sk.ShardingConflictError):
        einsum_notation(((2, 3),), equation="ij")


def test_batch_dims_broadcast_right_aligned():
    mesh = sk.abstract_mesh(x=2, y=4)
    r = sk.infer_forward("matmul", T((4, 1, 8, 16), P("x")), T((8, 16, 2), P("y")), mesh=mesh)
    assert str(r.outputs[0]) == "[4@x,8@y,8,2]"


def test_uneven_broadcast_batch_dim_is_not_split():
    # x broadcasts the size-3 batch dim: its grad sums over that dim, where the
    # padding of an uneven split (3 over 4) would be added into real elements
    mesh = sk.abstract_mesh(x=2, y=4)
    r = sk.infer_forward("matmul", T((4, 1, 8, 16), P("x")), T((3, 16, 2), P("y")), mesh=mesh)
    assert str(r.outputs[0]) == "[4@x,3,8,2]"


def test_matmul_rank_zero_is_refused():
    with pytest.raises(sk.ShardingConflictError):
        sk.infer_forward("matmul", T(()), T((4,)), mesh=sk.abstract_mesh(x=2))


def test_uneven_dims_stay_sharded_on_an_axis_of_three():
    """PaddlePaddle's held-out cases (a mesh axis of 3, dims of 32 and 64): the batch,
    contracting and output dims keep their sharding, forward and grad; nothing moves."""
    import spmdkit as sk

    mesh = sk.abstract_mesh(a=2, c=3)
    x = sk.TensorSpec((32, 64), P("c", "a"), dtype="float32")
    w = sk.TensorSpec((64, 32), P("a", None), dtype="float32")
    fwd = sk.infer_forward("matmul", x, w, mesh=mesh)
    assert fwd.inputs == (x, w) and not fwd.reshards
    assert str(fwd.outputs[0]) == "f32[32@c,32]{sum:a}"
    g = sk.TensorSpec((32, 32), P("c", None), dtype="float32")
    grad = sk.infer_grad("matmul", x, w, out_grads=(g,), mesh=mesh)
    assert not grad.reshards
    assert grad.outputs[0].dims == (("c",), ("a",)) and grad.outputs[1].partial_ops == {"c": "sum"}
