"""Choosing among a rule's answers and the hints: out_specs pulled upstream,
FSDP's weights gathered rather than activations, pending sums resolved before a
concatenation or a split."""

import jax
import jax.extend.core
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit.propagation import propagate
from tests.propagation.programs import (
    F32,
    S,
)


def test_out_specs_pull_sharding_upstream(mesh1d):
    def f(x, w):
        return jnp.tanh(x @ w)

    x, w = S((64, 32), F32), S((32, 16), F32)
    free = propagate(f, x, w, in_specs=(None, None), mesh=mesh1d)
    want = propagate(f, x, w, in_specs=(None, None), out_specs=P("x"), mesh=mesh1d)
    assert want.out_specs[0].dims == (("x",), ())
    assert want.flops < free.flops
    assert want.comm_bytes == 0
    dot = next(r for r in want.records if r.primitive == "dot_general")
    assert dot.outputs[0].dims == (("x",), ())


def mlp2_loss(ws, x):
    h = x
    for w1, w2 in ws:
        h = h + jax.nn.relu(h @ w1) @ w2
    return jnp.mean(h * h)


@pytest.mark.parametrize("axes", [{"data": 8}, {"data": 2, "model": 4}])
def test_fsdp_gathers_weights_and_reduce_scatters_grads(axes):
    """FSDP: every weight is all-gathered once (the backward reuses the forward's
    gathered copy, as XLA does), every weight grad is reduce-scattered, and the
    batch-sharded activations never move."""
    d, f, b = 32, 64, 16
    mesh = sk.abstract_mesh(**axes)
    every = tuple(axes)
    ws = [(S((d, f), F32), S((f, d), F32)) for _ in range(2)]
    specs = [(P(every), P(every)) for _ in range(2)]
    prop = propagate(
        jax.grad(mlp2_loss),
        ws,
        S((b, d), F32),
        mesh=mesh,
        in_specs=(specs, P(every)),
        out_specs=specs,
        arg_roles=("params", "batch"),
    )
    weight_bytes = 4 * d * f * 4
    assert prop.comm_bytes_by_kind == {
        "all_gather": weight_bytes,
        "reduce_scatter": weight_bytes,
    }
    gathers = [c for c in prop.collectives() if c.kind == "all_gather"]
    assert len(gathers) == 4 and all(c.group_size == 8 for c in gathers)


@pytest.mark.slow
def test_pending_sum_resolved_before_concatenation_and_split():
    """A row-parallel product (sum-partial) concatenated with a replicated skip
    connection is reduced alone, not with the skip; its cotangent, partial too, is
    reduced before the split that hands out its halves (XLA reduces a contraction's
    result where it is made; the replay pins the split's input so)."""
    mesh = sk.abstract_mesh(model=4)
    b, k, n = 16, 32, 8

    def f(x, w, skip, w2):
        y = jnp.concatenate([x @ w, skip], axis=-1)
        return jnp.sum(jnp.tanh(y @ w2))

    args = (S((b, k), F32), S((k, n), F32), S((b, n), F32), S((2 * n, n), F32))
    prop = propagate(
        jax.grad(f, argnums=(0, 2)),
        *args,
        mesh=mesh,
        in_specs=(P(None, "model"), P("model"), None, P(None, "model")),
    )
    concat = next(r for r in prop.records if r.primitive == "concatenate")
    assert not concat.outputs[0].partial
    assert concat.comm_bytes == b * n * 4  # the product's all-reduce only
    split = next(r for r in prop.records if r.primitive == "split")
    assert not any(o.partial for o in split.outputs)
