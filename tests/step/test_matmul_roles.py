"""Weight matmuls' roles in a layer that tags nothing: the named recompute
policies keep on an untagged copy of a reference model what they keep on the
tagged one (names, predicted memory, numerics, compiled memory)."""

from __future__ import annotations

import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spmdkit as sk
import spmdkit.models.layers as lyr
from spmdkit import describe, jit, plan
from spmdkit.models import get_model
from spmdkit.pipeline.layer_scan import find_layer_scan
from spmdkit.step.matmul_roles import matmul_roles
from spmdkit.step.recipe import NAMED_POLICIES, Recipe


def _untag(monkeypatch):
    """Reference models built from here on tag nothing (``lyr.tag`` an identity)."""
    monkeypatch.setattr(lyr, "tag", lambda x, name: x)


def _described(model, **changes):
    spec = get_model(model)
    cfg = dataclasses.replace(spec.config("tiny"), scan_layers=True, **changes)
    batch = spec.batch(cfg, 8, np.random.default_rng(0))
    return describe(spec, config=cfg, batch=batch), batch


def _layer_scan(info, batch):
    closed = jax.make_jaxpr(info.loss_fn)(info.abstract_params, batch)
    return find_layer_scan(closed.jaxpr).scan


@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_an_untagged_layer_gets_the_tags_of_the_tagged_one(model, monkeypatch):
    """Tiny GPT (one MLP input projection) and Llama (a gated MLP, GQA): each
    weight matmul of the untagged layer gets the role the tagged model names it
    by, one value per tag; the tagged layer itself gets no roles."""
    tagged = _layer_scan(*_described(model))
    names = collections.Counter(
        str(e.params["name"]) for e in tagged.jaxpr.eqns if e.primitive.name == "name"
    )
    assert matmul_roles(tagged.jaxpr, range(tagged.num_consts, tagged.first_xs)) == {}
    _untag(monkeypatch)
    plain = _layer_scan(*_described(model))
    roles = matmul_roles(plain.jaxpr, range(plain.num_consts, plain.first_xs))
    assert collections.Counter(roles.values()) == names
    assert all(plain.jaxpr.eqns[i].primitive.name == "dot_general" for i in roles)


@pytest.mark.slow
def test_named_policies_are_priced_alike_untagged(monkeypatch):
    """Tiny Llama, 4 layers: the analytic activation memory and step time of every
    named policy are the tagged model's (within 3%)."""
    mesh = sk.abstract_mesh(data=8)

    def priced(info):
        out = {}
        for name in ("full", *NAMED_POLICIES):
            p = plan(info, mesh, "dp", estimator="analytic", recipe=Recipe(remat=name))
            out[name] = (p.cost.memory["activations"], p.cost.step_time_s)
        return out

    tagged = priced(_described("llama", n_layers=4)[0])
    _untag(monkeypatch)
    untagged = priced(_described("llama", n_layers=4)[0])
    for name, (memory, time) in tagged.items():
        assert untagged[name][0] == pytest.approx(memory, rel=0.03), name
        assert untagged[name][1] == pytest.approx(time, rel=0.03), name
    # two keep alike, and save_out_proj_experts keeps save_out_proj's (no routed experts)
    assert len({m for m, _ in untagged.values()}) == len(untagged) - 2


def _hand_layer_loss(params, x):
    """Four untagged layers written out: batched-dot attention (no kernel), a
    gated MLP."""

    def layer(h, w):
        q, k, v = h @ w["q"], h @ w["k"], h @ w["v"]
        p = jax.nn.softmax(jnp.einsum("bqd,bkd->bqk", q, k), axis=-1)
        h = h + jnp.einsum("bqk,bkd->bqd", p, v) @ w["o"]
        return h + (jax.nn.silu(h @ w["gate"]) * (h @ w["up"])) @ w["down"], None

    h, _ = jax.lax.scan(layer, x, params)
    return jnp.mean(h**2)


