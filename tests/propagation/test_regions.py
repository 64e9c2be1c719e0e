"""propagation.regions: a composite op's region laid out whole by its rule, its
strategies priced (reshards plus the op's own collectives) and the cheapest chosen."""

import dataclasses
import functools
import re

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit.engine.region import region_call
from spmdkit.propagation import propagate
from spmdkit.versions import cse_merges_through_barriers

MESH = sk.abstract_mesh(a=2, b=4)
X = jax.ShapeDtypeStruct((8, 16), "float32")
W = jax.ShapeDtypeStruct((16,), "float32")


def _norm_grad(**attrs):
    def loss(x, w):
        return (region_call("rms_norm", (x, w), attrs) ** 2).sum()

    return jax.grad(loss, argnums=(0, 1))


def test_a_sharded_normalized_dim_picks_sharded_stats():
    prop = propagate(_norm_grad(), X, W, in_specs=(P("a", "b"), P()), mesh=MESH)
    assert prop.region_strategies() == {
        "rms_norm": {"sharded_stats": 1},
        "rms_norm:grad": {"sharded_stats": 1},
    }
    # forward: one row-statistic all-reduce (4 local rows); the grad region: the
    # recomputed forward's, the backward's, and the scale grad's sum over the rows
    kinds = [(c.kind, c.axes, c.payload_bytes) for c in prop.collectives()]
    assert sorted(kinds) == sorted(
        [("all_reduce", ("b",), 16)] * 3 + [("all_reduce", ("a",), 4 * 4)]
    )
    assert "ops (strategy): rms_norm sharded_stats, rms_norm:grad sharded_stats" in str(prop)


def test_batch_sharded_rows_keep_the_reference_strategy():
    prop = propagate(_norm_grad(), X, W, in_specs=(P("a"), P()), mesh=MESH)
    assert prop.region_strategies()["rms_norm"] == {"default": 1}
    # only the scale grad's sum over the batch axis moves: 16 floats
    assert [(c.kind, c.payload_bytes) for c in prop.collectives()] == [("all_reduce", 64)]


def test_a_fixed_strategy_is_kept_and_priced():
    for fixed in ({"strategy": "default"}, {}):
        kw = {"strategies": {"rms_norm": "default"}} if not fixed else {}
        prop = propagate(_norm_grad(**fixed), X, W, in_specs=(P("a", "b"), P()), mesh=MESH, **kw)
        assert prop.region_strategies()["rms_norm"] == {"default": 1}
        # the normalized dim is gathered: the activations move, 4 rows × 16 floats
        assert prop.comm_bytes_by_kind["all_gather"] >= 4 * 16 * 4


def test_a_partial_operand_is_resolved_before_the_region():
    def f(x, w):
        return region_call("rms_norm", (x @ w.T, w[0, :8]), {})

    w = jax.ShapeDtypeStruct((8, 16), "float32")
    prop = propagate(f, X, w, in_specs=(P(None, "b"), P(None, "b")), mesh=MESH)
    (rec,) = [r for r in prop.records if r.primitive == "spmdkit_op"]
    assert not any(s.partial for s in rec.inputs) and not rec.outputs[0].partial
    assert [c.kind for c in rec.collectives()] == ["all_reduce"]  # the product, once


def _ce_grad(**attrs):
    def loss(z, y):
        return region_call("softmax_cross_entropy", (z, y), {"ignore_index": None, **attrs})

    return jax.value_and_grad(loss)  # the loss keeps the forward region


Z = jax.ShapeDtypeStruct((8, 16, 64), "float32")
Y = jax.ShapeDtypeStruct((8, 16), "int32")


def test_vocab_sharded_logits_are_named_vocab_parallel():
    """The reference strategy keeps hard labels' class dim sharded, computing what
    vocab_parallel does: the plan names it vocab_parallel; the sequence-sharded
    labels move (an all-gather of ids), not the logits."""
    prop = propagate(_ce_grad(), Z, Y, in_specs=(P("a", None, "b"), P("a", "b")), mesh=MESH)
    assert prop.region_strategies() == {
        "softmax_cross_entropy": {"vocab_parallel": 1},
        "softmax_cross_entropy:grad": {"vocab_parallel": 1},
    }
    kinds = {c.kind for c in prop.collectives() if c.payload_bytes > 8}
    assert kinds == {"all_gather", "all_reduce"}  # the labels, the per-row statistics
    logits_block = 4 * 16 * 16 * 4
    assert max(c.payload_bytes for c in prop.collectives()) < logits_block / 4  # none moved


