"""HLO collective parsing: replica-group forms, async pairs, combined ops, plans."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit.errors import SpmdError
from spmdkit.resharding import Collective, plan_reshard
from spmdkit.spec import TensorSpec
from spmdkit.verification.hlo import (
    HloCollective,
    check_plan,
    compiled_collectives,
    parse_collectives,
    parse_replica_groups,
    summarize,
)

F32 = "float32"

# -- replica groups ------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "groups"),
    [
        ("{{0,1},{2,3}}", ((0, 1), (2, 3))),
        ("{{0,4,1,5,2,6,3,7}}", ((0, 4, 1, 5, 2, 6, 3, 7),)),
        ("{}", ((0, 1, 2, 3, 4, 5, 6, 7),)),
        # iota: arange(8) reshaped to [2,4], rows are the groups
        ("[2,4]<=[8]", ((0, 1, 2, 3), (4, 5, 6, 7))),
        # arange(8).reshape(2,4).T = [[0,4],[1,5],[2,6],[3,7]]
        ("[4,2]<=[2,4]T(1,0)", ((0, 4), (1, 5), (2, 6), (3, 7))),
        # arange(8).reshape(2,2,2).transpose(0,2,1) flattens to 0,2,1,3,4,6,5,7
        ("[4,2]<=[2,2,2]T(0,2,1)", ((0, 2), (1, 3), (4, 6), (5, 7))),
        ("[1,8]<=[8]", ((0, 1, 2, 3, 4, 5, 6, 7),)),
        # mesh form: devices 4a+b; grouping over b fixes a, grouping over a fixes b
        ("mesh['a'=2,'b'=4] {'b'}", ((0, 1, 2, 3), (4, 5, 6, 7))),
        ("mesh['a'=2,'b'=4] {'a'}", ((0, 4), (1, 5), (2, 6), (3, 7))),
        ("mesh['a'=2,'b'=4] {'a', 'b'}", ((0, 1, 2, 3, 4, 5, 6, 7),)),
        ("mesh['a'=2,'b'=4] {'b','a'}", ((0, 4, 1, 5, 2, 6, 3, 7),)),
        ("mesh[a=2,b=4] {b}", ((0, 1, 2, 3), (4, 5, 6, 7))),
        # jax 0.10.2 prints size-1 helper axes
        ("mesh['axis_0'=2,'axis_1'=1,'axis_2'=4] {'axis_0'}", ((0, 4), (1, 5), (2, 6), (3, 7))),
        # device_ids in iota form: [2,4]T(1,0) lists 0,4,1,5,2,6,3,7 over the [8,1] mesh
        (
            "mesh['axis_0'=8,'axis_1'=1], device_ids=([2,4]T(1,0)) {'axis_0'}",
            ((0, 4, 1, 5, 2, 6, 3, 7),),
        ),
        # device_ids 0,2,1,3,4,6,5,7 over [4,2] = [[0,2],[1,3],[4,6],[5,7]]; sub-axis
        # axis_0:(2)2 views axis_0 (size 4) as [pre=2, size=2, 1] and groups the middle
        # factor: for each (pre, axis_1) the rows 2*pre+0 and 2*pre+1
        (
            "mesh['axis_0'=4,'axis_1'=2], device_ids=([2,2,2]T(0,2,1)) {'axis_0':(2)2}",
            ((0, 1), (2, 3), (4, 5), (6, 7)),
        ),
        # sub-axis (1)2 of an axis of size 4 is its major half: groups {i, i+2}
        ("mesh['x'=4] {'x':(1)2}", ((0, 2), (1, 3))),
        # explicit device ids
        ("mesh['x'=2,'y'=2], device_ids=(3,2,1,0) {'y'}", ((3, 2), (1, 0))),
    ],
)
def test_replica_group_forms_expand(text, groups):
    assert parse_replica_groups(text, num_devices=8) == groups


def test_empty_groups_need_a_device_count_and_garbage_raises():
    with pytest.raises(SpmdError, match="device count"):
        parse_replica_groups("{}")
    with pytest.raises(SpmdError, match="replica_groups"):
        parse_replica_groups("groups<1,2>")
    with pytest.raises(SpmdError, match="mesh axes"):
        parse_replica_groups("mesh['a'=2] {'z'}")


# -- hand-written module: the forms CPU does not print -----------------------------

GPU_STYLE = """\
HloModule jit_step, is_scheduled=true, entry_computation_layout={(f32[2,16]{1,0})->f32[8,16]{1,0}}, num_partitions=8

