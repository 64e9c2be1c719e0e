"""Shape-op family: semantics table, reshape divisibility, errors, jaxpr params."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit.engine.inference import cache_info
from spmdkit.rules.shape import reshape_layout
from spmdkit.testing import check_forward_case, check_grad_case

T = sk.TensorSpec
MESH = sk.abstract_mesh(a=2, b=4)
GATHER_ROWS = {
    "dimension_numbers": lax.GatherDimensionNumbers(
        offset_dims=(1,), collapsed_slice_dims=(0,), start_index_map=(0,)
    ),
    "slice_sizes": (1, 6),
}


def _fwd(op, *specs, **attrs):
    r = sk.infer_forward(op, *specs, mesh=MESH, **attrs)
    return [str(s) for s in r.inputs], [str(s) for s in r.outputs]


# (op, input specs, attrs, required input specs, output specs)
TABLE = [
    # reshape: a merge keeps the major dim's sharding; a sharded minor dim is gathered
    ("reshape", [T((8, 4), P("b"))], {"new_sizes": (32,)}, ["[8@b,4]"], ["[32@b]"]),
    ("reshape", [T((8, 4), P(None, "b"))], {"new_sizes": (32,)}, ["[8,4]"], ["[32]"]),
    # a split puts the sharding on its major part, spilling over once that is split whole
    ("reshape", [T((32,), P(("a", "b")))], {"new_sizes": (2, 16)}, ["[32@(a,b)]"], ["[2@a,16@b]"]),
    ("reshape", [T((32,), P(("a", "b")))], {"new_sizes": (4, 8)}, ["[32@a]"], ["[4@a,8]"]),
    ("reshape", [T((2, 16), P("a", "b"))], {"new_sizes": (32,)}, ["[2@a,16@b]"], ["[32@(a,b)]"]),
    # uneven pass-through dim keeps its sharding; dimensions= transposes first
    ("reshape", [T((6, 8), P("b", "a"))], {"new_sizes": (6, 2, 4)}, ["[6@b,8@a]"], ["[6@b,2@a,4]"]),
    (
        "reshape",
        [T((4, 6), P("b", "a"))],
        {"new_sizes": (6, 4), "dimensions": (1, 0)},
        ["[4@b,6@a]"],
        ["[6@a,4@b]"],
    ),
    # every partial passes through a reshape
    (
        "reshape",
        [T((8, 4), P("b"), partial={"a": "max"})],
        {"new_sizes": (32,)},
        ["[8@b,4]{max:a}"],
        ["[32@b]{max:a}"],
    ),
    (
        "transpose",
        [T((6, 4, 2), P("b", "a"), partial={})],
        {"permutation": (2, 0, 1)},
        ["[6@b,4@a,2]"],
        ["[2,6@b,4@a]"],
    ),
    (
        "broadcast_in_dim",
        [T((6, 1), P("a"), partial={"b": "sum"})],
        {"shape": (2, 6, 4), "broadcast_dimensions": (1, 2)},
        ["[6@a,1]{sum:b}"],
        ["[2,6@a,4]{sum:b}"],
    ),
    (
        "squeeze",
        [T((6, 1, 4), P("a", None, "b"))],
        {"dimensions": (1,)},
        ["[6@a,1,4@b]"],
        ["[6@a,4@b]"],
    ),
    ("expand_dims", [T((6, 4), P("a", "b"))], {"dimensions": (0,)}, ["[6@a,4@b]"], ["[1,6@a,4@b]"]),
    # concatenate: concat dim replicated; a replicated operand joins a sum partial
    (
        "concatenate",
        [T((6, 4), P("a", "b")), T((6, 2), partial={"b": "sum"})],
        {"dimension": 1},
        ["[6@a,4]{sum:b}", "[6@a,2]{sum:b}"],
        ["[6@a,6]{sum:b}"],
    ),
    (
        "concatenate",
        [T((6, 4), partial={"b": "max"}), T((6, 2), partial={"b": "sum"})],
        {"dimension": 1},
        ["[6,4]", "[6,2]"],
        None,
    ),
    (
        "split",
        [T((6, 8), P("a", "b"))],
        {"sizes": (2, 6), "axis": 1},
        ["[6@a,8]"],
        ["[6@a,2]", "[6@a,6]"],
    ),
    (
        "slice",
        [T((6, 8), P("a", "b"))],
        {"start_indices": (0, 1), "limit_indices": (6, 7), "strides": (1, 2)},
        ["[6@a,8]"],
        ["[6@a,3]"],
    ),
    (
        "slice",
        [T((6, 8), P("a", "b"))],
        {"start_indices": (0, 0), "limit_indices": (6, 8), "strides": None},
        ["[6@a,8@b]"],
        ["[6@a,8@b]"],
    ),
    (
        "dynamic_slice",
        [T((6, 8), P("a", "b"), partial={}), T((), dtype="int32"), T((), dtype="int32")],
        {"slice_sizes": (6, 4)},
        ["[6@a,8]", "i32[]", "i32[]"],
        ["[6@a,4]"],
    ),
    (
        "dynamic_update_slice",
        [T((6, 8), P("a", "b")), T((6, 3)), T(()), T(())],
        {},
        ["[6@a,8]", "[6@a,3]", "[]", "[]"],
        ["[6@a,8]"],
    ),
    # pad: the padding value joins the operand's partial
    (
        "pad",
        [T((6, 4), P("a", "b"), partial={}), T(())],
        {"padding_config": ((0, 0, 0), (1, 2, 1))},
        ["[6@a,4]", "[]"],
        ["[6@a,10]"],
    ),
    (
        "pad",
        [T((6, 4), P("a"), partial={"b": "max"}), T(())],
        {"padding_config": ((0, 0, 0), (1, 2, 1))},
        ["[6@a,4]{max:b}", "[]"],
        ["[6@a,10]{max:b}"],
    ),
    (
        "pad",
        [T((6, 4), P("a"), partial={"b": "sum"}), T(())],
        {"padding_config": ((1, 0, 0), (0, 0, 0))},
        ["[6,4]{sum:b}", "[]{sum:b}"],
        ["[7,4]{sum:b}"],
    ),
    # one data operand: any mix of pending reductions passes (data movement commutes)
    (
        "transpose",
        [T((6, 4), partial={"a": "sum", "b": "min"})],
        {"permutation": (1, 0)},
        ["[6,4]{sum:a,min:b}"],
        ["[4,6]{sum:a,min:b}"],
    ),
    # gather: the indexed dim replicated; index batch dims and whole offset dims stay
    (
        "gather",
        [T((8, 6), P("a", "b")), T((4, 1), P("a"))],
        GATHER_ROWS,
        ["[8,6@b]", "[4@a,1]"],
        ["[4@a,6@b]"],
    ),
    (
        "gather",
        [T((8, 6), partial={"b": "sum"}), T((4, 1))],
        {**GATHER_ROWS, "mode": "fill", "fill_value": 1.0},
        ["[8,6]", "[4,1]"],
        ["[4,6]"],
    ),
    # a slice or dynamic_slice that drops elements passes no pending sum (as gather);
    # a full-range one passes it
    (
        "slice",
        [T((8, 6), partial={"b": "sum"})],
        {"start_indices": (0, 0), "limit_indices": (4, 6)},
        ["[8,6]"],
        ["[4,6]"],
    ),
    (
        "slice",
        [T((8, 6), partial={"b": "sum"})],
        {"start_indices": (0, 0), "limit_indices": (8, 6)},
        ["[8,6]{sum:b}"],
        ["[8,6]{sum:b}"],
    ),
    (
        "dynamic_slice",
        [T((8, 6), partial={"b": "sum"}), T((), dtype="int32"), T((), dtype="int32")],
        {"slice_sizes": (4, 6)},
        ["[8,6]", "i32[]", "i32[]"],
        ["[4,6]"],
    ),
    (
        "dynamic_slice",
        [T((8, 6), partial={"b": "max"}), T((), dtype="int32"), T((), dtype="int32")],
        {"slice_sizes": (4, 6)},
        ["[8,6]{max:b}", "i32[]", "i32[]"],
        ["[4,6]{max:b}"],
    ),
    # a gather passes no pending sum: XLA reduces its operand first
    (
        "gather",
        [T((8, 6), partial={"b": "sum"}), T((4, 1))],
        {**GATHER_ROWS, "mode": "clip"},
        ["[8,6]", "[4,1]"],
        ["[4,6]"],
    ),
    (
        "gather",
        [T((8, 6), partial={"b": "max"}), T((4, 1))],
        {**GATHER_ROWS, "mode": "clip"},
        ["[8,6]{max:b}", "[4,1]"],
        ["[4,6]{max:b}"],
    ),
    (
        "take_along_axis",
        [T((4, 6), P("a", "b")), T((4, 3), P(None, "b"))],
        {"axis": 1},
        ["[4@a,6]", "[4@a,3@b]"],
        ["[4@a,3@b]"],
    ),
]


@pytest.mark.parametrize(("op", "specs", "attrs", "req", "out"), TABLE)
def test_semantics(op, specs, attrs, req, out):
    got_req, got_out = _fwd(op, *specs, **attrs)
    assert got_req == req
    if out is not None:
        assert got_out == out


@pytest.mark.parametrize(
    ("src", "dst", "dims", "kept", "out"),
    [
        ((8, 4), (32,), (("b",), ()), (("b",), ()), (("b",),)),
        ((6, 4), (24,), (("b",), ()), ((), ()), ((),)),  # 6 does not divide over 4
        ((6, 4), (24,), (("a",), ()), (("a",), ()), (("a",),)),
        ((24,), (6, 4), (("a", "b"),), (("a",),), (("a",), ())),  # b does not divide 6/2
        ((2, 4), (8,), ((), ("a",)), ((), ()), ((),)),  # sharded minor under a whole major
        ((2, 3, 4), (6, 4), (("a",), (), ("b",)), (("a",), (), ("b",)), (("a",), ("b",))),
        ((4, 1, 2), (8,), (("b",), (), ()), (("b",), (), ()), (("b",),)),  # size-1 dims
        ((0, 4), (4, 0), (("a",), ()), ((), ()), ((), ())),
        # uneven, but the padded blocks line up: ceil(7/4)·2 = ceil(14/4)
        ((7, 2), (14,), (("b",), ()), (("b",), ()), (("b",),)),
        ((14,), (7, 2), (("b",),), (("b",),), (("b",), ())),
        ((3, 2), (6,), (("a",), ()), ((), ()), ((),)),  # ceil(3/2)·2 ≠ ceil(6/2)
    ],
)
def test_reshape_divisibility(src, dst, dims, kept, out):
    assert reshape_layout(src, dst, dims, {"a": 2, "b": 4}) == (kept, out)


def test_reshape_declares_its_merged_and_split_dims_must_divide():
    rule = sk.get_rule("reshape")
    ctx = sk.RuleContext("reshape", {"a": 2, "b": 4}, {"new_sizes": (6, 2, 4)})
    (x_dims, g_dims) = rule.divisible_dims(ctx, (T((6, 8)),), (T((6, 2, 4)),))
    assert (x_dims, g_dims) == ({1}, {1, 2})  # 6 passes through; 8 splits into 2 × 4
    assert [m.dims for m in sk.get_rule("transpose").must_divide] == []


def test_reshape_asks_for_the_reshard_it_needs():
    r = sk.infer_forward("reshape", T((6, 4), P("b")), mesh=MESH, new_sizes=(24,))
    assert [x.arg for x in r.reshards] == ["input 0"]
    assert "all_gather" in str(r.reshards[0])


def test_reshape_backward_and_grad():
    r = sk.infer_backward(
        "reshape", T((8, 4)), outputs=(T((32,), P(("a", "b"))),), mesh=MESH, new_sizes=(32,)
    )
    assert str(r.inputs[0]) == "[8@(a,b),4]"
    g = sk.infer_grad(
        "reshape",
        T((8, 4)),
        out_grads=(T((32,), P("b"), partial={"a": "sum"}),),
        mesh=MESH,
        new_sizes=(32,),
    )
    assert (str(g.inputs[0]), str(g.outputs[0])) == ("[8@b,4]", "[8@b,4]{sum:a}")


def test_grads_sum_over_factors_the_input_lacks():
    def bcast(out_shape, g):
        return sk.infer_grad(
            "broadcast_in_dim",
            T((6, 1), P("a")),
            out_grads=(g,),
            mesh=MESH,
            shape=out_shape,
            broadcast_dimensions=(1, 2),
        )

    g = bcast((4, 6, 4), T((4, 6, 4), P("b", "a")))
    assert str(g.outputs[0]) == "[6@a,1]{sum:b}"
    # a new dim of 2 over b=4 stays split: the padding of its short blocks is zeroed
    g = bcast((2, 6, 4), T((2, 6, 4), P("b", "a")))
    assert (str(g.out_grads[0]), str(g.outputs[0])) == ("[2@b,6@a,4]", "[6@a,1]{sum:b}")
    g = sk.infer_grad(
        "gather",
        T((8, 6), P(None, "a")),
        T((4, 1), P("b")),
        out_grads=(T((4, 6)),),
        mesh=MESH,
        **GATHER_ROWS,
    )
    assert str(g.outputs[0]) == "[8,6@a]{sum:b}"
    assert str(g.out_grads[0]) == "[4@b,6@a]"


def test_backward_takes_the_output_layout():
    r = sk.infer_backward(
        "transpose",
        T((6, 4, 2)),
        outputs=(T((2, 6, 4), P(None, "b", "a")),),
        mesh=MESH,
        permutation=(2, 0, 1),
    )
    assert str(r.inputs[0]) == "[6@b,4@a,2]"


@pytest.mark.parametrize(
    ("op", "specs", "attrs"),
    [
        ("reshape", [T((8, 4))], {"new_sizes": (5, 6)}),
        ("reshape", [T((8, 4))], {"new_sizes": (32,), "dimensions": (0, 0)}),
        ("reshape", [T((8, 4))], {}),
        ("transpose", [T((8, 4))], {"permutation": (0,)}),
        ("broadcast_in_dim", [T((3,))], {"shape": (2, 4), "broadcast_dimensions": (1,)}),
        ("squeeze", [T((3, 4))], {"dimensions": (0,)}),
        ("expand_dims", [T((3, 4))], {"dimensions": (5,)}),
        ("concatenate", [T((3, 4)), T((2, 5))], {"dimension": 0}),
        ("split", [T((6, 4))], {"sizes": (2, 2), "axis": 0}),
        ("slice", [T((6, 4))], {"start_indices": (0, 3), "limit_indices": (6, 2)}),
        ("dynamic_slice", [T((6, 4)), T(())], {"slice_sizes": (2, 2)}),
        ("dynamic_update_slice", [T((6, 4)), T((7, 4)), T(()), T(())], {}),
        ("pad", [T((6, 4)), T(())], {"padding_config": ((0, 0, 0),)}),
        ("gather", [T((8, 6)), T((4, 2))], GATHER_ROWS),
        ("take_along_axis", [T((4, 6)), T((4,))], {"axis": 1}),
        ("transpose", [T((8, 4))], {"perm": (1, 0)}),
        ("transpose", [T((8, 4))], {"permutation": (1, 0), "strategy": "fancy"}),
    ],
)
def test_bad_attrs_raise_conflicts(op, specs, attrs):
    with pytest.raises(sk.ShardingConflictError) as e:
        sk.infer_forward(op, *specs, mesh=MESH, **attrs)
    assert e.value.op == op and e.value.fix


def _jaxpr_cases():
    x = jnp.ones((4, 6))
    i = jnp.array([1, 2])
    return [
        (lambda x: x.reshape(24), (x,)),
        (lambda x: jax.lax.reshape(x, (6, 4), dimensions=(1, 0)), (x,)),
        (lambda x: x.T, (x,)),
        (lambda x: jnp.broadcast_to(x[:, None, :], (4, 3, 6)), (x,)),
        (lambda x: jnp.squeeze(x[None], 0), (x,)),
        (lambda x: jnp.concatenate([x, x], 1), (x,)),
        (lambda x: jnp.split(x, [2, 5], 1), (x,)),
        (lambda x: x[1:3, ::2], (x,)),
        (lambda x, i: lax.dynamic_slice(x, (i[0], 0), (2, 6)), (x, i)),
        (lambda x, i: lax.dynamic_update_slice(x, jnp.ones((2, 6)), (i[0], 0)), (x, i)),
        (lambda x, i: x[i], (x, i)),
        (lambda x: jnp.pad(x, ((1, 2), (0, 0))), (x,)),
        (lambda x, i: jnp.take_along_axis(x, jnp.zeros((4, 2), int), axis=1), (x, i)),
    ]


def _eqns(jaxpr):
    for e in jaxpr.eqns:
        yield e
        for p in e.params.values():
            inner = getattr(p, "jaxpr", None)  # a closed jaxpr (pjit / jit params)
            if inner is not None and hasattr(inner, "eqns"):
                yield from _eqns(inner)


SHAPE_OPS = {
    "reshape",
    "transpose",
    "broadcast_in_dim",
    "squeeze",
    "concatenate",
    "split",
    "slice",
    "dynamic_slice",
    "dynamic_update_slice",
    "gather",
    "pad",
}


@pytest.mark.parametrize("case", range(13))
def test_jaxpr_params_are_accepted_unchanged(case):
    """Each shape primitive's eqn.params go to the rule as they are, twice (cache hit),
    and the rule's impl with those params reproduces the primitive."""
    fn, args = _jaxpr_cases()[case]
    closed = jax.make_jaxpr(fn)(*args)
    seen = 0
    for e in _eqns(closed.jaxpr):
        if e.primitive.name not in SHAPE_OPS:
            continue
        seen += 1
        specs = [T(v.aval.shape, dtype=v.aval.dtype) for v in e.invars]
        r = sk.infer_forward(e.primitive.name, *specs, mesh=MESH, **e.params)
        assert [o.shape for o in r.outputs] == [v.aval.shape for v in e.outvars]
        hits = cache_info()["hits"]
        sk.infer_forward(e.primitive.name, *specs, mesh=MESH, **e.params)
        assert cache_info()["hits"] == hits + 1
        rng = np.random.default_rng(0)
        vals = [
            jnp.asarray(rng.integers(0, 2, v.aval.shape).astype(v.aval.dtype)) for v in e.invars
        ]
        want = e.primitive.bind(*vals, **e.params)
        got = sk.get_rule(e.primitive.name).impl(*vals, **e.params)
        for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
            np.testing.assert_array_equal(np.asarray(w), np.asarray(g))
    assert seen > 0


