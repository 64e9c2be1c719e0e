"""spmdkit.runtime.train: sharded training, accumulation, remat, plans, checkpoints, resume."""

import io
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from spmdkit.recipe import Recipe
from spmdkit.runtime.checkpoint import CheckpointMismatchError, Manager
from spmdkit.runtime.data import ShardedLoader
from spmdkit.runtime.train import TrainError, train


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(8, 16, rngs=rngs)
        self.l2 = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, x):
        return self.l2(jnp.tanh(self.l1(x)))


def loss_fn(model, batch, rng=None):
    err = jnp.mean((model(batch["x"]) - batch["y"]) ** 2)
    if rng is not None:  # a tiny rng-dependent term: resume must restore the key
        err = err + 1e-3 * jax.random.normal(rng, ())
    return err


_rs = np.random.RandomState(0)
X = _rs.randn(64, 8).astype(np.float32)
Y = np.tanh(X @ _rs.randn(8, 1)).astype(np.float32)  # learnable


def auto(mesh):
    return Mesh(mesh.devices, mesh.axis_names)


def tp_shardings(mesh, data_axis, model_axis):
    """Megatron-style MLP: l1 column-parallel, l2 row-parallel."""
    ns = lambda *s: NamedSharding(mesh, P(*s))  # noqa: E731
    return {
        "l1": {"kernel": ns(None, model_axis), "bias": ns(model_axis)},
        "l2": {"kernel": ns(model_axis, None), "bias": ns()},
    }


def loader(mesh, data_axis, batch_size=16, **kw):
    return ShardedLoader(
        {"x": X, "y": Y}, NamedSharding(mesh, P(data_axis)), batch_size=batch_size, **kw
    )


def run(mesh, steps, *, ckpt=None, resume=False, axes=("a", "b"), rng=1, loss=loss_fn, **kw):
    model = MLP(nnx.Rngs(0))
    sh = tp_shardings(mesh, *axes)
    return train(
        loss,
        model,
        optax.adam(1e-2),
        loader(mesh, axes[0]),
        steps=steps,
        shardings=(sh, None),
        rng=None if rng is None else jax.random.key(rng),
        ckpt=ckpt,
        resume=resume,
        progress=False,
        **kw,
    )


@pytest.fixture(scope="module")
def mesh(mesh2d):
    return auto(mesh2d)


@pytest.fixture(scope="module")
def reference(mesh):
    """Six uninterrupted steps (the data wraps into a second epoch after four)."""
    return run(mesh, 6)


def test_train_updates_the_module_and_keeps_shardings(mesh, reference):
    assert reference.step == 6 and [h["step"] for h in reference.history] == list(range(1, 7))
    assert reference.losses[-1] < reference.losses[0]
    assert all(np.isfinite(h["grad_norm"]) for h in reference.history)
    model = reference.params
    assert isinstance(model, MLP)
    assert model.l1.kernel[...].sharding.spec == P(None, "b")
    assert model.l2.kernel[...].sharding.spec == P("b", None)
    # adam's moments follow the params' layout by propagation
    mu = reference.opt_state[0].mu
    assert mu["l1"]["kernel"].sharding.spec == P(None, "b")


def test_resume_is_bit_identical_on_the_same_mesh(tmp_path, mesh, reference):
    first = run(mesh, 3, ckpt=Manager(tmp_path, save_interval_steps=100))
    assert first.losses == reference.losses[:3]
    mgr = Manager(tmp_path)
    assert mgr.latest_step() == 3
    assert mgr.metadata()["data"] == {"epoch": 0, "batch": 3}
    second = run(mesh, 6, ckpt=mgr, resume=True)
    assert second.start_step == 3 and [h["step"] for h in second.history] == [4, 5, 6]
    assert second.losses == reference.losses[3:]  # bit-identical


