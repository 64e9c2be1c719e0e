"""Inference semantics (the reference rules) and the public call contract."""

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit.engine import inference
from spmdkit.testing import check_forward_case

T = sk.TensorSpec
MESH = sk.abstract_mesh(data=2, model=4)


def fwd(op, *specs, **attrs):
    return sk.infer_forward(op, *specs, mesh=MESH, **attrs)


def strs(specs):
    return [str(s) for s in specs]


def test_replicated_yields_to_sharded():
    r = fwd("add", T((8, 4)), T((8, 4), P("data")))
    assert strs(r.inputs) == ["[8@data,4]", "[8@data,4]"]
    assert strs(r.outputs) == ["[8@data,4]"]
    assert [rs.arg for rs in r.reshards] == ["input 0"]


def test_earlier_input_wins_a_conflict():
    r = fwd("add", T((8, 4), P("model")), T((8, 4), P("data")))
    assert strs(r.outputs) == ["[8@model,4]"]
    assert strs(r.inputs) == ["[8@model,4]", "[8@model,4]"]


def test_an_axis_shards_one_dim_first_keeps_it():
    r = fwd("matmul", T((8, 16), P("model")), T((16, 4), P(None, "model")))
    assert strs(r.outputs) == ["[8@model,4]"]
    assert strs(r.inputs) == ["[8@model,16]", "[16,4]"]


def test_broadcast_size_one_dims_never_sharded():
    r = fwd("add", T((8, 1), P(None, "model")), T((1, 4), P("data", "model")))
    assert strs(r.inputs) == ["[8,1]", "[1,4@model]"]
    assert strs(r.outputs) == ["[8,4@model]"]


def test_contracted_axis_becomes_partial_sum():
    r = fwd("matmul", T((64, 32), P("data", "model")), T((32, 16), P("model")))
    assert strs(r.outputs) == ["[64@data,16]{sum:model}"]
    assert r.reshards == ()


def test_matmul_transpose_flags_and_one_d_operands():
    r = fwd(
        "matmul",
        T((32, 64), P("model", "data")),
        T((16, 32), P(None, "model")),
        transpose_x=True,
        transpose_y=True,
    )
    assert strs(r.outputs) == ["[64@data,16]{sum:model}"]
    r = fwd("matmul", T((32,), P("model")), T((32, 16)))
    assert strs(r.inputs) == ["[32@model]", "[32@model,16]"]
    assert strs(r.outputs) == ["[16]{sum:model}"]
    r = fwd("matmul", T((4, 8, 32), P("data")), T((32, 16), P(None, "model")))
    assert strs(r.outputs) == ["[4@data,8,16@model]"]


@pytest.mark.parametrize(
    ("op", "reduce"),
    [("reduce_sum", "sum"), ("reduce_mean", "avg"), ("reduce_max", "max"), ("reduce_min", "min")],
)
def test_reduction_over_a_sharded_dim_is_partial_with_the_ops_reduce(op, reduce):
    r = fwd(op, T((8, 16), P("data", "model")), axis=1)
    assert strs(r.outputs) == [f"[8@data]{{{reduce}:model}}"]


def test_prod_reduction_needs_the_dim_replicated():
    r = fwd("reduce_prod", T((8, 16), P("data", "model")), axis=1)
    assert strs(r.inputs) == ["[8@data,16]"]
    assert strs(r.outputs) == ["[8@data]"]


def test_mean_over_an_uneven_dim_stays_sharded(mesh2d):
    r = fwd("reduce_mean", T((8, 6), P(None, "model")), axis=1)
    assert strs(r.outputs) == ["[8]{avg:model}"]
    assert strs(r.inputs) == ["[8,6@model]"]
    # each device's mean of its padded block is rescaled: the average is the global mean
    x = T((8, 6), P(None, "b"))
    values = [np.random.default_rng(0).standard_normal((8, 6)).astype(np.float32)]
    failure, res = check_forward_case("reduce_mean", [x], mesh2d, values=values, attrs={"axis": 1})
    assert failure is None, str(failure)
    assert strs(res.outputs) == ["[8]{avg:b}"]


def test_keepdims_keeps_a_size_one_unsharded_dim():
    r = fwd("reduce_sum", T((8, 16), P("data", "model")), axis=1, keepdims=True)
    assert strs(r.outputs) == ["[8@data,1]{sum:model}"]