def test_rows_sharded_logits_keep_the_name_default():
    prop = propagate(_ce_grad(), Z, Y, in_specs=(P("a"), P("a")), mesh=MESH)
    assert prop.region_strategies()["softmax_cross_entropy"] == {"default": 1}


def test_attention_gather_kv_regions_predict_the_compiled_collectives():
    """gather_kv: the grad region's program gathers K and V (its recomputed
    forward, behind an optimization barrier) and reduce-scatters dK, dV. XLA:CPU
    up to jaxlib 0.10 computes those gathers once with the forward region's (the
    same collective on the same values), later ones run them again; the
    prediction follows (all-gathers of K and V twice or once, reduce-scatters of
    dK and dV), as compiled."""
    from jax.sharding import NamedSharding

    from spmdkit.compile.enforce import enforced
    from spmdkit.verification.compiled import report

    q = jax.ShapeDtypeStruct((2, 16, 4, 8), "float32")

    def loss(q, k, v):
        out = region_call("attention", (q, k, v), {"causal": True, "strategy": "gather_kv"})
        return (out**2).sum()

    mesh = sk.make_mesh(a=2, b=4, axis_types="auto")
    specs = (P(None, "b"),) * 3
    with jax.set_mesh(mesh):
        prop = propagate(jax.grad(loss, argnums=(0, 1, 2)), q, q, q, in_specs=specs, mesh=mesh)
        shardings = tuple(NamedSharding(mesh, s) for s in specs)
        compiled = jax.jit(enforced(prop), in_shardings=shardings).lower(q, q, q).compile()
    assert prop.comm_bytes_by_kind == report(compiled).bytes_by_kind()
    gathers = 2 if cse_merges_through_barriers("cpu") else 4
    assert (
        sorted(c.kind for c in prop.collectives())
        == ["all_gather"] * gathers + ["reduce_scatter"] * 2
    )


@pytest.mark.parametrize(
    "model",
    [
        "gpt",
        pytest.param("llama", marks=pytest.mark.slow),
        pytest.param("gpt_linen", marks=pytest.mark.slow),
    ],
)
def test_reference_megatron_plans_choose_vocab_parallel_cross_entropy(model):
    """The reference models compute their loss with spmdkit.nn (spmdkit.ops): under
    the megatron preset the logits arrive vocab-sharded and the loss region keeps
    them so; the plan's cost (the propagate estimator) and its table name the
    strategy chosen per composite op."""
    from spmdkit.introspect import describe
    from spmdkit.models import get_model
    from spmdkit.planner import plan

    spec = get_model(model)
    cfg = spec.config("tiny")
    batch = spec.batch(cfg, 8, np.random.default_rng(0))
    info = describe(spec, config=cfg, batch=batch)
    p = plan(info, sk.make_mesh(data=2, model=4), "megatron")  # estimator="propagate"
    chosen = p.cost.ops
    assert chosen["softmax_cross_entropy"] == {"vocab_parallel": 1}
    assert chosen["softmax_cross_entropy:grad"] == {"vocab_parallel": 1}
    rows = p.table().split("ops (strategy chosen per composite op; regions in the step):\n")[1]
    assert re.search(r"^  softmax_cross_entropy +vocab_parallel +1 +1$", rows, re.M), rows
    assert sk.Plan.from_json(p.to_json()).cost.ops == chosen


