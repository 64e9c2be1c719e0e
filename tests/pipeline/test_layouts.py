"""How the pipeline takes a weight's layout over the batch axes as given."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from spmdkit.introspect.model import describe
from spmdkit.models import get_model
from spmdkit.pipeline.layouts import batch_split, weight_splits
from spmdkit.pipeline.split import split_loss


def test_weight_splits_take_the_batch_axes_a_spec_splits_major_most():
    """What the pipeline takes as given of a weight's layout: per dim (the layer
    dim skipped), the batch axes leading its entry, where they divide the dim."""
    sizes = {"pipe": 2, "data": 2, "fsdp": 4, "model": 2}
    batch = ("data", "fsdp")
    spec = P("pipe", ("data", "fsdp"), "model")
    assert batch_split(spec, (8, 16, 4), batch, sizes, 1) == ((1, ("data", "fsdp")),)
    # a tensor-parallel axis leading the entry: the batch axes cannot be taken
    assert batch_split(P(None, ("model", "data")), (8, 16), batch, sizes, 1) == ()
    # the batch axes before an automatic one: taken, the automatic one left to XLA
    assert batch_split(P(None, ("fsdp", "model")), (8, 16), batch, sizes, 1) == ((1, ("fsdp",)),)
    # does not divide: replicated over the batch axes
    assert batch_split(P(None, "fsdp"), (8, 6), batch, sizes, 1) == ()
    # the layer dim is skipped for stacked weights, not for shared ones
    assert batch_split(P("data", None), (8, 6), batch, sizes, 1) == ()
    assert batch_split(P("data", None), (8, 6), batch, sizes, 0) == ((0, ("data",)),)


def test_weight_splits_follow_a_cast_to_the_parameter():
    """The stacked weights the layer scan reads are the bf16 casts of the fp32
    parameters under a bf16 recipe: their split is the parameter's."""
    info = describe(get_model("llama"), config="tiny_pipe", batch_size=8)
    params = info.init_fn()
    one = jax.tree.map(lambda s: jnp.zeros((4, *s.shape[1:]), s.dtype), info.batch)
    specs = jax.tree.map(lambda x: P(None, "data") if x.ndim > 1 else P(), params)
    leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    for cast in (None, jnp.bfloat16):

        def loss(p, b, cast=cast):
            return info.loss_fn(jax.tree.map(lambda x: x.astype(cast or x.dtype), p), b)

        sp = split_loss(loss, params, one)
        xs, _ = weight_splits(sp, leaves, ("data",), {"data": 2})
        assert len(xs) == len(sp.xs)
        for v, split in zip(sp.xs, xs, strict=True):
            want = ((1, ("data",)),) if len(v.aval.shape) > 1 and v.aval.shape[1] % 2 == 0 else ()
            assert split == want, (v.aval, split)