%add.clone (x.1: f32[], y.1: f32[]) -> f32[] {
  %x.1 = f32[] parameter(0)
  %y.1 = f32[] parameter(1)
  ROOT %add.2 = f32[] add(f32[] %x.1, f32[] %y.1)
}

%max_region (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %maximum.1 = f32[] maximum(%a, %b)
}

%wrapped_reduce_scatter (p: f32[8,16]) -> f32[4,16] {
  %p = f32[8,16]{1,0} parameter(0)
  ROOT %rs.1 = f32[4,16]{1,0} reduce-scatter(%p), channel_id=6, replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}, to_apply=%add.clone
}

ENTRY %main (p0: f32[2,16], p1: f32[8,16]) -> f32[8,16] {
  %p0 = f32[2,16]{1,0} parameter(0)
  %p1 = f32[8,16]{1,0} parameter(1)
  %c = bf16[4]{0} constant({1, 2, 3, 4})
  %all-gather-start = (f32[2,16]{1,0}, f32[8,16]{1,0}) all-gather-start(%p0), channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}, use_global_device_ids=true, metadata={op_name="jit(step)/jvp(model)/all_gather" stack_frame_id=3}
  %all-gather-done = f32[8,16]{1,0} all-gather-done(%all-gather-start)
  %all-reduce-start = (f32[8,16]{1,0}, bf16[4]{0}) all-reduce-start(%p1, %c), channel_id=2, replica_groups={{0,1},{2,3},{4,5},{6,7}}, use_global_device_ids=true, to_apply=%add.clone, metadata={op_name="jit(step)/transpose(jvp(model))/psum"}
  %all-reduce-done = (f32[8,16]{1,0}, bf16[4]{0}) all-reduce-done(%all-reduce-start)
  %reduce-scatter = f32[1,16]{1,0} reduce-scatter(%p1), channel_id=3, replica_groups=mesh['a'=2,'b'=4] {'b'}, dimensions={0}, to_apply=%max_region
  %all-to-all = f32[8,16]{1,0} all-to-all(%p1), channel_id=4, replica_groups={}, dimensions={0}
  %collective-permute-start = (f32[8,16]{1,0}, f32[8,16]{1,0}, u32[], u32[]) collective-permute-start(%p1), channel_id=5, source_target_pairs={{0,1},{1,0},{2,3},{3,2}}
  %collective-permute-done = f32[8,16]{1,0} collective-permute-done(%collective-permute-start)
  %rs-start = ((f32[8,16]{1,0}), f32[4,16]{1,0}, s32[]) async-start(%p1), calls=%wrapped_reduce_scatter
  %rs-done = f32[4,16]{1,0} async-done(%rs-start)
  ROOT %out = f32[8,16]{1,0} add(%all-gather-done, %all-to-all)
}
"""  # noqa: E501 - HLO lines are long


def test_gpu_style_module_parses_every_collective_once():
    got = {c.name: c for c in parse_collectives(GPU_STYLE)}
    assert list(got) == [
        "rs.1",
        "all-gather-start",
        "all-reduce-start",
        "reduce-scatter",
        "all-to-all",
        "collective-permute-start",
    ]

    rs = got["rs.1"]  # inside the async wrapper: counted once, not again as async-start
    assert (rs.kind, rs.group_size, rs.reduce_op) == ("reduce_scatter", 2, "sum")
    assert rs.replica_groups == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert rs.payload_bytes == 4 * 16 * 4 * 2  # input buffer = output × group size

    ag = got["all-gather-start"]
    assert ag.kind == "all_gather"
    assert ag.shapes == ((8, 16),)  # the gathered result, not the (operand, result) pair
    assert ag.payload_bytes == 8 * 16 * 4
    assert ag.replica_groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert ag.op_name == "jit(step)/jvp(model)/all_gather"
    assert not ag.is_backward

    ar = got["all-reduce-start"]
    assert ar.is_combined
    assert ar.shapes == ((8, 16), (4,))
    assert ar.dtypes == ("f32", "bf16")
    assert ar.payload_bytes == 8 * 16 * 4 + 4 * 2
    assert (ar.group_size, ar.reduce_op, ar.is_backward) == (2, "sum", True)

    mx = got["reduce-scatter"]
    assert (mx.reduce_op, mx.group_size, mx.payload_bytes) == ("max", 4, 1 * 16 * 4 * 4)
    assert mx.replica_groups == ((0, 1, 2, 3), (4, 5, 6, 7))

    a2a = got["all-to-all"]
    assert a2a.replica_groups == (tuple(range(8)),)  # {} = every device (num_partitions)
    assert (a2a.group_size, a2a.payload_bytes) == (8, 512)

    perm = got["collective-permute-start"]
    assert perm.kind == "collective_permute"
    assert perm.shapes == ((8, 16),)
    assert perm.source_target_pairs == ((0, 1), (1, 0), (2, 3), (3, 2))
    assert (perm.group_size, perm.payload_bytes) == (4, 512)

    assert summarize(got.values()) == {
        "all_gather": {"count": 1, "payload_bytes": 512},
        "all_reduce": {"count": 1, "payload_bytes": 520},
        "all_to_all": {"count": 1, "payload_bytes": 512},
        "collective_permute": {"count": 1, "payload_bytes": 512},
        "reduce_scatter": {"count": 2, "payload_bytes": 512 + 256},
    }


def test_a_ragged_all_to_all_is_an_all_to_all_of_its_receiving_buffer():
    """What a GPU compiles the moe_experts op's token exchange to: the payload is the
    receiving buffer (the plan's), not the offsets and sizes beside it."""
    text = (
        "HloModule m, num_partitions=8\n\nENTRY %main (p: f32[64,16]) -> f32[64,16] {\n"
        "  %p = f32[64,16]{1,0} parameter(0)\n  %z = f32[64,16]{1,0} parameter(1)\n"
        "  %o = s32[8]{0} parameter(2)\n"
        "  ROOT %ragged-all-to-all = f32[64,16]{1,0} ragged-all-to-all(%p, %z, %o, %o, %o, %o),"
        " channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}\n}\n"
    )
    (c,) = parse_collectives(text)
    assert (c.kind, c.group_size, c.payload_bytes) == ("all_to_all", 8, 64 * 16 * 4)


# -- real compiles -----------------------------------------------------------------


def test_cpu_compiled_psum_pmax_and_backward_reduce_scatter(mesh2d):
    x = jax.device_put(jnp.ones((8, 16)), NamedSharding(mesh2d, P(("a", "b"))))

    def shard(fn, out=None):
        out = P(("a", "b")) if out is None else out
        return jax.shard_map(
            fn, mesh=mesh2d, in_specs=P(("a", "b")), out_specs=out, check_vma=False
        )

    (ps,) = compiled_collectives(shard(lambda y: jax.lax.psum(y, "b")), x)
    assert (ps.kind, ps.reduce_op, ps.group_size, ps.payload_bytes) == ("all_reduce", "sum", 4, 64)
    assert ps.replica_groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    (pm,) = compiled_collectives(shard(lambda y: jax.lax.pmax(y, "a")), x)
    assert (pm.reduce_op, pm.replica_groups) == ("max", ((0, 4), (1, 5), (2, 6), (3, 7)))

    gather = shard(lambda y: jax.lax.all_gather(y, "b", axis=0, tiled=True), out=P("a"))
    grad = jax.grad(lambda w: jnp.sum(gather(w) ** 2))
    kinds = {(c.kind, c.is_backward) for c in compiled_collectives(grad, x)}
    assert kinds == {("all_gather", False), ("reduce_scatter", True)}


def test_cpu_reshard_groups_expand_to_the_mesh_axis(mesh2d):
    # jax 0.10.2 prints these with the mesh form; whatever the form, the groups are
    # the devices that differ only along the gathered axis (device id = 4a + b).
    with jax.set_mesh(mesh2d):
        for src, groups in [
            (P("a"), ((0, 4), (1, 5), (2, 6), (3, 7))),
            (P(None, "b"), ((0, 1, 2, 3), (4, 5, 6, 7))),
            (P(("b", "a")), ((0, 4, 1, 5, 2, 6, 3, 7),)),
        ]:
            x = jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=NamedSharding(mesh2d, src))
            (c,) = compiled_collectives(lambda y: jax.sharding.reshard(y, P()), x)
            assert (c.kind, c.payload_bytes, c.replica_groups) == ("all_gather", 512, groups)


