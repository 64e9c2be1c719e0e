"""models.layers attention: the blockwise (flash-style) version equals the plain one,
values and grads, never builds an S×S value, keeps O(S) residuals; implementation
selection and the configs' ``attention`` field. ``swiglu``: autodiff's values and
gradients, two residuals, less compiled memory. ``gelu``: ``jax.nn.gelu``'s values
and gradients, one residual, under the transforms, fp8 and the planner."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spmdkit import kernels
from spmdkit.engine.region import forward_fn
from spmdkit.errors import SpmdError
from spmdkit.models import gpt, llama
from spmdkit.models import layers as lyr
from spmdkit.models.layers import AttentionError, ModelConfigError


def _qkv(b, s, h, kv, d, dtype=jnp.float32, seed=0):
    kq, kk, kv_, kd = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(kq, (b, s, h, d), jnp.float32)
    k = jax.random.normal(kk, (b, s, kv, d), jnp.float32)
    v = jax.random.normal(kv_, (b, s, kv, d), jnp.float32)
    d_out = jax.random.normal(kd, (b, s, h, d), jnp.float32)
    return tuple(x.astype(dtype) for x in (q, k, v, d_out))


def _plain(causal):
    return lambda q, k, v: lyr.attention(q, k, v, causal=causal, implementation="xla")


def _plain_kernel(causal):
    """The plain kernel itself (``lyr.attention`` is a region whose jaxpr hides it)."""
    return lambda q, k, v: kernels.plain_attention(q, k, v, causal=causal)


def _blockwise(causal, block):
    return lambda q, k, v: lyr.blockwise_attention(q, k, v, causal=causal, block_size=block)


def _value_and_pullback(fn, q, k, v, d_out):
    """``fn(q, k, v)`` and its vjp at ``d_out``, one compiled program (eager op-by-op
    dispatch of the scans costs more than compiling them)."""

    def run(q, k, v, d_out):
        out, pull = jax.vjp(fn, q, k, v)
        return out, pull(d_out.astype(out.dtype))

    return jax.jit(run)(q, k, v, d_out)


@pytest.mark.parametrize(
    ("shape", "causal", "block"),
    [
        ((2, 64, 4, 2, 8), True, 16),  # grouped-query, 4 whole blocks
        ((2, 50, 4, 1, 8), True, 16),  # multi-query, last block padded and masked
        ((1, 40, 2, 2, 8), False, 7),  # not causal, padded
    ],
)
def test_blockwise_equals_plain_values_and_grads(shape, causal, block):
    q, k, v, d_out = _qkv(*shape)
    out, grads = _value_and_pullback(_plain(causal), q, k, v, d_out)
    got, got_grads = _value_and_pullback(_blockwise(causal, block), q, k, v, d_out)
    np.testing.assert_allclose(got, out, rtol=1e-5, atol=1e-5)
    for want, have in zip(grads, got_grads, strict=True):
        np.testing.assert_allclose(have, want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_blockwise_bf16_is_as_accurate_as_plain():
    """bf16 inputs: both versions are compared with the float32 computation on the
    same (bf16-rounded) inputs. bf16 keeps 8 significant bits (unit roundoff 2^-9),
    and both versions round the probabilities to bf16 before multiplying v, so
    each output element carries a relative error of a few 2^-9 of its scale; the
    blockwise one accumulates in float32 and must be no worse than the plain one
    (up to one bf16 ulp of slack) on outputs and on each gradient."""
    q, k, v, d_out = _qkv(2, 64, 4, 2, 16, jnp.bfloat16)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    ref, ref_grads = _value_and_pullback(_plain(True), *f32, d_out)

    def errors(fn):
        out, grads = _value_and_pullback(fn, q, k, v, d_out)
        pairs = [(out, ref), *zip(grads, ref_grads, strict=True)]
        return [
            float(jnp.max(jnp.abs(a.astype(jnp.float32) - r)) / jnp.max(jnp.abs(r)))
            for a, r in pairs
        ]

    plain, blockwise = errors(_plain(True)), errors(_blockwise(True, 16))
    assert jax.eval_shape(_blockwise(True, 16), q, k, v).dtype == jnp.bfloat16
    for p_err, b_err in zip(plain, blockwise, strict=True):
        assert b_err <= p_err + 2.0**-8
        assert b_err < 2.0**-5


def _values(jaxpr):
    """Every equation output aval in ``jaxpr`` and its nested jaxprs."""
    for eqn in jaxpr.eqns:
        yield from (var.aval for var in eqn.outvars)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _values(inner)


def _square(avals, s):
    return [a.shape for a in avals if sum(n == s for n in getattr(a, "shape", ())) >= 2]


def test_blockwise_value_and_grad_has_no_s_by_s_value():
    s = 96
    q, k, v, _ = _qkv(1, s, 4, 2, 8)

    def loss(fn):
        return jax.value_and_grad(lambda *a: jnp.sum(fn(*a) ** 2), argnums=(0, 1, 2))

    blockwise = jax.make_jaxpr(loss(_blockwise(True, 32)))(q, k, v).jaxpr
    avals = list(_values(blockwise))
    assert any(len(getattr(a, "shape", ())) == 5 and 32 in a.shape for a in avals)  # walked
    assert _square(avals, s) == []
    plain = jax.make_jaxpr(loss(_plain_kernel(True)))(q, k, v).jaxpr
    assert _square(list(_values(plain)), s)  # the check does see S×S values


def test_blockwise_residuals_are_linear_in_s():
    def residuals(fn, s):
        q, k, v, _ = (jax.ShapeDtypeStruct(x.shape, x.dtype) for x in _qkv(1, s, 4, 2, 8))
        return jax.tree.leaves(jax.eval_shape(lambda *a: jax.vjp(fn, *a)[1], q, k, v))

    sizes = []
    for s in (64, 128):
        res = residuals(_blockwise(True, 16), s)
        assert _square(res, s) == []
        sizes.append(sum(int(np.prod(r.shape)) for r in res))
        # q, k, v, the output and the float32 log-sum-exp per (head, row)
        assert sizes[-1] == s * (4 * 8 + 2 * 2 * 8 + 4 * 8 + 4)
    assert sizes[1] == 2 * sizes[0]
    assert _square(residuals(_plain_kernel(True), 64), 64)  # the plain one keeps S×S


def _region_body(q, k, v, **attrs):
    """The jaxpr text of what the ``attention`` region runs on this backend."""
    return str(jax.make_jaxpr(forward_fn("attention", {"causal": True, **attrs}))(q, k, v))


def test_default_traces_blockwise_on_cpu():
    q, k, v, _ = _qkv(1, 32, 2, 1, 8)
    text = str(jax.make_jaxpr(lambda *a: lyr.attention(*a, block_size=8))(q, k, v))
    # one attention region carrying the kernel's attributes
    assert "op=attention" in text and "('implementation', 'auto')" in text
    assert "('block_size', 8)" in text and "scan" not in text
    body = _region_body(q, k, v, implementation="auto", block_size=8)
    assert "custom_vjp_call" in body and "scan" in body
    assert "scan" not in _region_body(q, k, v, implementation="xla", block_size=8)
    auto = jax.jit(lambda *a: lyr.attention(*a, implementation="auto", block_size=64))
    # block_size clamped to S (one block)
    np.testing.assert_allclose(auto(q, k, v), _plain(True)(q, k, v), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="cuDNN may be present")
def test_cudnn_without_a_gpu_is_a_typed_error():
    q, k, v, _ = _qkv(1, 8, 2, 1, 8)
    with pytest.raises(AttentionError, match="GPU with cuDNN") as err:
        lyr.attention(q, k, v, implementation="cudnn")
    assert isinstance(err.value, SpmdError)


@pytest.mark.parametrize(
    ("kwargs", "shapes", "match"),
    [
        ({"implementation": "flash"}, None, "implementation be one of"),
        ({"implementation": "blockwise", "block_size": 0}, None, "block_size be a positive"),
        ({}, ((1, 8, 3, 8), (1, 8, 2, 8)), "kv_heads"),
        ({}, ((1, 8, 2, 8), (1, 6, 2, 8)), "kv_heads"),
    ],
)
def test_bad_input_is_a_typed_error(kwargs, shapes, match):
    qs, ks = shapes or ((1, 8, 2, 8), (1, 8, 1, 8))
    q, k = jnp.zeros(qs), jnp.zeros(ks)
    with pytest.raises(AttentionError, match=match):
        lyr.attention(q, k, k, **kwargs)


def test_configs_choose_the_implementation():
    assert llama.LlamaConfig().attention == "auto" and gpt.GPTConfig().attention == "auto"
    with pytest.raises(ModelConfigError, match="attention be one of"):
        llama.LlamaConfig(attention="flash")
    with pytest.raises(ModelConfigError, match="attention be one of"):
        gpt.GPTConfig(attention="flash")


@pytest.mark.slow
def test_planner_propagates_blockwise_like_plain_with_less_memory():
    """The planner's propagation walks the blockwise attention (custom_vjp, scans with
    carries) without a fallback warning, and batch/head sharding stays sharded: the
    same collectives as the plain attention, less memory (seq 1024: two blocks)."""
    import warnings

    import spmdkit as sk
    from spmdkit.models import get_model

    mesh = sk.abstract_mesh(data=2, model=4)
    costs = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for impl in ("xla", "auto"):
            cfg = llama.LlamaConfig(seq_len=1024, n_kv_heads=4, attention=impl)
            costs[impl] = sk.plan(get_model("llama"), mesh, "megatron", config=cfg).cost
    assert costs["auto"].estimator == "propagate"
    assert costs["auto"].comm_bytes == costs["xla"].comm_bytes
    # Megatron's all-reduces; the one gather is the vocab-sharded embedding table's
    # (the lookup region's cheapest layout at seq 1024: 64 KiB, not the rows' all-reduce)
    assert set(costs["auto"].comm_bytes) == {"all_reduce", "all_gather"}
    assert costs["auto"].comm_bytes["all_gather"] == 256 * 64 * 4
    # two key blocks halve the score-sized temporaries (scores, probabilities and
    # their gradients: 16 MiB each per device here), not the rest of the layer's
    temps = {impl: c.memory["temporaries"] for impl, c in costs.items()}
    assert temps["xla"] - temps["auto"] > 16 * 2**20 and temps["auto"] < 0.55 * temps["xla"]


def _scan_outputs(jaxpr):
    """(shape, dtype) of every scan result in a jaxpr, nested jaxprs included."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            out += [(v.aval.shape, str(v.aval.dtype)) for v in eqn.outvars]
        for p in eqn.params.values():
            for sub in p if isinstance(p, (tuple, list)) else (p,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    out += _scan_outputs(inner)
    return out


def test_the_causal_mask_is_not_stacked_out_of_the_layer_scan():
    """Inside scanned layers, JAX's partial evaluation hoists loop-invariant values out
    of the layer scan; the mask's broadcast to the scores' shape must stay in the loop
    (else a [blocks, b, kv, g, S, block] residual appears: 32 GiB at Llama-3 8B). The
    blockwise kernel under a layer scan, and the scanned Llama, whose attention is a
    region (its residuals q, k, v) inside the layer scan."""
    from spmdkit.introspect import describe
    from spmdkit.models import get_model

    q, k, v, _ = _qkv(2, 64, 4, 2, 8)

    def layers(q, ws):
        def body(x, w):
            return kernels.blockwise_attention(x * w, k * w, v, block_size=16), None

        return jnp.sum(jax.lax.scan(body, q, ws)[0])

    closed = jax.make_jaxpr(jax.value_and_grad(layers))(q, jnp.ones(3))
    masks = [shape for shape, dtype in _scan_outputs(closed.jaxpr) if dtype == "bool"]
    assert masks, "the blockwise attention's causal mask is a scan result"
    # only [blocks, S, block]: never with the batch and head dims
    assert all(len(shape) <= 3 for shape in masks), masks
    info = describe(get_model("llama"), config="tiny_scan", batch_size=4)
    closed = jax.make_jaxpr(jax.value_and_grad(info.loss_fn))(info.abstract_params, info.batch)
    masks = [shape for shape, dtype in _scan_outputs(closed.jaxpr) if dtype == "bool"]
    assert all(len(shape) <= 3 for shape in masks), masks


# -- swiglu ------------------------------------------------------------------------


def _plain_swiglu(gate, up):
    return jax.nn.silu(gate) * up


@functools.partial(jax.jit, static_argnums=0)
def _gated_value_and_pullback(fn, gate, up, d_out):
    out, pull = jax.vjp(fn, gate, up)
    return out, pull(d_out)


def _gated(shape, dtype, seed):
    """Gate (wide: both tails of the sigmoid), up and an output cotangent."""
    kg, ku, kd = jax.random.split(jax.random.key(seed), 3)
    gate = 4.0 * jax.random.normal(kg, shape, jnp.float32)
    up = jax.random.normal(ku, shape, jnp.float32)
    d_out = jax.random.normal(kd, shape, jnp.float32)
    return tuple(x.astype(dtype) for x in (gate, up, d_out))


@pytest.mark.parametrize(("dtype", "seed"), [(jnp.float32, 11), (jnp.bfloat16, 12)])
def test_swiglu_equals_silu_times_up_values_and_grads(dtype, seed):
    """Same values (same ops) and gradients as autodiff of ``silu(gate) * up``, to
    the dtype's rounding: float32 within a few ulps, bfloat16 within one ulp."""
    gate, up, d_out = _gated((3, 40, 96), dtype, seed)
    lean = _gated_value_and_pullback(lyr.swiglu, gate, up, d_out)
    plain = _gated_value_and_pullback(_plain_swiglu, gate, up, d_out)
    eps = float(jnp.finfo(dtype).eps)
    for a, b in zip(jax.tree.leaves(lean), jax.tree.leaves(plain), strict=True):
        assert a.dtype == b.dtype == dtype
        got, want = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_allclose(got, want, rtol=4 * eps, atol=4 * eps * np.abs(want).max())
    np.testing.assert_array_equal(np.asarray(lean[0]), np.asarray(plain[0]))


def test_swiglu_keeps_only_its_inputs_for_the_backward():
    """What the forward hands the backward: ``gate`` and ``up`` (autodiff of
    ``jax.nn.silu(gate) * up`` keeps more [tokens, mlp] values)."""
    gate, up, _ = _gated((64, 96), jnp.float32, 13)

    def residuals(fn):
        leaves = jax.tree.leaves(jax.eval_shape(lambda g, u: jax.vjp(fn, g, u)[1], gate, up))
        return sum(x.size for x in leaves) / gate.size

    assert residuals(lyr.swiglu) == 2
    assert residuals(_plain_swiglu) > 2


def test_swiglu_mismatched_inputs_are_a_typed_error():
    with pytest.raises(ModelConfigError, match="gate and up have one shape and dtype"):
        lyr.swiglu(jnp.ones((4, 8)), jnp.ones((4, 1)))
    with pytest.raises(ModelConfigError, match="bfloat16"):
        lyr.swiglu(jnp.ones((4, 8)), jnp.ones((4, 8), jnp.bfloat16))


@pytest.mark.slow
def test_scanned_swiglu_layers_hold_less_when_compiled():
    """XLA:CPU's compiled gradient of four scanned gated MLP layers holds less with
    :func:`swiglu` than with autodiff of ``silu(gate) * up`` (its buffer assignment:
    ``memory_analysis``), and computes the same gradient."""
    x = jax.random.normal(jax.random.key(14), (256, 64), jnp.float32)
    w = jax.random.normal(jax.random.key(15), (4, 3, 64, 256), jnp.float32) / 16

    def loss(gated, x, w):
        def layer(h, wl):
            return h + gated(h @ wl[0], h @ wl[1]) @ wl[2].T, None

        return jnp.sum(jax.lax.scan(layer, x, w)[0] ** 2)

    grads, temps = [], []
    for gated in (lyr.swiglu, _plain_swiglu):
        step = jax.jit(jax.grad(functools.partial(loss, gated), argnums=1))
        temps.append(step.lower(x, w).compile().memory_analysis().temp_size_in_bytes)
        grads.append(step(x, w))
    np.testing.assert_allclose(grads[0], grads[1], rtol=1e-5, atol=1e-5 * np.abs(grads[1]).max())
    # four layers' [256, 256] float32 values fewer at least (256 KiB each)
    assert temps[1] - temps[0] >= 4 * 2 * 256 * 256 * 4, temps


def test_planner_lays_swiglu_out_elementwise_as_the_compiled_step_runs():
    """Propagation walks the ``custom_vjp`` (forward: its call; gradient: its rules'
    equations) as elementwise work: a tensor-parallel MLP (column-parallel gate and
    up, row-parallel down) moves the same bytes as with autodiff of ``silu(g) * u``,
    the one all-reduce per pass the compiled HLO has, and nothing is left unknown."""
    from jax.sharding import PartitionSpec as P

    import spmdkit as sk
    from spmdkit.propagation import propagate
    from tests.propagation.programs import as_auto, compiled_report, sharded

    mesh = as_auto(sk.make_mesh(x=4))
    args = (
        jax.ShapeDtypeStruct((32, 64), jnp.float32),
        *(jax.ShapeDtypeStruct((64, 128), jnp.float32) for _ in range(2)),
        jax.ShapeDtypeStruct((128, 64), jnp.float32),
    )
    specs = (P(), P(None, "x"), P(None, "x"), P("x", None))

    def mlp(gated):
        return lambda x, wg, wu, wd: gated(x @ wg, x @ wu) @ wd

    def loss(gated):
        return jax.grad(lambda *a: jnp.sum(mlp(gated)(*a) ** 2), argnums=(1, 2, 3))

    assert "custom_vjp_call" in str(jax.make_jaxpr(mlp(lyr.swiglu))(*args))
    for make in (mlp, loss):
        got = {}
        for name, gated in (("lean", lyr.swiglu), ("plain", _plain_swiglu)):
            prop = propagate(make(gated), *args, in_specs=specs, mesh=mesh)
            assert not prop.unknown, prop.unknown
            got[name] = prop.comm_bytes_by_kind
        compiled = compiled_report(make(lyr.swiglu), sharded(args, specs, mesh))
        assert got["lean"] == got["plain"] == compiled.bytes_by_kind(), (make, got)
        assert set(got["lean"]) == {"all_reduce"}


# -- gelu --------------------------------------------------------------------------

_INT = {2: np.int16, 4: np.int32}


def _ulps(a, b):
    """Units in the last place between two arrays of one float dtype, elementwise
    (the bit patterns mapped to a monotone integer line)."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype
    it = _INT[a.dtype.itemsize]
    ia, ib = (x.view(it).astype(np.int64) for x in (a, b))
    ia, ib = (np.where(i < 0, np.iinfo(it).min - i, i) for i in (ia, ib))
    return np.abs(ia - ib)


def _plain_gelu(approximate):
    return functools.partial(jax.nn.gelu, approximate=approximate)


def _lean_gelu(approximate):
    return functools.partial(lyr.gelu, approximate=approximate)


@functools.partial(jax.jit, static_argnums=0)
def _unary_value_and_pullback(fn, x, d_out):
    out, pull = jax.vjp(fn, x)
    return out, pull(d_out)[0]


def _gelu_inputs(shape, dtype, seed):
    """x over both tails and the middle of GELU (its derivative dips below 0 near -0.75),
    and an output cotangent."""
    kx, kd = jax.random.split(jax.random.key(seed))
    x = 4.0 * jax.random.normal(kx, shape, jnp.float32)
    return x.astype(dtype), jax.random.normal(kd, shape, jnp.float32).astype(dtype)


@pytest.mark.parametrize("approximate", [True, False])
@pytest.mark.parametrize(("dtype", "seed"), [(jnp.float32, 21), (jnp.bfloat16, 22)])
def test_gelu_equals_jax_nn_gelu_values_and_grads(approximate, dtype, seed):
    """Values equal ``jax.nn.gelu``'s bit for bit (it is the forward); gradients
    autodiff's within one ulp, float32 and bfloat16, both forms."""
    x, d_out = _gelu_inputs((3, 40, 96), dtype, seed)
    y, dx = _unary_value_and_pullback(_lean_gelu(approximate), x, d_out)
    y0, dx0 = _unary_value_and_pullback(_plain_gelu(approximate), x, d_out)
    assert y.dtype == dx.dtype == dtype
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y0))
    assert _ulps(dx, dx0).max() <= 1
    # the two forms differ, so the flag reaches the formula
    assert not np.array_equal(np.asarray(y), np.asarray(jax.nn.gelu(x, not approximate)))


