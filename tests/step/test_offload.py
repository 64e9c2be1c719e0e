"""spmdkit.step.offload: the optimizer state and recomputed values in host memory,
and the typed error where the backend has none."""

import jax
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit.step import offload
from spmdkit.step.recipe import Recipe, RecipeError
from tests.step.dense_stack import assert_tree_close, batch, init, scanned_loss, tagged_loss


def test_train_step_with_offloaded_optimizer_state_on_cpu():
    """CPU devices expose ``pinned_host``: the optimizer state lives there between
    steps and the update matches the on-device one."""
    mesh = jax.sharding.Mesh(jax.devices(), ("data",))
    opt = optax.adam(1e-2)
    params = init()
    host = NamedSharding(mesh, P(), memory_kind="pinned_host")
    state = jax.device_put(opt.init(params), host)
    step = jax.jit(
        sk.train_step(scanned_loss, opt, Recipe(offload_opt=True)),
        out_shardings=(NamedSharding(mesh, P()), host, NamedSharding(mesh, P())),
    )
    new_params, new_state, _ = step(params, state, batch())
    ref_params, ref_state, _ = jax.jit(sk.train_step(scanned_loss, opt, Recipe()))(
        params, opt.init(params), batch()
    )
    assert {x.sharding.memory_kind for x in jax.tree.leaves(new_state)} == {"pinned_host"}
    assert_tree_close(new_params, ref_params, rtol=1e-6)
    assert_tree_close(new_state, ref_state, rtol=1e-6)


def test_offload_without_a_host_memory_kind_is_a_typed_error(monkeypatch):
    offload.check_offload(Recipe(offload_opt=True))  # CPU here: pinned_host exists
    import spmdkit.step.offload

    monkeypatch.setattr(
        spmdkit.step.offload, "host_memory_kinds", lambda device=None: frozenset({"device"})
    )
    with pytest.raises(RecipeError, match="pinned_host"):
        offload.check_offload(Recipe(offload_opt=True))
    offload.check_offload(Recipe())  # nothing offloaded, nothing checked


def test_remat_offload_without_a_host_memory_kind_is_a_typed_error(monkeypatch):
    recipe = Recipe(remat="save_qkv_proj", remat_offload=True)
    offload.check_offload(recipe)  # CPU here: pinned_host exists
    import spmdkit.step.offload

    monkeypatch.setattr(
        spmdkit.step.offload, "host_memory_kinds", lambda device=None: frozenset({"device"})
    )
    with pytest.raises(RecipeError, match=r"remat_offload.*pinned_host"):
        sk.value_and_grad(tagged_loss, recipe)(init(), batch())
