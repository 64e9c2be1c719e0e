"""spmdkit.step.fp8: float8 weight matmuls, their gradients, and the loss rewrite."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from spmdkit.errors import SpmdError
from spmdkit.step.fp8 import E4M3, E5M2, fp8_dot, fp8_dot_delayed, fp8_loss, fp8_state, quantize

# (lhs shape, rhs shape, dimension numbers): x @ W, einsum('bsd,dhk->bshk'),
# einsum('bshk,hkd->bsd') (two contracting dims), W^T-style contraction on dim 0
# (all five run in the slow step)
CASES = [
    ((8, 16), (16, 4), (((1,), (0,)), ((), ()))),
    ((2, 3, 16), (16, 2, 4), (((2,), (0,)), ((), ()))),
    ((2, 3, 2, 4), (2, 4, 16), (((2, 3), (0, 1)), ((), ()))),
    ((16, 8), (16, 4), (((0,), (0,)), ((), ()))),
    ((2, 3, 4, 5), (5, 3, 6), (((1, 3), (1, 0)), ((), ()))),
]


def _dequantized(x, dtype):
    q, s = quantize(x, dtype)
    return q.astype(jnp.float32) * s


@pytest.mark.parametrize(("ls", "rs", "dn"), CASES)
@pytest.mark.slow
def test_fp8_dot_and_its_gradients_are_the_quantized_matmuls(ls, rs, dn):
    """Forward: the matmul of the e4m3-quantized operands; backward: the transposed
    matmuls of the e5m2-quantized gradient with them (checked against jax's own
    transpose of dot_general on the dequantized values), in the operands' dtypes."""
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, ls, jnp.float32)
    w = jax.random.normal(kw, rs, jnp.float32)

    def ref(a, b):
        return lax.dot_general(a, b, dn, preferred_element_type=jnp.float32)

    y, vjp = jax.vjp(lambda a, b: fp8_dot(a, b, dn), x, w)
    xq, wq = _dequantized(x, E4M3), _dequantized(w, E4M3)
    np.testing.assert_allclose(y, ref(xq, wq), rtol=1e-5, atol=1e-5)
    g = jax.random.normal(kg, y.shape, jnp.float32)
    dx, dw = vjp(g)
    _, ref_vjp = jax.vjp(ref, xq, wq)
    want_dx, want_dw = ref_vjp(_dequantized(g, E5M2))
    np.testing.assert_allclose(dx, want_dx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, want_dw, rtol=1e-5, atol=1e-5)
    # and close to the exact product (fp8's error: a few per cent)
    exact = ref(x, w)
    assert float(jnp.linalg.norm(y - exact) / jnp.linalg.norm(exact)) < 0.08
    assert dx.dtype == x.dtype and dw.dtype == w.dtype


def test_fp8_dot_runs_on_float8_operands_in_the_compiled_program():
    x, w = jnp.ones((8, 16), jnp.bfloat16), jnp.ones((16, 4), jnp.float32)
    dn = (((1,), (0,)), ((), ()))
    step = jax.value_and_grad(lambda x, w: fp8_dot(x, w, dn).sum(), (0, 1))
    hlo = jax.jit(step).lower(x, w).as_text()
    dots = [line for line in hlo.splitlines() if "dot_general" in line]
    assert len(dots) == 3  # forward and the two gradient matmuls
    assert all("f8E4M3FN" in d or "f8E5M2" in d for d in dots)
    assert sum("f8E5M2" in d for d in dots) == 2  # the gradients' matmuls


def test_a_batched_matmul_is_refused_with_a_typed_error():
    from spmdkit.errors import SpmdError

    x = jnp.ones((2, 4, 8))
    with pytest.raises(SpmdError, match="no batch dimensions"):
        fp8_dot(x, x, (((2,), (2,)), ((0,), (0,))))


def test_zero_operands_scale_to_zero_not_nan():
    z = jnp.zeros((4, 4))
    y = fp8_dot(z, z, (((1,), (0,)), ((), ())))
    assert not jnp.isnan(y).any() and not y.any()


