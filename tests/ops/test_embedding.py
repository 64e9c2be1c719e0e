"""spmdkit.ops.embedding_lookup: values and table grads equal the unsharded lookup under
sampled input specs (every enumerated spec in the slow test, see ``layouts``), in
Explicit and Auto axis modes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit.errors import ShardingConflictError
from spmdkit.ops.embedding import embedding_lookup

from .layouts import check_every_layout, enumerated

OP = "embedding"
RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    table = rng.standard_normal((8, 4)).astype(np.float32)
    ids = rng.integers(0, 8, (4, 2)).astype(np.int32)
    w = rng.standard_normal((4, 2, 4)).astype(np.float32)
    return table, ids, w


def _check(mesh2d, mode, data, specs):
    """The lookup under ``specs``: value and table grad, and the grad's layout."""
    table, ids, w = data
    ref = jax.jit(jax.value_and_grad(lambda t, i: jnp.sum(jnp.take(t, i, axis=0) * w)))
    ref_val, ref_grad = ref(table, ids)
    mesh = mesh2d if mode == "explicit" else Mesh(mesh2d.devices, mesh2d.axis_names)
    pspecs = [s.to_partition_spec() for s in specs]
    args = [
        jax.device_put(v, NamedSharding(mesh, p)) for v, p in zip((table, ids), pspecs, strict=True)
    ]
    kw = {} if mode == "explicit" else {"in_specs": pspecs, "mesh": mesh}

    def f(t, i, kw=kw):
        return jnp.sum(embedding_lookup(t, i, **kw) * w)

    val, grad = jax.jit(jax.value_and_grad(f))(*args)
    where = f"{mode} {specs}"
    np.testing.assert_allclose(val, ref_val, rtol=RTOL, atol=ATOL, err_msg=where)
    np.testing.assert_allclose(grad, ref_grad, rtol=RTOL, atol=ATOL, err_msg=where)
    fwd = sk.infer_forward(OP, *specs, mesh=mesh2d)
    g_spec = fwd.outputs[0].without_partial()
    pred = sk.infer_grad(OP, *specs, out_grads=(g_spec,), mesh=mesh2d)
    assert pred.inputs == fwd.inputs
    want = pred.outputs[0].without_partial()  # the data-parallel sum is resolved
    if fwd.inputs[0] == specs[0]:
        assert grad.sharding.is_equivalent_to(NamedSharding(mesh, want.to_partition_spec()), 2), (
            where
        )


def _combos(data, mesh2d):
    table, ids, _ = data
    return enumerated([table.shape, ids.shape], [table.dtype, ids.dtype], mesh2d)


@pytest.mark.parametrize("mode", ["explicit", "auto"])
@pytest.mark.heavy
def test_values_and_grads_equal_the_unsharded_lookup(mesh2d, data, mode):
    combos = _combos(data, mesh2d)
    pick = sorted(np.random.default_rng(3).choice(np.arange(1, len(combos)), 4, replace=False))
    for specs in [combos[0], *(combos[i] for i in pick)]:  # all-replicated, and four more
        _check(mesh2d, mode, data, specs)


@pytest.mark.slow
def test_every_enumerated_layout(mesh2d, data):
    """Every input-spec combination the sweep enumerates, through the distinct local
    programs (both axis modes) and the distinct per-operand moves they need."""
    check_every_layout(
        _combos(data, mesh2d),
        lambda specs: sk.infer_forward(OP, *specs, mesh=mesh2d).inputs,
        lambda mode, specs: _check(mesh2d, mode, data, specs),
        data[:2],
        mesh2d,
    )


def test_outputs_carry_the_rule_layout(mesh2d, data):
    table, ids, _ = data
    t = jax.device_put(table, NamedSharding(mesh2d, P(None, "b")))
    i = jax.device_put(ids, NamedSharding(mesh2d, P("a")))
    out = jax.jit(embedding_lookup)(t, i)
    assert jax.typeof(out).sharding.spec == P("a", None, "b")
    np.testing.assert_array_equal(out, table[ids])
    grad = jax.jit(jax.grad(lambda a, b: jnp.sum(embedding_lookup(a, b) ** 2)))(t, i)
    assert jax.typeof(grad).sharding.spec == P(None, "b")


def test_bad_ids_raise_a_typed_error(mesh1d, data):
    table, ids, _ = data
    t = jax.device_put(table, NamedSharding(mesh1d, P()))
    with pytest.raises(ShardingConflictError, match="ids are integers"):
        embedding_lookup(t, ids.astype(np.float32))