BATCHED_GATHER = {
    "dimension_numbers": lax.GatherDimensionNumbers(
        offset_dims=(),
        collapsed_slice_dims=(1,),
        start_index_map=(1,),
        operand_batching_dims=(0,),
        start_indices_batching_dims=(0,),
    ),
    "slice_sizes": (1, 1),
    "mode": lax.GatherScatterMode.CLIP,
}


@pytest.mark.parametrize(
    ("op", "specs", "attrs", "dtypes", "req"),
    [
        # a split spilling over into the minor part, and a transposing reshape
        ("reshape", [T((32,), P(("a", "b")))], {"new_sizes": (2, 16)}, None, None),
        (
            "reshape",
            [T((4, 6), P("b", "a"))],
            {"new_sizes": (6, 4), "dimensions": (1, 0)},
            None,
            None,
        ),
        # uneven kept dims: local bounds are block sizes
        (
            "slice",
            [T((6, 8), P("b"))],
            {"start_indices": (0, 2), "limit_indices": (6, 8)},
            None,
            "[6@b,8]",
        ),
        (
            "dynamic_slice",
            [T((6, 8), P("b")), T(()), T(())],
            {"slice_sizes": (6, 3)},
            ("float32", "int32", "int32"),
            "[6@b,8]",
        ),
        # batched gather (take_along_axis lowers to it): batch dims shard operand and indices
        (
            "gather",
            [T((4, 6), P("a", "b")), T((4, 3, 1), P("a"))],
            BATCHED_GATHER,
            ("float32", "int32"),
            "[4@a,6]",
        ),
    ],
)
def test_chosen_cases_run_numerically(mesh2d, op, specs, attrs, dtypes, req):
    from spmdkit.testing import check_forward_case, check_grad_case, random_value

    rng = np.random.default_rng(0)
    dtypes = dtypes or ("float32",) * len(specs)
    specs = [s.replace(dtype=d) for s, d in zip(specs, dtypes, strict=True)]
    values = [random_value(s.shape, d, rng=rng) for s, d in zip(specs, dtypes, strict=True)]
    failure, res = check_forward_case(op, specs, mesh2d, values=values, attrs=attrs)
    assert failure is None, str(failure)
    if req is not None:
        assert str(res.inputs[0].replace(dtype=None)) == req
    assert any(s.sharding_axes for s in res.outputs)
    diff = [np.dtype(d) == np.float32 for d in dtypes]
    cots = [random_value(o.shape, "float32", rng=rng) for o in res.outputs]
    failure, _ = check_grad_case(
        op,
        specs,
        [o.without_partial() for o in res.outputs],
        mesh2d,
        values=values,
        cotangents=cots,
        attrs=attrs,
        differentiable=diff,
    )
    assert failure is None, str(failure)


