"""rules.moe's per-device programs: the forward that keeps its exchanged buffers and
the backward that reads them give the cotangents ``jax.vjp`` of the rule's program
gives, with the forward's two token exchanges transposed and nothing exchanged again."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import spmdkit as sk
from rules.moe import residual_programs
from spmdkit.engine.local import local_context, resolve_partials
from spmdkit.engine.registry import get_rule
from spmdkit.verification.hlo import compiled_collectives, summarize
from spmdkit.vma import shard_map

T, D, K, E, F = 32, 8, 2, 8, 8

# mesh axes, token spec, gate/up spec, down spec
LAYOUTS = {
    "ep8": (dict(ep=8), P("ep"), P("ep"), P("ep")),
    "ep4_tp2": (dict(ep=4, tp=2), P("ep"), P("ep", None, "tp"), P("ep", "tp")),
    "ep4_fsdp2": (dict(fs=2, ep=4), P(("fs", "ep")), P("ep", "fs"), P("ep", None, "fs")),
    "ep_joins_tokens": (dict(dp=2, ep=4), P("dp"), P("ep"), P("ep")),
}


def _values(t):
    rng = np.random.default_rng(0)
    idx = np.stack([rng.permutation(E)[:K] for _ in range(t)]).astype(np.int32)
    return (
        rng.standard_normal((t, D)).astype(np.float32),
        idx,
        rng.random((t, K)).astype(np.float32),
        rng.standard_normal((E, D, F)).astype(np.float32) * 0.5,
        rng.standard_normal((E, D, F)).astype(np.float32) * 0.5,
        rng.standard_normal((E, F, D)).astype(np.float32) * 0.5,
        rng.standard_normal((t, D)).astype(np.float32),  # the output's cotangent
    )


def _programs(layout, t, attrs):
    """The residual programs and the rule's own per-device program vjp'd, each
    under one shard_map returning the output and the five cotangents."""
    axes, tok, gu, down = LAYOUTS[layout]
    mesh = sk.make_mesh(**axes)
    vals = _values(t)
    specs = [
        sk.TensorSpec(v.shape, s, dtype=v.dtype)
        for v, s in zip(vals[:6], (tok, tok, tok, gu, gu, down), strict=True)
    ]
    res = sk.infer_forward("moe_experts", *specs, mesh=mesh, **attrs)
    tok = res.inputs[0].to_partition_spec()  # the expert axes join the tokens' (all_to_all)
    placed = [
        jax.device_put(v, NamedSharding(mesh, s))
        for v, s in zip(vals, (tok, tok, tok, gu, gu, down, tok), strict=True)
    ]
    rule = get_rule("moe_experts")
    lctx = local_context(rule, res, attrs, mesh)
    out = res.outputs[0]
    whole = out.without_partial().to_partition_spec()
    kept = residual_programs(lctx)
    assert kept is not None
    forward, backward = kept.forward, kept.backward

    def with_residuals(*a):
        xs, ct = a[:6], a[6]
        y, *r = forward(*xs)
        return (resolve_partials(y, out), *backward(*xs, *r, ct))

    def rerun(*a):
        xs, ct = a[:6], a[6]
        local = rule.local_fn(lctx)

        def f(x, w, wg, wu, wd):
            return resolve_partials(local(x, xs[1], w, wg, wu, wd), out)

        y, vjp = jax.vjp(f, *(xs[i] for i in (0, 2, 3, 4, 5)))
        return (y, *vjp(ct))

    grads = (tok, tok, gu, gu, down)
    ins = (tok, tok, tok, gu, gu, down, whole)
    build = lambda body: jax.jit(  # noqa: E731
        shard_map(body, mesh=mesh, in_specs=ins, out_specs=(whole, *grads), check_vma=True)
    )
    return build(with_residuals), build(rerun), placed, mesh


@pytest.mark.parametrize(
    ("layout", "t", "attrs"),
    [
        ("ep8", T, {}),
        pytest.param("ep4_tp2", T, {}, marks=pytest.mark.slow),
        pytest.param("ep4_fsdp2", T, {"capacity_factor": 0.75}, marks=pytest.mark.slow),
        pytest.param("ep_joins_tokens", T, {}, marks=pytest.mark.slow),
        # assignments dropped
        pytest.param("ep8", 16, {"capacity_factor": 0.5}, marks=pytest.mark.slow),
    ],
)
def test_the_backward_from_residuals_is_the_programs_vjp(layout, t, attrs):
    kept, rerun, args, _ = _programs(layout, t, {"strategy": "all_to_all", **attrs})
    for got, want in zip(kept(*args), rerun(*args), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    # per device: the counts, the tokens out and back, and their two transposes
    found = summarize(c for c in compiled_collectives(kept, *args) if c.kind == "all_to_all")
    n_ep = 8 if layout == "ep8" else 4
    t_local = t // (4 if layout == "ep4_tp2" else 8)
    tokens = n_ep * t_local * min(K, E // n_ep) * D * 4
    counts = n_ep * (E // n_ep) * 4
    assert found == {"all_to_all": {"count": 5, "payload_bytes": 4 * tokens + counts}}


def test_no_exchange_keeps_nothing():
    mesh = sk.make_mesh(dp=8)
    specs = [
        sk.TensorSpec(s, P("dp") if i < 3 else P(), dtype="int32" if i == 1 else "float32")
        for i, s in enumerate(((T, D), (T, K), (T, K), (E, D, F), (E, D, F), (E, F, D)))
    ]
    res = sk.infer_forward("moe_experts", *specs, mesh=mesh)
    assert residual_programs(local_context(get_rule("moe_experts"), res, {}, mesh)) is None


@pytest.mark.parametrize("layout", ["ep8", "ep_joins_tokens"])
def test_a_ragged_exchange_gives_what_the_padded_one_gives(monkeypatch, layout):
    """Where the backend has a ragged all-to-all (a GPU, a TPU) the four token
    exchanges send only the rows routed. XLA:CPU has none, so its documented
    semantics, built from a padded all-to-all (spmdkit.testing.ragged), stand in:
    the forward and the backward from residuals, and the rule's program vjp'd, give
    what the padded exchange gives."""
    from spmdkit.testing.ragged import ragged_all_to_all_reference

    padded, _, args, _ = _programs(layout, T, {"strategy": "all_to_all"})
    want = padded(*args)
    for moe in _moe_modules():
        monkeypatch.setattr(moe, "ragged_backend", lambda: True)
        monkeypatch.setattr(moe, "_ragged_all_to_all", ragged_all_to_all_reference)
    kept, rerun, args, _ = _programs(layout, T, {"strategy": "all_to_all"})
    # the counts, and per ragged exchange the reference's two all-to-alls (the rows,
    # the offsets), the rows' transposed in the backward: the stand-in is what ran
    text = rerun.trace(*args).lower().as_text()
    assert text.count('"stablehlo.all_to_all"') == 1 + 2 * 2 + 2
    for got, again, w in zip(kept(*args), rerun(*args), want, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(w), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(again), np.asarray(w), rtol=1e-5, atol=1e-5)


def test_on_a_gpu_the_token_exchanges_lower_to_ragged_all_to_alls(monkeypatch):
    """Lowered for CUDA (jax lowers for a platform it does not run on), the forward
    that keeps its buffers and the backward from them exchange the tokens by four
    ``ragged_all_to_all`` ops, the counts by one all-to-all; the rule's program
    differentiated by jax, by four too (jax's transpose of the op also exchanges
    its offsets)."""
    for moe in _moe_modules():
        monkeypatch.setattr(moe, "ragged_backend", lambda: True)
    kept, rerun, args, _ = _programs("ep8", T, {"strategy": "all_to_all"})
    for program in (kept, rerun):
        text = program.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("custom_call @ragged_all_to_all(") == 4
    text = kept.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count('"stablehlo.all_to_all"') == 1


def _moe_modules():
    """rules/moe.py as this file imports it and as the registry's rule does
    (``spmdkit.rules.moe``): one file, two modules."""
    import importlib

    return [importlib.import_module(m) for m in ("rules.moe", "spmdkit.rules.moe")]
