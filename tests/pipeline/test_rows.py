"""mixed_rows: which layers keep a micro-batch's rows apart."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import spmdkit as sk
from spmdkit.introspect.model import describe
from spmdkit.models import get_model
from spmdkit.pipeline.rows import mixed_rows
from spmdkit.pipeline.split import split_loss

X = jnp.ones((4, 6, 8))
W = jnp.ones((8, 8))


def _rows(fn, *args, dims=None):
    closed = jax.make_jaxpr(fn)(*args)
    return mixed_rows(closed, dims if dims is not None else [0] + [None] * (len(args) - 1))


def _scan_sum(x):
    def body(c, w):
        return c + jnp.tanh(x @ w), None

    return jax.lax.scan(body, jnp.zeros_like(x), jnp.stack([W, W]))[0]


@pytest.mark.parametrize(
    "fn",
    [
        lambda x, w: jax.nn.softmax(x @ w, axis=-1),
        lambda x, w: x - x.mean(-1, keepdims=True),  # a per-token norm
        lambda x, w: jnp.einsum("bsd,btd->bst", x, x),  # attention scores: rows as a batch dim
        lambda x, w: jnp.transpose(x.reshape(4, 6, 2, 4), (0, 2, 1, 3)).reshape(4, 2, 24),
        lambda x, w: jnp.where(jnp.arange(6)[:, None] > 2, x, 0.0),  # an iota over positions
        lambda x, w: jnp.cumsum(x, axis=1),
        lambda x, w: jnp.concatenate([x, x @ w], axis=-1)[:, :, :8],
        lambda x, w: _scan_sum(x),
        lambda x, w: jax.lax.fori_loop(0, 3, lambda i, c: c * 0.5 + x, jnp.zeros_like(x)),
        lambda x, w: jax.lax.cond(True, lambda a: a * 2, lambda a: a + 1, x),
        lambda x, w: jax.checkpoint(lambda a: jnp.sin(a) @ w)(x),
        lambda x, w: jax.nn.gelu(x),  # custom_jvp, pjit inside
        lambda x, w: sk.ops.rms_norm(x, jnp.ones(8)),  # a region
    ],
    ids=[
        "matmul",
        "norm",
        "scores",
        "heads",
        "mask",
        "cumsum",
        "concat",
        "scan",
        "loop",
        "cond",
        "remat",
        "gelu",
        "region",
    ],
)
def test_row_wise_layers_keep_rows_apart(fn):
    assert _rows(fn, X, W) is None


@pytest.mark.parametrize(
    ("fn", "match"),
    [
        (lambda x, w: x - x.mean(0), "reduce_sum over the rows"),  # a batch statistic
        (lambda x, w: jnp.einsum("bsd,bse->de", x, x), "rows contracted"),
        (lambda x, w: x.reshape(24, 8) @ w, "merged or split"),
        (lambda x, w: x * jnp.arange(4.0)[:, None, None], "varies along them"),
        (lambda x, w: jnp.cumsum(x, axis=0), "along the rows"),
        (lambda x, w: x[:2], "part of the rows"),
        (lambda x, w: jnp.flip(x, 0), "along the rows"),
        (lambda x, w: jnp.take(x, jnp.array([1, 0, 3, 2]), axis=0), "no row rule"),
        (
            lambda x, w: jax.lax.fori_loop(0, 2, lambda i, c: c + x.sum(0), jnp.zeros((6, 8))),
            "reduce_sum over the rows",
        ),
    ],
    ids=["stat", "contract", "merge", "iota", "cumsum", "slice", "flip", "gather", "loop"],
)
def test_layers_that_combine_rows_are_named(fn, match):
    assert match in (_rows(fn, X, W) or "")


def test_values_without_rows_pass():
    """Weights (no rows) combine freely; rows on another dim are followed."""
    assert _rows(lambda w: w @ w.T, W, dims=[None]) is None
    assert _rows(lambda x: x.sum(0), jnp.ones((6, 4)), dims=[1]) is None
    assert "over the rows" in _rows(lambda x: x.sum(1), jnp.ones((6, 4)), dims=[1])


@pytest.mark.parametrize(
    ("name", "config", "mixed"),
    [("gpt", "tiny_pipe", False), ("llama", "tiny_pipe", False), ("moe", "tiny_pipe", True)],
)
def test_the_reference_models_layers(name, config, mixed):
    """GPT's and Llama's layers keep rows apart (their attention kernels, norms and
    regions included); MoE's router takes the micro-batch's token statistics."""
    info = describe(get_model(name), config=config, batch_size=4)
    sp = split_loss(info.loss_fn, info.abstract_params, info.batch)
    eqn = sp.scan
    inputs = [*sp.consts, *sp.carry]
    dims = [0 if v in sp.per_mb and v.aval.ndim else None for v in inputs]
    dims += [None] * (len(eqn.invars) - len(inputs))
    found = mixed_rows(eqn.params["jaxpr"], dims)
    assert (found is not None) == mixed, found
    if mixed:
        assert found.startswith("reduce_sum over the rows")