# -- plan vs program -------------------------------------------------------------------


def _sum_partial(mesh, x, axis):
    """x as an asymmetric sum-partial value over ``axis`` (weights (i+1)/T)."""
    n = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))[axis]

    def body(y):
        y = y * (jax.lax.axis_index(axis) + 1).astype(y.dtype) * (2.0 / (n * (n + 1)))
        return jax.lax.pcast(y, axis, to="unreduced")  # typed as the pending sum

    fn = jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P(unreduced={axis}))
    return jax.jit(fn)(x)


def test_xla_partitioner_reduce_scatter_shows_as_all_reduce_on_cpu(mesh1d):
    g = jnp.arange(8 * 16, dtype=jnp.float32).reshape(8, 16)
    u = _sum_partial(mesh1d, jax.device_put(g, NamedSharding(mesh1d, P())), "x")
    dst = TensorSpec(g.shape, P("x"), dtype="float32")
    plan = plan_reshard(TensorSpec.from_value(u), dst, mesh1d)
    assert [s.kind for s in plan.steps] == ["reduce_scatter"]
    with jax.set_mesh(mesh1d):
        fn = jax.jit(lambda y: jax.sharding.reshard(y, P("x")))
        hlo = parse_collectives(fn.lower(u).compile().as_text())
        np.testing.assert_allclose(np.asarray(fn(u)), np.asarray(g), rtol=1e-6)
    assert [c.kind for c in hlo] == ["all_reduce"]
    assert check_plan(plan, hlo) != []
    assert check_plan(plan, hlo, reduce_scatter_as_all_reduce=True) == []

    to_replicated = plan_reshard(TensorSpec.from_value(u), dst.replace(spec=P()), mesh1d)
    with jax.set_mesh(mesh1d):
        hlo = compiled_collectives(lambda y: jax.sharding.reshard(y, P()), u)
    assert check_plan(to_replicated, hlo) == []