def test_resume_on_another_mesh_matches_within_tolerance(tmp_path, mesh, reference):
    run(mesh, 3, ckpt=Manager(tmp_path))
    other = Mesh(np.array(jax.devices()).reshape(4, 2), ("d", "m"))
    second = run(other, 6, ckpt=Manager(tmp_path), resume=True, axes=("d", "m"))
    np.testing.assert_allclose(second.losses, reference.losses[3:], rtol=1e-5)
    assert second.params.l1.kernel[...].sharding.spec == P(None, "m")


def test_accumulation_and_remat_match_the_plain_step(mesh, reference):
    # without the rng term: each micro-batch gets its own key
    def with_rows(model, batch):
        return loss_fn(model, batch), {"rows": jnp.float32(batch["x"].shape[0])}

    plain = run(mesh, 4, rng=None, loss=with_rows, has_aux=True)
    acc = run(mesh, 4, accum_steps=2, rng=None, loss=with_rows, has_aux=True)
    np.testing.assert_allclose(acc.losses, plain.losses, rtol=1e-5)
    assert plain.history[0]["rows"] == 16 and acc.history[0]["rows"] == 8  # micro-batches
    rem = run(mesh, 4, remat=True)
    np.testing.assert_allclose(rem.losses, reference.losses[:4], rtol=1e-6)


class _Zero1Plan:
    """The plan duck type: params replicated, optimizer moments sharded (ZeRO-1)."""

    def __init__(self, mesh):
        self.mesh = mesh

    def state_shardings(self, abstract_params, abstract_opt_state):
        rep = NamedSharding(self.mesh, P())

        def opt(x):
            if x.ndim >= 1 and x.shape[0] % self.mesh.shape["a"] == 0:
                return NamedSharding(self.mesh, P("a"))
            return rep

        return (jax.tree.map(lambda _: rep, abstract_params), jax.tree.map(opt, abstract_opt_state))

    def to_json(self):
        return json.dumps({"preset": "zero1"})


def test_plan_gives_param_and_optimizer_shardings(tmp_path, mesh, reference):
    plan = _Zero1Plan(mesh)
    out = io.StringIO()
    res = train(
        loss_fn,
        MLP(nnx.Rngs(0)),
        optax.adam(1e-2),
        loader(mesh, "a"),
        steps=4,
        plan=plan,
        rng=jax.random.key(1),
        ckpt=Manager(tmp_path),
        log_every=2,
        out=out,
    )
    np.testing.assert_allclose(res.losses, reference.losses[:4], rtol=1e-5)
    assert res.opt_state[0].mu["l1"]["kernel"].sharding.spec == P("a")
    assert res.params.l1.kernel[...].sharding.spec == P()
    meta = Manager(tmp_path).metadata()
    assert json.loads(meta["plan"]) == {"preset": "zero1"}
    assert meta["mesh"]["axes"] == {"a": 2, "b": 4}
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and "step 4/4" in lines[-1] and "loss" in lines[-1]


class _RecipePlan(_Zero1Plan):
    """The duck plan with a recipe and ZeRO-2 gradient specs (like the optimizer
    state's: leading dim over ``a`` where it divides)."""

    def __init__(self, mesh, recipe):
        super().__init__(mesh)
        self.recipe = recipe
        self.grads = {"*": "like the optimizer state"}

    def grad_specs(self, abstract_params):
        n = self.mesh.shape["a"]
        return jax.tree.map(
            lambda x: P("a") if x.ndim and x.shape[0] % n == 0 else P(), abstract_params
        )


@pytest.mark.slow
def test_the_plan_recipe_runs_micro_batches_zero2_and_offload(mesh):
    """Micro-batches split inside the step (the loader yields whole batches),
    gradients constrained to the plan's gradient specs, optimizer state in host
    memory between steps: the same losses as the plain run."""
    plan = _RecipePlan(mesh, Recipe(microbatches=2, offload_opt=True))
    data = loader(mesh, "a")
    res = train(
        loss_fn, MLP(nnx.Rngs(0)), optax.adam(1e-2), data, steps=4, plan=plan, rng=None,
        progress=False,
    )  # fmt: skip
    assert data.microbatches == 1
    assert {x.sharding.memory_kind for x in jax.tree.leaves(res.opt_state)} == {"pinned_host"}
    assert res.opt_state[0].mu["l1"]["kernel"].sharding.spec == P("a")
    np.testing.assert_allclose(res.losses, run(mesh, 4, rng=None).losses, rtol=1e-5)