def test_a_strategy_that_loses_on_its_reshards_is_not_traced(monkeypatch):
    """A grad region's own collectives are read off its traced program, but a
    strategy whose operand reshards alone cost more than the best found is never
    traced (its collectives only add): with the normalized dim sharded, the
    reference strategy's gather of it loses to sharded_stats untraced."""
    from spmdkit.propagation import regions

    asked = []
    program = regions.region_program
    sk.clear_caches()  # answers an earlier test memoized: asked anew
    monkeypatch.setattr(
        regions,
        "region_program",
        lambda prim, params, attrs, *a: (
            asked.append((prim, attrs["strategy"])) or program(prim, params, attrs, *a)
        ),
    )
    prop = propagate(_norm_grad(), X, W, in_specs=(P("a", "b"), P()), mesh=MESH)
    assert asked and set(asked) == {("spmdkit_op_grad", "sharded_stats")}
    assert prop.region_strategies()["rms_norm:grad"] == {"sharded_stats": 1}


def test_the_cheapest_candidate_is_the_one_pricing_them_all_picks():
    """cheapest_candidate asks a candidate for its own collectives only while its reshards
    alone do not exceed the best cost so far, and picks what pricing every
    candidate whole would: least (bytes, time), the first of equal costs."""
    from typing import NamedTuple

    from spmdkit.propagation.regions import CandidateLayout, cheapest_candidate

    class Own(NamedTuple):
        payload_bytes: int
        time_s: float

    rng = np.random.default_rng(0)
    for _ in range(300):
        n = int(rng.integers(1, 7))
        asked: list[int] = []
        found, costs = [], []
        for i in range(n):
            own = tuple(
                Own(8 * int(rng.integers(0, 3)), float(rng.integers(0, 3)) * 1e-6)
                for _ in range(int(rng.integers(0, 3)))
            )
            moves = (8 * int(rng.integers(0, 4)), float(rng.integers(0, 3)) * 1e-6)
            ask = functools.partial(lambda log, i, own: log.append(i) or own, asked, i, own)
            found.append((moves, CandidateLayout({"strategy": i}, (), (), ask), ()))
            costs.append(
                (
                    moves[0] + sum(c.payload_bytes for c in own),
                    moves[1] + sum(c.time_s for c in own),
                )
            )
        best = min(range(n), key=lambda i: (costs[i], i))
        ans, _ = cheapest_candidate(found)
        assert ans.attrs["strategy"] == best
        assert best in asked and len(set(asked)) == len(asked)
        assert all((found[i][0], i) <= (costs[best], best) for i in asked)


def test_region_memory_is_measured_only_when_asked(monkeypatch):
    """Pricing a region's strategies traces its program for the collectives; its
    memory (temporaries, what it holds from the forward pass) is measured when a
    memory estimate asks, not before."""
    from spmdkit.propagation import regions

    measured = []
    temp = regions.program_temp_bytes
    monkeypatch.setattr(
        regions, "program_temp_bytes", lambda *a, **k: measured.append(1) or temp(*a, **k)
    )
    x = jax.ShapeDtypeStruct((8, 24), "float32")  # a layout no other test traces
    w = jax.ShapeDtypeStruct((24,), "float32")
    prop = propagate(_norm_grad(), x, w, in_specs=(P("a", "b"), P()), mesh=MESH)
    assert prop.program is not None and measured == []
    assert prop.memory_materialized.temp_bytes > 0 and measured