@pytest.mark.slow  # the README command's budget
def test_a_hand_written_layer_is_tagged_and_keeps_its_gradients():
    """Batched-dot attention and a gated MLP written out, tagging nothing: the
    roles are MaxText's names, save_qkv_proj keeps Q, K and V (more residuals
    than full, fewer than none) and the gradients are the plain ones."""
    from spmdkit.step.remat_scan import remat_loss

    L, B, S, D = 4, 2, 8, 16
    keys = iter(jax.random.split(jax.random.key(0), 8))
    params = {n: jax.random.normal(next(keys), (L, D, D)) / 4 for n in
              ("q", "k", "v", "o", "gate", "up", "down")}  # fmt: skip
    x = jax.random.normal(next(keys), (B, S, D))
    sc = _layer_scan_of(_hand_layer_loss, params, x)
    roles = matmul_roles(sc.jaxpr, range(sc.num_consts, sc.first_xs))
    assert sorted(roles.values()) == sorted(
        ["query_proj", "key_proj", "value_proj", "out_proj", "mlpwi_0", "mlpwi_1", "mlpwo"]
    )

    def residual_bytes(recipe):
        _, vjp = jax.vjp(remat_loss(_hand_layer_loss, recipe), params, x)
        return sum(a.nbytes for a in jax.tree.leaves(vjp))

    full, qkv = residual_bytes(Recipe(remat="full")), residual_bytes(Recipe(remat="save_qkv_proj"))
    assert qkv - full == 3 * L * B * S * D * 4  # Q, K and V of every layer
    want = jax.value_and_grad(_hand_layer_loss)(params, x)
    got = jax.jit(sk.value_and_grad(_hand_layer_loss, Recipe(remat="save_qkv_proj")))(params, x)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for g, w in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)


def _layer_scan_of(loss, *args):
    return find_layer_scan(jax.make_jaxpr(loss)(*args).jaxpr).scan


@pytest.mark.slow
def test_a_named_policy_on_an_untagged_model_keeps_the_gradients(monkeypatch):
    """The untagged tiny Llama's loss and gradients under save_qkv_proj are the
    plain ones (fp32, rtol 1e-5)."""
    _untag(monkeypatch)
    info, batch = _described("llama")
    params = info.init_fn()
    want = jax.jit(jax.value_and_grad(info.loss_fn))(params, batch)
    got = jax.jit(sk.value_and_grad(info.loss_fn, Recipe(remat="save_qkv_proj")))(params, batch)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for g, w in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_untagged_policies_keep_what_the_tagged_ones_keep_when_compiled(monkeypatch):
    """Scanned tiny Llama (4 layers, 256 tokens, 4 sequences per device, dp=8):
    under save_qkv_proj and save_dot_except_mlpwi the untagged copy's compiled
    step holds what the tagged one's does (within 3%), and plan.verify's
    prediction of it is the tagged one's."""

    def measured(info, batch):
        base = plan(info, sk.make_mesh(data=8), "dp", estimator="analytic")
        abstract = (info.abstract_params, jax.eval_shape(lambda b: b, batch))
        out = {}
        for name in ("save_qkv_proj", "save_dot_except_mlpwi"):
            p = dataclasses.replace(base, recipe=Recipe(remat=name))
            step = jit(sk.value_and_grad(info.loss_fn, p), p)
            m = step.compile(*abstract).memory_analysis()
            prop = step.program(*abstract)[1]
            out[name] = (m.temp_size_in_bytes, prop.memory_as(None, cpu=True)[0].peak_bytes)
        return out

    def described():
        spec = get_model("llama")
        cfg = dataclasses.replace(spec.config("tiny_scan"), seq_len=256, n_layers=4)
        batch = spec.batch(cfg, 32, np.random.default_rng(0))
        return describe(spec, config=cfg, batch=batch), batch

    tagged = measured(*described())
    _untag(monkeypatch)
    untagged = measured(*described())
    for name, (compiled, predicted) in tagged.items():
        assert untagged[name][0] == pytest.approx(compiled, rel=0.03), (name, tagged, untagged)
        assert untagged[name][1] == pytest.approx(predicted, rel=0.03), (name, tagged, untagged)
