"""Reshard execution: values, compiled collectives, the public step runners, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit.errors import ReshardError, UnknownAxisError
from spmdkit.mesh import abstract_mesh
from spmdkit.resharding import plan_reshard, reshard, run_plan, step_fn
from spmdkit.spec import TensorSpec, axis_sizes
from spmdkit.verification.hlo import check_plan, parse_collectives, summarize
from spmdkit.versions import parse_version

M1 = abstract_mesh(x=4)
F32 = "float32"


@st.composite
def sum_specs_on_m2(draw, shape):
    """A spec of ``shape`` on the (a=2, b=4) mesh: each axis unused, sharding a
    dim, or sum-partial (the only partial a JAX array holds)."""
    dims = [[] for _ in shape]
    partial = {}
    for a in draw(st.permutations(("a", "b"))):
        where = draw(st.sampled_from(["none", "partial", *range(len(shape))]))
        if where == "partial":
            partial[a] = "sum"
        elif where != "none":
            dims[where].append(a)
    return TensorSpec(shape, [tuple(d) for d in dims], partial=partial, dtype=F32)


def make_value(mesh, g, target):
    """A real array with ``target``'s layout whose global value is ``g``.

    Sum-partial axes get asymmetric shares ((i + 1) / T on rank i) so a wrong
    reduction cannot pass by coincidence.
    """
    base = target.without_partial().to_partition_spec()
    x = jax.device_put(g, NamedSharding(mesh, base))
    if not target.partial:
        return x
    sizes = axis_sizes(mesh)

    def share(y):
        for a, _ in target.partial:
            n = sizes[a]
            y = y * (jax.lax.axis_index(a) + 1).astype(y.dtype) * (2.0 / (n * (n + 1)))
        return y

    fn = jax.shard_map(
        share, mesh=mesh, in_specs=base, out_specs=target.to_partition_spec(), check_vma=False
    )
    return jax.jit(fn)(x)


def global_value(y):
    """The global value of an array that may be sum-partial."""
    if TensorSpec.from_value(y).partial:
        y = reshard(y, P())
    return np.asarray(y)


EXEC_CASES = [
    ("mesh1d", P("x"), (), P()),
    ("mesh1d", P(), (), P("x")),
    ("mesh1d", P("x"), (), P(None, "x")),
    ("mesh1d", P(), ("x",), P()),
    ("mesh1d", P(), ("x",), P("x")),
    ("mesh1d", P(), (), P(unreduced={"x"})),
    ("mesh2d", P(("a", "b")), (), P()),
    ("mesh2d", P(("a", "b")), (), P("a", "b")),
    ("mesh2d", P(("a", "b")), (), P(None, ("a", "b"))),
    ("mesh2d", P("a", "b"), (), P("b", "a")),
    ("mesh2d", P("a"), (), P(None, "b")),
    ("mesh2d", P("b"), ("a",), P(None, "a")),
    ("mesh2d", P(), ("a", "b"), P(("a", "b"))),
    ("mesh2d", P(), ("a",), P("b", "a")),
    # collective-permutes: the blocks of another layout (XLA's own moves, below)
    ("mesh2d", P("a"), (), P("b")),
    ("mesh2d", P(("a", "b")), (), P(("b", "a"))),
    ("mesh2d", P(("a", "b")), (), P("b")),
    ("mesh2d", P(None, "b"), (), P(None, ("a", "b"))),
]

#: Moves XLA's partitioner makes with one collective-permute (jax 0.10.2 and 0.12,
#: 8 CPU devices, a=2 x b=4): the plan's permute step, byte for byte and group for
#: group. (XLA also permutes into layouts it then gathers: ``P(('a', 'b')) ->
#: P('b')`` a permute and a gather over ``a``, ``P('b') -> P('a')`` a gather over
#: half of ``b``; a plan gathers first, the permute only ever its last step.)
XLA_PERMUTES = [
    (P("a"), P("b")),
    (P(("a", "b")), P(("b", "a"))),
    (P(None, "b"), P(None, ("a", "b"))),
    (P("b"), P(("a", "b"))),
]


@pytest.mark.parametrize(("mesh_name", "src", "partial", "dst"), EXEC_CASES)
def test_reshard_values_and_hlo_match_the_plan(request, mesh_name, src, partial, dst):
    mesh = request.getfixturevalue(mesh_name)
    g = jnp.arange(8 * 16, dtype=jnp.float32).reshape(8, 16) - 40.0
    src_spec = TensorSpec(g.shape, src, partial=partial, dtype=F32)
    dst_spec = TensorSpec(g.shape, dst, dtype=F32)
    x = make_value(mesh, g, src_spec)
    assert TensorSpec.from_value(x) == src_spec

    fn = jax.jit(lambda v: reshard(v, dst))
    y = fn(x)
    assert TensorSpec.from_value(y) == dst_spec  # never silently replicated
    np.testing.assert_allclose(global_value(y), np.asarray(g), rtol=1e-6, atol=1e-5)

    plan = plan_reshard(src_spec, dst_spec, mesh)
    hlo = parse_collectives(fn.lower(x).compile().as_text())
    assert check_plan(plan, hlo) == []
    assert summarize(hlo) == summarize(plan.steps)


@pytest.mark.parametrize(("src", "dst"), XLA_PERMUTES)
def test_xla_moves_these_blocks_as_the_plan_permutes_them(src, dst):
    """Left to an output sharding, XLA's partitioner moves these layouts with the
    collective the plan has (a collective-permute of the target's block), so a
    reshard XLA makes itself is priced as it runs."""
    mesh = sk.make_mesh(a=2, b=4, axis_types="auto")
    x = jax.ShapeDtypeStruct((8, 16), jnp.float32)
    src_spec, dst_spec = TensorSpec((8, 16), src, dtype=F32), TensorSpec((8, 16), dst, dtype=F32)
    plan = plan_reshard(src_spec, dst_spec, mesh)
    assert [c.kind for c in plan.collectives] == ["collective_permute"], plan
    with jax.set_mesh(mesh):
        fn = jax.jit(
            lambda v: v * 2.0,
            in_shardings=NamedSharding(mesh, src),
            out_shardings=NamedSharding(mesh, dst),
        )
        hlo = parse_collectives(fn.lower(x).compile().as_text())
    assert check_plan(plan, hlo) == [], (str(plan), hlo)


def test_to_partial_keeps_the_value_on_rank_zero_only(mesh1d):
    g = jnp.arange(32, dtype=jnp.float32).reshape(4, 8)
    y = reshard(jax.device_put(g, NamedSharding(mesh1d, P())), P(unreduced={"x"}))
    shards = sorted(y.addressable_shards, key=lambda s: s.device.id)
    np.testing.assert_array_equal(np.asarray(shards[0].data), np.asarray(g))
    for s in shards[1:]:
        np.testing.assert_array_equal(np.asarray(s.data), np.zeros_like(g))


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_property_executor_on_small_even_shapes(mesh2d, data):
    shape = data.draw(st.sampled_from([(8, 8), (8, 8, 8)]))

    src = data.draw(sum_specs_on_m2(shape))
    dst = data.draw(sum_specs_on_m2(shape))
    g = jnp.asarray(np.random.default_rng(0).standard_normal(shape), dtype=jnp.float32)
    y = reshard(make_value(mesh2d, g, src), dst)
    assert TensorSpec.from_value(y) == dst
    np.testing.assert_allclose(global_value(y), np.asarray(g), rtol=1e-5, atol=1e-5)


def test_reshard_accepts_specs_shardings_and_unsharded_arrays(mesh1d):
    g = jnp.arange(16, dtype=jnp.float32).reshape(8, 2)
    x = jax.device_put(g, NamedSharding(mesh1d, P("x")))
    assert reshard(x, P("x")) is x  # no-op
    y = reshard(x, NamedSharding(mesh1d, P(None)))
    assert TensorSpec.from_value(y) == TensorSpec((8, 2), dtype=F32)
    z = reshard(x, TensorSpec((8, 2)))
    np.testing.assert_array_equal(np.asarray(z), np.asarray(g))
    w = reshard(g, P("x"), mesh=mesh1d)  # an unsharded array is placed on the mesh first
    assert TensorSpec.from_value(w) == TensorSpec((8, 2), P("x"), dtype=F32)
    np.testing.assert_array_equal(np.asarray(w), np.asarray(g))


def test_reshard_on_an_auto_mesh_runs_eagerly():
    mesh = sk.make_mesh(x=4, axis_types="auto")
    g = jnp.arange(32, dtype=jnp.float32).reshape(8, 4)
    y = reshard(jax.device_put(g, NamedSharding(mesh, P("x"))), P(None, "x"))
    assert TensorSpec.from_value(y) == TensorSpec((8, 4), P(None, "x"), dtype=F32)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(g))
    with pytest.raises(ReshardError, match="Explicit"):
        reshard(y, P(unreduced={"x"}))
    with pytest.raises(ReshardError, match="inside jit"):
        jax.jit(lambda v: reshard(v, P()))(y)


def test_reshard_errors_are_typed(mesh1d, mesh2d):
    x = jax.device_put(jnp.ones((6, 4)), NamedSharding(mesh1d, P()))
    with pytest.raises(ReshardError, match="dim 0 of size 6") as e:
        reshard(x, P("x"))
    assert "pad dim 0 to a multiple of 4 (e.g. 8)" in e.value.fix
    with pytest.raises(ReshardError, match="sum-partial"):
        reshard(x, TensorSpec((6, 4), partial={"x": "max"}))
    with pytest.raises(ReshardError, match="x's shape"):
        reshard(x, TensorSpec((4, 6)))
    with pytest.raises(UnknownAxisError):
        reshard(x, P("y"))
    with pytest.raises(ReshardError, match="target mesh"):
        reshard(x, NamedSharding(mesh2d, P()))
    with pytest.raises(ReshardError, match="a mesh is known"):
        reshard(jnp.ones(4), P())
    with pytest.raises(ReshardError, match="TensorSpec, PartitionSpec or NamedSharding"):
        reshard(x, "x")
    with pytest.raises(ReshardError, match="concrete Mesh"):
        reshard(jnp.ones(4), P("x"), mesh=M1)
    # an abstract mesh that matches x's own mesh is fine: x's devices are used
    np.testing.assert_array_equal(np.asarray(reshard(x, P(), mesh=M1)), np.ones((6, 4)))


def test_run_plan_and_step_fn_run_a_plan_without_reshard(mesh2d):
    g = jnp.arange(8 * 16, dtype=jnp.float32).reshape(8, 16)
    src = TensorSpec(g.shape, P("a", "b"), dtype=F32)
    dst = TensorSpec(g.shape, P("b", "a"), dtype=F32)
    plan = plan_reshard(src, dst, mesh2d)
    x = jax.device_put(g, NamedSharding(mesh2d, src.to_partition_spec()))
    y = jax.jit(lambda v: run_plan(v, plan, mesh2d))(x)
    assert TensorSpec.from_value(y) == dst
    np.testing.assert_array_equal(np.asarray(y), np.asarray(g))

    gather = plan_reshard(src, TensorSpec(g.shape, P(None, "b"), dtype=F32), mesh2d)
    (step,) = gather.steps
    local = jax.shard_map(
        step_fn(step), mesh=mesh2d, in_specs=P("a", "b"), out_specs=P(None, "b"), check_vma=False
    )
    np.testing.assert_array_equal(np.asarray(local(x)), np.asarray(g))


_ZERO_DIM = [None, "a", "b", ("a", "b")]
_ZERO_LAYOUTS = [
    P(d0, d1)
    for d0 in _ZERO_DIM
    for d1 in _ZERO_DIM
    if not (set(np.atleast_1d(d0 or ())) & set(np.atleast_1d(d1 or ())))
]


def test_zero_size_arrays_move_between_every_layout_without_a_collective(mesh2d):
    x = jnp.zeros((0, 8), jnp.float32)
    for src in _ZERO_LAYOUTS:
        placed = jax.device_put(x, NamedSharding(mesh2d, src))
        outs = jax.jit(lambda y: tuple(reshard(y, t) for t in _ZERO_LAYOUTS))
        for out, dst in zip(outs(placed), _ZERO_LAYOUTS, strict=True):
            assert out.shape == (0, 8) and out.sharding.spec == dst, (src, dst)
        text = outs.lower(placed).compile().as_text()
        assert parse_collectives(text) == [], src
    # eagerly: the right (empty) block on every device, so the value reads back
    placed = jax.device_put(x, NamedSharding(mesh2d, P("a", "b")))
    for dst in _ZERO_LAYOUTS:
        out = reshard(placed, dst)
        assert out.sharding.is_equivalent_to(NamedSharding(mesh2d, dst), 2), dst
        want = NamedSharding(mesh2d, dst).shard_shape((0, 8))
        assert {s.data.shape for s in out.addressable_shards} == {want}
        assert np.asarray(out).shape == (0, 8)
    # onto a sum-partial target: jax 0.11+ compiles no empty unreduced array (its
    # own jax.device_put fails), which reshard says in a typed error
    target = TensorSpec((0, 8), P(None, "b"), partial={"a": "sum"})
    if parse_version(jax.__version__) >= (0, 11):
        with pytest.raises(ReshardError, match="empty array"):
            reshard(placed, target)
    else:
        part = reshard(placed, target)
        assert part.shape == (0, 8) and "a" in part.sharding.spec.unreduced
