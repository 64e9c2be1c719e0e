"""spmdkit.step.recipe: recipes as data, and sk.value_and_grad / train_step running them.

The model here is a stack of dense layers scanned over stacked weights (what
``nnx.scan`` / ``scan_layers=True`` trace to), small enough that every test
compiles in well under a second.
"""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit.step import grad, offload, remat_scan
from spmdkit.step import recipe as rc
from spmdkit.step.passes import StepPlan
from spmdkit.step.recipe import Recipe, RecipeError

L, D, B = 3, 16, 8


def init(seed=0):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    return {
        "w": jax.random.normal(k1, (L, D, D)) / np.sqrt(D),
        "b": 0.1 * jax.random.normal(k2, (L, D)),
        "out": jax.random.normal(k3, (D,)) / np.sqrt(D),
    }


def batch(seed=1, n=B):
    rs = np.random.RandomState(seed)
    return {"x": rs.randn(n, D).astype(np.float32), "y": rs.randn(n).astype(np.float32)}


def scanned_loss(params, batch):
    def layer(h, wb):
        w, b = wb
        z = checkpoint_name(h @ w.astype(h.dtype), "proj")
        return jnp.tanh(z + b.astype(h.dtype)), None

    h = batch["x"].astype(params["w"].dtype)
    h, _ = jax.lax.scan(layer, h, (params["w"], params["b"]))
    pred = h @ params["out"]
    return jnp.mean((pred.astype(jnp.float32) - batch["y"]) ** 2)


def looped_loss(params, batch):
    h = batch["x"]
    for i in range(L):
        h = jnp.tanh(h @ params["w"][i] + params["b"][i])
    return jnp.mean((h @ params["out"] - batch["y"]) ** 2)


def assert_tree_close(got, want, rtol):
    """Leaf by leaf, relative to the leaf's largest magnitude (a leaf's entries
    that are zero in exact arithmetic carry only rounding noise)."""
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.dtype == w.dtype
        scale = float(jnp.max(jnp.abs(w)))
        np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol * scale)


@pytest.fixture(scope="module")
def reference():
    return jax.jit(jax.value_and_grad(scanned_loss))(init(), batch())


# -- recipes as data ------------------------------------------------------------------


def test_recipe_validates_and_round_trips():
    r = Recipe(remat="names", save_names=("proj",), compute_dtype=jnp.bfloat16, microbatches=2)
    assert r.compute_dtype == "bfloat16"
    assert r.short() == "remat=names, save=proj, bf16, microbatches=2"
    assert Recipe.from_json(r.to_json()) == r and Recipe().is_default
    for bad in (
        {"remat": "some"},
        {"remat": "names"},
        {"save_names": ("a",)},
        {"compute_dtype": "int8"},
        {"microbatches": 0},
        {"remat": "full", "remat_offload": True},
        {"remat_offload": True},
        {"remat_every": 2},
        {"remat": "full", "remat_every": 0},
    ):
        with pytest.raises(RecipeError):
            Recipe(**bad)


def test_named_policies_are_maxtexts_and_round_trip():
    r = Recipe(remat="save_qkv_proj", remat_offload=True, compute_dtype="bfloat16")
    assert r.short() == "remat=save_qkv_proj→host, bf16"
    assert Recipe.from_json(r.to_json()) == r
    assert r.saved_names == ("query_proj", "key_proj", "value_proj", "qkv_proj")
    assert (
        set(rc.NAMED_POLICIES["save_dot_except_mlp"])
        < set(rc.NAMED_POLICIES["save_dot_except_mlpwi"])
        < set(rc.NAMED_POLICIES["minimal"])
    )
    assert Recipe(remat="dots").saved_names == () and Recipe(remat="full").saved_names == ()


# -- sk.value_and_grad ----------------------------------------------------------------


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


def tagged_loss(params, batch):
    """``scanned_loss`` with its projection tagged ``query_proj`` (MaxText's name)."""

    def layer(h, wb):
        w, b = wb
        return jnp.tanh(checkpoint_name(h @ w, "query_proj") + b), None

    h, _ = jax.lax.scan(layer, batch["x"], (params["w"], params["b"]))
    return jnp.mean((h @ params["out"] - batch["y"]) ** 2)


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


# -- the whole step and offload -------------------------------------------------------


