"""spmdkit.ops norms: values and grads equal the unsharded computation under sampled
input specs of the sweep's enumeration (all of them in the slow test, see ``layouts``),
in Explicit and Auto axis modes; output and grad layouts are the ones the rule predicts."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit.errors import ShardingConflictError
from spmdkit.ops import norms
from spmdkit.testing import enumerate_specs

from .layouts import check_every_layout, enumerated

RTOL, ATOL = 1e-5, 1e-5

# -- the unsharded computations, written independently of the rules (two-pass variance)


def _standardize(x, axes, eps):
    mean = jnp.mean(x, axes, keepdims=True)
    return (x - mean) / jnp.sqrt(jnp.var(x, axes, keepdims=True) + eps)


def ref_layer_norm(x, scale=None, bias=None, *, begin_norm_axis=-1, epsilon=1e-5):
    b = begin_norm_axis % x.ndim
    y = _standardize(x, tuple(range(b, x.ndim)), epsilon)
    return y * (1 if scale is None else scale) + (0 if bias is None else bias)


def ref_rms_norm(x, scale=None, *, begin_norm_axis=-1, epsilon=1e-6):
    axes = tuple(range(begin_norm_axis % x.ndim, x.ndim))
    y = x / jnp.sqrt(jnp.mean(x * x, axes, keepdims=True) + epsilon)
    return y * (1 if scale is None else scale)


def _to_nchw(x, data_format):
    return x if data_format == "NCHW" else jnp.moveaxis(x, -1, 1)


def _from_nchw(y, data_format):
    return y if data_format == "NCHW" else jnp.moveaxis(y, 1, -1)


def _affine_nchw(y, scale, bias):
    shape = (1, -1) + (1,) * (y.ndim - 2)
    y = y if scale is None else y * scale.reshape(shape)
    return y if bias is None else y + bias.reshape(shape)


def ref_group_norm(x, scale=None, bias=None, *, num_groups, epsilon=1e-5, data_format="NCHW"):
    z = _to_nchw(x, data_format)
    g = z.reshape(z.shape[0], num_groups, -1)
    y = _standardize(g, (2,), epsilon).reshape(z.shape)
    return _from_nchw(_affine_nchw(y, scale, bias), data_format)


def ref_instance_norm(x, scale=None, bias=None, *, epsilon=1e-5, data_format="NCHW"):
    z = _to_nchw(x, data_format)
    y = _standardize(z, tuple(range(2, z.ndim)), epsilon)
    return _from_nchw(_affine_nchw(y, scale, bias), data_format)


def ref_batch_norm(
    x, mean, var, scale=None, bias=None, *, training=True, momentum=0.9, epsilon=1e-5,
    data_format="NCHW",
):  # fmt: skip
    z = _to_nchw(x, data_format)
    axes = (0, *range(2, z.ndim))
    shape = (1, -1) + (1,) * (z.ndim - 2)
    if training:
        m, v = jnp.mean(z, axes), jnp.var(z, axes)
    else:
        m, v = mean, var
    y = (z - m.reshape(shape)) / jnp.sqrt(v.reshape(shape) + epsilon)
    y = _from_nchw(_affine_nchw(y, scale, bias), data_format)
    if not training:
        return y, mean, var
    m, v = jax.lax.stop_gradient(m), jax.lax.stop_gradient(v)  # running stats are buffers
    return y, momentum * mean + (1 - momentum) * m, momentum * var + (1 - momentum) * v


# -- cases: (op, reference, shapes, attrs, rule operand order) --------------------------

CONFIGS = {
    "layer_norm": ("layer_norm", ref_layer_norm, [(4, 8), (8,), (8,)], {}),
    "layer_norm_sharded_stats": (
        "layer_norm",
        ref_layer_norm,
        [(2, 4, 8), (4, 8)],
        {"begin_norm_axis": 1, "strategy": "sharded_stats"},
    ),
    "rms_norm_sharded_stats": (
        "rms_norm",
        ref_rms_norm,
        [(4, 8), (8,)],
        {"strategy": "sharded_stats"},
    ),
    "group_norm_nhwc": (
        "group_norm",
        ref_group_norm,
        [(4, 2, 8), (8,), (8,)],
        {"num_groups": 4, "data_format": "NHWC"},
    ),
    "instance_norm": ("instance_norm", ref_instance_norm, [(4, 8, 2), (8,)], {}),
    "batch_norm": ("batch_norm", ref_batch_norm, [(4, 8, 2), (8,), (8,), (8,), (8,)], {}),
    "batch_norm_inference_nhwc": (
        "batch_norm",
        ref_batch_norm,
        [(4, 2, 8), (8,), (8,)],
        {"training": False, "data_format": "NHWC"},
    ),
    "sync_batch_norm": ("sync_batch_norm", ref_batch_norm, [(4, 8, 2), (8,), (8,), (8,)], {}),
}


def _values(name, shapes, rng):
    vals = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    if "batch_norm" in name:  # x, running mean, running var (positive), params
        vals[2] = rng.uniform(0.5, 2.0, shapes[2]).astype(np.float32)
    return vals


def _rule_order(name, specs):
    """The rule takes x, [scale], [bias], running_mean, running_var."""
    if "batch_norm" not in name:
        return list(specs)
    return [specs[0], *specs[3:], specs[1], specs[2]]


def _sample(shapes, mesh, n, seed):
    per_input = [enumerate_specs(s, mesh, dtype="float32", partial_ops=()) for s in shapes]
    combos = list(itertools.product(*per_input))
    rng = np.random.default_rng(seed)
    return [combos[i] for i in sorted(rng.choice(len(combos), size=n, replace=False))]


class _Case:
    """One config's values, unsharded reference outputs and grads."""

    def __init__(self, config):
        self.op, ref, self.shapes, self.attrs = CONFIGS[config]
        self.config = config
        rng = np.random.default_rng(len(config))
        self.vals = _values(config, self.shapes, rng)
        self.ref_attrs = {k: v for k, v in self.attrs.items() if k != "strategy"}
        self.argnums = tuple(range(len(self.vals)))
        ref_out = ref(*map(jnp.asarray, self.vals), **self.ref_attrs)
        self.ref_out = ref_out if isinstance(ref_out, tuple) else (ref_out,)
        self.weights = [rng.standard_normal(o.shape).astype(np.float32) for o in self.ref_out]
        self.ref_grads = jax.jit(
            jax.grad(lambda *a: self.scalar(ref(*a, **self.ref_attrs)), argnums=self.argnums)
        )(*self.vals)

    def scalar(self, outs):
        outs = outs if isinstance(outs, tuple) else (outs,)
        return sum(jnp.sum(o * w) for o, w in zip(outs, self.weights, strict=True))

    def required(self, specs, mesh2d):
        """The rule's required input specs, in this test's operand order."""
        fwd = sk.infer_forward(
            self.op, *_rule_order(self.config, specs), mesh=mesh2d, **self.attrs,
            **_flags(self.op, self.shapes),
        )  # fmt: skip
        perm = _rule_order(self.config, list(range(len(specs))))
        out = [None] * len(specs)
        for k, i in enumerate(perm):
            out[i] = fwd.inputs[k]
        return tuple(out)

    def check(self, mesh2d, mode, specs):
        """The op under ``specs``: values, grads and layouts as the rules say."""
        op, attrs, config, shapes = self.op, self.attrs, self.config, self.shapes
        mesh = mesh2d if mode == "explicit" else Mesh(mesh2d.devices, mesh2d.axis_names)
        fn = getattr(norms, op)
        pspecs = [s.to_partition_spec() for s in specs]
        args = [
            jax.device_put(v, NamedSharding(mesh, p))
            for v, p in zip(self.vals, pspecs, strict=True)
        ]
        kw = {} if mode == "explicit" else {"in_specs": pspecs, "mesh": mesh}
        where = f"{mode} {config} {specs}"

        outs = jax.jit(lambda *a, kw=kw: fn(*a, **attrs, **kw))(*args)
        outs = outs if isinstance(outs, tuple) else (outs,)
        for o, r in zip(outs, self.ref_out, strict=True):
            np.testing.assert_allclose(o, r, rtol=RTOL, atol=ATOL, err_msg=where)
        grads = jax.jit(
            jax.grad(lambda *a, kw=kw: self.scalar(fn(*a, **attrs, **kw)), argnums=self.argnums)
        )(*args)
        for g, rg in zip(grads, self.ref_grads, strict=True):
            np.testing.assert_allclose(g, rg, rtol=RTOL, atol=ATOL, err_msg=where)

        # outputs carry the rule's claim; grads leave with the grad rule's layouts
        rule_specs = _rule_order(config, specs)
        fwd = sk.infer_forward(op, *rule_specs, mesh=mesh2d, **attrs, **_flags(op, shapes))
        y_spec = fwd.outputs[0]
        assert outs[0].sharding.is_equivalent_to(
            NamedSharding(mesh, y_spec.to_partition_spec()), outs[0].ndim
        ), where
        pred = sk.infer_grad(
            op, *rule_specs, out_grads=fwd.outputs, mesh=mesh2d, **attrs, **_flags(op, shapes)
        )
        assert pred.inputs == fwd.inputs
        for i, g in enumerate(_rule_order(config, grads)):
            want = pred.outputs[i].without_partial()
            if fwd.inputs[i] == rule_specs[i]:  # no input reshard: the op's own grad layout
                assert g.sharding.is_equivalent_to(
                    NamedSharding(mesh, want.to_partition_spec()), g.ndim
                ), f"{where}: grad {i}"