@pytest.mark.parametrize(
    ("op", "specs", "attrs"),
    [
        ("reshape", [T((8, 4), P("b"))], {"new_sizes": (32,)}),
        ("reshape", [T((32,), P(("a", "b")))], {"new_sizes": (2, 16)}),
        ("reshape", [T((4, 8), P("b", "a"))], {"new_sizes": (8, 4), "dimensions": (1, 0)}),
        (
            "broadcast_in_dim",
            [T((8, 1), P("b"))],
            {"shape": (2, 8, 4), "broadcast_dimensions": (1, 2)},
        ),
        ("slice", [T((8, 8), P("b", "a"))], {"start_indices": (0, 2), "limit_indices": (8, 8)}),
        (
            "dynamic_slice",
            [T((8, 8), P("b", "a")), T((), dtype="int32"), T((), dtype="int32")],
            {"slice_sizes": (8, 4)},
        ),
        ("gather", [T((4, 6), P("b")), T((4, 3, 1), P("b"), dtype="int32")], BATCHED_GATHER),
    ],
)
def test_xla_needs_no_communication_for_the_claimed_layouts(mesh2d, op, specs, attrs):
    """Rules with a custom local computation are jit-checked on that program by the
    shared sweep; here XLA compiles the global op itself between the required and the
    claimed layouts and must move nothing."""
    from spmdkit.verification.hlo import compiled_collectives

    amesh = jax.sharding.Mesh(mesh2d.devices, mesh2d.axis_names)
    res = sk.infer_forward(op, *specs, mesh=mesh2d, **attrs)
    assert any(o.sharding_axes for o in res.outputs)
    args = [
        jax.ShapeDtypeStruct(s.shape, s.dtype or np.float32, sharding=s.to_named_sharding(amesh))
        for s in res.inputs
    ]
    impl = sk.get_rule(op).impl
    out = res.outputs[0].to_named_sharding(amesh)
    assert compiled_collectives(lambda *a: impl(*a, **attrs), *args, out_shardings=out) == []