@pytest.mark.slow
def test_fp8_loss_rewrites_weight_matmuls_inside_scans_calls_and_remat():
    """Weight matmuls inside the layer scan, a jit call and a jax.checkpoint run in
    float8; the attention-style batched matmul stays as it was."""
    ws = jax.random.normal(jax.random.key(1), (3, 16, 16)) * 0.3

    @jax.jit
    def head(h, w):
        return h @ w

    def loss(ws, x):
        def layer(h, w):
            h = jax.checkpoint(lambda h: jnp.tanh(h @ w))(h)
            scores = jnp.einsum("bqd,bkd->bqk", h, h)  # batched: stays
            return jax.nn.softmax(scores) @ h, None

        h, _ = lax.scan(layer, x, ws)
        return jnp.mean(head(h, ws[0]) ** 2)

    x = jax.random.normal(jax.random.key(2), (2, 4, 16))
    jaxpr = jax.make_jaxpr(jax.grad(fp8_loss(loss)))(ws, x)
    text = str(jaxpr)
    assert "f8_e4m3fn" in text and "f8_e5m2" in text
    hlo = jax.jit(jax.grad(fp8_loss(loss))).lower(ws, x).as_text()
    dots = [line for line in hlo.splitlines() if "dot_general" in line]
    f8 = [d for d in dots if "f8E" in d]
    batched = [d for d in dots if "batching_dims" in d]
    assert batched and not any("f8E" in d for d in batched)
    assert len(f8) == len(dots) - len(batched)  # every weight matmul, forward and backward
    g8, g = jax.grad(fp8_loss(loss))(ws, x), jax.grad(loss)(ws, x)
    assert float(jnp.linalg.norm(g8 - g) / jnp.linalg.norm(g)) < 0.25  # e5m2: 2 mantissa bits
    assert fp8_loss(loss)(ws, x) == pytest.approx(float(loss(ws, x)), rel=0.05)


@pytest.mark.slow  # the README command's budget
def test_an_input_weight_matmuls_share_is_quantized_and_kept_once():
    """q/k/v-style matmuls of one input (and a lone one after them): the input is
    quantized once and the backward keeps one float8 copy of it (one e4m3
    residual of its shape, where one ``fp8_dot`` per matmul keeps three); loss
    and gradients are those of the per-matmul ``fp8_dot``s, to the bit (the
    same per-tensor quantization)."""
    dn = (((1,), (0,)), ((), ()))
    k = jax.random.split(jax.random.key(3), 5)
    shapes = {"q": (16, 12), "k": (16, 12), "v": (16, 12), "o": (12, 16)}
    w = {n: jax.random.normal(k[i], shapes[n]) * 0.3 for i, n in enumerate("qkvo")}
    x = jax.random.normal(k[4], (8, 16))

    def loss(w, x):
        h = jnp.tanh(x @ w["q"]) * (x @ w["k"]) + x @ w["v"]
        return jnp.mean((h @ w["o"]) ** 2)

    def separate(w, x):
        h = jnp.tanh(fp8_dot(x, w["q"], dn)) * fp8_dot(x, w["k"], dn) + fp8_dot(x, w["v"], dn)
        return jnp.mean(fp8_dot(h, w["o"], dn) ** 2)

    def kept(f):
        resid = jax.eval_shape(lambda w, x: jax.vjp(f, w, x)[1], w, x)
        return [r.shape for r in jax.tree.leaves(resid) if r.dtype == E4M3 and r.shape == x.shape]

    assert len(kept(fp8_loss(loss))) == 1 and len(kept(separate)) == 3
    (l8, g8), (ls, gs) = (jax.value_and_grad(f, (0, 1))(w, x) for f in (fp8_loss(loss), separate))
    assert float(l8) == float(ls)
    for a, b in zip(jax.tree.leaves(g8), jax.tree.leaves(gs), strict=True):
        np.testing.assert_array_equal(a, b)


VOCAB = 40  # no other dim of _lm_loss is 40: a dot naming it is the head's


