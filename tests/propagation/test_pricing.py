"""Reshard and FLOP costs of propagated steps."""

from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit.propagation import propagate
from spmdkit.propagation.pricing import Pricer, node_flops
from spmdkit.util import H100_BF16_PEAK_FLOPS, contraction_flops
from tests.propagation.programs import F32, S


def test_contraction_flops_are_the_local_blocks_and_default_peak_is_the_h100():
    mesh = sk.abstract_mesh(data=2, model=4)
    x, w = S((64, 32), F32), S((32, 16), F32)
    prop = propagate(lambda x, w: x @ w, x, w, in_specs=(P("data"), P(None, "model")), mesh=mesh)
    (rec,) = prop.records
    assert rec.flops == contraction_flops("dot_general", rec.attrs, (32, 32), (32, 4), (32, 4))
    assert prop.compute_time_s == rec.flops / H100_BF16_PEAK_FLOPS
    node = prop.program.graph.nodes[0]
    assert node_flops(node, rec.inputs, rec.outputs, mesh) == rec.flops


def test_staged_gathers_of_one_dim_are_one_collective():
    mesh = sk.abstract_mesh(data=2, model=4)
    src = sk.TensorSpec((64, 32), P(("data", "model")), dtype=F32)
    dst = sk.TensorSpec((64, 32), P(), dtype=F32)
    a = Pricer(mesh, sk.DEFAULT_TOPOLOGY).reshard("x", src, dst)
    assert [(c.kind, c.group_size, c.payload_bytes) for c in a.plan.collectives] == [
        ("all_gather", 8, 64 * 32 * 4)
    ]
