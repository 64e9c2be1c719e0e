"""spmdkit.step.remat_scan: the recompute pass, each layer of the loss's layer scan
recomputed under the recipe's policy (full, dots, names, MaxText's named policies,
every k-th layer)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spmdkit as sk
from spmdkit.step import remat_scan
from spmdkit.step.recipe import Recipe, RecipeError
from tests.step.dense_stack import (
    B,
    D,
    L,
    assert_tree_close,
    batch,
    init,
    looped_loss,
    scanned_loss,
    tagged_loss,
)


@pytest.mark.parametrize(
    "recipe",
    [
        Recipe(remat="full"),
        Recipe(remat="dots"),
        Recipe(remat="names", save_names=("proj",)),
        Recipe(remat="save_qkv_proj"),
        Recipe(remat="save_qkv_proj", remat_offload=True),
    ],
    ids=str,
)
def test_remat_policies_recompute_each_layer_and_keep_the_gradients(reference, recipe):
    fn = sk.value_and_grad(scanned_loss, recipe)
    jaxpr = jax.make_jaxpr(fn)(init(), batch())
    scans = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
    # the backward scan recomputes each layer: its body is a checkpoint
    backward = [s for s in scans if s.params["reverse"]]
    assert backward and any(
        e.primitive.name in ("checkpoint", "remat2") for e in backward[0].params["jaxpr"].jaxpr.eqns
    )
    loss, grads = jax.jit(fn)(init(), batch())
    np.testing.assert_allclose(loss, reference[0], rtol=1e-5)
    assert_tree_close(grads, reference[1], rtol=1e-5)


def test_named_policy_keeps_its_tags_on_the_device_or_the_host():
    """save_qkv_proj keeps the tagged projection per layer besides the layer input
    (full keeps the input only); its offload form keeps it in host memory
    (``pinned_host``: CPU devices have it), and the gradients are the plain ones."""

    def stacks(recipe):
        _, vjp = jax.vjp(remat_scan.remat_loss(tagged_loss, recipe), init(), batch())
        return [x for x in jax.tree.leaves(vjp) if x.shape == (L, B, D)]

    assert len(stacks(Recipe(remat="full"))) == 1
    assert len(stacks(Recipe(remat="save_qkv_proj"))) == 2
    offload = remat_scan.remat_loss(tagged_loss, Recipe(remat="save_qkv_proj", remat_offload=True))
    _, vjp = jax.vjp(offload, init(), batch())
    kept = [x for x in jax.tree.leaves(vjp) if x.shape == (L, B, D)]
    assert [x.sharding.memory_kind for x in kept].count("pinned_host") == 1
    want = jax.jit(jax.value_and_grad(tagged_loss))(init(), batch())
    recipe = Recipe(remat="save_qkv_proj", remat_offload=True)
    got = jax.jit(sk.value_and_grad(tagged_loss, recipe))(init(), batch())
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    assert_tree_close(got[1], want[1], rtol=1e-6)


def test_every_kth_layer_recomputes_only_those_layers():
    """remat_every=2 on four layers: the first two (in the order they run: the
    last two of a reverse scan) recomputed, keeping their inputs, the other two
    keeping their residuals; the gradients are the plain ones. A count that does
    not divide, or leaves one recomputed layer, is a typed error."""
    params = dict(init(), w=jnp.concatenate([init()["w"], init(1)["w"]])[:4])
    params["b"] = jnp.concatenate([init()["b"], init(1)["b"]])[:4]

    def reversed_loss(params, batch):
        flipped = {k: v[::-1] if k in ("w", "b") else v for k, v in params.items()}
        h = batch["x"]
        h, _ = jax.lax.scan(
            lambda h, wb: (jnp.tanh(h @ wb[0] + wb[1]), h),
            h,
            (params["w"], params["b"]),
            reverse=True,
        )
        return scanned_loss(flipped, batch) + jnp.mean(h)

    def stacks(loss, recipe):
        _, vjp = jax.vjp(remat_scan.remat_loss(loss, recipe), params, batch())
        return sorted(
            x.shape for x in jax.tree.leaves(vjp) if x.ndim == 3 and x.shape[1:] == (B, D)
        )

    every2 = Recipe(remat="full", remat_every=2)
    assert stacks(scanned_loss, Recipe(remat="full")) == [(4, B, D)]
    got = stacks(scanned_loss, every2)
    assert len(got) > 2 and all(s[0] == 2 for s in got)
    for loss in (scanned_loss, reversed_loss):
        want = jax.jit(jax.value_and_grad(loss))(params, batch())
        value, grads = jax.jit(sk.value_and_grad(loss, every2))(params, batch())
        np.testing.assert_allclose(value, want[0], rtol=1e-6)
        assert_tree_close(grads, want[1], rtol=1e-6)
    with pytest.raises(RecipeError, match="remat_every divides"):
        sk.value_and_grad(scanned_loss, every2)(init(), batch())  # 3 layers
    with pytest.raises(RecipeError, match="two or more recomputed layers"):
        sk.value_and_grad(scanned_loss, Recipe(remat="full", remat_every=4))(params, batch())


def test_full_remat_saves_only_the_layer_inputs():
    """What crosses from the forward to the backward scan: with ``full`` each
    layer's input (the carry) plus the weights; without recompute also the
    layer's tanh output (and on jax 0.10 its pre-activation: jax 0.12 computes
    tanh's derivative from the output alone)."""

    def activation_stacks(fn):
        _, vjp = jax.vjp(fn, init(), batch())
        return [x for x in jax.tree.leaves(vjp) if x.shape == (L, B, D)]

    plain = activation_stacks(scanned_loss)
    full = activation_stacks(remat_scan.remat_loss(scanned_loss, Recipe(remat="full")))
    assert len(full) == 1  # the layers' inputs
    assert len(plain) >= 2  # ... and what each layer computed


def test_remat_finds_the_layer_scan_inside_a_jit(reference):
    jitted = jax.jit(scanned_loss)
    rematted = remat_scan.remat_loss(jitted, Recipe(remat="full"))
    closed = jax.make_jaxpr(rematted)(init(), batch())
    (call,) = [e for e in closed.jaxpr.eqns if e.primitive.name in ("pjit", "jit")]
    (scan,) = [e for e in call.params["jaxpr"].jaxpr.eqns if e.primitive.name == "scan"]
    body = scan.params["jaxpr"].jaxpr.eqns
    assert [e.primitive.name for e in body] in (["checkpoint"], ["remat2"])
    _, grads = jax.jit(sk.value_and_grad(jitted, Recipe(remat="full")))(init(), batch())
    assert_tree_close(grads, reference[1], rtol=1e-5)


def test_remat_of_an_unrolled_loss_is_a_typed_error():
    with pytest.raises(RecipeError, match="scan_layers=True"):
        sk.value_and_grad(looped_loss, Recipe(remat="full"))(init(), batch())


def test_every_trace_of_a_rematted_loss_runs_the_model():
    """The loss is traced afresh on every call, not from jax's trace cache: what
    its ops note while traced (a pipelined stage's expert exchanges) is noted by
    every trace of the step, as without recompute."""
    runs = []

    def noting_loss(params, x):
        runs.append(1)
        return scanned_loss(params, x)

    rematted = remat_scan.remat_loss(noting_loss, Recipe(remat="full"))
    for _ in range(2):

        def step(p, x):  # a new function per trace, as the pipeline's split makes
            return rematted(p, x)

        jax.make_jaxpr(step)(init(), batch())
    assert len(runs) == 2
