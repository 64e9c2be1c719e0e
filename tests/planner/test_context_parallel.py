"""Context parallelism in the planner: the meshes auto tries, the K/V exchange's
price, the plan's ``context`` field, and auto choosing it for long sequences."""

import dataclasses
import json

import jax
import numpy as np
import pytest

import spmdkit as sk
from spmdkit.context_parallel import BalancedOrder
from spmdkit.introspect import describe
from spmdkit.models import get_model
from spmdkit.planner import PlanError
from spmdkit.planner.context_parallel import (
    CONTEXT_AXIS,
    LONG_SEQUENCE,
    PIPELINED_STRATEGIES,
    causal_shares,
    context_attention,
    context_meshes,
    split_context,
)
from spmdkit.planner.notes import PlanNoteError
from spmdkit.planner.plans import ContextParallel, Plan

GIB = 2**30


def test_split_context_keeps_device_order():
    mesh = sk.make_mesh(data=8)
    split = split_context(mesh, 4)
    assert dict(zip(split.axis_names, split.devices.shape, strict=True)) == {
        "data": 2,
        "context": 4,
    }
    # the context axis is minor: neighbouring devices hold one sequence's chunks
    assert [d.id for d in split.devices[0]] == [d.id for d in mesh.devices[:4]]
    abstract = split_context(sk.abstract_mesh(data=8, model=2), 2)
    assert abstract.axis_names == ("data", "context", "model")
    assert tuple(abstract.axis_sizes) == (4, 2, 2)


def test_split_context_refuses_what_does_not_divide():
    with pytest.raises(PlanError, match="divides"):
        split_context(sk.abstract_mesh(data=6), 4)
    with pytest.raises(PlanError, match="context"):
        split_context(sk.abstract_mesh(data=4, context=2), 2)


def test_context_meshes_only_for_long_or_few_sequences():
    mesh = sk.abstract_mesh(data=8)
    # short sequences that fill the data axis: no context parallelism tried
    assert context_meshes(mesh, batch_size=64, seq_len=8192) == []
    # fewer sequences than devices: every degree whose 2n chunks divide the sequence
    few = context_meshes(mesh, batch_size=2, seq_len=8192)
    assert [tuple(m.axis_sizes) for m in few] == [(4, 2), (2, 4), (1, 8)]
    # long sequences, even with a full batch
    assert len(context_meshes(mesh, batch_size=64, seq_len=LONG_SEQUENCE)) == 3
    # a sequence that 2n chunks do not divide is never split n ways
    assert [tuple(m.axis_sizes) for m in context_meshes(mesh, 2, 12)] == [(4, 2)]
    # the user's context axis is used as it is
    user = sk.abstract_mesh(data=2, context=4)
    assert context_meshes(user, batch_size=64, seq_len=1024) == [user]
    assert context_meshes(sk.abstract_mesh(data=8), batch_size=2, seq_len=1) == []


def test_context_attention_ring_hides_under_long_attention():
    topo = sk.Topology.h100()
    mesh = sk.abstract_mesh(data=2, context=4)
    kv, layers = 32 * 2**30, 32
    ring = context_attention(topo, mesh, ("context",), kv, layers, 10.0, rerun=False, keep_all=True)
    assert ring.strategy == "ring"
    # 3 (n - 1) blocks of a layer's K/V / n per layer: forward, backward K/V, their grads
    assert ring.payload["collective_permute"] == pytest.approx(3 * 3 * kv / 4)
    assert ring.hidden_s == pytest.approx(ring.comm_s)
    rerun = context_attention(
        topo, mesh, ("context",), kv, layers, 10.0, rerun=True, keep_all=False
    )
    assert rerun.payload["collective_permute"] == pytest.approx(4 * 3 * kv / 4)
    # a pipelined stage runs only what PIPELINED_STRATEGIES lists: priced so
    staged = context_attention(topo, mesh, ("context",), kv, layers, 10.0, rerun=False,
                               keep_all=True, strategies=PIPELINED_STRATEGIES)  # fmt: skip
    assert PIPELINED_STRATEGIES == ("gather_kv",) and staged.strategy == "gather_kv"