@pytest.mark.parametrize(
    ("shape", "src", "dst"),
    [((10, 16), P("x"), P()), ((6, 8), P("x"), P(None, "x")), ((8, 16), P("x"), P(None, "x"))],
)
def test_xla_partitioner_pads_uneven_dims_as_the_plan_counts(shape, src, dst):
    # Auto axes let XLA pad uneven shards; the planned padded bytes match its buffers.
    mesh = sk.make_mesh(x=4, axis_types="auto")

    def fn(y):
        y = jax.lax.with_sharding_constraint(jnp.sin(y), NamedSharding(mesh, src))
        return jax.lax.with_sharding_constraint(jnp.cos(y), NamedSharding(mesh, dst))

    hlo = compiled_collectives(fn, jax.ShapeDtypeStruct(shape, jnp.float32))
    plan = plan_reshard(
        TensorSpec(shape, src, dtype="float32"), TensorSpec(shape, dst, dtype="float32"), mesh
    )
    assert check_plan(plan, hlo) == []


def _step(kind, payload, n=4, **kw):
    return Collective(kind, ("x",), n, payload_bytes=payload, wire_bytes=0, **kw)


def _hlo(kind, shapes, n=4):
    nbytes = sum(int(np.prod(s)) * 4 for s in shapes)
    if kind == "reduce_scatter":
        nbytes *= n
    groups = (tuple(range(n)),)
    return HloCollective(kind, tuple(shapes), ("f32",) * len(shapes), nbytes, n, groups)