def test_softmax_axis_replicated():
    r = fwd("softmax", T((8, 16), P("data", "model")), axis=-1)
    assert strs(r.inputs) == ["[8@data,16]"]
    assert strs(r.outputs) == ["[8@data,16]"]
    (rs,) = r.reshards
    assert [c.kind for c in rs.plan.collectives] == ["all_gather"]


@pytest.mark.parametrize(
    ("op", "specs", "expected_out", "expected_in"),
    [
        # sum-partial + sum-partial stays sum-partial
        ("add", [T((8,), partial="model"), T((8,), partial="model")], "[8]{sum:model}", None),
        # a replicated addend joins as partial for free (one rank keeps it)
        (
            "add",
            [T((8,), partial="model"), T((8,))],
            "[8]{sum:model}",
            ["[8]{sum:model}", "[8]{sum:model}"],
        ),
        # sum-partial x replicated stays sum-partial; two partial factors do not
        ("mul", [T((8,), partial="model"), T((8,))], "[8]{sum:model}", None),
        ("mul", [T((8,), partial="model"), T((8,), partial="model")], "[8]", ["[8]", "[8]"]),
        # max-partial passes through monotone exp, sum-partial does not
        ("exp", [T((8,), partial={"model": "max"})], "[8]{max:model}", None),
        ("exp", [T((8,), partial="model")], "[8]", ["[8]"]),
        # negation turns max into min
        ("neg", [T((8,), partial={"model": "max"})], "[8]{min:model}", None),
        # c - max(a) = min(c - a)
        ("sub", [T((8,)), T((8,), partial={"model": "max"})], "[8]{min:model}", None),
        # a sum-partial numerator over a replicated denominator
        ("div", [T((8,), partial="model"), T((8,))], "[8]{sum:model}", None),
        ("div", [T((8,)), T((8,), partial="model")], "[8]", ["[8]", "[8]"]),
        # comparisons pass nothing
        ("lt", [T((8,), partial={"model": "max"}), T((8,))], "bool[8]", ["[8]", "[8]"]),
        # sum reduction of a sum-partial is sum-partial; max reduction of it is not
        ("reduce_sum", [T((8, 4), partial="data")], "[8]{sum:data}", None),
        ("reduce_max", [T((8, 4), partial="data")], "[8]", ["[8,4]"]),
    ],
)
def test_partial_algebra(op, specs, expected_out, expected_in):
    attrs = {"axis": 1} if op.startswith("reduce") else {}
    r = fwd(op, *specs, **attrs)
    assert str(r.outputs[0]) == expected_out
    if expected_in is not None:
        assert strs(r.inputs) == expected_in


def test_partial_loses_to_sharding_on_the_same_axis():
    r = fwd("mul", T((8,), partial="model"), T((8,), P("model")))
    assert strs(r.inputs) == ["[8@model]", "[8@model]"]
    (rs,) = r.reshards
    assert [c.kind for c in rs.plan.collectives] == ["reduce_scatter"]


def test_narrowing_cast_resolves_sum_but_keeps_max():
    r = fwd("convert_element_type", T((8,), partial="model", dtype="float32"), new_dtype="bfloat16")
    assert strs(r.outputs) == ["bf16[8]"]
    r = fwd(
        "convert_element_type",
        T((8,), partial={"model": "max"}, dtype="float32"),
        new_dtype="bfloat16",
    )
    assert strs(r.outputs) == ["bf16[8]{max:model}"]
    r = fwd("convert_element_type", T((8,), partial="model", dtype="bfloat16"), new_dtype="float32")
    assert strs(r.outputs) == ["f32[8]{sum:model}"]


def test_backward_from_outputs():
    r = sk.infer_backward(
        "matmul", T((64, 32)), T((32, 16)), outputs=(T((64, 16), P("data", "model")),), mesh=MESH
    )
    assert strs(r.inputs) == ["[64@data,32]", "[32,16@model]"]
    assert strs(r.outputs) == ["[64@data,16@model]"]


def test_backward_traces_a_partial_output_to_the_contracted_dim():
    r = sk.infer_backward(
        "matmul",
        T((64, 32)),
        T((32, 16)),
        outputs=(T((64, 16), P("data"), partial="model"),),
        mesh=MESH,
    )
    assert strs(r.inputs) == ["[64@data,32@model]", "[32@model,16]"]
    assert strs(r.outputs) == ["[64@data,16]{sum:model}"]


