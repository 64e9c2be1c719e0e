"""Norm rules: layouts per strategy, grads, errors, strategy sweeps, collective budgets."""

import math

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit.engine.rule import Example
from spmdkit.errors import ShardingConflictError
from spmdkit.ops.norms import layer_norm, sync_batch_norm
from spmdkit.rules.norms import (
    batch_norm_notation,
    group_norm_notation,
    instance_norm_notation,
    layer_norm_notation,
)
from spmdkit.testing import check_forward_case, check_grad_case, check_jit, check_rule
from spmdkit.verification.hlo import compiled_collectives


def T(shape, spec=None, **kw):
    return sk.TensorSpec(shape, spec, dtype="float32", **kw)


C4 = T((4,))

# -- notations -----------------------------------------------------------------


def test_notations():
    assert str(layer_norm_notation(((2, 3, 4), (3, 4)), begin_norm_axis=1, has_bias=False)) == (
        "b0 d0 d1, d0 d1 -> b0 d0 d1  [replicated: d0,d1]"
    )
    assert str(layer_norm_notation(((2, 4), (4,), (4,)), strategy="sharded_stats")) == (
        "b0 d0, d0, d0 -> b0 d0"
    )
    assert (
        str(
            group_norm_notation(((2, 3, 4), (4,)), num_groups=2, data_format="NHWC", has_bias=False)
        )
        == "n s0 c, c -> n s0 c  [replicated: c,s0]"
    )
    assert str(instance_norm_notation(((2, 4, 3),), has_scale=False, has_bias=False)) == (
        "n c s0 -> n c s0  [replicated: s0]"
    )
    assert (
        str(
            batch_norm_notation(
                ((8, 4), C4.shape, C4.shape), training=False, has_scale=False, has_bias=False
            )
        )
        == "n c, c, c -> n c"
    )


# -- layouts per strategy --------------------------------------------------------


def test_layer_norm_default_gathers_the_normalized_dim_sharded_stats_keeps_it():
    mesh = sk.abstract_mesh(a=2, b=4)
    x, w = T((8, 16), P("a", "b")), T((16,))
    ref = sk.infer_forward("layer_norm", x, w, w, mesh=mesh)
    assert [str(s) for s in ref.inputs] == ["f32[8@a,16]", "f32[16]", "f32[16]"]
    assert str(ref.outputs[0]) == "f32[8@a,16]"
    assert not ref.collectives
    fast = sk.infer_forward("layer_norm", x, w, w, mesh=mesh, strategy="sharded_stats")
    assert [str(s) for s in fast.inputs] == ["f32[8@a,16@b]", "f32[16@b]", "f32[16@b]"]
    assert str(fast.outputs[0]) == "f32[8@a,16@b]"
    (stat,) = fast.collectives  # Σx and Σx² of the 4 local rows over b
    assert (stat.kind, stat.axes, stat.payload_bytes) == ("all_reduce", ("b",), 2 * 4 * 4)
    # the planner sees the difference: an activation all-gather against 32 bytes
    assert ref.payload_bytes == 8 * 16 * 4 // 2 > fast.payload_bytes == 32


def test_rms_norm_sharded_stats_all_reduces_one_scalar_per_row():
    mesh = sk.abstract_mesh(x=4)
    x = T((2, 6, 8), P(None, None, "x"))
    res = sk.infer_forward("rms_norm", x, T((8,)), mesh=mesh, strategy="sharded_stats")
    assert str(res.outputs[0]) == "f32[2,6,8@x]"
    assert res.collectives[0].payload_bytes == 12 * 4
    ref = sk.infer_forward("rms_norm", x, T((8,)), mesh=mesh)
    assert str(ref.inputs[0]) == "f32[2,6,8]"


def test_layer_norm_over_several_dims_keeps_the_leading_ones():
    mesh = sk.abstract_mesh(a=2, b=4)
    x = T((2, 4, 8), P("a", "b", None))
    res = sk.infer_forward("layer_norm", x, T((4, 8)), mesh=mesh, begin_norm_axis=1, has_bias=False)
    assert str(res.inputs[0]) == "f32[2@a,4,8]"
    res = sk.infer_forward(
        "layer_norm",
        x,
        T((4, 8)),
        mesh=mesh,
        begin_norm_axis=1,
        has_bias=False,
        strategy="sharded_stats",
    )
    assert str(res.inputs[0]) == "f32[2@a,4@b,8]" and str(res.inputs[1]) == "f32[4@b,8]"


