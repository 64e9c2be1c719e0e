"""spmdkit.ops.indexing: values and grads equal ``x.at[idx].set/add`` under sampled
input specs (every enumerated spec in the slow test, see ``layouts``), in Explicit and
Auto axis modes; the local update moves nothing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit.errors import ShardingConflictError
from spmdkit.ops.indexing import index_put
from spmdkit.rules.index_put import index_put_reference
from spmdkit.verification.hlo import compiled_collectives

from .layouts import check_every_layout, enumerated

T = sk.TensorSpec

OP = "index_put"
RTOL, ATOL = 1e-5, 1e-6


def _values(rng, unique):
    x = rng.standard_normal((8, 4)).astype(np.float32)
    if unique:
        i = rng.choice(8, size=4, replace=False).astype(np.int32)
        i[0] -= 8  # a negative index
    else:
        i = rng.integers(0, 8, size=4).astype(np.int32)
    v = rng.standard_normal((4, 4)).astype(np.float32)
    return x, i, v


CONFIGS = {
    "set_reference": {"accumulate": False},
    "add_local_update": {"accumulate": True, "strategy": "local_update"},
    "set_local_update": {"accumulate": False, "strategy": "local_update"},
}


class _Case:
    """One config's x, indices and values, and the unsharded result and grads."""

    def __init__(self, config):
        self.config, self.attrs = config, CONFIGS[config]
        rng = np.random.default_rng(len(config))
        acc = self.attrs["accumulate"]
        self.x, self.i, self.v = _values(rng, unique=not acc)
        self.w = rng.standard_normal(self.x.shape).astype(np.float32)

        def ref_loss(a, c):
            return jnp.sum(index_put_reference(a, self.i, c, accumulate=acc) * self.w)

        self.ref_val, self.ref_grads = jax.jit(jax.value_and_grad(ref_loss, argnums=(0, 1)))(
            self.x, self.v
        )

    @property
    def values(self):
        return self.x, self.i, self.v

    def combos(self, mesh2d):
        return enumerated([a.shape for a in self.values], [a.dtype for a in self.values], mesh2d)

    def required(self, specs, mesh2d):
        return tuple(sk.infer_forward(OP, *specs, mesh=mesh2d, **self.attrs).inputs)

    def check(self, mesh2d, mode, specs):
        attrs, w = self.attrs, self.w
        mesh = mesh2d if mode == "explicit" else Mesh(mesh2d.devices, mesh2d.axis_names)
        pspecs = [s.to_partition_spec() for s in specs]
        args = [
            jax.device_put(a, NamedSharding(mesh, p))
            for a, p in zip(self.values, pspecs, strict=True)
        ]
        kw = {} if mode == "explicit" else {"in_specs": pspecs, "mesh": mesh}

        def f(a, b, c, kw=kw):
            return jnp.sum(index_put(a, b, c, **attrs, **kw) * w)

        val, grads = jax.jit(jax.value_and_grad(f, argnums=(0, 2)))(*args)
        where = f"{mode} {self.config} {specs}"
        np.testing.assert_allclose(val, self.ref_val, rtol=RTOL, atol=ATOL, err_msg=where)
        for g, rg in zip(grads, self.ref_grads, strict=True):
            np.testing.assert_allclose(g, rg, rtol=RTOL, atol=ATOL, err_msg=where)
        # the grads leave the op with the layouts the grad rule predicts
        fwd = sk.infer_forward(OP, *specs, mesh=mesh2d, **attrs)
        out_spec = fwd.outputs[0].without_partial()
        pred = sk.infer_grad(OP, *specs, out_grads=(out_spec,), mesh=mesh2d, **attrs)
        assert pred.inputs == fwd.inputs
        for k, g in zip((0, 2), grads, strict=True):
            if fwd.inputs[k] == specs[k]:  # no input reshard: the op's own grad layout
                want = pred.outputs[k].without_partial().to_partition_spec()
                assert g.sharding.is_equivalent_to(NamedSharding(mesh, want), g.ndim), where