def test_backward_drops_what_the_op_cannot_produce():
    r = sk.infer_backward(
        "softmax", T((8, 16)), outputs=(T((8, 16), P("data", "model")),), mesh=MESH, axis=-1
    )
    assert strs(r.inputs) == ["[8@data,16]"]
    assert [rs.arg for rs in r.reshards] == ["input 0", "output 0"]


def test_grad_of_weight_is_partial_over_the_batch_axis():
    x = T((64, 32), P("data", "model"))
    w = T((32, 16), P("model"))
    g = T((64, 16), P("data"))
    r = sk.infer_grad("matmul", x, w, out_grads=(g,), mesh=MESH)
    assert strs(r.outputs) == ["[64@data,32@model]", "[32@model,16]{sum:data}"]
    assert strs(r.out_grads) == ["[64@data,16]"]
    assert strs(r.forward_outputs) == ["[64@data,16]{sum:model}"]


def test_grad_of_broadcast_operand_sums_over_the_broadcast_dim():
    r = sk.infer_grad(
        "add", T((8, 4), P("data")), T((4,)), out_grads=(T((8, 4), P("data")),), mesh=MESH
    )
    assert strs(r.outputs) == ["[8@data,4]", "[4]{sum:data}"]


def test_grad_takes_free_factors_from_the_cotangent():
    r = sk.infer_grad(
        "matmul", T((8, 32)), T((32, 16)), out_grads=(T((8, 16), P(None, "model")),), mesh=MESH
    )
    assert strs(r.inputs) == ["[8,32]", "[32,16@model]"]
    assert strs(r.outputs) == ["[8,32]{sum:model}", "[32,16@model]"]


def test_grad_passes_a_sum_partial_cotangent():
    r = sk.infer_grad(
        "exp", T((8,), P("data")), out_grads=(T((8,), P("data"), partial="model"),), mesh=MESH
    )
    assert strs(r.outputs) == ["[8@data]{sum:model}"]


def test_shape_mismatch_is_a_conflict():
    with pytest.raises(sk.ShardingConflictError, match="agree") as info:
        fwd("matmul", T((4, 3)), T((5, 2)))
    assert "transpose" in info.value.fix
    with pytest.raises(sk.ShardingConflictError, match="fit the op"):
        fwd("matmul", T((4, 3)))
    with pytest.raises(sk.ShardingConflictError):
        sk.infer_grad("exp", T((8,)), out_grads=(T((4,)),), mesh=MESH)


def test_unknown_axis_in_an_input_is_refused():
    with pytest.raises(sk.UnknownAxisError):
        fwd("exp", T((8,), P("tensor")))


def test_non_spec_input_is_refused():
    with pytest.raises(sk.SpecError, match="TensorSpec"):
        fwd("exp", (8,))


def test_mesh_must_be_a_mesh():
    with pytest.raises(sk.SpecError, match="Mesh"):
        sk.infer_forward("exp", T((8,)), mesh={"x": 4})


def test_unknown_op():
    with pytest.raises(sk.NoRuleError):
        fwd("softmaxx", T((8,)))


def test_results_are_cached_and_equal():
    inference.clear_cache()
    x = T((8, 16), P("data"))
    a = fwd("exp", x)
    before = inference.cache_info()
    b = fwd("exp", x)
    after = inference.cache_info()
    assert a is b
    assert after["hits"] == before["hits"] + 1
    c = sk.infer_forward("exp", x, mesh=sk.abstract_mesh(data=4, model=2))
    assert c is not a


def test_works_on_real_and_abstract_meshes(mesh2d):
    x = T((8, 16), P("a", "b"))
    w = T((16, 4), P("b"))
    real = sk.infer_forward("matmul", x, w, mesh=mesh2d)
    abstract = sk.infer_forward("matmul", x, w, mesh=sk.abstract_mesh(a=2, b=4))
    assert real.outputs == abstract.outputs


def test_result_prints_readably():
    r = fwd("softmax", T((8, 16), P("data", "model")), axis=-1)
    text = str(r)
    assert text.startswith("softmax forward: [8@data,16] -> [8@data,16]")
    assert "input 0" in text and "all_gather" in text
