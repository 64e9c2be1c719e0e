"""Loops and branches: scan, while, cond."""

import jax
import jax.extend.core
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from spmdkit.propagation import propagate
from tests.propagation.programs import (
    F32,
    S,
)


def scan_model(w, x):
    def body(h, wl):
        return jnp.tanh(h @ wl), None

    h, _ = jax.lax.scan(body, x, w)
    return h


def test_scan_body_row_parallel_counts_every_iteration(mesh1d):
    layers, b, h = 3, 16, 32
    w = S((layers, h, h), F32)
    x = S((b, h), F32)
    prop = propagate(scan_model, w, x, in_specs=(P(None, "x", None), P(None, "x")), mesh=mesh1d)
    rec = next(r for r in prop.records if r.primitive == "scan")
    assert rec.repeat == layers
    # each layer: x @ W row-parallel is sum-partial over x; tanh needs it reduced
    per_layer = b * h * 4
    assert prop.comm_bytes_by_kind["all_reduce"] == layers * per_layer
    assert prop.out_specs[0].shape == (b, h)


def test_scan_dp_carry_keeps_batch_sharding(mesh2d):
    w = S((4, 32, 32), F32)
    x = S((16, 32), F32)
    prop = propagate(scan_model, w, x, in_specs=(None, P("a")), mesh=mesh2d)
    assert prop.comm_bytes == 0
    assert prop.out_specs[0].dims == (("a",), ())


def test_scan_stacked_dim_is_gathered(mesh1d):
    w = S((4, 32, 32), F32)
    x = S((16, 32), F32)
    prop = propagate(scan_model, w, x, in_specs=(P("x"), None), mesh=mesh1d)
    # the stacked (layer) dim may not stay sharded: one all-gather of the weights
    assert prop.comm_bytes_by_kind == {"all_gather": 4 * 32 * 32 * 4}


def test_grad_through_scan_and_remat(mesh2d):
    def loss(w, x):
        return jnp.sum(jax.checkpoint(scan_model)(w, x) ** 2)

    w = S((2, 32, 32), F32)
    x = S((16, 32), F32)
    prop = propagate(jax.grad(loss), w, x, in_specs=(None, P("a")), mesh=mesh2d)
    assert not prop.unknown
    # dW is summed over the batch: one all-reduce over 'a' of the stacked weights' size
    assert prop.comm_bytes_by_kind.get("all_reduce", 0) >= 2 * 32 * 32 * 4


def test_cond_merges_branches(mesh1d):
    def f(p, x, w):
        return jax.lax.cond(p > 0, lambda x: jnp.tanh(x @ w), lambda x: x @ w, x)

    prop = propagate(
        f, S((), "int32"), S((16, 32), F32), S((32, 32), F32),
        in_specs=(None, P(None, "x"), P("x")), mesh=mesh1d,
    )  # fmt: skip
    assert not prop.unknown
    # row-parallel in both branches: one all-reduce of the [16, 32] result
    assert prop.comm_bytes_by_kind == {"all_reduce": 16 * 32 * 4}
    assert prop.out_specs[0].is_replicated


def test_while_keeps_the_carry_layout(mesh1d):
    def f(x):
        return jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, jnp.sin(c[1])), (0, x))

    prop = propagate(f, S((16, 32), F32), in_specs=(P("x"),), mesh=mesh1d)
    assert not prop.unknown
    assert prop.comm_bytes == 0
    assert prop.out_specs[1].dims == (("x",), ())
    assert [r.primitive for r in prop.records] == ["while"]