def test_context_attention_gathers_when_attention_is_short():
    # little attention compute to hide the ring under: the all-gather (fewer
    # bytes, fewer latencies) wins, and it holds the gathered K/V
    topo = sk.Topology.h100()
    mesh = sk.abstract_mesh(context=8)
    kv, layers = 2**30, 32
    out = context_attention(topo, mesh, ("context",), kv, layers, 0.0, rerun=False, keep_all=True)
    assert out.strategy == "gather_kv"
    assert out.payload == {"all_gather": kv, "reduce_scatter": kv}
    assert out.memory == pytest.approx(kv * 7 / 8)
    one = context_attention(topo, mesh, ("context",), kv, layers, 0.0, rerun=False, keep_all=False)
    assert one.memory == pytest.approx(kv / layers)
    none = context_attention(topo, sk.abstract_mesh(data=8), (), kv, layers, 1.0, rerun=False,
                             keep_all=False)  # fmt: skip
    assert none.comm_s == 0.0 and not none.payload


def test_a_tensor_parallel_stage_gathers_its_kv_heads_around_the_exchange():
    # a pipelined stage's K/V, heads split over the automatic model axis, are
    # gathered whole over it first (a device's tokens per forward, every token's
    # gradients in the backward): the exchange moves and holds all the heads
    topo = sk.Topology.h100()
    mesh = sk.abstract_mesh(context=2, model=4)
    kv, layers = 2**30, 8  # the device's share: heads split 4 ways
    flat = context_attention(topo, mesh, ("context",), kv, layers, 0.0, rerun=False,
                             keep_all=False, strategies=PIPELINED_STRATEGIES)  # fmt: skip
    tp = context_attention(topo, mesh, ("context",), kv, layers, 0.0, rerun=False,
                           keep_all=False, strategies=PIPELINED_STRATEGIES,
                           head_axes=("model",))  # fmt: skip
    assert tp.payload["reduce_scatter"] == pytest.approx(4 * kv)
    assert tp.payload["all_gather"] == pytest.approx(4 * kv * (1 + 1 / 2 + 1))
    assert tp.memory == pytest.approx(4 * flat.memory) and tp.comm_s > 4 * flat.comm_s


BF16 = sk.Recipe(compute_dtype="bfloat16")


@pytest.fixture(scope="module")
def small_long():
    """Llama "small" (4 layers) with 2 sequences of 4,096 tokens, described once."""
    spec = get_model("llama")
    cfg = dataclasses.replace(spec.configs["small"](), seq_len=4096)
    return describe(spec, config=cfg, batch_size=2)


def test_auto_splits_the_sequence_when_sequences_are_fewer_than_devices(small_long):
    p = sk.plan(small_long, sk.abstract_mesh(data=8), "auto", estimator="analytic",
                memory_budget=0.25 * GIB, recipe=BF16)  # fmt: skip
    assert p.context == ContextParallel((CONTEXT_AXIS,), p.context.degree, p.context.attention)
    assert p.context.degree >= 2 and p.context.attention in ("ring", "gather_kv")
    assert p.activation["seq"] == (CONTEXT_AXIS,)
    sizes = dict(zip(p.mesh.axis_names, p.mesh.axis_sizes, strict=True))
    assert sizes[CONTEXT_AXIS] == p.context.degree and np.prod(list(sizes.values())) == 8
    assert p.cost.peak_bytes <= 0.25 * GIB
    assert f"context parallel: context: {p.context.degree} ({p.context.attention}, " in str(p)
    (split,) = [n for n in p.notes if n.kind == "mesh_split"]
    assert f"data=8 into data={8 // p.context.degree} × context={p.context.degree}" in split.message
    assert "plan.mesh" in split.message and "sk.make_mesh(" in split.fix
    with pytest.raises(PlanNoteError, match="mesh_split"):
        sk.plan(small_long, sk.abstract_mesh(data=8), "auto", estimator="analytic",
                memory_budget=0.25 * GIB, recipe=BF16, strict=True)  # fmt: skip
    back = Plan.from_json(p.to_json())
    assert back.context == p.context and back == p


