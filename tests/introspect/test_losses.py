"""spmdkit.introspect.losses: one loss per model kind; aux, keys and state as the step runs them."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import spmdkit as sk
from spmdkit.introspect import describe
from spmdkit.step.loss import LossError


class Dropped(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(4, 16, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.drop(self.lin(x))


def dropped_loss(model, batch):
    h = model(batch["x"])
    return jnp.mean(h**2), {"kept": (h[0] != 0).astype(jnp.float32)}


BATCH = {"x": np.ones((8, 4), np.float32)}


def test_an_nnx_model_with_dropout_takes_a_key_and_draws_a_mask_per_step(mesh2d):
    """describe → sk.jit(sk.train_step(info, ...)): the key is a step input; two
    steps draw two masks; no key, or the planner's placeholder loss, is refused."""
    info = describe(lambda: Dropped(nnx.Rngs(0)), loss=dropped_loss, batch=BATCH)
    assert info.rng and info.has_aux and repr(info.train_loss) == "Loss(<lambda>: rng, aux)"
    plan = sk.plan(info, mesh2d, "dp", estimator="analytic")  # the loss's aux is dropped there
    opt = optax.sgd(0.1)
    step = sk.jit(sk.train_step(info, opt, plan), plan, donate_state=True)
    params = info.init_fn()
    state = opt.init(params)
    key = jax.random.key(3)
    masks = []
    for t in range(2):
        params, state, (_, aux) = step(params, state, BATCH, jax.random.fold_in(key, t))
        masks.append(np.asarray(aux["kept"]))
    assert not np.array_equal(*masks) and 0 < masks[0].sum() < 16
    with pytest.raises(LossError, match="gets a key every step"):
        step(params, state, BATCH)
    with pytest.raises(LossError, match="placeholder key"):
        sk.jit(sk.train_step(info.loss_fn, opt, plan), plan)(params, state, BATCH)


class LinenDrop(nn.Module):
    @nn.compact
    def __call__(self, x, train=True):
        return nn.Dropout(0.5, deterministic=not train)(nn.Dense(16)(x))


def linen_loss(variables, batch, rng):
    h = LinenDrop().apply(variables, batch["x"], rngs={"dropout": rng})
    return jnp.mean(h**2), {"kept": (h[0] != 0).astype(jnp.float32)}


def test_a_linen_loss_taking_rng_gets_the_step_key_folded_per_micro_batch(mesh2d):
    x = BATCH["x"]
    info = describe(LinenDrop(), loss=linen_loss, batch=BATCH, init_args=(x,))
    assert info.rng and info.kind == "linen"
    recipe = sk.Recipe(microbatches=2)
    plan = sk.plan(info, mesh2d, "dp", estimator="analytic", recipe=recipe)
    grad_fn = jax.jit(sk.value_and_grad(info, plan))
    params = info.init_fn()
    (value, _), _ = grad_fn(params, BATCH, jax.random.key(0))
    (again, _), _ = grad_fn(params, BATCH, jax.random.key(0))
    (other, _), _ = grad_fn(params, BATCH, jax.random.key(1))
    assert float(value) == float(again) != float(other)
    # each micro-batch folds in its index: the two halves' masks differ
    one = sk.value_and_grad(info, sk.Recipe())
    (whole, _), _ = jax.jit(one)(params, {"x": x[::2]}, jax.random.fold_in(jax.random.key(0), 0))
    (rest, _), _ = jax.jit(one)(params, {"x": x[1::2]}, jax.random.fold_in(jax.random.key(0), 1))
    np.testing.assert_allclose(float(value), (float(whole) + float(rest)) / 2, rtol=1e-6)


def test_a_linen_loss_returns_aux_beside_its_updates():
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.BatchNorm(use_running_average=False, momentum=0.5)(x)

    def loss(variables, batch):
        y, updates = Net().apply(variables, batch["x"], mutable=["batch_stats"])
        return (jnp.mean(y**2), {"mean": jnp.mean(y)}), updates

    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    info = describe(Net(), loss=loss, batch={"x": x}, init_args=(x,))
    assert info.has_state and info.has_aux
    grad_fn = sk.value_and_grad(info, sk.Recipe())
    ((_, aux), new), _ = grad_fn(info.init_fn(), {"x": x}, info.init_state_fn())
    assert set(aux) == {"mean"} and float(new["batch_stats"]["BatchNorm_0"]["mean"][0]) == 1.0
    assert np.ndim(info.loss_fn(info.init_fn(), {"x": x})) == 0  # the planner's: no aux


def test_a_params_pytree_is_described_with_its_loss():
    params = {"w": jnp.ones((4, 2))}
    info = describe(params, loss=lambda p, b: jnp.sum(b["x"] @ p["w"]), batch=BATCH)
    assert info.kind == "tree" and [p.path for p in info.params] == ["w"]
    assert not info.has_state and not info.rng and not info.has_aux
