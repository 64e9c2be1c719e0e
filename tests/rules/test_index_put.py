"""index_put family: layouts per strategy, partials, errors, the zero-communication update."""

import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit.engine.local import shard_program
from spmdkit.engine.registry import get_rule
from spmdkit.engine.rule import Example
from spmdkit.errors import ShardingConflictError
from spmdkit.rules.index_put import index_put_reference
from spmdkit.testing import check_rule
from spmdkit.verification.hlo import compiled_collectives

T = sk.TensorSpec


def x_spec(spec=None, shape=(8, 4), **kw):
    return T(shape, spec, dtype="float32", **kw)


def i_spec(shape=(3,), spec=None, dtype="int32"):
    return T(shape, spec, dtype=dtype)


def v_spec(spec=None, shape=(3, 4), **kw):
    return T(shape, spec, dtype="float32", **kw)


def test_reference_replicates_the_indexed_dim_and_passes_the_rest():
    mesh = sk.abstract_mesh(a=2, b=4)
    r = sk.infer_forward(
        "index_put", x_spec(P("a", "b")), i_spec(spec=P("a")), v_spec(P("b")), mesh=mesh
    )
    assert [str(s) for s in r.inputs] == ["f32[8,4@b]", "i32[3]", "f32[3,4@b]"]
    assert str(r.outputs[0]) == "f32[8,4@b]"
    # value's trailing dim is taken when x's is free
    r = sk.infer_forward("index_put", x_spec(), i_spec(), v_spec(P(None, "a")), mesh=mesh)
    assert str(r.outputs[0]) == "f32[8,4@a]"


def test_local_update_keeps_the_row_sharding():
    mesh = sk.abstract_mesh(x=4)
    r = sk.infer_forward(
        "index_put", x_spec(P("x")), i_spec(), v_spec(), mesh=mesh, strategy="local_update"
    )
    assert str(r.outputs[0]) == "f32[8@x,4]"
    assert r.reshards == () and r.collectives == ()
    g = sk.infer_grad(
        "index_put",
        x_spec(P("x")),
        i_spec(),
        v_spec(),
        out_grads=(x_spec(P("x")),),
        mesh=mesh,
        strategy="local_update",
    )
    assert str(g.outputs[0]) == "f32[8@x,4]"
    assert str(g.outputs[2]) == "f32[3,4]{sum:x}"  # each device gathers only rows it owns


def test_partials_pass_as_the_algebra_allows():
    mesh = sk.abstract_mesh(x=4)
    xs = x_spec(partial={"x": "sum"})
    r = sk.infer_forward("index_put", xs, i_spec(), v_spec(), mesh=mesh)
    assert str(r.inputs[2]) == "f32[3,4]{sum:x}"  # replicated value joins the sum
    assert str(r.outputs[0]) == "f32[8,4]{sum:x}"
    xm = x_spec(partial={"x": "max"})
    assert str(sk.infer_forward("index_put", xm, i_spec(), v_spec(), mesh=mesh).outputs[0]) == (
        "f32[8,4]{max:x}"
    )
    vm = v_spec(partial={"x": "max"})
    r = sk.infer_forward("index_put", x_spec(), i_spec(), vm, mesh=mesh)
    assert str(r.outputs[0]) == "f32[8,4]{max:x}"  # set picks x or value per element
    r = sk.infer_forward("index_put", x_spec(), i_spec(), vm, mesh=mesh, accumulate=True)
    assert not r.outputs[0].partial  # add: max(v) + x is not a max of sums of parts


def test_grad_passes_a_partial_cotangent():
    mesh = sk.abstract_mesh(x=4)
    g = x_spec(partial={"x": "sum"})
    r = sk.infer_grad("index_put", x_spec(), i_spec(), v_spec(), out_grads=(g,), mesh=mesh)
    assert str(r.outputs[0]) == "f32[8,4]{sum:x}"
    assert str(r.outputs[2]) == "f32[3,4]{sum:x}"