def test_check_plan_reports_missing_extra_and_splits_combined():
    plan = [_step("all_gather", 512, dim=0), _step("all_gather", 256, dim=1)]
    combined = _hlo("all_gather", [(8, 16), (4, 16)])
    assert check_plan(plan, [combined]) == []
    assert check_plan(plan, [_hlo("all_gather", [(8, 16)])]) == [
        "planned all_gather(x) dim1 4×: 256 B has no matching collective in the HLO"
    ]
    extra = _hlo("collective_permute", [(2, 16)])
    assert check_plan(plan, [combined, extra]) == [
        "HLO collective_permute 4×: 128 B is not in the plan"
    ]
    # a collective over a group of one moves nothing and is ignored
    assert check_plan(plan, [combined, _hlo("all_reduce", [(8,)], n=1)]) == []
    # same kind and bytes but another group size is a mismatch
    assert check_plan([_step("all_reduce", 64)], [_hlo("all_reduce", [(16,)], n=2)]) != []


def test_xla_splits_all_reduces_by_the_dims_the_partial_axes_came_from():
    mesh = sk.make_mesh(a=2, b=4, axis_types="auto")
    replicated = NamedSharding(mesh, P())
    plan = plan_reshard(
        TensorSpec((), partial=("a", "b"), dtype=F32), TensorSpec((), dtype=F32), mesh
    )
    assert [(s.kind, s.axes) for s in plan.steps] == [("all_reduce", ("a", "b"))]

    # sum over two dims sharded by a and b: one all-reduce per axis, full payload each
    x = jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=NamedSharding(mesh, P("a", "b")))
    hlo = compiled_collectives(jnp.sum, x, out_shardings=replicated)
    assert sorted((c.kind, c.group_size, c.payload_bytes) for c in hlo) == [
        ("all_reduce", 2, 4),
        ("all_reduce", 4, 4),
    ]
    assert check_plan(plan, hlo) != []
    assert check_plan(plan, hlo, all_reduce_per_axis=True) == []

    # contracting one dim sharded over (a, b): a single all-reduce over both
    v = jax.ShapeDtypeStruct((8,), jnp.float32, sharding=NamedSharding(mesh, P(("a", "b"))))
    hlo = compiled_collectives(jnp.dot, v, v, out_shardings=replicated)
    assert check_plan(plan, hlo) == []
    assert check_plan(plan, hlo, all_reduce_per_axis=True) == []


_UNNAMED = """HloModule m, num_partitions=4

ENTRY %main (p: f32[8]) -> (f32[8], f32[32]) {
  %p = f32[8]{0} parameter(0)
  %add.1 = f32[8]{0} add(%p, %p), metadata={op_name="jit(f)/sk_eq5/add"}
  %mid = f32[8]{0} collective-permute(%add.1), source_target_pairs={{0,1},{1,0}}
  %in = f32[8]{0} collective-permute(%p), source_target_pairs={{0,1},{1,0}}
  %mul = f32[8]{0} multiply(%in, %mid), metadata={op_name="jit(f)/sk_eq6/mul"}
  %out = f32[8]{0} collective-permute(%add.1), source_target_pairs={{0,2},{2,0}}
  %ag = f32[32]{0} all-gather(%out), replica_groups={{0,1,2,3}}, dimensions={0}
  ROOT %t = (f32[8]{0}, f32[32]{0}) tuple(%mul, %ag)
}
"""


def test_a_collective_without_metadata_names_its_nearest_instruction_with_some():
    """XLA's partitioner emits reshards with no metadata (no op_name, no frame):
    each is put on the nearest instruction that has some, saying how it relates."""
    found = {c.name: (c.nearest, c.nearest_role) for c in parse_collectives(_UNNAMED)}
    assert found == {
        "mid": ("jit(f)/sk_eq5/add", "result"),  # between two equations
        "in": ("jit(f)/sk_eq6/mul", "input"),  # a step input its reader needs laid out
        "out": ("jit(f)/sk_eq5/add", "output"),  # into the step output's layout
        "ag": ("jit(f)/sk_eq5/add", "output"),  # through the permute before it
    }
    named = [c for c in parse_collectives(GPU_STYLE) if c.op_name]
    assert named and all(c.nearest == "" and c.nearest_role == "" for c in named)