@pytest.mark.parametrize("approximate", [True, False])
def test_gelu_keeps_only_its_input_for_the_backward(approximate):
    """What the forward hands the backward: ``x`` itself (autodiff of the tanh
    form keeps five x-shaped values, of the erf form three)."""
    x, _ = _gelu_inputs((64, 96), jnp.bfloat16, 23)

    def residuals(fn):
        leaves = jax.tree.leaves(jax.eval_shape(lambda x: jax.vjp(fn, x)[1], x))
        return sum(a.size for a in leaves) / x.size

    assert residuals(_lean_gelu(approximate)) == 1
    assert residuals(_plain_gelu(approximate)) >= 3


def test_gelu_bad_inputs_are_typed_errors():
    with pytest.raises(ModelConfigError, match="floating-point"):
        lyr.gelu(jnp.ones((4, 8), jnp.int32))
    with pytest.raises(ModelConfigError, match="approximate be a Python bool"):
        lyr.gelu(jnp.ones((4, 8)), approximate="tanh")


def _mlp_layer(act):
    """A GELU MLP layer as the GPT block writes it: the ``mlpwi`` tag on the matmul,
    outside the activation."""

    def layer(h, w):
        return h + act(lyr.tag(h @ w[0], "mlpwi")) @ w[1].T, None

    return layer


