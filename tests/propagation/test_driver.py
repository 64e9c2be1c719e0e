"""propagate() end to end: train steps' collectives checked against compiled HLO,
specs and strategies checked, the cost table."""

import math

import jax
import jax.extend.core
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit.propagation import EqnRecord, Propagation, propagate
from tests.propagation.programs import (
    F32,
    PARAMS,
    S,
    X,
    Y,
    all_reduce_bytes,
    as_auto,
    compiled_report,
    mlp_forward,
    sgd_step,
    sharded,
)


def test_dp_train_step_grad_all_reduce_matches_hlo(mesh2d):
    dp = P(("a", "b"))
    prop = propagate(sgd_step, PARAMS, X, Y, in_specs=(None, dp, dp), mesh=mesh2d)
    assert isinstance(prop, Propagation)
    assert not prop.unknown
    grads = sum(math.prod(a.shape) * 4 for a in jax.tree.leaves(PARAMS))
    assert prop.comm_bytes_by_kind == {"all_reduce": grads}
    pspecs = (jax.tree.map(lambda _: P(), PARAMS), dp, dp)
    compiled = all_reduce_bytes(sgd_step, (PARAMS, X, Y), pspecs, mesh2d)
    assert abs(prop.comm_bytes - compiled) <= 0.10 * compiled
    # the outputs are reduced; the parameters stay replicated
    assert all(s.is_replicated for s in prop.out_specs)
    assert all(isinstance(r, EqnRecord) for r in prop.records)
    assert any(r.backward for r in prop.records)


def test_megatron_mlp_forward_has_one_activation_all_reduce(mesh2d):
    params = {"w1": PARAMS["w1"], "w2": PARAMS["w2"]}
    specs = ({"w1": P(None, "b"), "w2": P("b", None)}, P("a"))
    prop = propagate(mlp_forward, params, X, in_specs=specs, mesh=mesh2d)
    cols = prop.collectives()
    assert [c.kind for c in cols] == ["all_reduce"]
    assert cols[0].axes == ("b",)
    assert cols[0].payload_bytes == 32 * 32 * 4  # [64/2, 32] f32, the activation
    assert prop.out_specs[0] == sk.TensorSpec((64, 32), P("a"), dtype=F32)
    compiled = all_reduce_bytes(mlp_forward, (params, X), specs, mesh2d)
    assert compiled == prop.comm_bytes


def test_megatron_train_step_matches_hlo(mesh2d):
    specs = ({"w1": P(None, "b"), "b1": P("b"), "w2": P("b", None)}, P("a"), P("a"))
    prop = propagate(sgd_step, PARAMS, X, Y, in_specs=specs, mesh=mesh2d)
    fwd = [c for r in prop.records if not r.backward for c in r.collectives()]
    assert fwd, "the forward all-reduce of the row-parallel output"
    rep = compiled_report(sgd_step, sharded((PARAMS, X, Y), specs, as_auto(mesh2d)))
    assert abs(prop.comm_bytes - rep.comm_bytes) <= 0.10 * rep.comm_bytes


def test_out_specs_constraint_costs_a_reshard(mesh1d):
    x = S((64, 32), F32)
    prop = propagate(lambda x: x * 2.0, x, in_specs=(P("x"),), out_specs=P(), mesh=mesh1d)
    assert prop.out_specs[0].is_replicated
    assert prop.comm_bytes_by_kind == {"all_gather": 64 * 32 * 4}


