"""spmdkit.planner.expert_mesh: auto (and the ep preset) plan expert parallelism on a
mesh without an expert axis by splitting its data axis into data × expert."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import spmdkit as sk
from spmdkit.introspect import describe
from spmdkit.models import get_model
from spmdkit.planner.expert_mesh import (
    EXPERT_AXIS,
    expert_counts,
    expert_meshes,
    expert_placement,
)
from spmdkit.planner.logical import LogicalRules
from spmdkit.planner.options import CostModel
from spmdkit.planner.search import planner_for
from spmdkit.planner.trace import trace_step

GIB = 2**30
V, D, F, E, K = 256, 1024, 4096, 8, 2  # experts large beside the tokens: EP wins
B, S = 64, 64


class Decoder(nnx.Module):
    def __init__(self, rngs, *, experts=E):
        init = jax.nn.initializers.normal(0.5)
        self.embed = nnx.Param(init(rngs.params(), (V, D)), out_sharding=("vocab", "embed"))
        self.moe = sk.nn.MoE(D, n_experts=experts, top_k=K, d_ff_expert=F, rngs=rngs)
        self.head = nnx.Param(init(rngs.params(), (D, V)), out_sharding=("embed", "vocab"))

    def __call__(self, tokens):
        x = self.embed[...][tokens]
        y, aux = self.moe(x)
        return (x + y) @ self.head[...], aux


def decoder_loss(model, batch):
    logits, aux = model(batch["tokens"])
    return sk.nn.cross_entropy(logits, batch["targets"]) + aux


@pytest.fixture(scope="module")
def info():
    batch = {k: jax.ShapeDtypeStruct((B, S), jnp.int32) for k in ("tokens", "targets")}
    with nnx.use_eager_sharding(False):
        return describe(lambda: Decoder(nnx.Rngs(0)), loss=decoder_loss, batch=batch)


def _sizes(mesh):
    return dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))


def test_the_split_meshes(info):
    assert expert_counts(trace_step(info, None)) == (E,)
    got = [_sizes(m) for m in expert_meshes(sk.abstract_mesh(data=64), (8,))]
    assert got == [{"data": 32, "expert": 2}, {"data": 16, "expert": 4}, {"data": 8, "expert": 8}]
    # the degree divides every call's experts; the other axes are kept
    got = [_sizes(m) for m in expert_meshes(sk.abstract_mesh(data=12, model=2), (8, 4))]
    assert got == [{"data": 6, "expert": 2, "model": 2}, {"data": 3, "expert": 4, "model": 2}]
    # a mesh with an expert-role axis, or a step without moe_experts, is not split
    assert expert_meshes(sk.abstract_mesh(data=8, ep=2), (8,)) == []
    assert expert_meshes(sk.abstract_mesh(data=16), ()) == []
    assert expert_meshes(sk.abstract_mesh(data=7), (8,)) == []


def test_the_expert_placement_spans_the_model_axes_where_they_divide():
    """Megatron-LM's MoE layout: the experts over the expert axes and, where every
    expert count divides them too, the tensor-parallel ones (EP across TP ranks);
    the batch over the data and expert axes, never the model axes."""
    sizes = {"data": 16, "expert": 32, "model": 2}
    wide = expert_placement(sizes, (256,), None, over_model=True)
    assert wide.entries == (("expert", ("expert", "model")), ("batch", ("data", "expert")))
    # the pipelined stage's (over_model off) and 96 experts over 64: the expert axis alone
    narrow = (("expert", ("expert",)), ("batch", ("data", "expert")))
    assert expert_placement(sizes, (256,), None).entries == narrow
    assert expert_placement(sizes, (96,), None, over_model=True).entries == narrow
    # no expert-named axis, an axis that does not divide, a table placing the batch
    assert expert_placement({"data": 8, "model": 4}, (8,), None, over_model=True) is None
    assert expert_placement({"data": 2, "expert": 3}, (8,), None) is None
    given = LogicalRules((("batch", ("data",)),))
    assert expert_placement(sizes, (256,), given, over_model=True) is None
    # other extra rules stay, behind the placement
    extra = LogicalRules((("vocab", ("model",)),))
    got = expert_placement(sizes, (256,), extra, over_model=True)
    assert got.entries == (*wide.entries, *extra.entries)


def test_auto_costs_the_tensor_parallel_presets_with_expert_parallel_experts(info):
    """Issue 44: auto's flat candidates include Megatron-LM's MoE layout (dense
    weights tensor-parallel with sequence parallelism, the experts over the expert
    and model axes, the batch over data and expert, the optimizer state over data),
    which neither a preset nor the per-group search lays out."""
    mesh = sk.abstract_mesh(data=2, expert=2, model=2)
    planner = planner_for(info, mesh, None, CostModel(estimator="analytic"))
    planner.auto(None, sk.Recipe())
    names = {c.name for c in planner.analytic}
    assert {"megatron_sp+zero1+ep", "megatron+zero1+ep", "tp_fsdp+ep"} <= names
    c = next(c for c in planner.analytic if c.name == "megatron_sp+zero1+ep")
    p = planner.problem.make_plan(c.name, c, c.cost)
    assert p.params["moe/w_down"][0] == ("expert", "model")
    assert p.activation["batch"] == ("data", EXPERT_AXIS) and p.activation["seq"] == ("model",)
    assert p.params["head"] == jax.sharding.PartitionSpec(None, "model")  # vocab-parallel
    assert "data" in str(p.opt["head"])  # the distributed optimizer: state over data
    assert c.mesh is None and c.cost.comm_bytes["all_to_all"] > 0
    # on a mesh without an expert axis, on the split ones (no model axis: dense
    # weights replicated or FSDP, one candidate per distinct layout)
    split = planner_for(info, sk.abstract_mesh(data=8), None, CostModel(estimator="analytic"))
    got = split.experts.dense_presets(None, sk.Recipe())
    assert got and all(_sizes(c.mesh)[EXPERT_AXIS] > 1 for c in got)
    layouts = [(tuple(c.mesh.axis_sizes), tuple(c.choice)) for c in got]
    assert len(set(layouts)) == len(layouts)


@pytest.mark.slow  # the README command's budget
def test_auto_splits_the_data_axis_where_ep_wins(info):
    mesh = sk.abstract_mesh(data=16)  # 8 experts do not divide 16 devices
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = sk.plan(info, mesh, "auto")
    sizes = _sizes(p.mesh)
    assert EXPERT_AXIS in sizes and sizes["data"] * sizes[EXPERT_AXIS] == 16
    assert set(p.activation["batch"]) == {"data", EXPERT_AXIS}  # the batch over all 16
    (note,) = [n for n in p.notes if n.kind == "mesh_split"]
    assert "for expert parallelism" in note.message and "data=16 into data=" in note.message
    assert p.cost.peak_bytes <= 80 * GIB
    # every candidate on the mesh as given is slower
    unsplit = [c.step_time_s for name, c in p.alternatives if "expert" not in name and name != "ep"]
    assert unsplit and p.cost.step_time_s < min(unsplit)
    assert p == sk.Plan.from_json(p.to_json())


def test_the_ep_preset_splits_where_the_experts_would_be_replicated(info):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = sk.plan(info, sk.abstract_mesh(data=16), "ep", estimator="analytic")
        kept = sk.plan(info, sk.abstract_mesh(data=8), "ep", estimator="analytic")
    assert _sizes(p.mesh) == {"data": 2, "expert": 8}
    assert p.params["moe/w_down"][0] == EXPERT_AXIS
    assert p.activation["batch"] == ("data", EXPERT_AXIS)
    assert [n.kind for n in p.notes].count("mesh_split") == 1
    assert p.cost.comm_bytes["all_to_all"] > 0
    # 8 experts on data=8: one each, the mesh as given
    assert _sizes(kept.mesh) == {"data": 8} and kept.params["moe/w_down"][0] == "data"
    assert not [n for n in kept.notes if n.kind == "mesh_split"]


def test_a_dense_model_is_not_split():
    batch = {"x": jax.ShapeDtypeStruct((16, 64), jnp.float32)}

    class Dense(nnx.Module):
        def __init__(self, rngs):
            self.w = nnx.Param(jnp.zeros((64, 64)), out_sharding=("embed", "mlp"))

        def __call__(self, x):
            return x @ self.w[...]

    with nnx.use_eager_sharding(False):
        dense = describe(lambda: Dense(nnx.Rngs(0)), loss=lambda m, b: m(b["x"]).sum(), batch=batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = sk.plan(dense, sk.abstract_mesh(data=16), "auto", estimator="analytic")
    assert _sizes(p.mesh) == {"data": 16}
    assert not [n for n in p.notes if n.kind == "mesh_split"]


@pytest.mark.slow
def test_the_split_ep_plan_runs_on_8_devices():
    """The ep preset on ``make_mesh(data=8)`` with 4 experts splits the devices'
    mesh into data=2 × expert=4 (a real ``Mesh``); the planned step equals the
    one-device step."""
    v, d, f, b, s = 32, 16, 32, 8, 8

    class Small(nnx.Module):
        def __init__(self, rngs):
            init = jax.nn.initializers.normal(0.5)
            self.embed = nnx.Param(init(rngs.params(), (v, d)), out_sharding=("vocab", "embed"))
            self.moe = sk.nn.MoE(d, n_experts=4, top_k=K, d_ff_expert=f, rngs=rngs)
            self.head = nnx.Param(init(rngs.params(), (d, v)), out_sharding=("embed", "vocab"))

        def __call__(self, tokens):
            x = self.embed[...][tokens]
            y, aux = self.moe(x)
            return (x + y) @ self.head[...], aux

    toks = np.random.default_rng(0).integers(0, v, (b, s + 1)).astype(np.int32)
    batch = {"tokens": toks[:, :-1], "targets": toks[:, 1:]}
    with nnx.use_eager_sharding(False):
        small = describe(lambda: Small(nnx.Rngs(0)), loss=decoder_loss, batch=batch)
    params = small.init_fn()
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(small.loss_fn))(params, batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = sk.plan(small, sk.make_mesh(data=8), "ep")
    assert isinstance(plan.mesh, jax.sharding.Mesh)
    assert _sizes(plan.mesh) == {"data": 2, "expert": 4}
    assert plan.params["moe/w_down"][0] == EXPERT_AXIS
    step = sk.jit(sk.value_and_grad(small.train_loss, plan), plan)
    placed = jax.device_put(params, plan.param_shardings(small.abstract_params))
    loss, grads = step(placed, batch)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=2e-6)


@pytest.mark.slow
def test_mixtral_8x7b_dropless_on_64_devices_fits_with_the_data_axis_split():
    """Issue 44's acceptance: Mixtral 8x7B dropless (the zoo's ``qwen3_moe`` decoder
    at ``mixtral_8x7b``: 8 experts top-2, ``sk.nn.MoE``) on ``abstract_mesh(data=64)``,
    batch 256 of 4,096 tokens: auto fits 80 GiB by splitting data=64 into data × expert
    (8 experts do not divide 64 devices: on the mesh as given they are replicated)."""
    mixtral = describe(get_model("qwen3_moe"), config="mixtral_8x7b", batch_size=256)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = sk.plan(mixtral, sk.abstract_mesh(data=64), "auto")
    assert p.cost.peak_bytes <= 80 * GIB
    sizes = _sizes(p.mesh)
    assert sizes.get(EXPERT_AXIS, 1) > 1 and sizes["data"] * sizes[EXPERT_AXIS] == 64
    assert [n.kind for n in p.notes].count("mesh_split") == 1