def test_gelu_under_vmap_scan_and_named_remat():
    """Scanned layers, vmapped over a batch, each under ``jax.checkpoint`` saving only
    ``mlpwi``: the gradient is autodiff's (to rounding); the policy finds the tag
    (each layer keeps exactly its [tokens, mlp] input projection, which the
    ``custom_vjp``'s backward reads)."""
    from jax.ad_checkpoint import checkpoint_policies as cp

    x = jax.random.normal(jax.random.key(24), (2, 16, 32), jnp.float32)
    w = jax.random.normal(jax.random.key(25), (3, 2, 32, 64), jnp.float32) / 8

    def loss(act, policy, x, w):
        layer = jax.checkpoint(_mlp_layer(act), policy=policy)

        def one(xs):
            return jax.lax.scan(layer, xs, w)[0]

        return jnp.sum(jax.vmap(one)(x) ** 2)

    mlpwi = cp.save_only_these_names("mlpwi")
    grads = [
        jax.jit(jax.grad(functools.partial(loss, act, mlpwi), argnums=(0, 1)))(x, w)
        for act in (lyr.gelu, jax.nn.gelu)
    ]
    for a, b in zip(*grads, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max())

    def kept(policy):
        res = jax.eval_shape(
            lambda x, w: jax.vjp(functools.partial(loss, lyr.gelu, policy), x, w)[1], x, w
        )
        return sorted(a.shape for a in jax.tree.leaves(res))

    # per layer (3) and sequence (2): the saved mlpwi [16, 64], and nothing else
    saved = kept(mlpwi)
    for shape in kept(cp.nothing_saveable):
        saved.remove(shape)
    assert saved == [(3, 2, 16, 64)]