def test_auto_uses_the_users_context_axis(small_long):
    mesh = sk.abstract_mesh(data=2, context=4)
    p = sk.plan(small_long, mesh, "auto", estimator="analytic", memory_budget=0.07 * GIB,
                recipe=BF16)  # fmt: skip
    assert p.mesh is mesh
    assert not [n for n in p.notes if n.kind == "mesh_split"]  # the mesh as given
    assert p.context is not None and p.context.axes == (CONTEXT_AXIS,) and p.context.degree == 4
    assert p.activation["batch"] == ("data",) and p.activation["seq"] == (CONTEXT_AXIS,)


def test_a_preset_leaving_the_context_axis_idle_says_auto_uses_it(small_long):
    p = sk.plan(small_long, sk.abstract_mesh(data=2, context=4), "dp", estimator="analytic")
    (note,) = [n for n in p.notes if n.kind == "idle_axis"]
    assert "'context'" in note.message and "strategy='auto'" in note.fix
    assert p.context is None


def test_a_rule_table_with_seq_on_the_context_axis_is_context_parallel(small_long):
    # batch 2 does not divide data=4: the batch does not take the context axis
    # the sequence's rule asks for (it would leave the sequence whole)
    mesh = sk.abstract_mesh(data=4, context=2)
    p = sk.plan(small_long, mesh, "dp", rules={"seq": "context"}, estimator="analytic")
    assert p.activation["seq"] == (CONTEXT_AXIS,) and p.activation["batch"] == ()
    assert p.context == ContextParallel((CONTEXT_AXIS,), 2, p.context.attention)
    # a sequence over a tensor axis (Megatron-SP) is not context parallelism
    sp = sk.plan(small_long, sk.abstract_mesh(data=2, model=4), "megatron_sp",
                 estimator="analytic")  # fmt: skip
    assert sp.activation["seq"] == ("model",) and sp.context is None


