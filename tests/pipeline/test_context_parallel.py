"""The token check of a pipelined context-parallel step (spmdkit/pipeline/context_parallel.py):
a layer that mixes tokens other than through attention, or a loss that is not a
mean over the tokens, is a typed error when the step is traced; the ordinary
step traces. Cheap: abstract evaluation of a tiny per-token stack on
``pipe=2 × data=2 × context=2``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spmdkit as sk
import spmdkit.nn as sknn
from spmdkit.context_parallel import ContextShard
from spmdkit.pipeline import Pipeline, PipelineError
from spmdkit.pipeline.execute import pipelined_value_and_grad

V, D, B, S = 11, 8, 8, 16


def _params() -> dict:
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    return {"emb": f32(V, D), "layers": f32(2, D, D), "head": f32(D, V)}


def _batch() -> dict:
    i32 = jax.ShapeDtypeStruct((B, S), jnp.int32)
    return {"tokens": i32, "targets": i32}


def _loss(mix=lambda h: h, reduce=None):
    """A per-token stack (``mix`` applied to each layer's output ``[B, S, D]``)
    and a cross-entropy head reduced by ``reduce(nll, targets)`` (default: the
    op's mean; ``"ignore_index"``: the op's mean over the targets that are not 0)."""

    def loss(params: dict, batch: dict) -> jax.Array:
        h = jnp.take(params["emb"], batch["tokens"], axis=0)

        def layer(h, w):
            return mix(h + jnp.tanh(h @ w)), None

        h = jax.lax.scan(layer, h, params["layers"])[0]
        logits = h @ params["head"]
        if reduce in (None, "ignore_index"):  # the op's mean, or its masked mean
            return sknn.cross_entropy(logits, batch["targets"], ignore_index=reduce and 0)
        logp = jax.nn.log_softmax(logits)
        nll = -(logp * jax.nn.one_hot(batch["targets"], V)).sum(-1)
        return reduce(nll, batch["targets"])

    return loss


def _step(loss):
    axes = {"pipe": 2, "data": 2, "context": 2}
    devices = np.array(jax.devices()[:8]).reshape(2, 2, 2)
    mesh = jax.sharding.Mesh(devices, tuple(axes))
    shard = ContextShard(("context",), (2,), True, "gather_kv")
    f = pipelined_value_and_grad(
        loss, Pipeline(stages=2, microbatches=2), mesh, ("data",),
        context=shard, seq_dims={"tokens": 1, "targets": 1},
    )  # fmt: skip
    return lambda: jax.eval_shape(f, _params(), _batch())


@pytest.mark.parametrize(
    "reduce",
    [None, lambda nll, t: nll.mean(), lambda nll, t: nll.mean(1).mean() * 0.5 + 1.0],
    ids=["op-mean", "mean", "affine-of-means"],
)
def test_a_mean_over_the_tokens_traces(reduce):
    loss, _ = _step(_loss(reduce=reduce))()
    assert loss.shape == ()


def _attention(h: jax.Array) -> jax.Array:
    """Causal self-attention of ``[B, S, D]`` as 2 heads (q = k = v = h)."""
    q = h.reshape(*h.shape[:2], 2, h.shape[2] // 2)
    return h + sk.ops.attention(q, q, q, causal=True).reshape(h.shape)


def test_attention_is_the_one_op_that_may_mix_tokens():
    """The attention op (its K/V gathered over the context axis) passes; a
    sequence mean after it in the same layer does not."""
    loss, grads = _step(_loss(mix=_attention))()
    assert loss.shape == () and grads["layers"].shape == (2, D, D)
    after = lambda h: _attention(h).mean(1, keepdims=True) + h  # noqa: E731
    with pytest.raises(PipelineError, match="a layer's `reduce_sum over the rows"):
        _step(_loss(mix=after))()


@pytest.mark.parametrize(
    ("reduce", "match"),
    [
        (lambda nll, t: jnp.sum(nll * (t != 0)) / jnp.sum(t != 0), "masked mean"),
        ("ignore_index", "masked mean's count"),
        (lambda nll, t: nll.sum(), "not a mean over the tokens"),
        (lambda nll, t: nll.sum() / (B * S), "not a mean over the tokens"),
        (lambda nll, t: nll.max(), "reduce_max over the tokens"),
    ],
    ids=["masked-mean", "ignore-index", "sum", "global-count", "max"],
)  # fmt: skip
def test_a_loss_that_is_not_a_mean_over_the_tokens_is_refused(reduce, match):
    """A masked mean (the devices' masked means averaged are not the global one),
    a sum, a mean divided by the global count: typed errors naming the fix."""
    with pytest.raises(PipelineError, match=f"(?s){match}.*flat plan"):
        _step(_loss(reduce=reduce))()


@pytest.mark.parametrize(
    ("mix", "match"),
    [
        (lambda h: jnp.cumsum(h, axis=1), "cumsum along the rows"),
        (lambda h: h - h.mean(1, keepdims=True), "reduce_sum over the rows"),
        (lambda h: jnp.pad(h[:, :-1], ((0, 0), (1, 0), (0, 0))), "part of the rows"),
        (lambda h: h * jnp.arange(h.shape[1])[None, :, None], "varies along them"),
    ],
    ids=["cumsum", "sequence-mean", "token-shift", "local-positions"],
)
def test_a_layer_that_mixes_tokens_is_refused(mix, match):
    """Under manual context axes a layer sees its device's tokens alone: a cumsum,
    a mean over the sequence, a token shift or positions counted from the
    device's first token would be wrong, so each is a typed error."""
    with pytest.raises(PipelineError, match=f"a layer's .*{match}"):
        _step(_loss(mix=mix))()


def _rows_step(loss):
    """The step pipelined over ``pipe=2`` with the batch over ``data=2`` (no context)."""
    devices = np.array(jax.devices()[:4]).reshape(2, 2)
    mesh = jax.sharding.Mesh(devices, ("pipe", "data"))
    f = pipelined_value_and_grad(loss, Pipeline(stages=2, microbatches=2), mesh, ("data",))
    return lambda: jax.eval_shape(f, _params(), _batch())


@pytest.mark.parametrize(
    ("reduce", "match"),
    [
        ("ignore_index", "masked mean's count"),
        (lambda nll, t: nll.sum(), "not a mean over the rows"),
    ],
    ids=["ignore-index", "sum"],
)  # fmt: skip
def test_with_batch_axes_the_loss_must_be_a_mean_over_the_rows(reduce, match):
    """Each device runs the loss on its rows of a micro-batch and the devices'
    losses are averaged: a masked mean or a sum is a typed error when the step is
    traced (spmdkit.pipeline.context_parallel.rows_loss_combined), before the stages are. A
    mean traces: every pipelined test with batch axes (tests/pipeline/test_execute.py)."""
    with pytest.raises(PipelineError, match=f"(?s)mean over the rows.*{match}"):
        _rows_step(_loss(reduce=reduce))()