def test_gelu_is_left_alone_by_fp8_loss_and_the_matmuls_are_not():
    """``fp8_loss`` rewrites the weight matmuls around the ``custom_vjp`` (it has
    none inside): every matmul of the compiled float8 step, forward and backward,
    reads float8 operands, as with ``jax.nn.gelu``, and the loss and gradients
    equal that one's to an ulp."""
    from spmdkit.step.fp8 import fp8_loss

    x = jax.random.normal(jax.random.key(26), (64, 32), jnp.bfloat16)
    w = (jax.random.normal(jax.random.key(27), (2, 2, 32, 64), jnp.float32) / 8).astype(
        jnp.bfloat16
    )

    def loss(act):
        def fn(w, x):
            return jnp.sum(jax.lax.scan(_mlp_layer(act), x, w)[0].astype(jnp.float32) ** 2)

        return jax.value_and_grad(fp8_loss(fn))

    def f8_dots(step):
        dots = [ln for ln in step.lower(w, x).as_text().splitlines() if "dot_general" in ln]
        return len(dots), sum("f8E" in ln for ln in dots)

    lean, plain = jax.jit(loss(lyr.gelu)), jax.jit(loss(jax.nn.gelu))
    # the scan bodies: 2 matmuls forward, their 4 operand gradients backward
    assert f8_dots(lean) == f8_dots(plain) == (6, 6)
    for a, b in zip(jax.tree.leaves(lean(w, x)), jax.tree.leaves(plain(w, x)), strict=True):
        assert _ulps(a, b).max() <= 1


