"""Elementwise family: broadcast notation and the partial policy per op."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit.rules.elementwise import broadcast_notation
from spmdkit.testing import check_grad_case, local_pieces, random_value

T = sk.TensorSpec
MESH = sk.abstract_mesh(x=4, y=2)


@pytest.mark.parametrize(
    ("shapes", "text"),
    [
        (((8, 4), (8, 4)), "d0 d1, d0 d1 -> d0 d1"),
        (((8, 4), (4,)), "d0 d1, d1 -> d0 d1"),
        (((8, 1), (1, 4)), "d0 1, 1 d1 -> d0 d1"),
        (((1,), (1,)), "d0, d0 -> d0"),
        (((2, 8, 4), (8, 1), ()), "d0 d1 d2, d1 1,  -> d0 d1 d2"),
    ],
)
def test_broadcast_notation(shapes, text):
    assert broadcast_notation(shapes) == text


def test_policies_are_declared_per_op():
    policies = {op: sk.get_rule(op).partial for op in ("add", "mul", "exp", "neg", "lt", "where")}
    assert policies == {
        "add": "ADDITIVE",
        "mul": "MULTIPLICATIVE",
        "exp": "MONOTONE",
        "neg": "NEGATE",
        "lt": "NONE",
        "where": "SELECT",
    }


def test_where_keeps_the_condition_replicated_over_partial_axes():
    r = sk.infer_forward(
        "where",
        T((8,), partial="x", dtype="bool"),
        T((8,), partial="x"),
        T((8,), partial="x"),
        mesh=MESH,
    )
    assert [str(s) for s in r.inputs] == ["bool[8]", "[8]", "[8]"]
    assert str(r.outputs[0]) == "[8]"
    r = sk.infer_forward(
        "where", T((8,), P("y"), dtype="bool"), T((8,), partial="x"), T((8,)), mesh=MESH
    )
    assert str(r.outputs[0]) == "[8@y]{sum:x}"


def test_max_of_max_partials_stays_max_partial():
    r = sk.infer_forward(
        "max", T((8,), partial={"x": "max"}), T((8,), partial={"x": "max"}), mesh=MESH
    )
    assert str(r.outputs[0]) == "[8]{max:x}"


def test_mixed_reduce_ops_do_not_combine():
    # max over x from one operand, sum over y from the other: they do not commute
    r = sk.infer_forward("mul", T((8,), partial={"y": "sum"}), T((8,)), mesh=MESH)
    assert str(r.outputs[0]) == "[8]{sum:y}"
    r = sk.infer_forward(
        "add", T((8,), partial={"x": "max"}), T((8,), partial={"y": "sum"}), mesh=MESH
    )
    assert len(r.outputs[0].partial) == 1


def test_bfloat16_cast_grad_with_a_sum_partial_cotangent(mesh2d):
    # Found by the 2-D uneven sweep: a bf16 cotangent sum-partial over 8 devices was
    # split into parts much larger than its elements, whose bf16 rounding missed the
    # value by more than rtol (~1 seed in 10). Parts now follow each element's scale.
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 6)).astype(np.float32)
    grad_spec = T((6, 6), partial={"a": "sum", "b": "sum"}, dtype="bfloat16")
    for seed in range(20):
        cot = random_value((6, 6), "bfloat16", rng=np.random.default_rng(seed))
        failure, res = check_grad_case(
            "convert_element_type",
            [T((6, 6), dtype="float32")],
            [grad_spec],
            mesh2d,
            values=[x],
            cotangents=[cot],
            attrs={"new_dtype": "bfloat16"},
            rtol=2e-2,
            seed=seed,
        )
        assert failure is None, str(failure)
    assert res.outputs[0].partial == grad_spec.partial  # the widening cast's grad keeps it


def test_bfloat16_uneven_pieces_are_padded_with_nan(mesh1d):
    # bfloat16 is not a numpy floating type: its padding must still be NaN, not 0
    value = np.ones((6,), dtype=jnp.bfloat16)
    pieces = local_pieces(value, T((6,), P("x")), mesh1d, rng=np.random.default_rng(0))
    assert np.isnan(pieces.astype(np.float32)).sum() == 2  # blocks of 2: the last is padding


@pytest.mark.parametrize(
    ("op", "partial", "passes"),
    [
        ("fmax", "max", True),
        ("fmax", "sum", False),
        ("fmin", "min", True),
        ("fmin", "max", False),
        ("atan2", "sum", False),
    ],
)
def test_named_binary_rules_pass_only_what_their_algebra_allows(op, partial, passes):
    r = sk.infer_forward(op, T((8, 4), P("y"), partial={"x": partial}), T((8, 4)), mesh=MESH)
    assert r.outputs[0].dims == (("y",), ())
    assert (r.outputs[0].partial_ops == {"x": partial}) is passes


@pytest.mark.parametrize("op", ["gelu", "reciprocal"])
def test_named_unary_rules_resolve_every_partial(op):
    for kind in ("sum", "max", "min"):
        r = sk.infer_forward(op, T((8, 4), P(None, "y"), partial={"x": kind}), mesh=MESH)
        assert not r.inputs[0].partial and not r.outputs[0].partial
        assert r.outputs[0].dims == ((), ("y",))


def test_fmax_ignores_nan_and_gelu_has_both_forms():
    nan = np.float32(np.nan)
    fmax = sk.get_rule("fmax").impl
    assert float(fmax(nan, np.float32(2.0))) == 2.0
    gelu = sk.get_rule("gelu").impl
    x = jnp.linspace(-3, 3, 7)
    exact, tanh = gelu(x, approximate=False), gelu(x, approximate=True)
    assert not np.allclose(exact, tanh, atol=1e-6) and np.allclose(exact, tanh, atol=1e-2)


# -- name: checkpoint_name's primitive ---------------------------------------------------


def test_name_passes_every_layout_and_partial():
    """``checkpoint_name`` is the identity: a sharded, sum-partial operand comes out
    as it went in (nothing gathered, nothing reduced)."""
    x = T((8, 4), ("x", None), partial={"y": "sum"})
    res = sk.infer_forward("name", x, mesh=MESH, name="query_proj")
    assert res.outputs == (x,) and not res.reshards


def _tagged_and_untagged(model, monkeypatch):
    """The tiny ``model`` described with its projections tagged (the reference
    models tag them) and with the tags taken out, and its batch."""
    import numpy as np

    from spmdkit.models import get_model
    from spmdkit.models import layers as lyr

    spec = get_model(model)
    cfg = spec.config("tiny")
    batch = spec.batch(cfg, 8, np.random.default_rng(0))
    infos = {}
    for tagged in (True, False):
        if not tagged:
            monkeypatch.setattr(lyr, "tag", lambda x, name: x)
        info = sk.describe(spec, config=cfg, batch=batch)
        jaxpr = str(jax.make_jaxpr(info.loss_fn)(info.abstract_params, batch))
        assert ("name[name=" in jaxpr) == tagged
        infos[tagged] = info
    return infos, batch


def _plans(infos, strategies, mesh):
    out = {}
    for tagged, info in infos.items():
        for s in strategies:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # Llama's kv heads do not split over model=4
                out[tagged, s] = sk.plan(info, mesh, s, estimator="propagate")
    return out


def test_tagged_projections_plan_as_the_untagged_model(monkeypatch):
    """A decoder whose Q/K/V/out and MLP projections are tagged with
    ``checkpoint_name`` plans to the same collectives as the untagged one: the
    tagged values are not gathered (without the rule, megatron gathered ~0.6 MB
    of them per step)."""
    infos, _ = _tagged_and_untagged("gpt", monkeypatch)
    got = _plans(infos, ("megatron",), sk.abstract_mesh(data=2, model=4))
    assert got[True, "megatron"].cost.comm_bytes == got[False, "megatron"].cost.comm_bytes
    assert "all_gather" not in got[True, "megatron"].cost.comm_bytes


@pytest.mark.slow
@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_tagged_projections_plan_and_verify_as_the_untagged_model_per_preset(model, monkeypatch):
    """Every preset: the tagged model's predicted collectives equal the untagged
    model's; megatron_sp's compiled step moves the same bytes per collective kind
    as the untagged one and plan.verify holds on it (every preset's verify on the
    tagged reference models: tests/compile/test_function.py)."""
    infos, batch = _tagged_and_untagged(model, monkeypatch)
    strategies = [s for s in sk.PRESETS if s != "ep"]
    got = _plans(infos, strategies, sk.abstract_mesh(data=2, model=4))
    for s in strategies:
        assert got[True, s].cost.comm_bytes == got[False, s].cost.comm_bytes, s
    if model != "llama":
        return
    mesh = sk.make_mesh(data=2, model=4)
    compiled = {}
    for tagged, info in infos.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            p = sk.plan(info, mesh, "megatron_sp", estimator="propagate")
        step = sk.jit(jax.value_and_grad(info.loss_fn), p)
        params = sk.init_sharded(info, p)
        report = p.verify(step, params, batch)
        assert report.ok, str(report)
        compiled[tagged] = sk.report(step.compile(params, batch)).comm_bytes
    assert compiled[True] == compiled[False]
