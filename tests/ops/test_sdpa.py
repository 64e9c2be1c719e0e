"""spmdkit.ops.sdpa: values and grads equal ``jax.nn.dot_product_attention`` under
sequence-sharded and sampled input specs (every enumerated spec in the slow test, see
``layouts``), in Explicit and Auto axis modes, for every strategy; the collectives are
the rule's."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit.errors import ShardingConflictError
from spmdkit.ops.sdpa import attention
from spmdkit.rules.attention import attention_reference
from spmdkit.testing import enumerate_specs
from spmdkit.verification.hlo import check_plan, compiled_collectives

from .layouts import check_every_layout, enumerated

OP = "attention"
RTOL, ATOL = 1e-5, 1e-6
SHAPES = ((2, 8, 4, 4), (2, 8, 2, 4), (2, 8, 2, 4))  # grouped-query: 4 query heads, 2 kv heads


def _sample(mesh, n, seed):
    """``n`` input-spec combinations from the sweep's enumeration (all-replicated excluded)."""
    per_input = [enumerate_specs(s, mesh, dtype="float32", partial_ops=()) for s in SHAPES]
    combos = list(itertools.product(*per_input))
    rng = np.random.default_rng(seed)
    return [combos[i] for i in sorted(rng.choice(np.arange(1, len(combos)), n, replace=False))]


def _seq_sharded():
    """Batch over a, sequence over b: the layout sequence parallelism starts from."""
    return tuple(sk.TensorSpec(s, P("a", "b"), dtype="float32") for s in SHAPES)


CONFIGS = {
    "default": {"causal": True},
    "gather_kv": {"causal": True, "strategy": "gather_kv"},
    "ring": {"causal": True, "strategy": "ring", "scale": 0.4},
}


class _Case:
    """One config's q, k, v and the unsharded attention's value and grads."""

    def __init__(self, config):
        self.config, self.attrs = config, CONFIGS[config]
        rng = np.random.default_rng(len(config))
        self.values = tuple(rng.standard_normal(s).astype(np.float32) for s in SHAPES)
        self.w = rng.standard_normal(SHAPES[0]).astype(np.float32)
        ref_attrs = {a: b for a, b in self.attrs.items() if a != "strategy"}

        def ref_loss(a, b, c):
            return jnp.sum(attention_reference(a, b, c, **ref_attrs) * self.w)

        self.ref_val, self.ref_grads = jax.jit(jax.value_and_grad(ref_loss, argnums=(0, 1, 2)))(
            *self.values
        )

    def required(self, specs, mesh2d):
        return tuple(sk.infer_forward(OP, *specs, mesh=mesh2d, **self.attrs).inputs)

    def check(self, mesh2d, mode, specs):
        attrs, w = self.attrs, self.w
        mesh = mesh2d if mode == "explicit" else Mesh(mesh2d.devices, mesh2d.axis_names)
        pspecs = [s.to_partition_spec() for s in specs]
        placed = zip(self.values, pspecs, strict=True)
        args = [jax.device_put(a, NamedSharding(mesh, p)) for a, p in placed]
        kw = {} if mode == "explicit" else {"in_specs": pspecs, "mesh": mesh}

        def f(a, b, c, kw=kw):
            return jnp.sum(attention(a, b, c, **attrs, **kw) * w)

        val, grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(*args)
        where = f"{mode} {self.config} {specs}"
        np.testing.assert_allclose(val, self.ref_val, rtol=RTOL, atol=ATOL * 10, err_msg=where)
        for g, rg in zip(grads, self.ref_grads, strict=True):
            np.testing.assert_allclose(g, rg, rtol=RTOL, atol=ATOL * 10, err_msg=where)
        # the grads leave the op with the layouts the grad rule predicts
        fwd = sk.infer_forward(OP, *specs, mesh=mesh2d, **attrs)
        out_spec = fwd.outputs[0].without_partial()
        pred = sk.infer_grad(OP, *specs, out_grads=(out_spec,), mesh=mesh2d, **attrs)
        assert pred.inputs == fwd.inputs
        for i, g in enumerate(grads):
            if fwd.inputs[i] == specs[i]:  # no input reshard: the op's own grad layout
                want = pred.outputs[i].without_partial().to_partition_spec()
                assert g.sharding.is_equivalent_to(NamedSharding(mesh, want), g.ndim), where