def test_a_recipe_conflicting_with_train_options_raises(mesh):
    plan = _RecipePlan(mesh, Recipe(microbatches=2, remat="none"))
    model = MLP(nnx.Rngs(0))
    with pytest.raises(TrainError, match=r"accum_steps=4, plan\.recipe\.microbatches=2"):
        train(loss_fn, model, optax.sgd(0.1), loader(mesh, "a"), steps=1, plan=plan, accum_steps=4)
    with pytest.raises(TrainError, match="loader microbatches=2"):
        train(loss_fn, model, optax.sgd(0.1), loader(mesh, "a", microbatches=2), steps=1, plan=plan)


def test_plain_params_and_aux_metrics(mesh):
    rep = NamedSharding(mesh, P())
    params = {"w": jax.device_put(jnp.zeros((8, 1)), rep)}

    def loss(p, batch):
        pred = batch["x"] @ p["w"]
        return jnp.mean((pred - batch["y"]) ** 2), {"pred_mean": jnp.mean(pred)}

    res = train(
        loss, params, optax.sgd(0.1), loader(mesh, "a"), steps=2, has_aux=True, progress=False
    )
    assert set(res.history[0]) == {"step", "loss", "grad_norm", "pred_mean"}
    assert res.history[0]["pred_mean"] == 0.0 and res.history[1]["pred_mean"] != 0.0
    assert res.params["w"].sharding == rep


def test_bad_configurations_raise(mesh):
    with pytest.raises(TrainError, match="resume=True comes with a checkpoint manager"):
        run(mesh, 1, resume=True)
    with pytest.raises(TrainError, match="not both"):
        train(
            loss_fn,
            MLP(nnx.Rngs(0)),
            optax.sgd(0.1),
            [],
            steps=1,
            plan=object(),
            shardings=({}, None),
        )
    with pytest.raises(TrainError, match="accum_steps"):
        run(mesh, 1, accum_steps=0)


@pytest.mark.slow
def test_string_ids_and_nested_fields_reach_each_micro_batch(mesh):
    """Non-tensor leaves (a list of example ids) and a nested array field pass
    through the loader, micro-batching and the compiled step to loss_fn; each
    micro-batch sees its own ids."""
    seen = []

    def nested_loss(model, batch):
        ids = batch["meta"]["ids"]
        assert isinstance(ids, list) and all(isinstance(i, str) for i in ids)
        seen.append(ids)  # at trace time: the non-tensor part is static
        return loss_fn(model, {"x": batch["inp"]["x"], "y": batch["y"]})

    source = {"inp": {"x": X}, "y": Y, "meta": {"ids": [f"ex{i}" for i in range(64)]}}
    data = ShardedLoader(source, NamedSharding(mesh, P("a")), batch_size=16)
    sh = tp_shardings(mesh, "a", "b")
    res = train(
        nested_loss,
        MLP(nnx.Rngs(0)),
        optax.adam(1e-2),
        data,
        steps=2,
        shardings=(sh, None),
        accum_steps=2,
        progress=False,
    )
    plain = run(mesh, 2, accum_steps=2, rng=None)
    np.testing.assert_allclose(res.losses, plain.losses, rtol=1e-6)
    # step 1: micro-batches take examples 0,2,4.. and 1,3,5..; step 2 the next 16
    traced = [list(t) for t in dict.fromkeys(map(tuple, seen))]  # in order, once each
    assert traced[:2] == [[f"ex{i}" for i in range(0, 16, 2)], [f"ex{i}" for i in range(1, 16, 2)]]
    assert traced[2][0] == "ex16" and len(traced) == 4
    assert res.compiles == 2  # one per distinct id list