@pytest.mark.parametrize("mode", ["explicit", "auto"])
@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.heavy
def test_values_and_grads_equal_the_unsharded_computation(mesh2d, mode, config):
    case = _Case(config)
    for specs in _sample(case.shapes, mesh2d, 2, seed=len(config) + (mode == "auto")):
        case.check(mesh2d, mode, specs)


@pytest.mark.slow
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_every_enumerated_layout(mesh2d, config):
    """Every input-spec combination the sweep enumerates, through the distinct local
    programs (both axis modes) and the distinct per-operand moves they need."""
    case = _Case(config)
    check_every_layout(
        enumerated(case.shapes, ["float32"] * len(case.shapes), mesh2d),
        lambda specs: case.required(specs, mesh2d),
        lambda mode, specs: case.check(mesh2d, mode, specs),
        case.vals,
        mesh2d,
    )


def _flags(op, shapes):
    """The has_scale / has_bias the op derives from the arguments it was given."""
    if op == "rms_norm":
        return {"has_scale": len(shapes) > 1}
    n = len(shapes) - (3 if "batch_norm" in op else 1)
    return {"has_scale": n >= 1, "has_bias": n >= 2}


def test_inference_returns_the_running_statistics_unchanged(mesh1d):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((8, 4)).astype(np.float32)
    m, v = np.zeros(4, np.float32), np.ones(4, np.float32)
    y, m2, v2 = norms.batch_norm(x, m, v, training=False, mesh=mesh1d)
    np.testing.assert_array_equal(m2, m)
    np.testing.assert_array_equal(v2, v)
    np.testing.assert_allclose(y, x / np.sqrt(1 + 1e-5), rtol=RTOL)