def test_train_step_with_offloaded_optimizer_state_on_cpu():
    """CPU devices expose ``pinned_host``: the optimizer state lives there between
    steps and the update matches the on-device one."""
    mesh = jax.sharding.Mesh(jax.devices(), ("data",))
    opt = optax.adam(1e-2)
    params = init()
    host = NamedSharding(mesh, P(), memory_kind="pinned_host")
    state = jax.device_put(opt.init(params), host)
    step = jax.jit(
        sk.train_step(scanned_loss, opt, Recipe(offload_opt=True)),
        out_shardings=(NamedSharding(mesh, P()), host, NamedSharding(mesh, P())),
    )
    new_params, new_state, _ = step(params, state, batch())
    ref_params, ref_state, _ = jax.jit(sk.train_step(scanned_loss, opt, Recipe()))(
        params, opt.init(params), batch()
    )
    assert {x.sharding.memory_kind for x in jax.tree.leaves(new_state)} == {"pinned_host"}
    assert_tree_close(new_params, ref_params, rtol=1e-6)
    assert_tree_close(new_state, ref_state, rtol=1e-6)


def test_offload_without_a_host_memory_kind_is_a_typed_error(monkeypatch):
    offload.check_offload(Recipe(offload_opt=True))  # CPU here: pinned_host exists
    import spmdkit.step.offload

    monkeypatch.setattr(
        spmdkit.step.offload, "host_memory_kinds", lambda device=None: frozenset({"device"})
    )
    with pytest.raises(RecipeError, match="pinned_host"):
        offload.check_offload(Recipe(offload_opt=True))
    offload.check_offload(Recipe())  # nothing offloaded, nothing checked


def test_remat_offload_without_a_host_memory_kind_is_a_typed_error(monkeypatch):
    recipe = Recipe(remat="save_qkv_proj", remat_offload=True)
    offload.check_offload(recipe)  # CPU here: pinned_host exists
    import spmdkit.step.offload

    monkeypatch.setattr(
        spmdkit.step.offload, "host_memory_kinds", lambda device=None: frozenset({"device"})
    )
    with pytest.raises(RecipeError, match=r"remat_offload.*pinned_host"):
        sk.value_and_grad(tagged_loss, recipe)(init(), batch())


def test_train_step_is_what_the_planner_can_trace():
    step = sk.train_step(scanned_loss, optax.sgd(0.1), Recipe(remat="full", microbatches=2))
    assert step.recipe == Recipe(remat="full", microbatches=2)
    params, _, loss = jax.jit(step)(init(), optax.sgd(0.1).init(init()), batch())
    assert np.isfinite(loss)
    ref = jax.tree.map(lambda p, g: p - 0.1 * g, init(), jax.grad(scanned_loss)(init(), batch()))
    assert_tree_close(params, ref, rtol=1e-5)


def test_replace_keeps_recipe_frozen():
    r = Recipe(remat="full")
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.remat = "none"  # type: ignore[misc]


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


def test_delayed_fp8_scaling_is_a_float8_option_that_round_trips():
    rcp = Recipe(compute_dtype="float8", fp8_scaling="delayed")
    assert Recipe.from_json(rcp.to_json()) == rcp and rcp.short() == "fp8(delayed)"
    assert Recipe.from_json({"compute_dtype": "float8"}).fp8_scaling == "current"
    with pytest.raises(RecipeError, match="only with compute_dtype='float8'"):
        Recipe(compute_dtype="bfloat16", fp8_scaling="delayed")
    with pytest.raises(RecipeError, match="fp8_scaling is one of"):
        Recipe(compute_dtype="float8", fp8_scaling="late")


def test_float8_keeps_the_lm_head_in_bf16_unless_told_and_refuses_other_names():
    """``fp8_exclude``: ("lm_head",) by default (as TE, torchao and MaxText), ()
    for every weight matmul in float8; it round-trips; a name other than
    "lm_head", a bare string, or a non-default value without float8 is a typed
    error."""
    rcp = Recipe(compute_dtype="float8")
    assert rcp.fp8_exclude == ("lm_head",) and rcp.short() == "fp8"
    every = Recipe(compute_dtype="float8", fp8_exclude=[])
    assert every.fp8_exclude == () and every.short() == "fp8(lm_head too)"
    for r in (rcp, every):
        assert Recipe.from_json(r.to_json()) == r
    assert Recipe.from_json({"compute_dtype": "float8"}) == rcp
    for bad in (("output",), "lm_head"):
        with pytest.raises(RecipeError, match=r"each one of \('lm_head',\)"):
            Recipe(compute_dtype="float8", fp8_exclude=bad)
    with pytest.raises(RecipeError, match="only with compute_dtype='float8'"):
        Recipe(compute_dtype="bfloat16", fp8_exclude=())


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
