"""spmdkit.propagation.cse: a value XLA computes once is moved once in the prediction,
as in the compiled program."""

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit.compile.enforce import enforced
from spmdkit.models.layers import blockwise_attention
from spmdkit.propagation import propagate
from spmdkit.propagation.cse import ValueNumbers
from spmdkit.propagation.graph import Group, Node
from spmdkit.verification.hlo import parse_collectives


def _by_kind(collectives):
    out: dict[str, int] = {}
    for c in collectives:
        out[c.kind] = out.get(c.kind, 0) + c.payload_bytes
    return out


def _compiled_by_kind(prop, mesh, *args):
    shardings = tuple(NamedSharding(mesh, s.to_partition_spec()) for s in prop.in_specs)
    with jax.set_mesh(mesh):
        compiled = jax.jit(enforced(prop), in_shardings=shardings).lower(*args).compile()
    return _by_kind(parse_collectives(compiled.as_text()))


def test_a_value_computed_twice_is_moved_once():
    """``sin(w)`` written twice is one value to XLA: each copy gathered for a
    product over every dim is one gather in the compiled program, and in the
    prediction."""
    mesh = sk.make_mesh(data=2, model=4, axis_types="auto")

    def f(w):
        return jnp.prod(jnp.sin(w)) + jnp.prod(jnp.sin(w), keepdims=True).sum()

    w = jax.ShapeDtypeStruct((4, 64, 192), jnp.float32)
    prop = propagate(f, w, mesh=mesh, in_specs=(P("data", "model"),))
    assert _by_kind(prop.collectives()) == {"all_gather": 48 * 1024 + 192 * 1024}
    assert _compiled_by_kind(prop, mesh, w) == prop.comm_bytes_by_kind
    sins = [r for r in prop.records if r.primitive == "sin"]
    assert [r.flops > 0 for r in sins] == [True, False]  # computed once


def test_one_block_attention_backward_reuses_the_forwards_moves():
    """Blockwise attention over one key block: its forward and backward are scans
    of length 1, which XLA inlines; the backward's recomputed scores (and the
    query gathered for them) are the forward's, moved once. With two blocks the
    loops stay loops and nothing is merged across them."""
    mesh = sk.make_mesh(data=2, model=4, axis_types="auto")

    def loss(q, k, v):
        return jnp.sum(blockwise_attention(q, k, v, block_size=16) ** 2)

    q = jax.ShapeDtypeStruct((8, 16, 4, 16), jnp.float32)  # seq 16: one block
    spec = P("data", "model")  # sequence parallel
    step = jax.value_and_grad(loss, argnums=(0, 1, 2))
    prop = propagate(step, q, q, q, mesh=mesh, in_specs=(spec,) * 3)
    compiled = _compiled_by_kind(prop, mesh, q, q, q)
    assert prop.comm_bytes_by_kind["all_gather"] == compiled["all_gather"] == 16 * 1024


def test_loops_and_barriered_remat_are_scopes_of_their_own():
    """Identical equations merge within one scope only."""
    numbers = ValueNumbers({0: 2.0, 1: 2.0, 2: jnp.zeros(1000)})
    assert (numbers.of(0), numbers.of(1)) == (0, 0)  # small constants by value
    assert numbers.of(2) == 2

    def sin_of(x):
        return jnp.sin(x)

    jaxpr = jax.make_jaxpr(sin_of)(jnp.ones(4)).jaxpr
    eqn = jaxpr.eqns[0]
    spec = sk.TensorSpec((4,), P(None), dtype=jnp.float32)

    def node(out, group=None):
        return Node("sin", eqn, [10], [out], False, group=group)

    assert not numbers.merge(node(11), [spec], [spec], scope=None)
    assert numbers.merge(node(12), [spec], [spec], scope=None)
    assert numbers.of(12) == 11
    assert not numbers.merge(node(13), [spec], [spec], scope=("loop", 1))
    remat = jax.make_jaxpr(jax.checkpoint(sin_of))(jnp.ones(4)).jaxpr.eqns[0]
    barriered = remat.replace(params={**remat.params, "differentiated": True})
    n = node(14, Group(barriered, [10]))
    assert not numbers.merge(n, [spec], [spec], scope=numbers.scope(n, None))
    n = node(15, Group(remat, [10]))  # not differentiated: no barrier, merged
    assert numbers.merge(n, [spec], [spec], scope=numbers.scope(n, None))


def test_a_1x1_convolutions_backward_reads_the_kernel_the_forward_gathered():
    """The input gradient of a 1x1 convolution reads ``rev(kernel)`` over its size-1
    window dims, which XLA simplifies to the kernel itself: the fully sharded kernel
    is gathered once for both passes, in the compiled program and in the prediction.
    A 3x3 kernel's ``rev`` is a real one: gathered again for the backward, in both.
    (Each time into its blocks over ``model``: gathered over ``model``, then its
    blocks permuted.)"""
    mesh = sk.make_mesh(data=2, model=4, axis_types="auto")

    def loss(x, w):
        y = jax.lax.conv_general_dilated(
            x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )
        return jnp.sum(jnp.tanh(y) ** 2)

    x = jax.ShapeDtypeStruct((8, 8, 8, 16), jnp.float32)
    step = jax.grad(loss, argnums=(0, 1))
    for window, gathers in ((1, 1), (3, 2)):
        w = jax.ShapeDtypeStruct((window, window, 16, 32), jnp.float32)
        prop = propagate(
            step, x, w, mesh=mesh, in_specs=(P("data"), P(None, None, None, ("data", "model")))
        )
        compiled = _compiled_by_kind(prop, mesh, x, w)
        assert prop.comm_bytes_by_kind["all_gather"] == compiled["all_gather"]
        assert compiled["all_gather"] == gathers * window * window * 16 * 32 * 4 // 2
        assert prop.comm_bytes_by_kind["collective_permute"] == compiled["collective_permute"]