def test_a_list_of_string_ids_reaches_loss_fn(mesh):
    """The plain and the accumulated step take a batch with a list of strings (it
    used to fail: `Error interpreting argument ... as an abstract array`)."""
    seen = []

    def ids_loss(model, batch):
        seen.append(batch["ids"])
        return loss_fn(model, batch)

    source = {"x": X, "y": Y, "ids": [f"ex{i}" for i in range(64)]}
    sh = tp_shardings(mesh, "a", "b")
    for accum in (1, 2):
        seen.clear()
        data = ShardedLoader(source, NamedSharding(mesh, P("a")), batch_size=16)
        res = train(
            ids_loss,
            MLP(nnx.Rngs(0)),
            optax.adam(1e-2),
            data,
            steps=1,
            shardings=(sh, None),
            accum_steps=accum,
            progress=False,
        )
        want = [f"ex{i}" for i in range(16)]
        assert sorted(i for ids in dict.fromkeys(map(tuple, seen)) for i in ids) == sorted(want)
        assert res.compiles == 1


def test_params_only_checkpoint_restores_into_a_fresh_optimizer(tmp_path, mesh):
    config = {"hidden": 16, "name": "mlp"}
    first = run(mesh, 3, ckpt=Manager(tmp_path), save_opt_state=False, config=config)
    mgr = Manager(tmp_path)
    assert not any(p.startswith("opt_state") for p in mgr.saved_shapes())
    assert mgr.metadata()["config"]["value"] == config
    # the optimizer state is not in the checkpoint: asking for it is a typed error
    with pytest.raises(CheckpointMismatchError, match="opt_state"):
        run(mesh, 4, ckpt=mgr, resume=True, restore_opt_state=True)
    second = run(mesh, 5, ckpt=mgr, resume=True)  # default: fresh optimizer state
    assert second.start_step == 3 and int(second.opt_state[0].count) == 2
    assert first.step == 3


@pytest.mark.slow
def test_a_full_checkpoint_restores_its_optimizer_state_unless_told_not_to(tmp_path, mesh):
    full = tmp_path / "full"
    run(mesh, 3, ckpt=Manager(full))
    assert int(run(mesh, 4, ckpt=Manager(full), resume=True).opt_state[0].count) == 4
    fresh = run(mesh, 5, ckpt=Manager(full), resume=True, restore_opt_state=False)
    assert fresh.start_step == 4 and int(fresh.opt_state[0].count) == 1


def test_bucketed_lengths_compile_per_bucket_and_match_the_unpadded_loss(mesh):
    """Five different lengths, three buckets: at most three compiled steps, and each
    step's loss (and so its update) equals the computation on the unpadded examples."""
    lengths = [3, 5, 6, 7, 9] * 4
    rs = np.random.RandomState(1)
    tokens = [rs.randint(0, 16, n).astype(np.int32) for n in lengths]
    rep = NamedSharding(mesh, P())
    init = {"emb": rs.randn(16, 8).astype(np.float32), "w": rs.randn(8).astype(np.float32)}

    def token_err(p, tok):
        return (p["emb"][tok] @ p["w"] - tok / 16.0) ** 2

    def masked_loss(p, batch):
        m = batch["tokens_mask"]
        return jnp.sum(jnp.where(m, token_err(p, batch["tokens"]), 0.0)) / jnp.sum(m)

    data = ShardedLoader(
        {"tokens": tokens},
        NamedSharding(mesh, P("a")),
        batch_size=4,
        shuffle_seed=0,
        bucket_sizes=(4, 8, 12),
        bucket_dims={"tokens": 0},
    )
    params = jax.device_put({k: jnp.asarray(v) for k, v in init.items()}, rep)
    res = train(masked_loss, params, optax.sgd(0.1), data, steps=5, progress=False)
    assert res.compiles <= 3 < len(set(lengths))

    # the same steps by hand in float64 numpy, on the unpadded tokens of each batch
    p = {k: v.astype(np.float64) for k, v in init.items()}
    order = np.random.default_rng((0, 0)).permutation(len(tokens))
    want = []
    for i in range(5):
        tok = np.concatenate([tokens[j] for j in order[4 * i : 4 * i + 4]])
        r = p["emb"][tok] @ p["w"] - tok / 16.0
        want.append(np.mean(r**2))
        g_emb = np.zeros_like(p["emb"])
        np.add.at(g_emb, tok, (2 * r / len(tok))[:, None] * p["w"])
        g_w = (2 * r / len(tok)) @ p["emb"][tok]
        p = {"emb": p["emb"] - 0.1 * g_emb, "w": p["w"] - 0.1 * g_w}
    np.testing.assert_allclose(res.losses, want, rtol=1e-5)