def test_a_region_answer_is_memoized_and_each_caller_owns_its_attrs(monkeypatch):
    """region_answer prices a region's strategies once per (mesh, topology, region,
    operand layouts, flags): a second propagation of the same step traces no grad
    region again and gets the same answer; another mesh is asked anew; each
    caller's answer has attributes of its own."""
    from spmdkit.engine.region import FORWARD
    from spmdkit.propagation import regions
    from spmdkit.propagation.pricing import Pricer
    from spmdkit.spec import TensorSpec

    sk.clear_caches()
    asked = []
    program = regions.region_program
    monkeypatch.setattr(
        regions,
        "region_program",
        lambda prim, *a: asked.append(prim) or program(prim, *a),
    )
    first = propagate(_norm_grad(), X, W, in_specs=(P("a", "b"), P()), mesh=MESH)
    n = len(asked)
    assert n
    again = propagate(_norm_grad(), X, W, in_specs=(P("a", "b"), P()), mesh=MESH)
    assert len(asked) == n
    assert again.region_strategies() == first.region_strategies()
    moved = [(c.kind, c.axes, c.payload_bytes) for c in first.collectives()]
    assert [(c.kind, c.axes, c.payload_bytes) for c in again.collectives()] == moved
    other = sk.abstract_mesh(a=2, b=2)
    propagate(_norm_grad(), X, W, in_specs=(P("a", "b"), P()), mesh=other)
    assert len(asked) > n

    # asked directly: equal answers, attributes not shared
    def regions_in(jaxpr):
        for e in jaxpr.eqns:
            if e.primitive.name == FORWARD:
                yield e
            for v in e.params.values():
                inner = getattr(v, "jaxpr", v)
                if hasattr(inner, "eqns"):
                    yield from regions_in(inner)

    closed = jax.make_jaxpr(lambda x, w: region_call("rms_norm", (x, w), {}))(X, W)
    eqn = next(regions_in(closed.jaxpr))
    specs = (TensorSpec(X.shape, P("a", "b"), dtype=X.dtype), TensorSpec(W.shape, dtype=W.dtype))
    pricer = Pricer(MESH, sk.Topology.h100())
    one = regions.region_answer(FORWARD, eqn.params, specs, pricer)
    two = regions.region_answer(FORWARD, eqn.params, specs, pricer)
    assert one is not None and one == two and one.attrs is not two.attrs
    one.attrs["strategy"] = "changed"
    assert regions.region_answer(FORWARD, eqn.params, specs, pricer) == two


def _experts(t=128, d=16, f=8, e=8, k=2):
    """Routed experts' loss (the squared output) and its arguments' shapes: tokens,
    model and hidden widths, experts, top-k."""

    def loss(x, idx, gate, wg, wu, wd):
        return (sk.ops.moe_experts(x, idx, gate, wg, wu, wd) ** 2).sum()

    args = (
        jax.ShapeDtypeStruct((t, d), "float32"),
        jax.ShapeDtypeStruct((t, k), "int32"),
        jax.ShapeDtypeStruct((t, k), "float32"),
        jax.ShapeDtypeStruct((e, d, f), "float32"),
        jax.ShapeDtypeStruct((e, d, f), "float32"),
        jax.ShapeDtypeStruct((e, f, d), "float32"),
    )
    return loss, args


@pytest.mark.parametrize(
    ("platform", "grad"), [("gpu", False), ("gpu", True), ("cpu", False)], ids=str
)
def test_expert_parallel_is_priced_by_the_rows_its_link_carries(platform, grad):
    """Routed experts over 8 devices (one expert each, top-2, 16 tokens a device).
    The exchange buffer is padded for the worst case, 8 rows per token where 2
    are routed. Where the backend sends only the routed rows (a ragged all-to-all:
    GPU), the exchange costs less than gathering the experts' weights and the
    op keeps expert parallelism, forward and grad, its all-to-alls' payload the
    padded buffer (what the HLO shows) and their wire the routed rows; on
    XLA:CPU, which sends the whole buffer, gathering the weights moves fewer
    bytes and wins."""
    loss, args = _experts()
    step = jax.grad(loss, argnums=(0, 3, 4, 5)) if grad else loss
    topology = dataclasses.replace(sk.Topology.h100(), platform=platform)
    ep = P("expert")
    prop = propagate(
        step,
        *args,
        in_specs=(ep, ep, ep, ep, ep, ep),
        mesh=sk.abstract_mesh(expert=8),
        topology=topology,
        arg_roles=("batch", "batch", "batch", "params", "params", "params"),
    )
    gathered = prop.comm_bytes_by_kind.get("all_gather", 0)
    exchanges = [c for c in prop.collectives() if c.routed_bytes is not None]
    if platform == "cpu":
        assert gathered == 3 * 8 * 16 * 8 * 4  # the three weights, whole
        assert not exchanges
        return
    assert gathered == 0
    # forward: the tokens out and back; grad: their transposes too
    assert len(exchanges) == (4 if grad else 2)
    padded, routed = 8 * 16 * 1 * 16 * 4, 16 * 2 * 16 * 4
    for c in exchanges:
        assert (c.payload_bytes, c.routed_bytes, c.wire_bytes) == (padded, routed, routed * 7 // 8)
