"""The engine's handling of shard_map, sharding constraints and optimization barriers."""

import jax
import jax.extend.core
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from spmdkit.propagation import propagate
from tests.propagation.programs import (
    F32,
    S,
    as_auto,
    compiled_report,
)


def test_shard_map_specs_and_body_collectives_match_hlo(mesh1d):
    mesh = as_auto(mesh1d)

    def f(x):
        body = lambda b: jax.lax.psum(jnp.tanh(b), "x")  # noqa: E731
        return jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P())(x)

    prop = propagate(f, S((16, 32), F32), in_specs=(P(None, "x"),), mesh=mesh)
    # the operand moves to the shard_map's in_specs, then the body's psum
    assert prop.comm_bytes_by_kind == {"all_reduce": 4 * 32 * 4, "all_to_all": 4 * 32 * 4}
    rep = compiled_report(f, (S((16, 32), F32, sharding=NamedSharding(mesh, P(None, "x"))),))
    assert rep.bytes_by_kind() == prop.comm_bytes_by_kind


def test_a_partially_manual_shard_map_leaves_the_automatic_axes_alone(mesh2d):
    """``axis_names={"a"}``: the in/out specs speak for ``a`` only; the operand keeps
    its ``b`` layout (no gather at the boundary), the result shaped like it too."""
    mesh = as_auto(mesh2d)

    def f(x):
        body = lambda blk: jnp.tanh(blk) * 2.0  # noqa: E731
        sm = jax.shard_map(body, mesh=mesh, in_specs=P("a"), out_specs=P("a"), axis_names={"a"})
        return sm(x)

    prop = propagate(f, S((8, 16), F32), in_specs=(P("a", "b"),), mesh=mesh)
    assert prop.comm_bytes == 0
    assert prop.out_specs[0].dims == (("a",), ("b",))


def test_sharding_constraints_and_reshards_set_layouts(mesh1d):
    auto = as_auto(mesh1d)
    x = S((16, 8), F32)
    explicit = propagate(
        lambda x: jax.sharding.reshard(x, NamedSharding(mesh1d, P("x"))) * 2.0,
        x, in_specs=(None,), mesh=mesh1d,
    )  # fmt: skip
    constrained = propagate(
        lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(auto, P(None, "x"))) * 2.0,
        x, in_specs=(P("x"),), mesh=auto,
    )  # fmt: skip
    assert explicit.out_specs[0].dims == (("x",), ())
    assert explicit.comm_bytes == 0  # replicated -> sharded is a local slice
    assert constrained.out_specs[0].dims == ((), ("x",))
    assert constrained.comm_bytes_by_kind == {"all_to_all": 16 * 8 * 4 // 4}


def test_optimization_barrier_keeps_layouts(mesh1d):
    def f(x, y):
        a, b = jax.lax.optimization_barrier((x, y))
        return a + 1.0, b * 2.0

    prop = propagate(f, S((16, 8), F32), S((8,), F32), in_specs=(P("x"), None), mesh=mesh1d)
    assert not prop.unknown
    assert prop.out_specs[0].dims == (("x",), ())
    assert prop.comm_bytes == 0
