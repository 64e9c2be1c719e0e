"""Provenance of a propagated step: owners, buckets that add up, uses, how layouts were decided."""

import jax
import jax.numpy as jnp
import optax
from jax.sharding import AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit.propagation import propagate
from spmdkit.propagation.provenance import ACTIVATIONS, decided_by, trails
from tests.propagation.programs import F32, S


def _step(w, b, x, y):
    """An SGD step of a linear layer: the weight's gather, its gradient's reduction."""

    def loss(params):
        w, b = params
        h = jnp.tanh(x @ w + b)
        h = jax.ad_checkpoint.checkpoint_name(h, "hidden")
        return jnp.mean((h - y) ** 2)

    grads = jax.grad(loss)((w, b))
    return tuple(p - 0.1 * g for p, g in zip((w, b), grads, strict=True))


def _propagated():
    mesh = sk.abstract_mesh(data=4)
    args = (S((32, 16), F32), S((16,), F32), S((8, 32), F32), S((8, 16), F32))
    specs = (P("data"), P(), P("data"), P("data"))
    return propagate(_step, *args, in_specs=specs, mesh=mesh, out_specs=(P("data"), P()))


def test_buckets_add_up_to_the_steps_bytes_and_time():
    prop = _propagated()
    t = trails(prop, {0: "w", 1: "b"}, {0: "w", 1: "b"})
    total: dict[str, int] = {}
    for per in t.bytes.values():
        for kind, n in per.items():
            total[kind] = total.get(kind, 0) + n
    assert total == prop.comm_bytes_by_kind
    assert abs(sum(t.time_s.values()) - prop.comm_time_s) < 1e-12
    # FSDP-style: the weight is gathered for the matmul and its gradient scattered
    # back; the bias's gradient is summed over the batch shards
    assert t.bytes["w"].get("all_gather", 0) > 0
    assert t.bytes["b"].get("all_reduce", 0) == 16 * 4
    assert set(t.bytes) <= {"w", "b", ACTIVATIONS}


def test_uses_name_the_equation_its_pass_and_source():
    prop = _propagated()
    t = trails(prop, {0: "w", 1: "b"}, {0: "w", 1: "b"})
    uses = t.uses["w"]
    gather = next(u for u in uses if any(m.kind == "all_gather" for m in u.moves))
    assert gather.primitive == "dot_general" and gather.phase == "forward"
    assert "test_provenance.py" in gather.source
    assert {u.phase for u in uses} >= {"forward", "backward"}
    (named,) = t.named["hidden"]
    assert named.decided in ("forward rule", "backward rule")


def test_decided_by_names_constraints_and_forward_rules():
    mesh = AbstractMesh((4,), ("data",), axis_types=(AxisType.Auto,))
    wanted = NamedSharding(mesh, P(None, "data"))

    def f(x):
        y = jax.lax.with_sharding_constraint(x * 2.0, wanted)
        return jnp.sin(y)

    prop = propagate(f, S((8, 8), F32), in_specs=(P("data"),), mesh=mesh)
    how = {s.node.prim: decided_by(s) for s in prop.steps}
    assert how["sharding_constraint"] == "constraint"
    assert how["mul"] == "forward rule"


def test_no_labels_put_everything_on_the_activations():
    prop = _propagated()
    t = trails(prop, {})
    assert t.bytes.keys() <= {ACTIVATIONS}
    assert t.uses == {}


def test_an_optax_update_attributes_the_moments_to_their_parameter():
    mesh = sk.abstract_mesh(data=4)
    opt = optax.adam(1e-3)
    w = S((32, 16), F32)
    state = jax.eval_shape(opt.init, w)

    def step(w, state, x):
        g = jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w)
        upd, state = opt.update(g, state, w)
        return optax.apply_updates(w, upd), state

    specs = (P("data"), jax.tree.map(lambda _: P(), state), P("data"))
    prop = propagate(step, w, state, S((8, 32), F32), in_specs=specs, mesh=mesh)
    t = trails(prop, {0: "w"}, {0: "w"})
    total = sum(n for per in t.bytes.values() for n in per.values())
    assert total == prop.comm_bytes
    assert sum(t.bytes["w"].values()) > 0


def test_a_region_forward_is_put_on_the_line_that_called_the_op():
    """jax keeps only the body's frames for the equations of a ``custom_vjp``'s
    forward (an ``spmdkit.ops`` region: ``region.py``, then ``rules/``): the
    source is the user's line that called the op, read from the call it was
    inlined from, for the forward region as for its grad region."""
    from spmdkit.engine.region import FORWARD, GRAD
    from spmdkit.propagation.graph import FlatProgram
    from spmdkit.propagation.provenance import caller

    def loss(x, scale):
        y = sk.ops.layer_norm(x, scale)  # THE LINE
        return jnp.sum(y * y)

    closed = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(
        jnp.ones((4, 8), jnp.float32), jnp.ones((8,), jnp.float32)
    )
    graph, _ = FlatProgram().graph(closed)
    regions = [n for n in graph.nodes if n.prim in (FORWARD, GRAD)]
    assert {n.prim for n in regions} == {FORWARD, GRAD}
    with open(__file__) as f:
        line = next(i for i, t in enumerate(f, 1) if "# THE LINE" in t and "layer_norm" in t)
    for n in regions:
        assert f"test_provenance.py:{line}:" in caller(n.eqn, "", n.outer), n.prim
