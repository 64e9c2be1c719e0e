"""spmdkit.ops.softmax_cross_entropy: values and grads equal the unsharded op under
sampled input specs (every enumerated spec in the slow test, see ``layouts``), in
Explicit and Auto axis modes; works where optax raises."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit.errors import ShardingConflictError, SpecError
from spmdkit.ops.cross_entropy import softmax_cross_entropy
from spmdkit.rules.cross_entropy import softmax_cross_entropy_reference as ce_ref

from .layouts import check_every_layout, enumerated

OP = "softmax_cross_entropy"
RTOL, ATOL = 1e-5, 1e-6


def _hard(rng):
    z = (rng.standard_normal((4, 8)) * 2).astype(np.float32)
    y = rng.integers(0, 8, 4).astype(np.int32)
    y[1] = -100
    return z, y


def _hard_axis0(rng):
    z, y = _hard(rng)
    return np.ascontiguousarray(z.T), y


def _soft(rng):
    z = (rng.standard_normal((4, 8)) * 2).astype(np.float32)
    return z, rng.dirichlet(np.ones(8), 4).astype(np.float32)


CONFIGS = {
    "hard_mean": (_hard, {"reduction": "mean", "label_smoothing": 0.1}),
    "hard_sum_axis0_vocab_parallel": (
        _hard_axis0,
        {"axis": 0, "reduction": "sum", "strategy": "vocab_parallel"},
    ),
    "soft_none_vocab_parallel": (
        _soft,
        {"reduction": "none", "label_smoothing": 0.2, "strategy": "vocab_parallel"},
    ),
}


def _scalar(loss, w):
    return loss if loss.ndim == 0 else jnp.sum(loss * w)


class _Case:
    """One config's logits and labels, and the unsharded loss and grads."""

    def __init__(self, config):
        make, self.attrs = CONFIGS[config]
        self.config = config
        rng = np.random.default_rng(0)
        self.z, self.y = make(rng)
        self.w = rng.standard_normal(4).astype(np.float32)
        ref_attrs = {k: v for k, v in self.attrs.items() if k != "strategy"}
        self.argnums = (0, 1) if self.y.dtype != np.int32 else (0,)
        self.ref_val, self.ref_grads = jax.jit(
            jax.value_and_grad(
                lambda a, b: _scalar(ce_ref(a, b, **ref_attrs), self.w), argnums=self.argnums
            )
        )(self.z, self.y)

    def combos(self, mesh2d):
        return enumerated([self.z.shape, self.y.shape], [self.z.dtype, self.y.dtype], mesh2d)

    def required(self, specs, mesh2d):
        return tuple(sk.infer_forward(OP, *specs, mesh=mesh2d, **self.attrs).inputs)

    def check(self, mesh2d, mode, specs):
        attrs, argnums, w = self.attrs, self.argnums, self.w
        mesh = mesh2d if mode == "explicit" else Mesh(mesh2d.devices, mesh2d.axis_names)
        pspecs = [s.to_partition_spec() for s in specs]
        args = [
            jax.device_put(v, NamedSharding(mesh, p))
            for v, p in zip((self.z, self.y), pspecs, strict=True)
        ]
        kw = {} if mode == "explicit" else {"in_specs": pspecs, "mesh": mesh}

        def f(a, b, kw=kw):
            return _scalar(softmax_cross_entropy(a, b, **attrs, **kw), w)

        val, grads = jax.jit(jax.value_and_grad(f, argnums=argnums))(*args)
        where = f"{mode} {self.config} {specs}"
        np.testing.assert_allclose(val, self.ref_val, rtol=RTOL, atol=ATOL, err_msg=where)
        for g, rg in zip(grads, self.ref_grads, strict=True):
            np.testing.assert_allclose(g, rg, rtol=RTOL, atol=ATOL, err_msg=where)
        # the grads leave the op with the layouts the grad rule predicts
        fwd = sk.infer_forward(OP, *specs, mesh=mesh2d, **attrs)
        loss_spec = fwd.outputs[0].without_partial()
        pred = sk.infer_grad(OP, *specs, out_grads=(loss_spec,), mesh=mesh2d, **attrs)
        assert pred.inputs == fwd.inputs
        for i, g in zip(argnums, grads, strict=True):
            want = pred.outputs[i].without_partial()
            if fwd.inputs[i] == specs[i]:  # no input reshard: the op's own grad layout
                assert g.sharding.is_equivalent_to(
                    NamedSharding(mesh, want.to_partition_spec()), g.ndim
                ), where
            if mode == "explicit":  # the reshard's transpose brings it back to the input's
                assert g.sharding.spec == pspecs[i] or g.sharding.is_equivalent_to(
                    NamedSharding(mesh, pspecs[i]), g.ndim
                ), where


@pytest.mark.parametrize("mode", ["explicit", "auto"])
@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.heavy
def test_values_and_grads_equal_the_unsharded_op(mesh2d, mode, config):
    case = _Case(config)
    combos = case.combos(mesh2d)
    rng = np.random.default_rng(len(config))
    pick = sorted(rng.choice(np.arange(1, len(combos)), size=2, replace=False))
    for specs in [combos[0], *(combos[i] for i in pick)]:  # all-replicated, and two more
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
        (case.z, case.y),
        mesh2d,
    )


def test_optax_raises_on_vocab_sharded_logits_where_the_op_works(mesh1d):
    rng = np.random.default_rng(3)
    z = rng.standard_normal((8, 16)).astype(np.float32)
    y = rng.integers(0, 16, 8).astype(np.int32)
    zs = jax.device_put(z, NamedSharding(mesh1d, P(None, "x")))
    ys = jax.device_put(y, NamedSharding(mesh1d, P()))

    def plain(a, b):
        return optax.softmax_cross_entropy_with_integer_labels(a, b).mean()

    with pytest.raises(Exception) as err:  # ShardingTypeError is not exported by jax
        jax.jit(plain)(zs, ys)
    assert type(err.value).__name__ == "ShardingTypeError"
    val, grad = jax.jit(jax.value_and_grad(softmax_cross_entropy))(zs, ys)
    ref_val, ref_grad = jax.jit(jax.value_and_grad(plain))(z, y)
    np.testing.assert_allclose(val, ref_val, rtol=RTOL)
    np.testing.assert_allclose(grad, ref_grad, rtol=RTOL, atol=ATOL)
    assert jax.typeof(grad).sharding.spec == P(None, "x")  # still vocab-sharded


def test_bad_labels_and_missing_mesh_raise_typed_errors(mesh1d):
    z = jax.device_put(np.zeros((8, 16), np.float32), NamedSharding(mesh1d, P()))
    with pytest.raises(ShardingConflictError, match="without the class dim"):
        softmax_cross_entropy(z, jnp.zeros((7,), jnp.int32))
    with pytest.raises(ShardingConflictError, match="hard labels are integers"):
        softmax_cross_entropy(z, np.zeros((8,), np.float32))
    with pytest.raises(SpecError, match="knows its mesh"):
        softmax_cross_entropy(np.zeros((8, 16), np.float32), np.zeros((8,), np.int32))