@pytest.mark.slow
@pytest.mark.parametrize(
    ("op", "specs", "grad", "values", "attrs"),
    [
        # a broadcast's new dim split unevenly: the input grad sums the cotangent over it
        (
            "broadcast_in_dim",
            [T((6, 1))],
            T((2, 6, 4), P("c", None, "a")),
            [(6, 1)],
            {"shape": (2, 6, 4), "broadcast_dimensions": (1, 2)},
        ),
        # a padding value's grad sums the cotangent over the uneven rows
        (
            "pad",
            [T((32, 4)), T(())],
            T((32, 10), P("c")),
            [(32, 4), ()],
            {"padding_config": ((0, 0, 0), (1, 2, 1))},
        ),
        # uneven merge whose blocks line up: 11·2 = ceil(64/3)
        ("reshape", [T((32, 2), P("c"))], T((64,), P("c")), [(32, 2)], {"new_sizes": (64,)}),
    ],
)
def test_uneven_dims_a_grad_sums_over_stay_split(op, specs, grad, values, attrs):
    mesh = sk.make_mesh(a=2, c=3)
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal(s).astype(np.float32) for s in values]
    cot = rng.standard_normal(grad.shape).astype(np.float32)
    failure, res = check_grad_case(
        op, specs, [grad], mesh, values=xs, cotangents=[cot], attrs=attrs
    )
    assert failure is None, str(failure)
    assert res.out_grads[0].dims == grad.dims  # nothing gathered
    failure, fwd = check_forward_case(op, list(res.inputs), mesh, values=xs, attrs=attrs)
    assert failure is None, str(failure)
    assert fwd.inputs == res.inputs  # the forward keeps the uneven split too