def _lm_loss(p, tokens, tied=False):
    """A tiny language model: embedding lookup, a scan of 3 layers, the LM head
    inside a jit call (or tied to the embedding), a log-softmax loss."""
    h = p["embed"][tokens]
    h, _ = lax.scan(lambda h, w: (jnp.tanh(h @ w), None), h, p["layers"])
    w = p["embed"].T if tied else p["head"]
    logits = jax.jit(lambda h, w: h @ w)(h, w)
    return -jnp.mean(jax.nn.log_softmax(logits)[..., 0])


def _lm_args():
    k1, k2, k3 = jax.random.split(jax.random.key(3), 3)
    p = {
        "embed": jax.random.normal(k1, (VOCAB, 16)),
        "head": jax.random.normal(k2, (16, VOCAB)) * 0.3,
        "layers": jax.random.normal(k3, (3, 16, 16)) * 0.3,
    }
    return p, jax.random.randint(jax.random.key(4), (2, 4), 0, VOCAB)


def _head_and_other_dots(hlo):
    """The lowered step's dot_generals: (the LM head's, the other weight matmuls')."""
    dots = [line for line in hlo.splitlines() if "dot_general" in line and "batching" not in line]
    head = [d for d in dots if re.search(rf"[<x]{VOCAB}x", d)]
    return head, [d for d in dots if d not in head]


def test_the_lm_head_stays_in_bf16_and_every_other_weight_matmul_runs_in_float8():
    """``exclude=("lm_head",)`` (the recipe's default): the matmul producing the
    logits, found inside its jit call, tied to the embedding or not, runs its
    forward and both gradient matmuls on non-float8 operands and has no amax
    history; the layers' matmuls still read float8. ``exclude=()`` quantizes it
    too; an unknown name is a typed error."""
    from spmdkit.step import recipe as rc
    from spmdkit.step.fp8 import lm_head_operands, lm_heads
    from spmdkit.step.grad import value_and_grad

    p, tokens = _lm_args()
    for tied in (False, True):
        jaxpr = jax.make_jaxpr(lambda p, t, tied=tied: _lm_loss(p, t, tied))(p, tokens).jaxpr
        (site,) = lm_heads(jaxpr)
        assert len(site) == 2  # in the jit call
        assert lm_head_operands(jaxpr, {site}) == {0 if tied else 1}  # embed, head, layers
    grad = jax.grad(fp8_loss(_lm_loss, exclude=("lm_head",)))
    head, other = _head_and_other_dots(jax.jit(grad).lower(p, tokens).as_text())
    assert len(head) == 3 and not any("f8E" in d for d in head)  # forward, dgrad, wgrad
    assert len(other) == 3 and all("f8E" in d for d in other)  # the scan body's three
    step = value_and_grad(_lm_loss, rc.Recipe(compute_dtype="float8"))  # the default
    head, other = _head_and_other_dots(jax.jit(step).lower(p, tokens).as_text())
    assert len(head) == 3 and not any("f8E" in d for d in head)
    assert len(other) == 3 and all("f8E" in d for d in other)
    every = jax.jit(jax.grad(fp8_loss(_lm_loss))).lower(p, tokens).as_text()
    head, other = _head_and_other_dots(every)
    assert all("f8E" in d for d in head + other)
    assert len(fp8_state(_lm_loss, p, tokens)) == 2
    assert list(fp8_state(_lm_loss, p, tokens, exclude=("lm_head",))) == ["fp8_amax_0000"]
    with pytest.raises(SpmdError, match="each one of"):
        fp8_loss(_lm_loss, exclude=("output",))