def test_abstract_mesh_needs_no_devices():
    mesh = sk.abstract_mesh(data=64, model=8)
    params = {"w1": S((4096, 16384), "bfloat16"), "w2": S((16384, 4096), "bfloat16")}
    x = S((512, 4096), "bfloat16")
    prop = propagate(
        mlp_forward,
        params,
        x,
        in_specs=({"w1": P(None, "model"), "w2": P("model", None)}, P("data")),
        mesh=mesh,
    )
    assert prop.comm_bytes_by_kind == {"all_reduce": 512 // 64 * 4096 * 2}
    assert prop.flops == pytest.approx(2 * 2 * 8 * 4096 * 16384 / 8 + 8 * 16384 / 8)
    assert prop.step_time_s > prop.compute_time_s > 0
    assert "all_reduce" in str(prop)


def test_strategies_are_checked(mesh1d):
    x = S((8, 8), F32)
    with pytest.raises(sk.ShardingConflictError, match="strategy"):
        propagate(jnp.tanh, x, in_specs=(P("x"),), mesh=mesh1d, strategies={"tanh": "fast"})
    with pytest.raises(sk.NoRuleError):
        propagate(jnp.tanh, x, in_specs=(P("x"),), mesh=mesh1d, strategies={"tanhh": "x"})
    prop = propagate(jnp.tanh, x, in_specs=(P("x"),), mesh=mesh1d, strategies={"tanh": "default"})
    assert prop.records[0].strategy == "default"
    assert not prop.unknown


def test_bad_in_specs_raise(mesh1d):
    with pytest.raises(sk.SpecError):
        propagate(jnp.tanh, S((8, 8), F32), in_specs=(P("x"), P("x")), mesh=mesh1d)
    with pytest.raises(sk.SpmdError):
        propagate(jnp.tanh, S((8, 8), F32), in_specs=(P("nope"),), mesh=mesh1d)


def test_table_lists_costly_equations(mesh2d):
    dp = P(("a", "b"))
    prop = propagate(sgd_step, PARAMS, X, Y, in_specs=(None, dp, dp), mesh=mesh2d)
    text = prop.table(limit=2)
    assert len(text.splitlines()) == 3
    assert "all_reduce" in text


def test_the_report_waits_for_its_first_read(mesh2d, monkeypatch):
    """propagate() decides and pins every layout at once (what sk.jit's replay
    runs), but prices the records, their totals and the memory estimate on the
    first read of any of them, once; which is read first changes nothing."""
    from spmdkit.propagation.records import REPORTED, Recorder

    priced = []
    record = Recorder.record
    monkeypatch.setattr(
        Recorder, "record", lambda self, *a, **k: priced.append(1) or record(self, *a, **k)
    )
    specs = ({"w1": P(None, "b"), "b1": P("b"), "w2": P("b", None)}, P("a"), P("a"))
    prop = propagate(sgd_step, PARAMS, X, Y, in_specs=specs, mesh=mesh2d)
    assert prop.program is not None and prop.out_specs and priced == []
    memory = prop.memory
    n = len(priced)
    assert n >= len(prop.steps)
    assert prop.comm_bytes == sum(r.comm_bytes for r in prop.records) > 0
    assert len(priced) == n  # once for every field
    other = propagate(sgd_step, PARAMS, X, Y, in_specs=specs, mesh=mesh2d)
    assert other.records == prop.records and other.memory == memory
    assert {k: getattr(other, k) for k in REPORTED} == {k: getattr(prop, k) for k in REPORTED}
    assert prop.memory_as(cpu=True)[0].peak_bytes > 0


def test_a_free_value_is_made_as_its_reader_wants():
    """The user model of tests/cli under fsdp (its head split on ``vocab``): the
    loss's cotangent ``broadcast(ct)`` is made from a replicated operand, so it
    costs nothing in any layout. The head's gradient asks for it vocab-split
    (a backward hint); its reader, ``onehot * ct``, keeps the batch-split one-hot
    and wants it batch-split. The sweeps keep every reader's request for a free
    value across rounds, so the broadcast makes the reader's layout and nothing
    moves it (before, an all-gather and an all-to-all of f32[8,8,32] per device
    that XLA ran as a 4 KiB all-to-all)."""
    from tests.cli import mymodel

    p = sk.plan(mymodel.make_info(), sk.abstract_mesh(data=2, model=4), "fsdp")
    assert p.params["head/kernel"] == P(None, ("data", "model"))
    # what is left are the scan's bias gradients moving to their layouts (48 B)
    assert p.cost.comm_bytes.get("all_to_all", 0) < 1024, p.cost.comm_bytes


def test_routing_after_top_k_stays_split_over_the_batch():
    """GShard routing (the zoo's ``moe`` layer) in a recomputed layer scan, batch
    split over 64 devices: ``top_k`` gathers its operand, and what the routing
    builds from its results (the one-hots, the ``[batch, seq, expert, capacity]``
    dispatch and combine tensors) is a free slice away from the batch split the
    dispatch einsums read. The rounds of sweeps are compared with the bytes each
    device writes: computed replicated, those tensors are written whole on every
    device, 64 times the bytes, for a few fewer tiny all-reduces (the
    load-balancing statistics'); the round that keeps them split wins (before,
    the forward scan made them replicated: Mixtral 8x7B's needed 80 GiB more)."""
    from models.moe import capacity, route

    b, s, d, e = 256, 4096, 32, 8
    cap = capacity(s, n_experts=e, top_k=2, capacity_factor=1.25)

    def layer(x, w):
        router, wg = w
        r = route(jnp.einsum("bsd,de->bse", x, router), top_k=2, capacity=cap)
        xe = jnp.einsum("bsec,bsd->ebcd", r.dispatch.astype(x.dtype), x)
        ye = jnp.einsum("ebcd,edm->ebcm", xe, wg.astype(x.dtype))
        return x + jnp.einsum("bsec,ebcm->bsm", r.combine.astype(x.dtype), ye), r.aux_loss

    def loss(ws, x):
        y, aux = jax.lax.scan(jax.checkpoint(layer), x.astype(jnp.bfloat16), ws)
        return jnp.sum(y.astype(F32)) + aux.sum()

    ws = (S((2, d, e), F32), S((2, e, d, d), F32))
    spec = (P(None, None, "data"), P(None, None, "data"))
    prop = propagate(
        jax.grad(loss),
        ws,
        S((b, s, d), F32),
        in_specs=(spec, P("data")),
        mesh=sk.abstract_mesh(data=64),
    )

    def routing(records):
        for r in records:
            yield from (o for o in r.outputs if o.shape == (b, s, e, cap))
            yield from routing(r.body)

    made = list(routing(prop.records))
    assert len(made) >= 4  # dispatch and combine, forward and recomputed
    assert all(o.dims[0] == ("data",) for o in made), [str(o) for o in made]
