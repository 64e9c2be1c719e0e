"""The step's state placed on a plan: parameters, the fp32 master, host-offloaded
optimizer state and model state, from values, from an initialiser, and restored."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit.compile.place import place_state, state_layout
from spmdkit.runtime.checkpoint import Manager
from spmdkit.step.master import MasterState

SHAPES = {"w": (8, 16), "b": (16,)}


def _params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {"w": jax.random.normal(k1, (8, 16)), "b": jax.random.normal(k2, (16,))}


def _plan(mesh, **recipe):
    params = {"w": P(None, "b"), "b": P("b")}
    opt = {"w": P("a", "b"), "b": P("b")}  # ZeRO-1 on a: the moments split further
    return sk.Plan(
        mesh, params, opt, {"batch": ("a",)}, recipe=sk.Recipe(**recipe), state={"count": P()}
    )


@pytest.fixture(scope="module")
def plan(mesh2d):
    return _plan(mesh2d, compute_dtype="bfloat16", master_weights="optimizer", offload_opt=True)


def _masters(opt_state):
    return [x for x in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, MasterState))
            if isinstance(x, MasterState)]  # fmt: skip


def test_params_master_offload_and_model_state_land_where_the_plan_says(plan):
    params = _params()
    state = place_state(plan, params, optax.adam(1e-3), model_state={"count": jnp.zeros(())})
    assert state["params"]["w"].dtype == jnp.bfloat16
    assert state["params"]["w"].sharding.spec == P(None, "b")
    np.testing.assert_array_equal(state["params"]["w"], params["w"].astype(jnp.bfloat16))
    (master,) = _masters(state["opt_state"])
    # the fp32 master made from the stored parameters, as the step starts from them
    assert master.master["w"].dtype == jnp.float32
    np.testing.assert_array_equal(master.master["w"], state["params"]["w"].astype(jnp.float32))
    assert master.master["w"].sharding.spec == P("a", "b")
    kinds = {x.sharding.memory_kind for x in jax.tree.leaves(state["opt_state"])}
    assert kinds == {"pinned_host"}
    assert state["model_state"]["count"].sharding.spec == P()


def test_an_initialiser_is_run_born_sharded_with_the_same_result(plan):
    from_values = place_state(plan, _params())
    from_init = place_state(plan, _params)
    assert set(from_init) == {"params"}
    for a, b in zip(jax.tree.leaves(from_values), jax.tree.leaves(from_init), strict=True):
        assert a.sharding == b.sharding and a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)


def test_init_sharded_is_place_state_on_the_users_mesh():
    from spmdkit.introspect import describe
    from tests.plan_model import toy_batch, toy_init, toy_loss

    mesh = sk.make_mesh(data=2, model=4)
    info = describe(toy_init, loss=toy_loss, batch=toy_batch())
    p = sk.plan(info, mesh, "megatron", estimator="analytic")
    born = jax.tree.leaves(sk.init_sharded(info, p))
    placed = jax.tree.leaves(place_state(p, info.init_fn, mesh=mesh)["params"])
    for a, b in zip(born, placed, strict=True):
        assert a.sharding == b.sharding and a.sharding.mesh == mesh  # Explicit axes kept
        np.testing.assert_array_equal(a, b)


def test_a_checkpoint_restores_onto_the_layout_in_host_memory(plan, tmp_path):
    opt = optax.adam(1e-3)
    state = place_state(plan, _params(), opt)
    with Manager(tmp_path / "ckpt") as mgr:
        mgr.save(1, state, plan=plan, force=True)
        mgr.wait()
        layout = state_layout(plan, _params(), opt)
        restored = mgr.restore(target=layout.target()).state
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored), strict=True):
        assert a.sharding == b.sharding and a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(restored["opt_state"])} == {
        "pinned_host"
    }