def test_nc_norms_keep_what_the_reference_allows():
    mesh = sk.abstract_mesh(a=2, b=4)
    x = T((8, 4, 4), P("a", "b", None))
    xs = T((8, 4, 4), P("a", None, "b"))
    gn = sk.infer_forward("group_norm", x, C4, C4, mesh=mesh, num_groups=2)
    assert str(gn.inputs[0]) == "f32[8@a,4,4]" and str(gn.inputs[1]) == "f32[4]"
    inn = sk.infer_forward("instance_norm", x, C4, C4, mesh=mesh)
    assert str(inn.inputs[0]) == "f32[8@a,4@b,4]" and str(inn.inputs[1]) == "f32[4@b]"
    assert (
        str(
            sk.infer_forward(
                "instance_norm", xs, mesh=mesh, has_scale=False, has_bias=False
            ).inputs[0]
        )
        == "f32[8@a,4,4]"
    )
    bn = sk.infer_forward("batch_norm", x, C4, C4, C4, C4, mesh=mesh)
    assert str(bn.inputs[0]) == "f32[8,4@b,4]"
    assert [str(o) for o in bn.outputs] == ["f32[8,4@b,4]", "f32[4@b]", "f32[4@b]"]
    bn_inf = sk.infer_forward("batch_norm", xs, C4, C4, C4, C4, mesh=mesh, training=False)
    assert [str(o) for o in bn_inf.outputs] == ["f32[8@a,4,4@b]"]
    sbn = sk.infer_forward("sync_batch_norm", xs, C4, C4, C4, C4, mesh=mesh)
    assert str(sbn.inputs[0]) == "f32[8@a,4,4@b]"
    (stat,) = sbn.collectives  # Σx and Σx² per channel over both axes: O(C)
    assert set(stat.axes) == {"a", "b"} and stat.payload_bytes == 2 * 4 * 4


def test_partial_inputs_are_resolved():
    mesh = sk.abstract_mesh(x=4)
    res = sk.infer_forward("rms_norm", T((4, 8), partial={"x": "sum"}), T((8,)), mesh=mesh)
    assert not res.inputs[0].partial and not res.outputs[0].partial


def test_backward_takes_layouts_from_the_outputs():
    mesh = sk.abstract_mesh(a=2, b=4)
    x, w, out = T((8, 16)), T((16,)), T((8, 16), P("a", "b"))
    r = sk.infer_backward("layer_norm", x, w, w, outputs=(out,), mesh=mesh)
    assert str(r.inputs[0]) == "f32[8@a,16]"  # the normalized dim cannot be sharded
    r = sk.infer_backward(
        "layer_norm", x, w, w, outputs=(out,), mesh=mesh, strategy="sharded_stats"
    )
    assert [str(s) for s in r.inputs] == ["f32[8@a,16@b]", "f32[16@b]", "f32[16@b]"]
    c = T((4,), P("b"))
    r = sk.infer_backward(
        "batch_norm",
        T((8, 4)),
        C4,
        C4,
        outputs=(T((8, 4), P("a", "b")), c, c),
        mesh=mesh,
        has_scale=False,
        has_bias=False,
    )
    assert str(r.inputs[0]) == "f32[8,4@b]"


# -- grads -----------------------------------------------------------------------


def test_param_grads_are_partial_over_the_leading_axes():
    mesh = sk.abstract_mesh(a=2, b=4)
    x, w = T((8, 16), P("a", "b")), T((16,))
    g = sk.infer_grad("layer_norm", x, w, w, out_grads=(x,), mesh=mesh)
    assert [str(s) for s in g.outputs] == ["f32[8@a,16]", "f32[16]{sum:a}", "f32[16]{sum:a}"]
    g = sk.infer_grad("layer_norm", x, w, w, out_grads=(x,), mesh=mesh, strategy="sharded_stats")
    assert [str(s) for s in g.outputs] == ["f32[8@a,16@b]", "f32[16@b]{sum:a}", "f32[16@b]{sum:a}"]
    assert g.collectives[0].payload_bytes == 2 * 4 * 4  # the backward's per-row sums


def test_running_statistics_grads_are_not_partial():
    mesh = sk.abstract_mesh(a=2, b=4)
    x = T((8, 4, 4), P("a", None, "b"))
    outs = (x, C4, C4)
    g = sk.infer_grad("sync_batch_norm", x, C4, C4, C4, C4, out_grads=outs, mesh=mesh)
    assert str(g.outputs[1]) == "f32[4]{sum:a,sum:b}"
    assert str(g.outputs[3]) == "f32[4]" and str(g.outputs[4]) == "f32[4]"
    g = sk.infer_grad("batch_norm", x, C4, C4, C4, C4, out_grads=(x,), mesh=mesh, training=False)
    assert all(str(s) == "f32[4]{sum:a,sum:b}" for s in g.outputs[1:])  # all summed over rows