def _block_work(shard_of_block, n):
    """Each shard's count of the (query block, key block) pairs a causal kernel
    computes (key block <= query block), from each block's shard."""
    work = [0] * n
    for q, shard in enumerate(shard_of_block):
        work[shard] += q + 1
    return work


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("blocks", [1, 2, 3, 16])
def test_causal_shares_count_the_blocks_each_shard_computes(n, blocks):
    total_blocks = n * blocks
    pairs = total_blocks * (total_blocks + 1) // 2
    contiguous = _block_work([q // blocks for q in range(total_blocks)], n)
    got = causal_shares(n, balanced=False, blocks=blocks)
    np.testing.assert_allclose(got, [w / pairs for w in contiguous], rtol=1e-12)
    if blocks % 2 == 0:  # the balanced order: 2n chunks of blocks/2, shard i has i and 2n-1-i
        order = BalancedOrder(n).permutation(total_blocks)  # block at each position
        shard = {int(b): pos // blocks for pos, b in enumerate(order)}
        balanced = _block_work([shard[q] for q in range(total_blocks)], n)
        np.testing.assert_allclose(causal_shares(n), [w / pairs for w in balanced], rtol=1e-12)
    # fine blocks: the last contiguous shard does (2n - 1) / n² of the work
    limit = causal_shares(n, balanced=False)
    assert limit[-1] == pytest.approx((2 * n - 1) / n**2) and sum(limit) == pytest.approx(1.0)
    assert 1 / n < got[-1] < limit[-1]  # whole diagonal blocks add work to every shard


def test_causal_shares_refuses_bad_degrees():
    with pytest.raises(PlanError, match="positive ints"):
        causal_shares(0)
    with pytest.raises(PlanError, match="positive ints"):
        causal_shares(4, balanced=False, blocks=0)


def test_a_plan_cannot_hold_contiguous_context_shards(small_long):
    """Nothing plans contiguous shards (a rule table's context is load-balanced),
    and a plan edited to hold them is refused: its cost priced the balanced order,
    and the last contiguous shard does (2n - 1)/n² of the causal work."""
    p = sk.plan(small_long, sk.abstract_mesh(data=4, context=2), "dp", rules={"seq": "context"},
                estimator="analytic")  # fmt: skip
    assert p.context.load_balanced
    with pytest.raises(PlanError, match=r"last holds 75\.0% of the causal work, 1\.50x"):
        dataclasses.replace(p.context, load_balanced=False)
    data = json.loads(p.to_json())
    data["context"]["load_balanced"] = False
    with pytest.raises(PlanError, match="load_balanced=True"):
        Plan.from_json(json.dumps(data))
    assert ContextParallel((CONTEXT_AXIS,), 1, "ring", load_balanced=False).degree == 1


def test_auto_keeps_short_sequences_with_plenty_of_batch_data_parallel():
    spec = get_model("llama")
    p = sk.plan(spec, sk.abstract_mesh(data=8), "auto", config="small", batch_size=64,
                estimator="analytic", recipe=BF16)  # fmt: skip
    assert p.context is None
    assert CONTEXT_AXIS not in p.mesh.axis_names
    assert not p.activation.get("seq")


@pytest.mark.slow
@pytest.mark.parametrize("seq,batch", [(65536, 4), (65536, 2), (131072, 4), (131072, 2)])
def test_llama3_8b_long_sequences_fit_with_context_parallelism(seq, batch):
    """Issue 34's acceptance: Llama-3 8B at 64K and 128K tokens on 8 devices with
    4 and 2 sequences fits 80 GiB by splitting the sequences (analytic estimator;
    the propagate estimator's figures, which agree, are in benchmarks/planner.py)."""
    spec = get_model("llama")
    cfg = dataclasses.replace(spec.configs["8b"](), seq_len=seq)
    p = sk.plan(spec, sk.abstract_mesh(data=8), "auto", config=cfg, batch_size=batch,
                estimator="analytic")  # fmt: skip
    assert p.cost.peak_bytes <= 80 * GIB
    assert p.context is not None and p.context.degree >= 2
    text = str(p)
    assert "activations: " in text and "seq→context" in text
    assert f"context parallel: context: {p.context.degree} ({p.context.attention}" in text
    assert p.cost.ops["attention"].get(p.context.attention)


@pytest.mark.slow
def test_autos_context_parallel_plan_runs_on_8_devices_and_verifies():
    """auto on ``make_mesh(data=8)`` with 2 sequences splits the devices' mesh into
    ``data × context`` (a real ``Mesh``, the devices in order); the planned step
    (propagate estimator: the attention strategy propagation chose) equals the
    one-device step and ``plan.verify`` agrees with the compiled HLO."""
    from models.llama import LlamaConfig

    cfg = LlamaConfig(seq_len=1024, n_layers=1)  # GQA: 4 query heads, 2 kv heads
    info = describe(get_model("llama"), config=cfg, batch_size=2)
    seq = np.random.default_rng(0).integers(0, cfg.vocab, (2, 1025)).astype(np.int32)
    batch = {"tokens": seq[:, :-1], "targets": seq[:, 1:]}
    params = info.init_fn()
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(info.loss_fn))(params, batch)
    plan = sk.plan(info, sk.make_mesh(data=8), "auto", memory_budget=6 * 2**20,
                   recipe=sk.Recipe())  # fmt: skip
    assert isinstance(plan.mesh, jax.sharding.Mesh) and CONTEXT_AXIS in plan.mesh.axis_names
    assert plan.context is not None and plan.activation["seq"] == (CONTEXT_AXIS,)
    assert plan.cost.ops["attention"].get(plan.context.attention)
    step = sk.jit(sk.value_and_grad(info.train_loss, plan), plan)
    placed = jax.device_put(params, plan.param_shardings(info.abstract_params))
    loss, grads = step(placed, batch)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=2e-6)
    report = plan.verify(step, placed, batch)
    assert report.ok, str(report)


def test_plan_without_context_round_trips():
    p = Plan.from_json(
        Plan(mesh=sk.abstract_mesh(data=2), params={}, opt={}, activation={}).to_json()
    )
    assert p.context is None
    assert jax.tree.leaves(p.activation) == []