@pytest.mark.parametrize("mode", ["explicit", "auto"])
@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.heavy
def test_values_and_grads_equal_the_unsharded_op(mesh2d, mode, config):
    case = _Case(config)
    cases = [_seq_sharded()]
    if mode == "explicit" and config != "ring":  # ring's layouts: the slow test below
        cases += _sample(mesh2d, 1, seed=len(config))
    for specs in cases:
        case.check(mesh2d, mode, specs)


@pytest.mark.slow
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_every_enumerated_layout(mesh2d, config):
    """Every input-spec combination the sweep enumerates, through the distinct local
    programs (both axis modes) and the distinct per-operand moves they need."""
    case = _Case(config)
    check_every_layout(
        enumerated(SHAPES, ["float32"] * 3, mesh2d),
        lambda specs: case.required(specs, mesh2d),
        lambda mode, specs: case.check(mesh2d, mode, specs),
        case.values,
        mesh2d,
    )


def test_sequence_parallel_strategies_keep_the_query_sequence_sharded(mesh2d):
    specs = _seq_sharded()
    args = [s.to_shape_dtype_struct(mesh2d) for s in specs]  # Explicit axes: typed layouts
    for strategy in ("gather_kv", "ring"):
        out = jax.eval_shape(lambda *a, s=strategy: attention(*a, causal=True, strategy=s), *args)
        assert out.sharding.spec == P("a", "b", None, None)
    out = jax.eval_shape(lambda *a: attention(*a, causal=True), *args)
    assert out.sharding.spec == P("a", None, None, None)  # the reference gathers the sequence


def test_sequence_parallel_collectives_are_the_predicted_ones(mesh1d):
    shapes = ((2, 16, 4, 8), (2, 16, 1, 8), (2, 16, 1, 8))  # multi-query
    specs = tuple(sk.TensorSpec(s, P(None, "x"), dtype="float32") for s in shapes)
    args = [s.to_shape_dtype_struct(mesh1d) for s in specs]
    kv_bytes = 2 * 16 * 8 * 4  # K (or V) whole, f32

    def loss(strategy):
        return lambda a, b, c: jnp.sum(attention(a, b, c, causal=True, strategy=strategy))

    # gather_kv's grad (its forward: tests/rules/test_attention.py): the two gathers
    # again, and dK, dV reduce-scattered back
    grad = sk.infer_grad(
        OP, *specs, out_grads=(specs[0],), mesh=mesh1d, strategy="gather_kv", causal=True
    )
    compiled = compiled_collectives(jax.grad(loss("gather_kv"), argnums=(0, 1, 2)), *args)
    assert check_plan(grad.collectives, compiled, reduce_scatter_as_all_reduce=True) == []
    assert sorted(c.payload_bytes for c in compiled) == [kv_bytes] * 4
    # ring: one K and one V permute per step forward, their transposes backward, each
    # of one block; over n - 1 = 3 steps the wire bytes equal the stated all-gathers'
    grad = sk.infer_grad(
        OP, *specs, out_grads=(specs[0],), mesh=mesh1d, strategy="ring", causal=True
    )
    compiled = compiled_collectives(jax.grad(loss("ring"), argnums=(0, 1, 2)), *args)
    assert [c.kind for c in compiled] == ["collective_permute"] * 4
    assert {c.payload_bytes for c in compiled} == {kv_bytes // 4}
    assert 3 * sum(c.payload_bytes for c in compiled) == sum(c.wire_bytes for c in grad.collectives)


def test_bad_inputs_raise_typed_errors(mesh1d):
    def put(shape, dtype=jnp.float32):
        return jax.device_put(jnp.zeros(shape, dtype), NamedSharding(mesh1d, P()))

    with pytest.raises(ShardingConflictError, match="multiple of the key/value heads"):
        attention(put((1, 4, 4, 2)), put((1, 4, 3, 2)), put((1, 4, 3, 2)))
    with pytest.raises(ShardingConflictError, match="one dtype"):
        attention(put((1, 4, 2, 2)), put((1, 4, 2, 2)), put((1, 4, 2, 2), jnp.bfloat16))
    with pytest.raises(ShardingConflictError, match="strategy"):
        attention(put((1, 4, 2, 2)), put((1, 4, 2, 2)), put((1, 4, 2, 2)), strategy="flash")