# -- errors ----------------------------------------------------------------------

X = T((4, 8, 2))


@pytest.mark.parametrize(
    ("op", "specs", "attrs", "match"),
    [
        ("layer_norm", (X, T((2,)), T((2,))), {"begin_norm_axis": 3}, "begin_norm_axis"),
        ("layer_norm", (X, T((2,))), {}, "operand"),
        ("layer_norm", (X, T((8, 2)), T((2,))), {}, "scale has shape"),
        ("layer_norm", (X, T((2,)), T((2,))), {"epsilon": 0.0}, "epsilon"),
        ("rms_norm", (X, T((2,))), {"strategy": "fastest"}, "strategy is one of"),
        ("group_norm", (X, T((8,)), T((8,))), {"num_groups": 3}, "num_groups"),
        (
            "group_norm",
            (X,),
            {"num_groups": 2, "has_scale": False, "has_bias": False, "data_format": "NCW"},
            "data_format",
        ),
        (
            "group_norm",
            (X, T((8,)), T((8,))),
            {"num_groups": 2, "strategy": "sharded_stats"},
            "strategy",
        ),
        ("instance_norm", (T((4, 8)), T((8,)), T((8,))), {}, "rank"),
        ("batch_norm", (X, T((2,)), T((2,)), T((2,)), T((2,))), {}, "has shape"),
        (
            "batch_norm",
            (X, T((8,)), T((8,)), T((8,)), T((8,))),
            {"data_format": "NHWC"},
            "has shape",
        ),
        ("batch_norm", (X, T((8,)), T((8,))), {}, "operand"),
        ("sync_batch_norm", (X, *[T((8,))] * 4), {"momentum": 2.0}, "momentum"),
        ("sync_batch_norm", (X, *[T((8,))] * 4), {"training": "yes"}, "training"),
        ("batch_norm", (X, *[T((8,))] * 4), {"axis": 1}, "attributes fit"),
    ],
)
def test_bad_calls_raise_typed_errors(op, specs, attrs, match):
    with pytest.raises(ShardingConflictError, match=match):
        sk.infer_forward(op, *specs, mesh=sk.abstract_mesh(x=4), **attrs)


# -- the sweep, per strategy -------------------------------------------------------

LN_FAST = (
    Example(((4, 8), (8,), (8,)), attrs={"strategy": "sharded_stats"}, rtol=1e-4),
    Example(
        ((3, 6, 2), (6, 2)),
        attrs={"strategy": "sharded_stats", "begin_norm_axis": 1, "has_bias": False},
        rtol=1e-4,
        uneven=True,
    ),
)
RMS_FAST = (Example(((6, 6), (6,)), attrs={"strategy": "sharded_stats"}, rtol=1e-4, uneven=True),)
LN_REF = (Example(((4, 8), (8,), (8,)), attrs={"strategy": "default"}, rtol=1e-4),)


@pytest.mark.parametrize(
    ("op", "examples"),
    [("layer_norm", LN_FAST), ("rms_norm", RMS_FAST), ("layer_norm", LN_REF)],
    ids=["layer_norm-sharded_stats", "rms_norm-sharded_stats", "layer_norm-default"],
)
@pytest.mark.slow
def test_sweep_per_strategy(op, examples, mesh1d, mesh2d):
    for mesh, seed in ((mesh1d, 0), (mesh2d, 1)):
        report = check_rule(
            op,
            mesh=mesh,
            examples=examples,
            max_cases=12,
            max_grad_cases=5,
            missing=False,
            seed=seed,
        )
        assert report.ok, str(report)
    assert check_jit(op, mesh=mesh2d, examples=examples[:1], max_cases=2).ok


# -- collective budgets from the compiled HLO ----------------------------------------


def _put(x, mesh, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))


