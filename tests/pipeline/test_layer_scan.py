"""One layer-scan finder: the planner's trace, the pipeline cost model, the
executor's split and the recompute rewrite all take the same scan."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from spmdkit import jaxprs
from spmdkit.introspect import describe
from spmdkit.pipeline.layer_scan import find_layer_scan
from spmdkit.pipeline.split import split_loss
from spmdkit.planner.pipeline.cost import param_stages
from spmdkit.planner.trace import trace_step
from spmdkit.step.recipe import Recipe
from spmdkit.step.remat_scan import remat_loss

L, B, S, D, V = 4, 8, 4, 16, 32


class TwoScans(nnx.Module):
    """A short scan (a 2-step recurrent prelude of tiny matmuls) before the
    stack of L layers (D x D matmuls): the stack is the layer scan."""

    def __init__(self, *, rngs):
        init = nnx.initializers.normal(0.1)
        self.embed = nnx.Param(init(rngs.params(), (V, D)))
        self.prelude = nnx.Param(init(rngs.params(), (2, D, 2)))
        self.layers = nnx.Param(init(rngs.params(), (L, D, D)))
        self.head = nnx.Param(init(rngs.params(), (D, V)))

    def __call__(self, tokens):
        x = jnp.take(self.embed[...], tokens, axis=0)

        def step(h, w):  # a short, cheap scan
            return h + jnp.tanh(h @ w).sum(-1, keepdims=True), None

        x, _ = jax.lax.scan(step, x, self.prelude[...])

        def layer(h, w):
            return h + jnp.tanh(h @ w), None

        x, _ = jax.lax.scan(layer, x, self.layers[...])
        return x @ self.head[...]


def loss_fn(model, batch):
    logits = model(batch["tokens"])
    onehot = jax.nn.one_hot(batch["labels"], V)
    return -(jax.nn.log_softmax(logits) * onehot).sum(-1).mean()


def _batch():
    tokens = np.arange(B * S).reshape(B, S) % V
    return {"tokens": jnp.asarray(tokens), "labels": jnp.asarray((tokens + 1) % V)}


@pytest.fixture(scope="module")
def info():
    return describe(lambda: TwoScans(rngs=nnx.Rngs(0)), loss=loss_fn, batch=_batch())


def _scan_lengths(closed):
    return [
        jaxprs.scan(e).length for e, _ in jaxprs.walk_eqns(closed) if e.primitive.name == "scan"
    ]


def test_the_finder_takes_the_stack_not_the_short_scan(info):
    closed = jax.make_jaxpr(info.loss_fn)(info.abstract_params, info.batch)
    assert sorted(_scan_lengths(closed)) == [2, L]
    found = find_layer_scan(closed)
    assert found.length == L and found.stacked == (len(found.eqn.invars) - 1,)
    assert find_layer_scan(closed, layers=2).length == 2  # asked for by length
    assert find_layer_scan(closed, layers=3) is None


def test_trace_split_costs_and_remat_take_the_same_scan(info):
    # the planner's trace
    assert trace_step(info, None).layers == L
    # the pipeline cost model: the stacked layer weights are split over stages
    stages = param_stages(info.loss_fn, info.abstract_params, info.batch, L)
    assert stages["layers"] == "layers" and stages["prelude"] == "first"
    # the executor's split: the prelude runs before the stack, on the first stage
    sp = split_loss(info.loss_fn, info.abstract_params, info.batch, ())
    assert sp.layers == L
    assert any(e.primitive.name == "scan" for e in sp.closed.jaxpr.eqns[: sp.index])
    # the recompute rewrite checkpoints the stack's body, and only it
    rematted = remat_loss(info.loss_fn, Recipe(remat="full"))
    closed = jax.make_jaxpr(rematted)(info.abstract_params, info.batch)
    bodies = {
        jaxprs.scan(e).length: jaxprs.scan(e).jaxpr
        for e, _ in jaxprs.walk_eqns(closed)
        if e.primitive.name == "scan"
    }
    remat = {
        n: any(e.primitive.name in jaxprs.REMAT_PRIMITIVES for e in body.eqns)
        for n, body in bodies.items()
    }
    assert remat == {2: False, L: True}
