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


def test_uneven_broadcast_batch_dim_stays_split(mesh2d):
    # x broadcasts the size-3 batch dim: its grad sums over that dim. The split
    # (3 over 4) stays: the local computation zeroes the padding of the cotangent
    # and fills w's padding, so nothing of it is added into real elements
    import numpy as np

    from spmdkit.testing import check_grad_case

    mesh = sk.abstract_mesh(a=2, b=4)
    x, w = T((4, 1, 8, 16), P("a")), T((3, 16, 2), P("b"))
    r = sk.infer_forward("matmul", x, w, mesh=mesh)
    assert str(r.outputs[0]) == "[4@a,3@b,8,2]"
    rng = np.random.default_rng(0)
    values = [rng.standard_normal(s.shape).astype(np.float32) for s in (x, w)]
    g = rng.standard_normal((4, 3, 8, 2)).astype(np.float32)
    failure, res = check_grad_case(
        "matmul",
        (x.replace(dtype="float32"), w.replace(dtype="float32")),
        (r.outputs[0].replace(dtype="float32"),),
        mesh2d,
        values=values,
        cotangents=[g],
        rtol=1e-4,
    )
    assert failure is None, str(failure)
    assert res.outputs[0].partial_ops == {"b": "sum"}  # x's grad sums over the split dim


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