def test_sharded_stats_layer_norm_moves_only_row_scalars(mesh2d):
    rows, d = 16, 64
    rng = np.random.default_rng(0)
    x = _put(rng.standard_normal((rows, d)).astype(np.float32), mesh2d, P("a", "b"))
    w = _put(np.ones(d, np.float32), mesh2d, P("b"))

    def fwd(x, w):
        return layer_norm(x, w, w, strategy="sharded_stats")

    local_rows = rows // 2
    (stat,) = compiled_collectives(fwd, x, w)
    assert (stat.kind, stat.group_size, stat.payload_bytes) == ("all_reduce", 4, 2 * local_rows * 4)

    def loss(x, w):
        return (fwd(x, w) ** 2).sum()

    grad = compiled_collectives(jax.grad(loss, argnums=(0, 1)), x, w)
    assert all(c.kind == "all_reduce" for c in grad)
    over_b = [c for c in grad if c.group_size == 4]  # the normalized dim's axis
    over_a = [c for c in grad if c.group_size == 2]  # the weight grads' sum over rows
    assert len(over_b) + len(over_a) == len(grad)
    # forward and backward per-row sums (+ the loss's own sum: one scalar)
    assert sum(c.payload_bytes for c in over_b) <= 2 * (2 * local_rows * 4) + 4
    assert sum(c.payload_bytes for c in over_a) <= 2 * (d // 4) * 4 + 4  # d scale + d bias
    ref = compiled_collectives(lambda x, w: layer_norm(x, w, w), x, w)
    assert sum(c.payload_bytes for c in ref) >= rows * d * 4 // 2 // 4  # gathers activations


def test_sync_batch_norm_moves_only_channel_statistics(mesh2d):
    n, c, s = 16, 8, 8
    rng = np.random.default_rng(1)
    x = _put(rng.standard_normal((n, c, s)).astype(np.float32), mesh2d, P("a", None, "b"))
    stats = _put(np.ones(c, np.float32), mesh2d, P())

    def fwd(x, m):
        return sync_batch_norm(x, m, m, m, m)

    (stat,) = compiled_collectives(fwd, x, stats)
    assert (stat.kind, stat.group_size, stat.payload_bytes) == ("all_reduce", 8, 2 * c * 4)

    def loss(x, m):
        y, mean, var = fwd(x, m)
        return (y**2).sum() + mean.sum() + var.sum()

    grad = compiled_collectives(jax.grad(loss, argnums=(0, 1)), x, stats)
    assert all(c_.kind == "all_reduce" for c_ in grad)
    # every array moved is O(C) (XLA may combine several into one collective):
    # Σx, Σx² forward; their cotangents backward; the scale and bias grads
    assert max(math.prod(shape) for c_ in grad for shape in c_.shapes) <= 2 * c
    assert sum(c_.payload_bytes for c_ in grad) <= 6 * c * 4


def test_sync_batch_norm_with_scale_and_bias_chosen_cases(mesh2d):
    rng = np.random.default_rng(4)
    shapes = [(8, 4, 4), (4,), (4,), (4,), (4,)]
    vals = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    vals[4] = rng.uniform(0.5, 2.0, 4).astype(np.float32)
    x = T((8, 4, 4), P("a", None, "b"))
    specs = (x, C4, C4, C4, C4)
    failure, res = check_forward_case("sync_batch_norm", specs, mesh2d, values=vals, rtol=1e-4)
    assert failure is None, str(failure)
    assert res.inputs[0] == x  # batch and spatial sharding kept
    cots = [rng.standard_normal(s).astype(np.float32) for s in ((8, 4, 4), (4,), (4,))]
    outs = (T((8, 4, 4), P("b")), C4, C4)
    failure, res = check_grad_case(
        "sync_batch_norm", specs, outs, mesh2d, values=vals, cotangents=cots, rtol=1e-4
    )
    assert failure is None, str(failure)
    assert str(res.outputs[1]) == "f32[4]{sum:a,sum:b}"  # scale grad sums over rows


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_sharded_stats_on_an_unevenly_sharded_normalized_dim(op, mesh1d):
    # 6 over 4 devices: blocks of 2, the last device holds only padding
    rng = np.random.default_rng(6)
    vals = [rng.standard_normal(s).astype(np.float32) for s in ((3, 6), (6,))]
    specs = (T((3, 6), P(None, "x")), T((6,), P("x")))
    attrs = {"strategy": "sharded_stats", **({"has_bias": False} if op == "layer_norm" else {})}
    failure, res = check_forward_case(op, specs, mesh1d, values=vals, attrs=attrs, rtol=1e-4)
    assert failure is None, str(failure)
    assert res.inputs == specs and res.collectives  # kept sharded, statistics all-reduced
    cots = [rng.standard_normal((3, 6)).astype(np.float32)]
    failure, res = check_grad_case(
        op, specs, specs[:1], mesh1d, values=vals, cotangents=cots, attrs=attrs, rtol=1e-4
    )
    assert failure is None, str(failure)
    assert res.outputs[1] == specs[1]


# -- fused residual-add + RMS norm ---------------------------------------------------


def test_fused_add_rms_norm_resolves_a_partial_residual_once():
    mesh = sk.abstract_mesh(a=2, b=4)
    x = T((8, 16), P("a"), partial={"b": "sum"})
    r = T((8, 16), P("a"))
    res = sk.infer_forward("fused_add_rms_norm", x, r, T((16,)), mesh=mesh)
    # both inputs stay partial over b (the replicated residual joins for free) ...
    assert res.inputs[0].partial_ops == res.inputs[1].partial_ops == {"b": "sum"}
    assert all(r.plan.payload_bytes == 0 for r in res.reshards)  # r -> p moves nothing
    # ... and the op all-reduces h = x + residual once: the local 4 × 16 block
    (resolve,) = res.collectives
    assert (resolve.kind, resolve.axes, resolve.payload_bytes) == ("all_reduce", ("b",), 4 * 16 * 4)
    y, h, inv = res.outputs
    assert str(y) == str(h) == "f32[8@a,16]" and str(inv) == "f32[8@a]"


def test_fused_add_rms_norm_partial_case_is_numerically_right(mesh2d):
    rng = np.random.default_rng(0)
    values = [rng.standard_normal(s).astype(np.float32) for s in ((8, 16), (8, 16), (16,))]
    specs = (T((8, 16), P("a"), partial={"b": "sum"}), T((8, 16), P("a")), T((16,)))
    failure, res = check_forward_case("fused_add_rms_norm", specs, mesh2d, values=values, rtol=1e-4)
    assert failure is None, str(failure)
    assert res.inputs[1].partial_ops == {"b": "sum"}


def test_fused_add_rms_norm_max_partial_and_scale_partial_are_resolved():
    mesh = sk.abstract_mesh(x=4)
    x = T((4, 8), partial={"x": "max"})
    res = sk.infer_forward("fused_add_rms_norm", x, T((4, 8)), T((8,)), mesh=mesh)
    assert not res.inputs[0].partial and not res.collectives
    s = T((8,), partial={"x": "sum"})
    res = sk.infer_forward("fused_add_rms_norm", T((4, 8)), T((4, 8)), s, mesh=mesh)
    assert not any(i.partial for i in res.inputs)


def test_fused_add_rms_norm_scale_grad_is_partial_over_the_batch_axes():
    mesh = sk.abstract_mesh(a=2, b=4)
    x = T((8, 16), P("a", None))
    g = sk.infer_grad(
        "fused_add_rms_norm",
        x,
        x,
        T((16,)),
        out_grads=(x, x, T((8,), P("a"))),
        mesh=mesh,
    )
    dx, dr, ds = g.outputs
    assert not dx.partial and not dr.partial
    assert ds.partial_ops == {"a": "sum"}


FUSED_FAST = (
    Example(((4, 8), (4, 8), (8,)), attrs={"strategy": "sharded_stats"}, rtol=1e-4),
    Example(((6, 6), (6, 6)), attrs={"strategy": "sharded_stats", "has_scale": False}, rtol=1e-4),
)


@pytest.mark.slow  # the README command's budget
def test_fused_add_rms_norm_sharded_stats_sweep(mesh2d):
    report = check_rule(
        "fused_add_rms_norm",
        mesh=mesh2d,
        examples=FUSED_FAST,
        max_cases=10,
        max_grad_cases=4,
        missing=False,
        seed=4,
    )
    assert report.ok, str(report)
    mesh = sk.abstract_mesh(x=4)
    res = sk.infer_forward(
        "fused_add_rms_norm",
        T((4, 8), P(None, "x")),
        T((4, 8), P(None, "x")),
        T((8,)),
        mesh=mesh,
        strategy="sharded_stats",
    )
    assert str(res.outputs[0]) == "f32[4,8@x]" and res.collectives[0].payload_bytes == 4 * 4


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_uneven_rows_stay_sharded_on_an_axis_of_three(op):
    """A mesh axis of 3 over 32 rows (PaddlePaddle's held-out cases): the rows stay
    sharded forward and grad, the scale grad is partial over them; nothing moves."""
    mesh = sk.abstract_mesh(a=2, c=3)
    x = T((32, 64), P("c", None))
    params = (T((64,)),) * (2 if op == "layer_norm" else 1)
    fwd = sk.infer_forward(op, x, *params, mesh=mesh)
    assert fwd.inputs[0] == x and not fwd.reshards
    grad = sk.infer_grad(op, x, *params, out_grads=(x,), mesh=mesh)
    assert not grad.reshards and grad.outputs[0].dims == (("c",), ())
    assert all(g.partial_ops == {"c": "sum"} for g in grad.outputs[1:])
    fast = sk.infer_forward(
        op, T((32, 64), P(None, "c")), *params, mesh=mesh, strategy="sharded_stats"
    )
    assert fast.inputs[0].dims == ((), ("c",))  # the parameters are sliced: no bytes move
    assert all(r.plan.payload_bytes == 0 for r in fast.reshards)
