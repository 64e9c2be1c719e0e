"""Pooling: flax's max_pool / avg_pool and their gradients propagate with rules,
keep the batch and channel sharding, and move what the compiled HLO moves."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from spmdkit.propagation import propagate
from spmdkit.rules.pooling import window_map
from tests.propagation.programs import F32, S, as_auto, compiled_report


def test_untouched_dims_pass_and_windowed_dims_are_replicated():
    dm = window_map(
        ((8, 6, 6, 4),),
        window_dimensions=(1, 3, 3, 1),
        window_strides=(1, 2, 2, 1),
        padding=((0, 0), (1, 1), (1, 1), (0, 0)),
    )
    assert dm.inputs == (("d0", None, None, "d3"),)
    assert dm.out_shapes == ((8, 3, 3, 4),)


@pytest.mark.parametrize(
    ("pool", "spec"),
    [
        (lambda x: nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME"), P("a", None, None, "b")),
        (lambda x: nn.avg_pool(x, (2, 2), strides=(2, 2)), P(("a", "b"))),
    ],
    ids=["max_pool-batch-and-channels", "avg_pool-batch"],
)
def test_pool_train_step_has_rules_and_matches_hlo(mesh2d, pool, spec):
    def step(x):
        return jax.grad(lambda x: jnp.sum(jnp.tanh(pool(x))))(x)

    x = S((8, 12, 12, 8), F32)
    prop = propagate(step, x, in_specs=(spec,), out_specs=spec, mesh=mesh2d)
    assert not prop.unknown
    windowed = [r for r in prop.records if r.primitive.startswith(("reduce_window", "select_and"))]
    assert windowed and all(r.op == r.primitive for r in windowed)
    assert all(r.outputs[0].dims[0] for r in windowed)  # the batch stays sharded
    assert prop.comm_bytes_by_kind == {}
    rep = compiled_report(step, (S(x.shape, F32, sharding=NamedSharding(as_auto(mesh2d), spec)),))
    assert rep.bytes_by_kind() == {}