def test_planner_lays_gelu_out_elementwise_as_the_compiled_step_runs():
    """Propagation walks the ``custom_vjp`` (its forward call, its backward's
    equations) as elementwise work: a tensor-parallel GELU MLP (column-parallel
    fc, row-parallel proj) moves the bytes autodiff of ``jax.nn.gelu`` does, the
    compiled HLO's, with nothing left unknown."""
    from jax.sharding import PartitionSpec as P

    import spmdkit as sk
    from spmdkit.propagation import propagate
    from tests.propagation.programs import as_auto, compiled_report, sharded

    mesh = as_auto(sk.make_mesh(x=4))
    args = (
        jax.ShapeDtypeStruct((32, 64), jnp.float32),
        jax.ShapeDtypeStruct((64, 128), jnp.float32),
        jax.ShapeDtypeStruct((128, 64), jnp.float32),
    )
    specs = (P(), P(None, "x"), P("x", None))

    def mlp(act):
        return lambda x, w1, w2: act(x @ w1) @ w2

    def loss(act):
        return jax.grad(lambda *a: jnp.sum(mlp(act)(*a) ** 2), argnums=(1, 2))

    assert "custom_vjp_call" in str(jax.make_jaxpr(mlp(lyr.gelu))(*args))
    for make in (mlp, loss):
        got = {}
        for name, act in (("lean", lyr.gelu), ("plain", jax.nn.gelu)):
            prop = propagate(make(act), *args, in_specs=specs, mesh=mesh)
            assert not prop.unknown, prop.unknown
            got[name] = prop.comm_bytes_by_kind
        compiled = compiled_report(make(lyr.gelu), sharded(args, specs, mesh))
        assert got["lean"] == got["plain"] == compiled.bytes_by_kind(), (make, got)
        assert set(got["lean"]) == {"all_reduce"}


@pytest.mark.slow
def test_scanned_gelu_layers_hold_less_when_compiled():
    """XLA:CPU's compiled gradient of four scanned GELU MLP layers holds less with
    :func:`gelu` than with autodiff of ``jax.nn.gelu`` (``memory_analysis``), and
    computes the same gradient."""
    x = jax.random.normal(jax.random.key(28), (256, 64), jnp.float32)
    w = jax.random.normal(jax.random.key(29), (4, 2, 64, 256), jnp.float32) / 16

    def loss(act, x, w):
        return jnp.sum(jax.lax.scan(_mlp_layer(act), x, w)[0] ** 2)

    grads, temps = [], []
    for act in (lyr.gelu, jax.nn.gelu):
        step = jax.jit(jax.grad(functools.partial(loss, act), argnums=1))
        temps.append(step.lower(x, w).compile().memory_analysis().temp_size_in_bytes)
        grads.append(step(x, w))
    np.testing.assert_allclose(grads[0], grads[1], rtol=1e-5, atol=1e-5 * np.abs(grads[1]).max())
    # four layers' [256, 256] float32 values fewer at least (256 KiB each)
    assert temps[1] - temps[0] >= 4 * 2 * 256 * 256 * 4, temps
