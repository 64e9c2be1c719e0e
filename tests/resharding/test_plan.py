"""Reshard planning: steps, bytes, order, printing and errors."""

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

from spmdkit.errors import ReshardError, SpmdError, UnknownAxisError
from spmdkit.mesh import abstract_mesh
from spmdkit.resharding import Collective, ReshardPlan, plan_reshard
from spmdkit.spec import TensorSpec
from spmdkit.topology import Topology

M1 = abstract_mesh(x=4)
M2 = abstract_mesh(a=2, b=4)
F32 = "float32"


def spec(shape, layout=None, partial=None, dtype=F32):
    return TensorSpec(shape, layout, partial=partial, dtype=dtype)


def steps(src, dst, mesh=M2, **kw):
    """(kind, axes, dim, dst_dim, reduce_op, payload_bytes) per step."""
    plan = plan_reshard(src, dst, mesh, **kw)
    return [(s.kind, s.axes, s.dim, s.dst_dim, s.reduce_op, s.payload_bytes) for s in plan.steps]


# -- planner: one case per reshard function ---------------------------------------

L = 8 * 16 * 4  # bytes of the global f32[8,16]


@pytest.mark.parametrize(
    ("src", "dst", "mesh", "expected"),
    [
        # s -> r: all-gather; payload = gathered output
        (spec((8, 16), P("x")), spec((8, 16)), M1, [("all_gather", ("x",), 0, None, None, L)]),
        # r -> s: local slice
        (spec((8, 16)), spec((8, 16), P("x")), M1, [("slice", ("x",), 0, None, None, 0)]),
        # s -> s across dims: all-to-all of the local block
        (
            spec((8, 16), P("x")),
            spec((8, 16), P(None, "x")),
            M1,
            [("all_to_all", ("x",), 0, 1, None, L // 4)],
        ),
        # p -> r: all-reduce with the partial's op
        (
            spec((8, 16), partial={"x": "max"}),
            spec((8, 16)),
            M1,
            [("all_reduce", ("x",), None, None, "max", L)],
        ),
        # p -> s: reduce-scatter; payload = input buffer
        (
            spec((8, 16), partial="x"),
            spec((8, 16), P(None, "x")),
            M1,
            [("reduce_scatter", ("x",), 1, None, "sum", L)],
        ),
        # r -> p: local
        (
            spec((8, 16)),
            spec((8, 16), partial="x"),
            M1,
            [("to_partial", ("x",), None, None, "sum", 0)],
        ),
        # p(max) -> p(sum): all-reduce then to_partial
        (
            spec((8, 16), partial={"x": "max"}),
            spec((8, 16), partial={"x": "sum"}),
            M1,
            [
                ("all_reduce", ("x",), None, None, "max", L),
                ("to_partial", ("x",), None, None, "sum", 0),
            ],
        ),
        # s -> p: all-gather then to_partial
        (
            spec((8, 16), P("x")),
            spec((8, 16), partial={"x": "avg"}),
            M1,
            [
                ("all_gather", ("x",), 0, None, None, L),
                ("to_partial", ("x",), None, None, "avg", 0),
            ],
        ),
        # multi-axis dim: keep the common prefix (a), gather the rest (b)
        (
            spec((8, 16), P(("a", "b"))),
            spec((8, 16), P("a")),
            M2,
            [("all_gather", ("b",), 0, None, None, L // 2)],
        ),
        # gather minor-most first, one axis at a time
        (
            spec((8, 16), P(("a", "b"))),
            spec((8, 16)),
            M2,
            [
                ("all_gather", ("b",), 0, None, None, L // 2),
                ("all_gather", ("a",), 0, None, None, L),
            ],
        ),
        # gather b then slice b onto another dim = one all-to-all
        (
            spec((8, 16), P(("a", "b"))),
            spec((8, 16), P("a", "b")),
            M2,
            [("all_to_all", ("b",), 0, 1, None, L // 8)],
        ),
        # swap: b cannot join dim 0 before a leaves it -> gather a, all-to-all b, slice a
        (
            spec((8, 16), P("a", "b")),
            spec((8, 16), P("b", "a")),
            M2,
            [
                ("all_gather", ("a",), 0, None, None, L // 4),
                ("all_to_all", ("b",), 1, 0, None, L // 4),
                ("slice", ("a",), 1, None, None, 0),
            ],
        ),
        # another, larger axis on the same dim: one permute of the target's block
        # (XLA: slice, then collective-permute); payload = the permuted block
        (
            spec((8, 16), P("a")),
            spec((8, 16), P("b")),
            M2,
            [("collective_permute", ("a", "b"), None, None, None, L // 4)],
        ),
        # a smaller one: gather, then slice (a permute is only the last step)
        (
            spec((8, 16), P("b")),
            spec((8, 16), P("a")),
            M2,
            [("all_gather", ("b",), 0, None, None, L), ("slice", ("a",), 0, None, None, 0)],
        ),
        # partial and sharded: reduce while small, then gather
        (
            spec((8, 16), P("b"), partial="a"),
            spec((8, 16)),
            M2,
            [
                ("all_reduce", ("a",), None, None, "sum", L // 4),
                ("all_gather", ("b",), 0, None, None, L),
            ],
        ),
        # reduce-scatter straight into the target dim, then gather the old one
        (
            spec((8, 16), P("b"), partial="a"),
            spec((8, 16), P(None, "a")),
            M2,
            [
                ("reduce_scatter", ("a",), 1, None, "sum", L // 4),
                ("all_gather", ("b",), 0, None, None, L // 2),
            ],
        ),
        # two partial axes onto one dim: staged reduce-scatters, major axis first
        (
            spec((8, 16), partial={"a": "sum", "b": "sum"}),
            spec((8, 16), P(("a", "b"))),
            M2,
            [
                ("reduce_scatter", ("a",), 0, None, "sum", L),
                ("reduce_scatter", ("b",), 0, None, "sum", L // 2),
            ],
        ),
    ],
)
def test_plan_steps(src, dst, mesh, expected):
    assert steps(src, dst, mesh) == expected


def test_mixed_partial_ops_reduce_in_name_order():
    # {max:a, sum:b} means sum_b(max_a(x)): b cannot be summed while a is pending,
    # so a is reduced (and made partial again) around it
    got = steps(
        spec((8, 16), partial={"a": "max", "b": "sum"}), spec((8, 16), partial={"a": "max"})
    )
    assert [(k, ax, op) for k, ax, _, _, op, _ in got] == [
        ("all_reduce", ("a",), "max"),
        ("all_reduce", ("b",), "sum"),
        ("to_partial", ("a",), "max"),
    ]
    # the other way round is already in order: sum over a, keep max over b
    got = steps(
        spec((8, 16), partial={"a": "sum", "b": "max"}), spec((8, 16), partial={"b": "max"})
    )
    assert [(k, ax, op) for k, ax, _, _, op, _ in got] == [("all_reduce", ("a",), "sum")]
    # sum and avg commute: avg over b may go first
    got = steps(
        spec((8, 16), partial={"a": "sum", "b": "avg"}), spec((8, 16), partial={"a": "sum"})
    )
    assert [(k, ax, op) for k, ax, _, _, op, _ in got] == [("all_reduce", ("b",), "avg")]


def test_a_slice_that_shrinks_a_later_gather_runs_first():
    # slicing b onto dim 1 first makes the gather of a move 4x fewer bytes
    got = steps(spec((8, 16), P("a")), spec((8, 16), P(None, "b")))
    assert got == [
        ("slice", ("b",), 1, None, None, 0),
        ("all_gather", ("a",), 0, None, None, L // 4),
    ]
    got = steps(spec((8, 16), partial="a"), spec((8, 16), P("b", "a")))
    assert got == [
        ("slice", ("b",), 0, None, None, 0),
        ("reduce_scatter", ("a",), 1, None, "sum", L // 4),
    ]


def test_slices_that_save_nothing_run_last():
    got = steps(spec((8, 16), P("b")), spec((8, 16), P("a")))
    assert [k for k, *_ in got] == ["all_gather", "slice"]
    got = steps(spec((8, 16), P(("a", "b"))), spec((8, 16), P(("b", "a"))))
    assert [(k, ax) for k, ax, *_ in got] == [("collective_permute", ("a", "b"))]


def test_a_dims_axes_in_another_order_move_by_one_permute():
    """The same blocks on other devices: one collective-permute of the block, as
    XLA moves them (tests/resharding/test_execute.py checks the compiled HLO),
    where the planner had to gather both axes and slice again."""
    plan = plan_reshard(spec((8, 16), P(("a", "b"))), spec((8, 16), P(("b", "a"))), M2)
    (step,) = plan.steps
    assert (step.kind, step.payload_bytes, step.wire_bytes) == ("collective_permute", 64, 64)
    assert step.layouts == ((("a", "b"), ()), (("b", "a"), ()))
    assert str(plan).endswith("collective_permute(a,b) →[(b,a),-] 8×: 64 B")
    # the last step into a finer goal: gathered first, then permuted
    plan = plan_reshard(spec((64, 16), P(("a", "b"))), spec((64, 16), P("b")), M2)
    assert [(s.kind, s.axes, s.payload_bytes) for s in plan.steps] == [
        ("all_gather", ("b",), 64 * 16 * 4 // 2),
        ("collective_permute", ("a", "b"), 64 * 16 * 4 // 4),
    ]
    # never from or into a pending sum (a permute moves one block, not a sum)
    plan = plan_reshard(spec((8, 16), P("a"), partial="b"), spec((8, 16), P("b")), M2)
    assert "collective_permute" not in [s.kind for s in plan.steps]


def test_big_tensors_choose_bandwidth_optimal_groups():
    # tiny: latency dominates -> short groups; big: bytes dominate -> one 8-way all-to-all
    small = steps(spec((8, 16), P(("a", "b"))), spec((8, 16), P(None, ("a", "b"))))
    assert [k for k, *_ in small] == ["all_gather", "all_to_all", "slice"]
    shape = (4096, 4096)
    big = steps(spec(shape, P(("a", "b"))), spec(shape, P(None, ("a", "b"))))
    assert big == [("all_to_all", ("a", "b"), 0, 1, None, 4096 * 4096 * 4 // 8)]


def test_pending_reductions_of_one_op_merge_into_one_all_reduce():
    # as XLA emits it, whatever the size (staged all-reduces send more bytes)
    for shape in [(8, 16), (4096, 4096)]:
        got = steps(spec(shape, partial=("a", "b")), spec(shape))
        assert got == [("all_reduce", ("a", "b"), None, None, "sum", math.prod(shape) * 4)]
    # one axis scatters into the target dim, the other is all-reduced on the smaller block
    got = steps(spec((8, 16), partial=("a", "b")), spec((8, 16), P("b")))
    assert got == [
        ("reduce_scatter", ("b",), 0, None, "sum", L),
        ("all_reduce", ("a",), None, None, "sum", L // 4),
    ]


def test_topology_changes_the_plan():
    src, dst = spec((8, 16), P(("a", "b"))), spec((8, 16), P(None, ("a", "b")))
    no_latency = Topology(default_latency=0.0)
    assert [k for k, *_ in steps(src, dst, topology=no_latency)] == ["all_to_all"]
    plan = plan_reshard(src, dst, M2, topology=no_latency)
    (step,) = plan.steps
    assert step.time_s == pytest.approx(step.wire_bytes / no_latency.default_bandwidth)


def test_uneven_dims_count_padding():
    # 10 rows over 4 devices: 3 per device, the gathered buffer holds 12 rows
    (ag,) = plan_reshard(spec((10, 16), P("x")), spec((10, 16)), M1).steps
    assert (ag.payload_bytes, ag.wire_bytes) == (12 * 16 * 4, 9 * 16 * 4)
    # all-to-all of f32[10,3]: local [3,3], the split dim padded to 4 -> [3,4]
    (a2a,) = plan_reshard(spec((10, 3), P("x")), spec((10, 3), P(None, "x")), M1).steps
    assert a2a.payload_bytes == 3 * 4 * 4
    # reduce-scatter of 6 rows over 4: input padded to 4 x 2 rows
    (rs,) = plan_reshard(spec((6, 8), partial="x"), spec((6, 8), P("x")), M1).steps
    assert rs.payload_bytes == 8 * 8 * 4


def test_bytes_and_time_follow_the_ring_model():
    plan = plan_reshard(spec((8, 16), partial="x"), spec((8, 16)), M1)
    (ar,) = plan.steps
    assert ar.wire_bytes == 2 * 3 * ar.payload_bytes // 4
    bandwidth, latency = Topology.h100().link(("x",), M1)
    assert ar.time_s == pytest.approx(6 * latency + ar.wire_bytes / bandwidth)
    assert (plan.payload_bytes, plan.wire_bytes, plan.time_s) == (
        ar.payload_bytes,
        ar.wire_bytes,
        ar.time_s,
    )
    (ag,) = plan_reshard(spec((8, 16), P("x")), spec((8, 16)), M1).steps
    assert ag.wire_bytes == 3 * ag.payload_bytes // 4
    bf16 = plan_reshard(spec((8, 16), P("x"), dtype="bfloat16"), spec((8, 16), dtype=None), M1)
    assert bf16.payload_bytes == L // 2


def test_plan_value_semantics_and_printing():
    src, dst = spec((8, 4), P("x")), spec((8, 4))
    plan = plan_reshard(src, dst, M1)
    assert plan is plan_reshard(src, dst, M1)  # cached
    assert plan == plan_reshard(src, dst, M1, topology=Topology.h100())
    assert str(plan) == "f32[8@x,4] -> f32[8,4]: all_gather(x) dim0 4×: 128 B"
    assert plan.collectives == plan.steps
    assert plan.specs == (src, dst)
    noop = plan_reshard(src, src, M1)
    assert noop.is_noop
    assert str(noop) == "f32[8@x,4] -> f32[8@x,4]: no-op"
    two = plan_reshard(spec((8, 16), P("b"), partial="a"), spec((8, 16)), M2)
    assert str(two) == (
        "f32[8@b,16]{sum:a} -> f32[8,16]: all_reduce[sum](a) 2×: 128 B; "
        "all_gather(b) dim0 4×: 512 B (total 640 B, 25.0 µs)"
    )
    assert str(Collective("all_gather", ("x",), 4, dim=0, payload_bytes=1024)) == (
        "all_gather(x) dim0 4×: 1.0 KiB"
    )
    assert str(
        Collective("all_to_all", ("a", "b"), 8, dim=0, dst_dim=1, payload_bytes=3 << 20)
    ) == ("all_to_all(a,b) dim0→1 8×: 3.0 MiB")
    assert str(Collective("slice", ("x",), 4, dim=1)) == "slice(x) dim1 4×: local"
    assert plan_reshard(spec((8, 16)), spec((8, 16), P("x")), M1).collectives == ()


def test_plan_errors_are_typed():
    with pytest.raises(ReshardError, match="same global shape") as e:
        plan_reshard(spec((8, 4)), spec((4, 8)), M1)
    assert e.value.op == "plan_reshard" and e.value.fix
    with pytest.raises(ReshardError, match="same dtype"):
        plan_reshard(spec((8,)), spec((8,), dtype="bfloat16"), M1)
    with pytest.raises(UnknownAxisError, match="'x'"):
        plan_reshard(spec((8,), P("y")), spec((8,)), M1)
    with pytest.raises(ReshardError, match="TensorSpec"):
        plan_reshard(P("x"), spec((8,)), M1)
    with pytest.raises(SpmdError, match="kind"):
        Collective("broadcast", ("x",), 4)


# -- property: plans are legal and reach dst -------------------------------------

AXES = ("a", "b")
SIZES = {"a": 2, "b": 4}


@st.composite
def specs_on_m2(draw, shape):
    dims = [[] for _ in shape]
    partial = {}
    for a in draw(st.permutations(AXES)):
        where = draw(st.sampled_from(["none", "partial", *range(len(shape))]))
        if where == "partial":
            partial[a] = draw(st.sampled_from(["sum", "avg", "max", "min"]))
        elif where != "none":
            dims[where].append(a)
    return TensorSpec(shape, [tuple(d) for d in dims], partial=partial, dtype=F32)


@st.composite
def reshard_pairs(draw):
    shape = tuple(draw(st.lists(st.sampled_from([1, 3, 8, 16]), min_size=1, max_size=3)))
    return draw(specs_on_m2(shape)), draw(specs_on_m2(shape))


def simulate(src, plan):
    """Apply steps with their preconditions; check bytes on even layouts."""
    dims = [list(d) for d in src.dims]
    partial = dict(src.partial)

    def local_bytes():
        sizes = [
            math.ceil(s / math.prod(SIZES[a] for a in d))
            for s, d in zip(src.shape, dims, strict=True)
        ]
        return math.prod(sizes) * 4

    def used():
        return {a for d in dims for a in d} | set(partial)

    for step in plan.steps:
        n = math.prod(SIZES[a] for a in step.axes)
        assert step.group_size == n
        assert step.payload_bytes >= 0 and step.wire_bytes >= 0 and step.time_s >= 0
        even = all(
            s % math.prod(SIZES[a] for a in d) == 0 for s, d in zip(src.shape, dims, strict=True)
        )
        before = local_bytes()
        k = len(step.axes)
        if step.kind == "slice":
            assert not set(step.axes) & used()
            dims[step.dim] += step.axes
        elif step.kind == "all_gather":
            assert tuple(dims[step.dim][-k:]) == step.axes  # minor-most leave first
            del dims[step.dim][-k:]
            if even and n > 1:
                assert step.payload_bytes == local_bytes()
        elif step.kind == "all_to_all":
            assert tuple(dims[step.dim][-k:]) == step.axes
            del dims[step.dim][-k:]
            dims[step.dst_dim] += step.axes
        elif step.kind in ("all_reduce", "reduce_scatter"):
            # partial axes reduce in name order: jumping ahead of a pending axis is
            # only allowed when the two ops commute
            for b, op in partial.items():
                if b not in step.axes and b < max(step.axes):
                    assert op == step.reduce_op or {op, step.reduce_op} <= {"sum", "avg"}
            assert all(partial.pop(a) == step.reduce_op for a in step.axes)
            if step.kind == "reduce_scatter":
                dims[step.dim] += step.axes
        elif step.kind == "collective_permute":
            # one block each: no pending sum, every dim's block split into the target's
            before_dims, after_dims = step.layouts
            assert not partial and before_dims == tuple(tuple(d) for d in dims)
            assert set(step.axes) == {a for d in (*before_dims, *after_dims) for a in d}
            for s, d, t in zip(src.shape, before_dims, after_dims, strict=True):
                have, want = (math.prod(SIZES[a] for a in x) for x in (d, t))
                assert want % have == 0 and s % want == 0
            dims = [list(t) for t in after_dims]
            assert step.payload_bytes == local_bytes()
        else:
            assert step.kind == "to_partial"
            assert not set(step.axes) & used()
            partial.update(dict.fromkeys(step.axes, step.reduce_op))
        even_after = all(
            s % math.prod(SIZES[a] for a in d) == 0 for s, d in zip(src.shape, dims, strict=True)
        )
        kinds = ("all_reduce", "reduce_scatter", "all_to_all")
        if even and even_after and n > 1 and step.kind in kinds:
            assert step.payload_bytes == before
    return TensorSpec(src.shape, [tuple(d) for d in dims], partial=partial, dtype=F32)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reshard_pairs())
def test_property_plans_reach_dst_and_beat_going_through_replicated(pair):
    src, dst = pair
    plan = plan_reshard(src, dst, M2)
    assert simulate(src, plan) == dst
    assert plan.is_noop == (src == dst)
    assert [s.is_local for s in plan.steps] == [
        s.kind in ("slice", "to_partial") or s.group_size == 1 for s in plan.steps
    ]
    # never worse than gathering/reducing everything and re-slicing
    rep = TensorSpec(src.shape, dtype=F32)
    detour = plan_reshard(src, rep, M2).time_s + plan_reshard(rep, dst, M2).time_s
    assert plan.time_s <= detour * (1 + 1e-9)


def test_plan_str_for_reshard_plan_type():
    plan = plan_reshard(spec((8, 16), P("x")), spec((8, 16), P(None, "x")), M1)
    assert isinstance(plan, ReshardPlan)
    assert str(plan) == "f32[8@x,16] -> f32[8,16@x]: all_to_all(x) dim0→1 4×: 128 B"
