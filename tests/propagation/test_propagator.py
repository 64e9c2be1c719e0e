"""The propagator's handling of shard_map, sharding constraints and optimization barriers."""

import jax
import jax.extend.core
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from spmdkit.propagation import propagate
from tests.propagation.programs import (
    F32,
    S,
    as_auto,
    compiled_report,
)


def test_shard_map_specs_and_body_collectives_match_hlo(mesh1d):
    mesh = as_auto(mesh1d)

    def f(x):
        body = lambda b: jax.lax.psum(jnp.tanh(b), "x")  # noqa: E731
        return jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P())(x)

    prop = propagate(f, S((16, 32), F32), in_specs=(P(None, "x"),), mesh=mesh)
    # the operand moves to the shard_map's in_specs, then the body's psum
    assert prop.comm_bytes_by_kind == {"all_reduce": 4 * 32 * 4, "all_to_all": 4 * 32 * 4}
    rep = compiled_report(f, (S((16, 32), F32, sharding=NamedSharding(mesh, P(None, "x"))),))
    assert rep.bytes_by_kind() == prop.comm_bytes_by_kind


def test_a_partially_manual_shard_map_leaves_the_automatic_axes_alone(mesh2d):
    """``axis_names={"a"}``: the in/out specs speak for ``a`` only; the operand keeps
    its ``b`` layout (no gather at the boundary), the result shaped like it too."""
    mesh = as_auto(mesh2d)

    def f(x):
        body = lambda blk: jnp.tanh(blk) * 2.0  # noqa: E731
        sm = jax.shard_map(body, mesh=mesh, in_specs=P("a"), out_specs=P("a"), axis_names={"a"})
        return sm(x)

    prop = propagate(f, S((8, 16), F32), in_specs=(P("a", "b"),), mesh=mesh)
    assert prop.comm_bytes == 0
    assert prop.out_specs[0].dims == (("a",), ("b",))


def test_sharding_constraints_and_reshards_set_layouts(mesh1d):
    auto = as_auto(mesh1d)
    x = S((16, 8), F32)
    explicit = propagate(
        lambda x: jax.sharding.reshard(x, NamedSharding(mesh1d, P("x"))) * 2.0,
        x, in_specs=(None,), mesh=mesh1d,
    )  # fmt: skip
    constrained = propagate(
        lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(auto, P(None, "x"))) * 2.0,
        x, in_specs=(P("x"),), mesh=auto,
    )  # fmt: skip
    assert explicit.out_specs[0].dims == (("x",), ())
    assert explicit.comm_bytes == 0  # replicated -> sharded is a local slice
    assert constrained.out_specs[0].dims == ((), ("x",))
    assert constrained.comm_bytes_by_kind == {"all_to_all": 16 * 8 * 4 // 4}


def test_optimization_barrier_keeps_layouts(mesh1d):
    def f(x, y):
        a, b = jax.lax.optimization_barrier((x, y))
        return a + 1.0, b * 2.0

    prop = propagate(f, S((16, 8), F32), S((8,), F32), in_specs=(P("x"), None), mesh=mesh1d)
    assert not prop.unknown
    assert prop.out_specs[0].dims == (("x",), ())
    assert prop.comm_bytes == 0


def _qkv_input_grad():
    """The input gradient of three column-parallel projections of one bf16 input (a
    layer's q, k and v): three partial sums over the weights' axis, added."""
    bf16 = jnp.bfloat16

    def loss(x, wq, wk, wv):
        h = x.astype(bf16)
        q, k, v = (h @ w.astype(bf16) for w in (wq, wk, wv))
        return jnp.sum((jnp.tanh(q) * k + v).astype(jnp.float32))

    w = S((64, 128), F32)
    return jax.grad(loss), (S((16, 64), F32), w, w, w), (P("data"), *(P(None, "model"),) * 3)


def test_partial_sums_meeting_at_an_add_reduce_as_the_target_does():
    """XLA:GPU sums the q, k, v input gradients before one all-reduce
    (``AllReduceReassociate``); XLA:CPU reduces each (one tuple all-reduce of three
    operands): on an abstract mesh the topology's platform decides, on devices the
    devices'. Each reduces in bf16, at its dot, before the cast to the f32 input."""
    from dataclasses import replace

    import spmdkit as sk
    from spmdkit.verification.planned import promoted_on_cpu

    step, args, specs = _qkv_input_grad()
    local = 8 * 64 * 2  # the input's gradient on one device, bf16
    gpu = sk.Topology.h100()
    cpu = replace(gpu, platform="cpu")
    abstract = sk.abstract_mesh(data=2, model=4)
    for topology, n in ((gpu, 1), (cpu, 3)):
        prop = propagate(step, *args, in_specs=specs, out_specs=P("data"), mesh=abstract,
                         topology=topology)  # fmt: skip
        assert prop.comm_bytes_by_kind == {"all_reduce": n * local}, topology.platform
    mesh = as_auto(sk.make_mesh(data=2, model=4))
    prop = propagate(step, *args, in_specs=specs, out_specs=P("data"), mesh=mesh, topology=gpu)
    assert prop.comm_bytes_by_kind == {"all_reduce": 3 * local}  # CPU devices: CPU's passes
    placed = [
        S(a.shape, a.dtype, sharding=NamedSharding(mesh, s))
        for a, s in zip(args, specs, strict=True)
    ]
    rep = compiled_report(step, placed)
    assert rep.bytes_by_kind() == promoted_on_cpu(prop).comm_bytes_by_kind  # moved in f32


def test_a_grad_region_is_laid_out_as_its_forward_region_kept_its_residuals():
    """Routed experts keep their exchange's residuals for the grad region, which
    reads them on the layout they were kept under. Each pass picking its cheapest
    strategy alone, auto on tiny Qwen3-MoE over data=4 x model=2 gave the forward
    region ``local`` (it keeps none) and the grad region ``all_to_all`` (it reads
    them), a pair sk.jit refused when tracing the plan's step. The grad region is
    now laid out as its forward region was, so the step traces and every pair
    agrees."""
    import numpy as np
    import optax

    import spmdkit as sk
    from spmdkit.engine.region import FORWARD, GRAD, KEPT_NOTHING, kept_layout
    from spmdkit.propagation.propagator import Propagator

    m = sk.models.get_model("qwen3_moe")
    cfg = m.config("tiny")
    batch = m.batch(cfg, 8, np.random.default_rng(0))
    info = sk.describe(m, config=cfg, batch=batch)
    mesh = sk.make_mesh(data=4, model=2)
    plan = sk.plan(info, mesh, "auto", estimator="analytic")
    pairs: list = []
    paired = Propagator._pair_kept

    def spy(self, node, specs, ans):
        out = paired(self, node, specs, ans)
        if node.eqn.params["op"] == "moe_experts":
            made = kept_layout(
                node.prim, node.eqn.params, out.attrs, out.required, out.outputs, mesh
            )
            pairs.append((node.prim, made or KEPT_NOTHING, out.attrs.get("strategy")))
        return out

    opt = optax.adam(1e-3)
    params, opt_state = plan.abstract(
        info.abstract_params, jax.eval_shape(opt.init, info.abstract_params)
    )
    try:
        Propagator._pair_kept = spy
        sk.jit(sk.train_step(info, opt, plan), plan).lower(params, opt_state, batch)
    finally:
        Propagator._pair_kept = paired
    forward = {made for prim, made, _ in pairs if prim == FORWARD}
    grad = {made for prim, made, _ in pairs if prim == GRAD}
    assert forward and grad and grad <= forward, pairs