class BatchNormMLP(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(8, 16, rngs=rngs)
        self.bn = nnx.BatchNorm(16, momentum=0.9, rngs=rngs)
        self.l2 = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, x):
        return self.l2(jnp.tanh(self.bn(self.l1(x))))


def run_bn(mesh, steps, **kw):
    sh = tp_shardings(mesh, "a", "b")
    sh["bn"] = {"scale": NamedSharding(mesh, P("b")), "bias": NamedSharding(mesh, P("b"))}
    model = BatchNormMLP(nnx.Rngs(0))
    return train(loss_fn, model, optax.adam(1e-2), loader(mesh, "a"), steps=steps,
                 shardings=(sh, None), progress=False, **kw)  # fmt: skip


def test_batch_stats_are_carried_not_optimized_and_checkpointed(tmp_path, mesh):
    """An NNX module's BatchStats: updated every step (not by the optimizer, which
    has no state for them), written back into the module, saved as model_state and
    restored on resume: 3 steps + resume to 5 == 5 uninterrupted."""
    whole = run_bn(mesh, 5)
    first = BatchNormMLP(nnx.Rngs(0)).bn.mean[...]
    assert not np.allclose(whole.model_state["bn"]["mean"], first)
    np.testing.assert_array_equal(whole.params.bn.mean[...], whole.model_state["bn"]["mean"])
    assert set(whole.opt_state[0].mu["bn"]) == {"scale", "bias"}  # no mean/var moments
    run_bn(mesh, 3, ckpt=Manager(tmp_path))
    mgr = Manager(tmp_path)
    assert {"model_state/bn/mean", "model_state/bn/var"} <= set(mgr.saved_shapes())
    second = run_bn(mesh, 5, ckpt=mgr, resume=True)
    assert second.losses == whole.losses[3:]
    for a, b in zip(*map(jax.tree.leaves, (second.model_state, whole.model_state)), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_params_pytree_carries_state_given_with_its_loss(mesh):
    """``state=`` for a pytree: ``loss_fn(params, batch, state) -> (loss, new_state)``;
    the running mean moves with every micro-batch, in order."""
    params = {"w": jnp.zeros((8, 1))}

    def loss(p, batch, state):
        new = {"mean": 0.5 * state["mean"] + 0.5 * batch["x"].mean(0)}
        return jnp.mean((batch["x"] @ p["w"] - batch["y"]) ** 2), new

    state = {"mean": jnp.zeros((8,))}
    sh = ({"w": NamedSharding(mesh, P())}, None)
    res = train(loss, params, optax.sgd(0.1), loader(mesh, "a"), steps=2, state=state,
                shardings=sh, accum_steps=2, progress=False)  # fmt: skip
    want = np.zeros(8)
    for _, batch in zip(range(2), loader(mesh, "a", microbatches=2), strict=False):
        for micro in np.asarray(batch["x"]):  # the loader's micro-batches, in order
            want = 0.5 * want + 0.5 * micro.mean(0)
    np.testing.assert_allclose(res.model_state["mean"], want, rtol=1e-5)
    assert res.model_state["mean"].sharding.spec == P()
    with pytest.raises(TrainError, match="brings its own state"):
        train(loss_fn, MLP(nnx.Rngs(0)), optax.sgd(0.1), [], steps=0, state=state)