def test_bad_arguments_raise_typed_errors(mesh1d):
    x = jax.device_put(np.zeros((8, 4), np.float32), NamedSharding(mesh1d, P()))
    with pytest.raises(ShardingConflictError, match="num_groups"):
        norms.group_norm(x, num_groups=3)
    with pytest.raises(ShardingConflictError, match="strategy is one of"):
        norms.layer_norm(x, strategy="fastest")
    with pytest.raises(ShardingConflictError, match="one spec per array"):
        norms.rms_norm(x, in_specs=(P(), P()))


@pytest.mark.parametrize(
    ("spec", "strategy", "out"),
    [
        (P("a", None), "default", "a"),
        (P(None, "b"), "sharded_stats", None),
    ],
)
@pytest.mark.slow
def test_fused_add_rms_norm_equals_add_then_rms_norm(mesh2d, spec, strategy, out):
    rng = np.random.default_rng(3)
    x, r = (rng.standard_normal((4, 8)).astype(np.float32) for _ in range(2))
    scale = rng.standard_normal(8).astype(np.float32)
    put = lambda v, s: jax.device_put(v, NamedSharding(mesh2d, s))  # noqa: E731
    xs, rs, ss = put(x, spec), put(r, spec), put(scale, P(spec[1]))

    def f(x, r, s):
        y, h, inv = norms.fused_add_rms_norm(x, r, s, strategy=strategy)
        return (y * y).sum() + (h * inv[:, None]).sum()

    def ref(x, r, s):
        h = x + r
        inv = 1 / jnp.sqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6)
        return ((h * inv * s) ** 2).sum() + (h * inv).sum()

    y, h, inv = norms.fused_add_rms_norm(xs, rs, ss, strategy=strategy)
    np.testing.assert_allclose(np.asarray(h), x + r, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(np.asarray(y), ref_rms_norm(x + r, scale), rtol=1e-4, atol=1e-5)
    assert inv.shape == (4,) and inv.sharding.spec[0] == out
    with jax.set_mesh(mesh2d):
        got = jax.grad(f, argnums=(0, 1, 2))(xs, rs, ss)
    want = jax.grad(ref, argnums=(0, 1, 2))(x, r, scale)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-4)