def _counting_batches(cfg, n, batch_size, seed=0):
    """Next-token batches a tiny model can learn: each row counts up from a random start."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        start = rng.integers(0, cfg.vocab, size=(batch_size, 1))
        seq = ((start + np.arange(cfg.seq_len + 1)) % cfg.vocab).astype(np.int32)
        out.append({"tokens": seq[:, :-1], "targets": seq[:, 1:]})
    return out


# CI's slow step leaves this out (SPMDKIT_FULL_SWEEP=1 runs it): training curves of float8 vs
# bf16; the float8 steps' verify on a 2-D mesh stays in CI's sample
@pytest.mark.full
@pytest.mark.slow
def test_tiny_gpt_trains_in_float8_as_in_bfloat16():
    """50 steps of tiny GPT under fsdp on 8 devices: the float8 recipe's loss, with
    current and with delayed scaling, within 2% of bf16's; the compiled matmuls
    read float8 operands; FSDP gathers the quantized weights (XLA:CPU moves f8
    widened to f16, as it moves bf16 in f32): fewer bytes than bf16's gathers;
    every row of ``plan.verify`` holds, peak memory included (float8 held in
    float32 on CPU), and delayed scaling's amax histories stay replicated."""
    import optax

    import spmdkit as sk
    from spmdkit.models import get_model
    from spmdkit.step.grad import init_fp8_state

    spec = get_model("gpt")
    info = sk.describe(spec, config="tiny", batch_size=8)
    batches = _counting_batches(spec.configs["tiny"](), 50, 8)
    mesh = sk.make_mesh(data=8)
    losses, gathered = {}, {}
    recipes = {
        "bfloat16": sk.Recipe(compute_dtype="bfloat16"),
        "float8": sk.Recipe(compute_dtype="float8"),
        "delayed": sk.Recipe(compute_dtype="float8", fp8_scaling="delayed"),
    }
    for name, recipe in recipes.items():
        p = sk.plan(info, mesh, "fsdp", recipe=recipe)
        opt = optax.adam(3e-3)
        params = sk.init_sharded(info, p)
        abstract = jax.eval_shape(opt.init, params)
        opt_state = jax.jit(opt.init, out_shardings=p.opt_shardings(abstract))(params)
        state = (init_fp8_state(info, params, batches[0]),) if name == "delayed" else ()
        step = sk.jit(sk.train_step(info, opt, p), p)
        report = p.verify(step, params, opt_state, *state, batches[0])
        assert report.ok, (name, str(report))
        gathered[name] = {kind: got for kind, _, got, _ in report.rows}["all_gather"]
        if name == "float8":
            hlo = step.lower(params, opt_state, batches[0]).as_text()
            dots = [line for line in hlo.splitlines() if "dot_general" in line]
            assert sum("f8E4M3FN" in d for d in dots) >= 4 and any("f8E5M2" in d for d in dots)
        out = []
        for b in batches:
            *new, loss = step(params, opt_state, *state, b)
            params, opt_state, state = new[0], new[1], tuple(new[2:])
            out.append(float(loss))
        if state:
            assert all(h.sharding.is_fully_replicated for h in state[0].values())
        losses[name] = out
    assert gathered["float8"] < 0.8 * gathered["bfloat16"], gathered
    b16 = np.mean(losses["bfloat16"][-5:])
    assert b16 < 0.6 * losses["bfloat16"][0], losses  # it learned
    for name in ("float8", "delayed"):
        f8 = np.mean(losses[name][-5:])
        assert abs(f8 - b16) / b16 < 0.02, (name, f8, b16)


def _scanned_loss(w, x):
    h, _ = lax.scan(lambda h, wl: (jnp.tanh(h @ wl), None), x, w["layers"])
    return jnp.mean((h @ w["head"]) ** 2)


def _scanned_args():
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    w = {
        "layers": jax.random.normal(k1, (3, 8, 8)) * 0.3,
        "head": jax.random.normal(k2, (8, 4)),
    }
    return w, jax.random.normal(k3, (16, 8))


