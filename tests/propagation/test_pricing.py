"""Reshard and FLOP costs of propagated steps."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit.propagation import propagate
from spmdkit.propagation.pricing import Pricer, charged_bytes, node_flops, on_link, steps_bytes
from spmdkit.propagation.steps import LoopBody, Step
from spmdkit.resharding import Collective
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


def test_steps_bytes_are_the_results_local_blocks_loops_times_their_trips():
    """What a round of sweeps writes per device: each equation's results at their
    local size (replicated: whole on every device), a loop's body per trip."""
    mesh = sk.abstract_mesh(data=8)
    x, w = S((64, 32), F32), S((32, 16), F32)
    prop = propagate(lambda x, w: x @ w, x, w, in_specs=(P("data"), None), mesh=mesh)
    (rec,) = prop.records
    node = prop.program.graph.nodes[0]
    split = Step(node, "dot_general", rec.attrs, rec.inputs, rec.inputs, rec.outputs)
    assert steps_bytes([split], mesh) == 64 * 16 * 4 / 8
    whole = split._replace(outputs=tuple(o.replace(dims=()) for o in rec.outputs))
    assert steps_bytes([whole], mesh) == 64 * 16 * 4
    loop = whole._replace(loop=LoopBody([split, whole], [], 3), outputs=())
    assert steps_bytes([loop], mesh) == 3 * (64 * 16 * 4 / 8 + 64 * 16 * 4)


def test_staged_gathers_of_one_dim_are_one_collective():
    mesh = sk.abstract_mesh(data=2, model=4)
    src = sk.TensorSpec((64, 32), P(("data", "model")), dtype=F32)
    dst = sk.TensorSpec((64, 32), P(), dtype=F32)
    a = Pricer(mesh, sk.DEFAULT_TOPOLOGY).reshard("x", src, dst)
    assert [(c.kind, c.group_size, c.payload_bytes) for c in a.plan.collectives] == [
        ("all_gather", 8, 64 * 32 * 4)
    ]


def _ragged_records(in_specs, mesh):
    """The propagated records of a grouped GEMM's value and both grads: 16 rows of 8
    features, 4 groups of 8 x 12 weights."""

    def loss(x, w, sizes):
        return jnp.sum(jax.lax.ragged_dot(x, w, sizes) ** 2)

    args = (S((16, 8), F32), S((4, 8, 12), F32), S((4,), "int32"))
    step = jax.grad(loss, argnums=(0, 1))
    prop = propagate(step, *args, in_specs=in_specs, mesh=mesh)
    return [r for r in prop.records if r.primitive == "ragged_dot_general"]


@pytest.mark.parametrize(
    ("in_specs", "per_device"),
    [
        # every record multiplies 16 rows by one group's 8 x 12 weights: 2·16·8·12
        ((P(), P(), P()), (3072, 3072, 3072)),
        # tokens over data: half the rows on each device
        ((P("data"), P(), P()), (1536, 1536, 1536)),
        # experts over model: each device still runs every row it holds (rows of
        # other devices' experts meet a zero group), so no FLOP is saved
        ((P(), P("model"), P()), (3072, 3072, 3072)),
        # the contracted features over model: a quarter of each row's products
        ((P(None, "model"), P(None, "model"), P()), (768, 768, 768)),
    ],
)
def test_a_grouped_gemm_counts_each_row_times_one_groups_weights(in_specs, per_device):
    mesh = sk.abstract_mesh(data=2, model=4)
    recs = _ragged_records(in_specs, mesh)
    modes = sorted(len(r.outputs[0].shape) for r in recs)
    assert modes == [2, 2, 3]  # the forward, the lhs cotangent, the rhs cotangent
    assert tuple(r.flops for r in recs) == per_device


def test_a_padded_exchange_is_priced_by_its_routed_rows_where_the_link_is_ragged():
    """The routed experts' padded all-to-all (payload 4 KiB, 1 KiB routed over 4
    devices): a GPU's ragged all-to-all sends the routed rows, so its wire bytes,
    time and the bytes a choice compares are theirs; XLA:CPU sends the buffer, and
    the collective is left as it was. Other collectives never change."""
    mesh = sk.abstract_mesh(x=4)
    padded = Collective("all_to_all", ("x",), 4, payload_bytes=4096, wire_bytes=3072)
    routed = dataclasses.replace(padded, routed_bytes=1024)
    gpu = sk.Topology.h100()
    cpu = dataclasses.replace(gpu, platform="cpu")
    sent = on_link(routed, mesh, gpu)
    assert (sent.payload_bytes, sent.wire_bytes) == (4096, 768)
    assert sent.time_s == gpu.collective_time("all_to_all", 768, 4, ("x",), mesh)
    assert charged_bytes(sent, mesh, gpu) == 1024
    assert on_link(routed, mesh, cpu) is routed
    assert charged_bytes(routed, mesh, cpu) == 4096
    assert on_link(padded, mesh, gpu) is padded
    assert charged_bytes(padded, mesh, gpu) == 4096


def test_a_broadcast_scalar_moves_for_nothing_and_is_made_where_it_is_read():
    """A ``broadcast_in_dim`` of a scalar (the zeros a transposed relu reads) is a
    fill: a reshard of it is planned with no collective, and the enforced replay
    makes it anew in its reader's layout, so the compiled step moves nothing for
    it either (XLA moved such a pinned fill by all-to-all, or replicated it)."""
    from spmdkit.propagation.graph import FILL

    mesh = sk.abstract_mesh(data=2, model=4)
    src = sk.TensorSpec((8, 16), P(("data", "model")), dtype=F32)
    dst = sk.TensorSpec((8, 16), P(None, "data"), dtype=F32)
    pricer = Pricer(mesh, sk.DEFAULT_TOPOLOGY, producer={1: FILL, 2: "mul"})
    assert pricer.reshard("input 1", src, dst, 1).plan.collectives == ()
    assert pricer.reshard("input 1", src, dst, 2).plan.collectives != ()
    # a pending sum broadcast from a partial scalar still moves as planned
    partial = sk.TensorSpec((8, 16), P("data"), dtype=F32, partial="model")
    assert pricer.reshard("input 1", partial, src, 1).plan.collectives != ()