def test_backward_from_a_sharded_output():
    mesh = sk.abstract_mesh(x=4)
    out = x_spec(P("x", None))
    r = sk.infer_backward(
        "index_put",
        x_spec(),
        i_spec(),
        v_spec(),
        outputs=(out,),
        mesh=mesh,
        strategy="local_update",
    )
    assert str(r.inputs[0]) == "f32[8@x,4]"
    r = sk.infer_backward("index_put", x_spec(), i_spec(), v_spec(), outputs=(out,), mesh=mesh)
    assert str(r.inputs[0]) == "f32[8,4]"


@pytest.mark.parametrize(
    ("specs", "match"),
    [
        ((x_spec(), i_spec(dtype="float32"), v_spec()), "integer"),
        ((x_spec(), i_spec(), v_spec(shape=(3, 5))), "value has shape"),
        ((x_spec(), i_spec(), i_spec((2,)), v_spec()), "one shape"),
        ((x_spec(), i_spec(), T((3, 4), dtype="bfloat16")), "dtype"),
        ((x_spec(), i_spec(), i_spec(), i_spec(), v_spec(shape=(3,))), "at most one index"),
        ((x_spec(), v_spec()), "operands"),
    ],
)
def test_bad_operands_raise(specs, match):
    with pytest.raises(ShardingConflictError, match=match):
        sk.infer_forward("index_put", *specs, mesh=sk.abstract_mesh(x=4))


def test_unknown_strategy_raises():
    with pytest.raises(ShardingConflictError, match="strategy"):
        sk.infer_forward(
            "index_put", x_spec(), i_spec(), v_spec(), mesh=sk.abstract_mesh(x=4), strategy="x"
        )


def test_local_update_on_row_sharded_x_moves_nothing(mesh2d):
    specs = (x_spec(P(("a", "b")), shape=(16, 4)), i_spec((5,)), v_spec(shape=(5, 4)))
    for acc in (False, True):
        attrs = {"strategy": "local_update", "accumulate": acc}
        res = sk.infer_forward("index_put", *specs, mesh=mesh2d, **attrs)
        amesh = Mesh(mesh2d.devices, mesh2d.axis_names)
        program = shard_program(get_rule("index_put"), res, attrs, amesh)
        args = [s.to_shape_dtype_struct(amesh) for s in res.inputs]
        assert compiled_collectives(program, *args) == []


def _unique(rng):
    x = rng.standard_normal((4, 6, 2)).astype(np.float32)
    flat = rng.choice(24, size=3, replace=False)
    i0, i1 = np.unravel_index(flat, (4, 6))
    v = rng.standard_normal((3, 2)).astype(np.float32)
    return [x, i0.astype(np.int32) - 4 * (flat % 2), i1.astype(np.int32), v]


def test_local_update_set_with_two_index_tensors_sweep(mesh1d):
    ex = Example(
        ((4, 6, 2), (3,), (3,), (3, 2)),
        attrs={"accumulate": False, "strategy": "local_update"},
        dtypes=("float32", "int32", "int32", "float32"),
        differentiable=(True, False, False, True),
        values=_unique,
        uneven=True,
    )
    report = check_rule("index_put", mesh=mesh1d, examples=[ex], max_cases=8, max_grad_cases=3)
    assert report.ok, str(report)


def test_reference_matches_jax_at_semantics():
    x = np.arange(12.0, dtype=np.float32).reshape(6, 2)
    i = np.array([1, -1, 9], dtype=np.int32)  # negative counts from the end; 9 is dropped
    v = np.ones((3, 2), np.float32)
    out = np.asarray(index_put_reference(x, i, v))
    want = x.copy()
    want[[1, 5]] = 1.0
    np.testing.assert_array_equal(out, want)
    out = np.asarray(index_put_reference(x, i, v, accumulate=True))
    want = x.copy()
    want[[1, 5]] += 1.0
    np.testing.assert_array_equal(out, want)