def test_delayed_scaling_starts_as_current_and_pushes_each_steps_amax():
    """Delayed scaling: one history per weight matmul and layer; the first step
    (empty histories) is current scaling's, bit for bit; the state's gradient is
    the history with this step's lhs/rhs/gradient amaxes in front."""
    w, x = _scanned_args()
    state = fp8_state(_scanned_loss, w, x, history=4)
    assert {k: v.shape for k, v in state.items()} == {
        "fp8_amax_0000": (3, 3, 4),  # the scanned matmul: one history per layer
        "fp8_amax_0001": (3, 4),
    }
    f = fp8_loss(_scanned_loss, "delayed")

    @jax.jit
    def run(state, w, x):
        step1 = jax.value_and_grad(f, argnums=(0, 1))(state, w, x)
        step2 = jax.grad(f)(step1[1][0], w, x)
        return step1, step2, jax.value_and_grad(fp8_loss(_scanned_loss))(w, x)

    (value, (new, grads)), newer, (ref, ref_grads) = run(state, w, x)
    assert value == ref
    jax.tree.map(np.testing.assert_array_equal, grads, ref_grads)
    head = new["fp8_amax_0001"]
    np.testing.assert_allclose(head[1, 0], jnp.max(jnp.abs(w["head"])))
    np.testing.assert_allclose(
        new["fp8_amax_0000"][:, 1, 0], jnp.max(jnp.abs(w["layers"]), axis=(1, 2))
    )
    assert np.all(np.asarray(head[:, 1:]) == 0) and np.all(np.asarray(head[:, 0]) > 0)
    # the next step pushes again: the oldest drops
    np.testing.assert_array_equal(newer["fp8_amax_0001"][:, 1:], head[:, :-1])


def test_delayed_scaling_saturates_past_the_history_not_nan():
    """An operand 100x larger than its history allows saturates at the float8
    maximum (e4m3 has no infinity: an unclipped cast is NaN)."""
    x, w = jnp.ones((4, 8)), jnp.ones((8, 2))
    history = jnp.zeros((3, 4)).at[:, 0].set(0.01)  # amax 0.01 remembered, 1.0 arrives
    dn = (((1,), (0,)), ((), ()))
    out, grads = jax.jit(
        jax.value_and_grad(lambda x, w: jnp.sum(fp8_dot_delayed(x, w, history, dn)), (0, 1))
    )(x, w)
    assert np.isfinite(out) and all(np.all(np.isfinite(g)) for g in grads)
    # each operand clipped to 448 x its scale (0.01 / 448): 0.01, so 8 x 0.01 x 0.01
    np.testing.assert_allclose(out, 4 * 2 * 8 * 0.01 * 0.01, rtol=1e-6)


def test_delayed_state_of_another_loss_is_refused():
    w, x = _scanned_args()
    with pytest.raises(SpmdError, match="one amax history per weight matmul"):
        fp8_loss(_scanned_loss, "delayed")({"fp8_amax_0000": jnp.zeros((3, 4))}, w, x)
    with pytest.raises(SpmdError, match="scaling is one of"):
        fp8_loss(_scanned_loss, "late")


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "remat"), [("fsdp", "full"), ("megatron_sp", "dots")])
def test_float8_step_on_a_2d_mesh_verifies(strategy, remat):
    """Llama tiny_scan on ``data=2 × model=4``, float8: under fsdp (the layer
    stack sharded over ``data``) and under megatron_sp, ``plan.verify`` holds
    row by row, the reduce-scatters included (the replay reduces each float8
    GEMM's scaled partial product itself, as planned: the weight gradients
    under fsdp, the row-parallel outputs under megatron_sp; before, fsdp's step
    all-reduced each weight gradient whole, as planned, and megatron_sp's missed
    its collective bytes by 13%)."""
    import optax

    import spmdkit as sk
    from spmdkit.models import get_model

    spec = get_model("llama")
    info = sk.describe(spec, config="tiny_scan", batch_size=8)
    p = sk.plan(info, sk.make_mesh(data=2, model=4), strategy, recipe=sk.Recipe(
        compute_dtype="float8", remat=remat))  # fmt: skip
    opt = optax.adam(1e-3)
    params = sk.init_sharded(info, p)
    opt_state = jax.jit(opt.init, out_shardings=p.opt_shardings(jax.eval_shape(opt.init, params)))(
        params
    )
    batch = _counting_batches(spec.configs["tiny_scan"](), 1, 8)[0]
    report = p.verify(sk.jit(sk.train_step(info, opt, p), p), params, opt_state, batch)
    assert {kind for kind, *_ in report.rows} >= {"all_gather", "reduce_scatter"}
    assert report.ok, str(report)