@pytest.mark.parametrize("mode", ["explicit", "auto"])
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_values_and_grads_equal_the_unsharded_op(mesh2d, mode, config):
    case = _Case(config)
    x, i, v = case.values
    rows = (T(x.shape, P(("a", "b")), dtype=x.dtype), T(i.shape, dtype=i.dtype), T(v.shape))
    combos = case.combos(mesh2d)
    sampled = combos[np.random.default_rng(7).integers(1, len(combos))]
    for specs in (rows, sampled):  # row-sharded x, and one sampled layout
        case.check(mesh2d, mode, specs)


@pytest.mark.slow
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_every_enumerated_layout(mesh2d, config):
    """Every input-spec combination the sweep enumerates, through the distinct local
    programs (both axis modes) and the distinct per-operand moves they need."""
    case = _Case(config)
    check_every_layout(
        case.combos(mesh2d),
        lambda specs: case.required(specs, mesh2d),
        lambda mode, specs: case.check(mesh2d, mode, specs),
        case.values,
        mesh2d,
    )


def test_several_index_arrays_and_in_specs_under_auto_jit(mesh2d):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, 8, 2)).astype(np.float32)
    i0 = np.array([0, 3, 1], np.int32)
    i1 = np.array([7, 2, 2], np.int32)
    v = rng.standard_normal((3, 2)).astype(np.float32)
    amesh = Mesh(mesh2d.devices, mesh2d.axis_names)
    xs = jax.device_put(x, NamedSharding(amesh, P("a", "b")))
    f = jax.jit(
        lambda a, b, c, d: index_put(
            a,
            (b, c),
            d,
            strategy="local_update",
            mesh=amesh,
            in_specs=(P("a", "b"), (P(), P()), P()),
        )
    )
    out = f(xs, i0, i1, v)
    np.testing.assert_allclose(out, _set(x, i0, i1, v))
    assert out.sharding.is_equivalent_to(NamedSharding(amesh, P("a", "b")), 3)


def _set(x, i0, i1, v):
    y = x.copy()
    y[i0, i1] = v
    return y


def test_local_update_on_row_sharded_x_moves_nothing(mesh1d):
    x = jax.device_put(jnp.zeros((16, 8)), NamedSharding(mesh1d, P("x")))
    i = jax.device_put(jnp.array([1, 9, 15], jnp.int32), NamedSharding(mesh1d, P()))
    v = jax.device_put(jnp.ones((3, 8)), NamedSharding(mesh1d, P()))
    for acc in (False, True):

        def f(a, b, c, acc=acc):
            return index_put(a, b, c, accumulate=acc, strategy="local_update")

        assert compiled_collectives(f, x, i, v) == []
        out = jax.jit(f)(x, i, v)
        assert jax.typeof(out).sharding.spec == P("x", None)
        np.testing.assert_array_equal(np.asarray(out)[[1, 9, 15]], 1.0)
    # the reference strategy gathers the rows instead
    kinds = {c.kind for c in compiled_collectives(index_put, x, i, v)}
    assert kinds == {"all_gather"}


def test_bad_inputs_raise_typed_errors(mesh1d):
    x = jax.device_put(jnp.zeros((8, 4)), NamedSharding(mesh1d, P()))
    with pytest.raises(ShardingConflictError, match="integer"):
        index_put(x, jnp.zeros((3,), jnp.float32), jnp.zeros((3, 4)))
    with pytest.raises(ShardingConflictError, match="dtype"):
        index_put(x, jnp.zeros((3,), jnp.int32), jnp.zeros((3, 4), jnp.bfloat16))
    with pytest.raises(ShardingConflictError, match="strategy"):
        index_put(x, jnp.zeros((3,), jnp.int32), jnp.zeros((3, 4)), strategy="scatter")
