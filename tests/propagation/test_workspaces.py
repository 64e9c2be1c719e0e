"""XLA:CPU's workspaces for the ops it expands, against its memory_analysis on one
CPU device: a max pool's gradient, a depthwise filter gradient, grouped GEMMs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spmdkit.propagation.memory import estimate_memory
from spmdkit.propagation.workspaces import (
    batch_group_workspace,
    ragged_dot_workspace,
    select_and_scatter_workspace,
)

S = jax.ShapeDtypeStruct
F32 = "float32"


def test_select_and_scatter_workspace_follows_the_window():
    """XLA:CPU's expansion of a max pool's gradient, from the equation's shapes:
    one int32 iota per operand dim over the padded operand, the zero-filled padded
    scatter target, one int32 position per window and dim, the padded copy."""
    same = select_and_scatter_workspace(
        (8, 16, 16, 32), 4, 4, (1, 3, 3, 1), (1, 2, 2, 1), ((0, 0), (0, 1), (0, 1), (0, 0))
    )
    padded, windows = 8 * 17 * 17 * 32, 8 * 8 * 8 * 32
    assert same.iotas == 4 * padded * 4 and same.zeros == padded * 4
    assert same.indices == 4 * windows * 4
    assert same.forward == padded * 4 + windows * 4  # the padded operand, the maxima
    valid = select_and_scatter_workspace(
        (2, 24, 16), 2, 4, (1, 3, 1), (1, 2, 1), ((0, 0), (0, 0), (0, 0))
    )
    assert valid.zeros == 2 * 24 * 16 * 4 and valid.forward == 2 * 11 * 16 * 2  # no pad copy


def _max_pool(x, window, strides, padding):
    dims, steps = (1, *window, 1), (1, *strides, 1)
    if isinstance(padding, str):
        padding = jax.lax.padtype_to_pads(x.shape, dims, steps, padding)
    else:
        padding = ((0, 0), *padding, (0, 0))
    return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, dims, steps, padding)


@pytest.mark.slow
@pytest.mark.parametrize(
    "shape, window, strides, padding",
    [
        ((8, 16, 16, 32), (3, 3), (2, 2), "SAME"),
        ((8, 16, 16, 32), (2, 2), (2, 2), "VALID"),
        ((8, 16, 16, 32), (3, 3), (1, 1), "SAME"),
        ((4, 32, 32, 8), (5, 5), (3, 3), "SAME"),
        ((4, 32, 32, 8), (3, 3), (2, 2), ((1, 1), (1, 1))),
        ((8, 24, 16), (3,), (2,), "SAME"),
        ((2, 8, 8, 8, 16), (2, 2, 2), (2, 2, 2), "VALID"),
    ],
)
def test_max_pool_gradient_workspace_matches_xla_cpu(shape, window, strides, padding):
    """A max pool's gradient on one CPU device: liveness alone counts a fifth to a
    third of XLA:CPU's temporaries; with the expansion's workspace (cpu=True) it
    matches memory_analysis to the byte (up to XLA's 40-byte tuple table), over
    1-D, 2-D and 3-D windows, strides 1 to 3, VALID, SAME and explicit padding."""

    def step(x):
        grad = jax.grad(lambda x: jnp.sum(jnp.sin(_max_pool(x, window, strides, padding))))(x)
        return jnp.sum(jnp.cos(grad))  # the gradient is a temporary, not an output

    x = S(shape, F32)
    closed = jax.make_jaxpr(step)(x)
    mesh = jax.sharding.AbstractMesh((), ())
    compiled = jax.jit(step).lower(x).compile().memory_analysis().temp_size_in_bytes
    assert estimate_memory(closed, {}, mesh).temp_bytes < 0.4 * compiled  # GPU: no workspace
    assert estimate_memory(closed, {}, mesh, cpu=True).temp_bytes == pytest.approx(compiled, abs=64)


@pytest.mark.parametrize(("channels", "window", "size"), [(16, 7, 4), (32, 5, 8), (16, 3, 16)])
def test_depthwise_filter_gradient_workspace_matches_xla_cpu(channels, window, size):
    """A depthwise convolution's gradient (its filter gradient has batch groups =
    channels) on one CPU device: XLA:CPU runs the filter gradient dense, channels
    times the kernel, masked and reduced. With that workspace (cpu=True) the
    estimate is XLA's temp to the byte, whether the dense buffers set the peak
    (large kernels on small images: liveness alone counts a quarter of it or less)
    or the activations do."""

    def step(x, w):
        def loss(x, w):
            y = jax.lax.conv_general_dilated(
                x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
                feature_group_count=channels,
            )  # fmt: skip
            return jnp.sum(y**2)

        return jax.grad(loss, argnums=(0, 1))(x, w)

    x, w = S((8, size, size, channels), F32), S((window, window, 1, channels), F32)
    closed = jax.make_jaxpr(step)(x, w)
    mesh = jax.sharding.AbstractMesh((), ())
    compiled = jax.jit(step).lower(x, w).compile().memory_analysis().temp_size_in_bytes
    assert estimate_memory(closed, {}, mesh, cpu=True).temp_bytes == pytest.approx(compiled, abs=64)
    if window == 7:
        assert estimate_memory(closed, {}, mesh).temp_bytes < 0.25 * compiled
    dense = channels * window * window * channels * 4  # the dense result
    assert batch_group_workspace(dense // channels, channels) == 2 * dense  # operands freed
    assert batch_group_workspace(dense // channels, channels, dense) == dense


def test_ragged_dot_workspace_expands_the_ragged_operands():
    """Ragged rows: the rows expanded per group and the weight's copy, while the dot
    runs; a ragged contraction (the weights' gradient): both operands expanded."""
    rows, weight = 256 * 64 * 4, 4 * 64 * 48 * 4
    fwd = ragged_dot_workspace(rows, weight, 4, ragged_contracting=False)
    assert fwd.early == (0, 0) and fwd.during == 4 * rows + weight
    back = ragged_dot_workspace(rows, 256 * 48 * 4, 4, ragged_contracting=True)
    assert back.early == (4 * rows, 4 * 256 * 48 * 4) and back.during == 0


def _grouped(x, w, sizes):
    return jnp.tanh(jax.lax.ragged_dot(x, w, sizes))


@pytest.mark.parametrize(
    ("argnums", "groups", "rows", "k", "n"),
    [(None, 4, 256, 64, 48), ((0, 1), 4, 256, 64, 48), (1, 8, 128, 32, 64), (0, 2, 512, 64, 32)],
)
def test_ragged_dot_workspace_matches_xla_cpu(argnums, groups, rows, k, n):
    """One grouped GEMM and its gradients on one CPU device: XLA:CPU lowers
    ``ragged_dot`` by expanding the ragged operand per group and contracting it
    densely. Liveness alone misses most of XLA's temp (the GEMM makes none of the
    program's values); with the expansion's workspace (cpu=True) the estimate is
    within a fifth of it."""
    sizes = np.full(groups, rows // groups - 3, np.int32)  # ragged: some rows in no group
    f = (
        (lambda x, w: _grouped(x, w, sizes))
        if argnums is None
        else jax.grad(lambda x, w: jnp.sum(_grouped(x, w, sizes)), argnums=argnums)
    )
    x, w = S((rows, k), F32), S((groups, k, n), F32)
    closed = jax.make_jaxpr(f)(x, w)
    mesh = jax.sharding.AbstractMesh((), ())
    compiled = jax.jit(f).lower(x, w).compile().memory_analysis().temp_size_in_bytes
    assert estimate_memory(closed, {}, mesh).temp_bytes < 0.3 * compiled  # GPU: no workspace
    got = estimate_memory(closed, {}, mesh, cpu=True).temp_bytes
    assert got == pytest.approx(compiled, rel=0.2), (got, compiled)


#: (lhs shape, rhs shape, dimension numbers) of 16-bit dots: forward, input and
#: weight gradients of 2-D and 3-D activations, attention's batched dots.
_DOTS = [
    ((64, 32), (32, 48), (((1,), (0,)), ((), ()))),  # x @ w
    ((64, 48), (32, 48), (((1,), (1,)), ((), ()))),  # dy @ w.T
    ((64, 32), (64, 48), (((0,), (0,)), ((), ()))),  # x.T @ dy
    ((4, 16, 32), (4, 16, 48), (((0, 1), (0, 1)), ((), ()))),  # bsd,bsf->df
    ((2, 4, 16, 16), (2, 4, 16, 8), (((3,), (2,)), ((0, 1), (0, 1)))),  # bhqk,bhkd->bhqd
    ((2, 4, 16, 16), (2, 4, 16, 8), (((2,), (2,)), ((0, 1), (0, 1)))),  # bhqk,bhqd->bhkd
]


@pytest.mark.parametrize(("lhs", "rhs", "dims"), _DOTS)
def test_float32_dot_names_the_dots_xla_cpu_runs_in_float32(lhs, rhs, dims):
    """Against the compiled program of one bf16 dot on one CPU device: from jaxlib
    0.11 the dots ``float32_dot`` names compile to a float32 dot and the others to
    a bf16 one (YNNPACK's fusion); up to 0.10 every one runs in float32."""
    from spmdkit.propagation.workspaces import float32_dot
    from spmdkit.versions import cpu_float8_held_as

    bf16 = jnp.bfloat16

    def f(a, b):
        return jax.lax.dot_general(a, b, dims)

    hlo = jax.jit(f).lower(S(lhs, bf16), S(rhs, bf16)).compile().as_text()
    entry = hlo[hlo.index("ENTRY") :]
    dots = [line for line in entry.splitlines() if " dot(" in line or "__ynn_fusion" in line]
    assert len(dots) == 1, entry
    in_float32 = "= f32[" in dots[0]
    native = cpu_float8_held_as() != "float32"
    assert in_float32 == (float32_dot(len(lhs), len(rhs), dims) or not native), entry
