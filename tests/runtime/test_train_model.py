"""spmdkit.runtime.train_model: init_sharded -> train for models with dropout, state
and RNG (NNX and linen), the wrong calls refused with the right one, and trained
arrays usable in the user's own jax.jit."""

import io

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit.runtime.train import TrainError, train


class Tagger(nnx.Module):
    """A token model with an embedding gather, dropout and a projection."""

    def __init__(self, rngs):
        self.embed = nnx.Embed(32, 16, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)
        self.out = nnx.Linear(16, 32, rngs=rngs)

    def __call__(self, tokens):
        return self.out(self.drop(self.embed(tokens)))


def tagger_loss(model, batch):
    logits = model(batch["tokens"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()


def token_batches(n, size=8):
    rng = np.random.default_rng(0)
    return [
        {
            "tokens": rng.integers(0, 32, (size, 4)).astype(np.int32),
            "labels": rng.integers(0, 32, (size, 4)).astype(np.int32),
        }
        for _ in range(n)
    ]


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.BatchNorm(use_running_average=False, momentum=0.9)(nn.Dense(16)(x))
        return nn.Dense(4)(nn.Dropout(0.2, deterministic=False)(nn.relu(h)))


def net_loss(variables, batch, rng):
    y, updates = Net().apply(variables, batch["x"], mutable=["batch_stats"], rngs={"dropout": rng})
    return ((y - batch["y"]) ** 2).mean(), updates


def net_batches(n):
    rng = np.random.default_rng(1)
    return [
        {"x": rng.standard_normal((8, 8)).astype(np.float32), "y": np.zeros((8, 4), np.float32)}
        for _ in range(n)
    ]


@pytest.fixture(scope="module")
def tagger():
    batches = token_batches(3)
    info = sk.describe(lambda: Tagger(nnx.Rngs(0)), loss=tagger_loss, batch=batches[0])
    plan = sk.plan(info, sk.make_mesh(data=2, model=4), "fsdp", estimator="analytic")
    return info, plan, batches


@pytest.mark.slow
def test_nnx_dropout_trains_from_init_sharded_params(tagger):
    info, plan, batches = tagger
    assert info.rng  # nnx.Dropout's stream: the step draws from a per-step key
    params = sk.init_sharded(info, plan)
    res = train(info, params, optax.adam(1e-2), batches, steps=3, plan=plan, progress=False)
    assert res.step == 3 and all(np.isfinite(res.losses))
    assert isinstance(res.params, nnx.State)  # handed back in the form given
    before = np.asarray(sk.init_sharded(info, plan)["embed"]["embedding"][...])
    after = np.asarray(res.params["embed"]["embedding"][...])
    assert not np.allclose(before, after)
    # another seed draws other dropout masks: the key reaches the module
    again = train(info, sk.init_sharded(info, plan), optax.adam(1e-2), batches, steps=3,
                  plan=plan, rng=1, progress=False)  # fmt: skip
    assert again.losses[0] != res.losses[0]


class Mlp(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(8, 256, rngs=rngs)
        self.down = nnx.Linear(256, 4, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.relu(self.up(x)))


def mlp_loss(model, batch):
    return ((model(batch["x"]) - batch["y"]) ** 2).mean()


def test_the_step_that_ran_verifies_on_the_trained_state_as_handed_back():
    """README's path: ``train(info, sk.init_sharded(info, plan), ...)`` hands the
    parameters back as the nnx.State given and the optimizer state in the same
    form (what ``opt.init(params)`` makes of it), so ``result.planned`` takes the
    two together (before, the moments came back as pure dicts: a pytree
    structure error in ``verify``)."""
    batches = net_batches(1)
    info = sk.describe(lambda: Mlp(nnx.Rngs(0)), loss=mlp_loss, batch=batches[0])
    plan = sk.plan(info, sk.make_mesh(data=2, model=4), "megatron", estimator="analytic")
    opt = optax.adam(1e-2)
    params = sk.init_sharded(info, plan)
    made = jax.eval_shape(opt.init, params)  # before train: it donates the arrays
    res = train(info, params, opt, batches, steps=1, plan=plan, progress=False)
    assert isinstance(res.params, nnx.State)
    assert jax.tree.structure(res.opt_state) == jax.tree.structure(made)
    mu = res.opt_state[0].mu["up"]["kernel"][...]
    assert mu.sharding.spec == plan.opt_shardings(made)[0].mu["up"]["kernel"].spec != P()
    report = res.planned.verify(res.params, res.opt_state, batches[0])
    assert report.ok and {kind for kind, *_ in report.rows} >= {"all_reduce"}, str(report)


@pytest.mark.slow
def test_linen_batchnorm_dropout_trains_from_init_sharded_params():
    batches = net_batches(2)
    info = sk.describe(Net(), loss=net_loss, batch=batches[0], init_args=(batches[0]["x"],))
    assert info.rng and info.has_state
    plan = sk.plan(info, sk.make_mesh(data=2, model=4), "fsdp", estimator="analytic")
    params = sk.init_sharded(info, plan)
    assert set(params) == {"params"}  # the statistics come from info.init_state_fn()
    res = train(info, params, optax.adam(1e-2), batches, steps=2, plan=plan, progress=False)
    assert all(np.isfinite(res.losses))
    mean = np.asarray(res.model_state["batch_stats"]["BatchNorm_0"]["mean"])
    assert np.abs(mean).max() > 0  # updated from zeros by two steps
    assert set(res.params) == {"params"}
    # the full variables dict: its statistics carried on, handed back with them
    full = train(info, {**sk.init_sharded(info, plan), **res.model_state}, optax.adam(1e-2),
                 batches, steps=1, plan=plan, progress=False)  # fmt: skip
    assert set(full.params) == {"params", "batch_stats"}


def test_the_planner_loss_of_a_dropout_model_is_refused_naming_train_info(tagger):
    info, plan, batches = tagger
    params = sk.init_sharded(info, plan)
    with pytest.raises(TrainError, match=r"info\.loss_fn.*Fix: train\(info, params, optimizer"):
        train(info.loss_fn, params, optax.adam(1e-2), batches, steps=1, plan=plan)
    with pytest.raises(TrainError, match=r"without the model.*Fix: train\(info, params"):
        train(info.train_loss, params, optax.adam(1e-2), batches, steps=1, plan=plan)


def test_an_nnx_loss_given_a_state_is_refused_naming_train_info(tagger):
    info, plan, batches = tagger
    params = sk.init_sharded(info, plan)
    with pytest.raises(TrainError, match=r"nnx\.State.*not callable.*Fix: train\(info, params"):
        train(tagger_loss, params, optax.adam(1e-2), batches, steps=1, plan=plan)
    with pytest.raises(TrainError, match=r"ModelInfo holds no values"):
        train(tagger_loss, info, optax.adam(1e-2), batches, steps=1, plan=plan)


def test_values_that_are_not_the_described_models_are_refused(tagger):
    info, plan, batches = tagger
    with pytest.raises(TrainError, match=r"Tagger|parameters"):
        train(info, {"w": jnp.zeros(3)}, optax.adam(1e-2), batches, steps=1, plan=plan)


@pytest.mark.slow
def test_on_an_auto_mesh_params_run_in_the_users_own_jit(tagger):
    """An Explicit mesh's arrays carry their sharding in their type, which
    nnx.Embed's gather cannot resolve in plain jax.jit; on an Auto mesh they run
    as any jax array does, before and after training."""
    info, _, batches = tagger
    mesh = sk.make_mesh(data=2, model=4, axis_types="auto")
    plan = sk.plan(info, mesh, "fsdp", estimator="analytic")
    graphdef, _, rngs = nnx.split(Tagger(nnx.Rngs(0)), nnx.Param, ...)

    @jax.jit
    def forward(params, tokens):
        model = nnx.merge(graphdef, params, rngs)
        model.eval()
        return model(tokens)

    params = sk.init_sharded(info, plan)
    assert forward(params, batches[0]["tokens"]).shape == (8, 4, 32)
    res = train(info, params, optax.adam(1e-2), batches, steps=2, plan=plan, progress=False)
    with jax.set_mesh(mesh):
        assert forward(res.params, batches[0]["tokens"]).shape == (8, 4, 32)


@pytest.mark.slow
def test_trained_arrays_live_on_the_users_explicit_mesh(tagger):
    """train hands arrays back on the plan's own mesh, as init_sharded does, so
    code written for Explicit axes runs on them under jax.set_mesh(mesh)."""
    info, plan, batches = tagger
    params = sk.init_sharded(info, plan)
    res = train(info, params, optax.adam(1e-2), batches, steps=1, plan=plan, progress=False)
    leaf = res.params["embed"]["embedding"][...]
    assert leaf.sharding.mesh == plan.mesh
    assert jax.tree.leaves(res.opt_state)[-1].sharding.mesh == plan.mesh
    with jax.set_mesh(plan.mesh):
        doubled = jax.jit(lambda t: jax.tree.map(lambda x: 2 * x, t))(res.params)
    assert jax.tree.leaves(doubled)[0].sharding.mesh == plan.mesh


def test_a_linen_loss_without_rng_that_draws_dropout_gets_a_typed_error():
    batches = net_batches(1)

    def no_rng(variables, batch):
        y, updates = Net().apply(variables, batch["x"], mutable=["batch_stats"])
        return ((y - batch["y"]) ** 2).mean(), updates

    info = sk.describe(Net(), loss=no_rng, batch=batches[0], init_args=(batches[0]["x"],))
    with pytest.raises(sk.SpmdError, match=r"rng=.*Fix: def loss\(variables, batch, rng\)"):
        sk.plan(info, sk.make_mesh(data=2, model=4), "fsdp", estimator="analytic")


@pytest.mark.slow
def test_a_no_op_resume_says_there_is_nothing_to_train(tmp_path, tagger):
    from spmdkit.runtime.checkpoint import Manager

    info, plan, batches = tagger

    def go(steps):
        out = io.StringIO()
        with Manager(tmp_path) as ckpt:
            res = train(info, sk.init_sharded(info, plan), optax.adam(1e-2), batches,
                        steps=steps, plan=plan, ckpt=ckpt, resume=True, out=out)  # fmt: skip
        return res, out.getvalue()

    go(3)
    res, said = go(2)
    assert "nothing to train: checkpoint at step 3 >= steps 2" in said
    assert res.step == 3 and res.history == []
