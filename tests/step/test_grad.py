"""spmdkit.step.grad: sk.value_and_grad and sk.train_step running a recipe or a plan
(micro-batches, compute dtype, gradient layouts, state, keys, delayed float8)."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit.step import grad
from spmdkit.step.passes import StepPlan
from spmdkit.step.recipe import Recipe, RecipeError
from tests.step.dense_stack import assert_tree_close, batch, init, scanned_loss


@pytest.mark.slow  # the README command's budget
def test_micro_batches_give_the_full_batch_gradient(reference):
    for n in (2, 4):
        loss, grads = jax.jit(sk.value_and_grad(scanned_loss, Recipe(microbatches=n)))(
            init(), batch()
        )
        np.testing.assert_allclose(loss, reference[0], rtol=1e-5)
        assert_tree_close(grads, reference[1], rtol=1e-5)


def test_micro_batches_must_divide_the_batch():
    with pytest.raises(RecipeError, match=r"batch\['x'\]: shape \(6, 16\), microbatches=4"):
        sk.value_and_grad(scanned_loss, Recipe(microbatches=4))(init(), batch(n=6))


def test_micro_batch_keys_are_folded_per_micro_batch():
    seen = []

    def loss(params, b, key):
        seen.append(key)
        return scanned_loss(params, b) + 0.0 * jax.random.normal(key, ())

    key = jax.random.key(3)
    jax.make_jaxpr(sk.value_and_grad(loss, Recipe(microbatches=2)))(init(), batch(), key)
    assert seen  # traced once inside the scan, with the folded key
    assert jax.dtypes.issubdtype(seen[-1].dtype, jax.dtypes.prng_key)


def test_bf16_compute_keeps_fp32_master_gradients(reference):
    """bf16 keeps 8 significant bits: each rounding is off by at most 2^-9
    relative (half an ulp). One layer's output rounds its inputs, its weights
    and its result (3 roundings); 3 layers forward and their transposes
    backward stack some 20 roundings, which add like a random walk
    (sqrt(20) * 2^-9 ≈ 0.9%) in the typical case and linearly (4%) at worst.
    Gradients are compared leaf-wise against their largest entry at 5e-2, the
    loss (accumulated in fp32) at 1e-2."""
    fn = sk.value_and_grad(scanned_loss, Recipe(compute_dtype="bfloat16"))
    jaxpr = str(jax.make_jaxpr(fn)(init(), batch()))
    assert "bf16[8,16]" in jaxpr  # activations in bf16
    loss, grads = jax.jit(fn)(init(), batch())
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))
    np.testing.assert_allclose(loss, reference[0], rtol=1e-2)
    assert_tree_close(grads, reference[1], rtol=5e-2)


def test_grad_specs_constrain_the_accumulated_gradients():
    mesh = jax.sharding.Mesh(jax.devices(), ("data",))
    specs = {"w": P(None, "data"), "b": P(None, "data"), "out": P("data")}
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    fn = sk.value_and_grad(scanned_loss, Recipe(microbatches=2), grad_specs=shardings)
    _, grads = jax.jit(fn)(init(), batch())
    for g, s in zip(jax.tree.leaves(grads), jax.tree.leaves(specs), strict=True):
        assert g.sharding.spec == s


def test_a_plan_passes_its_recipe_and_gradient_specs():
    class FakePlan:  # what the step reads of a plan (spmdkit.step.passes.StepPlan)
        recipe = Recipe(microbatches=2)
        pipeline = None
        grads = types.MappingProxyType({"w": P(None, "data")})
        opt = activation = batch_axes = info = types.MappingProxyType({})
        context = None
        sharding_mesh = jax.sharding.Mesh(jax.devices(), ("data",))

        def param_specs(self, params):
            return {"w": P(), "b": P(), "out": P()}

        def grad_specs(self, params):
            return {"w": P(None, "data"), "b": P(), "out": P()}

        def opt_specs(self, opt_state):
            return jax.tree.map(lambda _: P(), opt_state)

    assert isinstance(FakePlan(), StepPlan)
    fn = sk.value_and_grad(scanned_loss, FakePlan())
    assert fn.recipe == Recipe(microbatches=2)
    _, grads = jax.jit(fn)(init(), batch())
    assert grads["w"].sharding.spec == P(None, "data")
    with pytest.raises(RecipeError, match="Recipe or a plan"):
        sk.value_and_grad(scanned_loss, "full")


def test_recipes_used_collects_the_traced_recipes():
    r = Recipe(remat="full")
    with grad.recipes_used() as seen:
        jax.eval_shape(sk.value_and_grad(scanned_loss, r), init(), batch())
    assert seen == [r]


def test_train_step_is_what_the_planner_can_trace():
    step = sk.train_step(scanned_loss, optax.sgd(0.1), Recipe(remat="full", microbatches=2))
    assert step.recipe == Recipe(remat="full", microbatches=2)
    params, _, loss = jax.jit(step)(init(), optax.sgd(0.1).init(init()), batch())
    assert np.isfinite(loss)
    ref = jax.tree.map(lambda p, g: p - 0.1 * g, init(), jax.grad(scanned_loss)(init(), batch()))
    assert_tree_close(params, ref, rtol=1e-5)


def test_state_is_threaded_through_micro_batches_and_not_differentiated():
    """has_state: the loss takes and returns state; with micro-batches micro-batch i
    sees what i-1 wrote (in dtype), and the step's optimizer never sees it."""

    def loss(params, batch, state):
        new = {"seen": state["seen"] * 2 + batch["x"].sum().astype(jnp.float16)}
        return jnp.mean((batch["x"] @ params["w"]) ** 2), new

    params = {"w": jnp.ones((4, 1))}
    batch = {"x": jnp.arange(16.0).reshape(4, 4)}
    state = {"seen": jnp.zeros((), jnp.float16)}
    (value, new), grads = sk.value_and_grad(loss, Recipe(microbatches=2), has_state=True)(
        params, batch, state
    )
    rows = [batch["x"][0::2], batch["x"][1::2]]  # micro-batch i: rows i, i+2
    want = 0.0
    for r in rows:
        want = want * 2 + float(r.sum())
    assert new["seen"].dtype == jnp.float16 and float(new["seen"]) == want
    plain, plain_grads = jax.value_and_grad(lambda p: loss(p, batch, state)[0])(params)
    np.testing.assert_allclose(value, plain, rtol=1e-6)
    np.testing.assert_allclose(grads["w"], plain_grads["w"], rtol=1e-6)
    opt = optax.sgd(0.1, momentum=0.9)
    step = sk.train_step(loss, opt, Recipe(), has_state=True)
    p2, o2, s2, _ = jax.jit(step)(params, opt.init(params), state, batch)
    assert jax.tree.structure(o2) == jax.tree.structure(opt.init(params))
    assert float(s2["seen"]) == float(batch["x"].sum())
    assert jax.tree.structure(p2) == jax.tree.structure(params)


def test_delayed_fp8_step_carries_the_histories_and_refuses_model_state():
    """The delayed step takes and returns the amax histories after the optimizer
    state; a loss with state of its own is refused (one state per step)."""

    def loss(w, batch):
        return jnp.mean((batch["x"] @ w) ** 2)

    # the loss's one matmul is its head: fp8_exclude=() runs it in float8 too
    rcp = Recipe(compute_dtype="float8", fp8_scaling="delayed", fp8_exclude=())
    w, batch = jnp.full((4, 2), 0.5), {"x": jnp.ones((8, 4))}
    assert grad.init_fp8_state(loss, w, batch) == {}  # the default keeps it in bf16
    state = grad.init_fp8_state(loss, w, batch, exclude=())
    opt = optax.sgd(0.1)
    w2, _, state2, value = jax.jit(grad.train_step(loss, opt, rcp))(w, opt.init(w), state, batch)
    np.testing.assert_allclose(state2["fp8_amax_0000"][:2, 0], [1.0, 0.5])
    assert value > 0 and w2.shape == w.shape
    with pytest.raises(RecipeError, match="no mutable model state of its own"):
        grad.value_and_grad(lambda w, b, s: (loss(w, b), s), rcp, has_state=True)
