"""The analytic cost of pipelined plans, on numbers small enough to check by hand."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import spmdkit as sk
from spmdkit.introspect import describe
from spmdkit.models import get_model
from spmdkit.pipeline import Pipeline, build_schedule
from spmdkit.planner.analytic import CostContext, GroupLayout, StepTrace, param_groups
from spmdkit.planner.pipeline.cost import (
    StageSplit,
    activation_bytes,
    held_activations,
    most_sends,
    param_stages,
    pipeline_cost,
    stage_groups,
)
from spmdkit.planner.trace import trace_step
from spmdkit.spec import axis_sizes
from spmdkit.topology import Topology

MiB = 2**20


def _trace(**kw: float) -> StepTrace:
    """8 layers; per micro-batch and device (scale 1/8): carry 1 MiB, residuals
    4 MiB per layer, head residuals 2 MiB, the logits 1 MiB."""
    base = dict(
        flops=0.0,
        resid_bytes=int(8 * 32 * MiB + 16 * MiB),
        opt_bytes={},
        opt_other_bytes=0,
        tokens=1,
        batch_size=8,
        seq_len=1,
        act_itemsize=4,
        abstract_opt=None,
        layers=8,
        layer_resid=32.0 * MiB,
        layer_carry=8.0 * MiB,
        resid_peak=8.0 * MiB,
    )
    base.update(kw)
    return StepTrace(**base)


def _acts(schedule: str, remat: str = "full", m: int = 8) -> tuple[float, ...]:
    pipe = Pipeline(4, m, schedule)
    out = activation_bytes(_trace(), pipe, remat, (), 1 / 8, 1 / 8)
    return tuple(a / MiB for a in out)


def test_activations_per_schedule_by_hand() -> None:
    # Per chunk (2 layers, full remat) R = 2 × 1 MiB carry; the head H = 2 MiB;
    # a send C = 1 MiB; every device also holds one recomputed layer (4 MiB) and
    # the logits' gradient (1 MiB), and a tick's two residual sets around its
    # switch (one program on every device: the busiest device's buffers everywhere).
    # 1F1B: 4 stash slots (no trash slot), 2 inbox slots + 2 trash slots.
    assert _acts("1f1b") == (4 * 2 + 4 * 1 + 2 * 2 + 4 + 1.0,) * 4
    # F-then-B with input release: 8 slots; the last device's backward inbox
    # holds all 8 losses' cotangents at the end of the forwards.
    assert _acts("fthenb") == (8 * 2 + (2 + 9) * 1 + 2 * 2 + 4 + 1.0,) * 4
    # GPipe: the 8 + 3 forward ticks (the bubble's included) each keep R and the
    # head's residuals, and the forward inbox (2 slots) it read, plus the last
    # one; a tick's own set R.
    assert _acts("gpipe") == (11 * (2 + 2) + 12 * 2 * 1 + 2 + 4 + 1.0,) * 4
    # No remat: every layer's residuals (4 MiB), nothing recomputed.
    assert _acts("1f1b", remat="none")[0] == 4 * 8 + 4 + 2 * 8 + 1


def test_held_and_sends_match_the_tick_table() -> None:
    for p, m, schedule, v in [
        (2, 4, "1f1b", 1),
        (4, 8, "1f1b", 1),
        (3, 2, "fthenb", 1),
        (2, 2, "fthenb", 2),
        (4, 8, "interleaved", 2),
        (2, 4, "interleaved", 3),
    ]:
        pipe = Pipeline(p, m, schedule, virtual=v)
        table = build_schedule(pipe)
        assert held_activations(pipe)[0] == table.peak_in_flight, pipe
        assert most_sends(pipe) == max(table.sends), pipe
    gp = Pipeline(4, 8, "gpipe")
    assert held_activations(gp)[0] == (11,) * 4  # v·m + p - 1 forward ticks


def _loss(params: dict, batch: jax.Array) -> jax.Array:
    x = params["emb"][batch]

    def layer(h: jax.Array, w: jax.Array) -> tuple[jax.Array, None]:
        return jnp.tanh(h @ w), None

    x, _ = jax.lax.scan(layer, x, params["stack"])
    return jnp.mean((x @ params["head"]) ** 2) + jnp.sum(params["emb"]) * 0.0


def test_param_stages_split_at_the_layer_scan() -> None:
    params = {
        "emb": jax.ShapeDtypeStruct((16, 8), jnp.float32),
        "stack": jax.ShapeDtypeStruct((4, 8, 8), jnp.float32),
        "head": jax.ShapeDtypeStruct((8, 16), jnp.float32),
    }
    batch = jax.ShapeDtypeStruct((2, 3), jnp.int32)
    found = param_stages(_loss, params, batch, 4)
    # the embedding is used before the scan and (tied-style) after it: both ends
    assert found == {"emb": "both", "head": "last", "stack": "layers"}


@pytest.fixture(scope="module")
def tiny() -> tuple:
    info = describe(get_model("llama"), config="tiny_scan", batch_size=8)
    trace = trace_step(info, None)
    groups = param_groups(info, trace)
    found = param_stages(info.loss_fn, info.abstract_params, info.batch, trace.layers)
    return info, trace, groups, tuple(found[g.paths[0]] for g in groups)


def _cost(tiny: tuple, config: Pipeline, topology: Topology, **axes: int) -> sk.Cost:
    _, trace, groups, where = tiny
    mesh = sk.abstract_mesh(**axes)
    ctx = CostContext(mesh, axis_sizes(mesh), topology, trace, None, 1.0)
    sg = stage_groups(groups, where, config.stages)
    choice = [GroupLayout(((),) * len(g.shape), ((),) * len(g.shape)) for g in sg]
    return pipeline_cost(ctx, sg, choice, ("data",), (), StageSplit(config, where, trace.layers))


def test_every_stage_holds_its_layers_and_the_ends(tiny: tuple) -> None:
    _, trace, groups, where = tiny
    kinds = dict(zip((g.key for g in groups), where, strict=True))
    assert kinds["embed/embedding"] == "first" and kinds["lm_head"] == "last"
    c = _cost(tiny, Pipeline(2, 4, "1f1b"), Topology.h100(), pipe=2, data=4)
    # a stage's chunk weights (half the layers): the switch's accumulator copy
    chunk = sum(g.nbytes * g.count / 2 for g, w in zip(groups, where, strict=True) if w == "layers")
    acts = activation_bytes(
        trace, Pipeline(2, 4, "1f1b"), "none", (), 1 / 16, 1 / 16, chunk_weights=chunk
    )
    # params + grads + Adam's two moments (4x the bytes) of half the layers and of
    # the embedding, norm and head, which the plan replicates over the pipe axis
    held = sum(
        g.nbytes * g.count / (2 if w == "layers" else 1) for g, w in zip(groups, where, strict=True)
    )
    for d in range(2):
        assert c.stage_memory[d] - acts[d] == pytest.approx(4 * held + 8, abs=16)
    assert c.peak_bytes == max(c.stage_memory)
    # the ends' gradients are all-reduced over the pipe axis
    ends = sum(g.nbytes for g, w in zip(groups, where, strict=True) if w != "layers")
    plain = _cost(tiny, Pipeline(2, 4, "1f1b"), Topology.h100(), pipe=2, data=4)
    assert plain.comm_bytes["all_reduce"] >= ends


def test_bubble_and_sends_over_the_pipe_link(tiny: tuple) -> None:
    _, trace, groups, where = tiny
    pipe = Pipeline(4, 8, "1f1b")
    inside = _cost(tiny, pipe, Topology.h100(gpus_per_node=8), pipe=4, data=2)
    across = _cost(tiny, pipe, Topology.h100(gpus_per_node=2), pipe=4, data=2)
    # 1F1B over 4 stages, 8 micro-batches: compute stretched by (8 + 3) / 8
    stage = inside.compute_time_s - inside.bubble_s
    assert inside.bubble_s == pytest.approx(stage * 3 / 8)
    # a middle device sends 8 forwards and 8 backwards, each one micro-batch's
    # carry: 1 of 8 micro-batches of half the batch (data=2)
    sends = 2 * 8
    carry = trace.layer_carry / 2 / 8
    assert inside.comm_bytes["collective_permute"] == int(sends * carry)
    # the same bytes, over NVLink (inside a node) vs InfiniBand (across nodes): the
    # sends and the all-reduce of the embedding's and head's gradients over the pipe
    t = Topology.h100()
    p2p_in = sends * (t.node_latency + carry / t.node_bandwidth)
    p2p_ib = sends * (t.default_latency + carry / t.default_bandwidth)
    ends = sum(g.nbytes for g, w in zip(groups, where, strict=True) if w != "layers")
    wire = int(2 * ends * 3 / 4)
    mesh = sk.abstract_mesh(pipe=4, data=2)
    sync_in = Topology.h100(gpus_per_node=8).collective_time("all_reduce", wire, 4, ("pipe",), mesh)
    sync_ib = Topology.h100(gpus_per_node=2).collective_time("all_reduce", wire, 4, ("pipe",), mesh)
    expected = p2p_ib - p2p_in + sync_ib - sync_in
    assert across.step_time_s - inside.step_time_s == pytest.approx(expected, rel=1e-6)


def test_more_microbatches_shrink_bubble_and_activations(tiny: tuple) -> None:
    topo = Topology.h100()
    few = _cost(tiny, Pipeline(2, 2, "1f1b"), topo, pipe=2, data=4)
    many = _cost(tiny, Pipeline(2, 8, "1f1b"), topo, pipe=2, data=4)
    assert many.bubble_s < few.bubble_s
    assert many.memory["activations"] < few.memory["activations"]
    inter = _cost(tiny, Pipeline(2, 8, "interleaved", virtual=2), topo, pipe=2, data=4)
    for c, ticks in ((few, 2), (many, 8), (inter, 16)):  # v·m
        assert c.bubble_s / (c.compute_time_s - c.bubble_s) == pytest.approx(1 / ticks)
    assert inter.comm_bytes["collective_permute"] > many.comm_bytes["collective_permute"]


def test_cost_json_keeps_stage_memory(tiny: tuple) -> None:
    c = _cost(tiny, Pipeline(2, 4, "1f1b"), Topology.h100(), pipe=2, data=4)
    back = sk.Cost.from_json(c.to_json())
    assert back == c
    plain = dataclasses.replace(c, stage_memory=(), bubble_s=0.0)
    assert "stage_memory" not in plain.to_json()
