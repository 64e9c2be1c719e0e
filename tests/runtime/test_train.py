"""spmdkit.runtime.train: the planned step, plans made here, accumulation, checkpoints, resume."""

import hashlib
import io
import itertools
import json
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit.runtime.checkpoint import CheckpointMismatchError, Manager
from spmdkit.runtime.data import ShardedLoader
from spmdkit.runtime.train import TrainError, train
from spmdkit.step.recipe import Recipe


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


def plain_loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


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


def run(mesh, steps, *, ckpt=None, resume=False, axes=("a", "b"), loss=loss_fn, **kw):
    sh = tp_shardings(mesh, *axes)
    kw.setdefault("progress", False)
    return train(
        loss,
        MLP(nnx.Rngs(0)),
        optax.adam(1e-2),
        loader(mesh, axes[0]),
        steps=steps,
        shardings=(sh, None),
        ckpt=ckpt,
        resume=resume,
        **kw,
    )


#: The debug sections of compiled HLO text: where each op was traced from (which
#: differs between two call sites of one step), not what runs.
_DEBUG = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")


def fingerprint(compiled):
    """A hash of the compiled program, its source locations left out."""
    text = re.sub(r", metadata=\{[^}]*\}", "", compiled.as_text())
    blocks = [b for b in text.split("\n\n") if b.strip().split("\n")[0] not in _DEBUG]
    return hashlib.sha256("\n\n".join(blocks).encode()).hexdigest()


@pytest.fixture(scope="module")
def mesh(mesh2d):
    return auto(mesh2d)


@pytest.fixture(scope="module")
def reference(mesh):
    """Six uninterrupted steps (the data wraps into a second epoch after four)."""
    return run(mesh, 6, rng=1)


# -- one step, one path --------------------------------------------------------------------


def test_train_updates_the_module_and_keeps_shardings(mesh, reference):
    assert reference.step == 6 and [h["step"] for h in reference.history] == list(range(1, 7))
    assert reference.losses[-1] < reference.losses[0]
    model = reference.params
    assert isinstance(model, MLP)
    assert model.l1.kernel[...].sharding.spec == P(None, "b")
    assert model.l2.kernel[...].sharding.spec == P("b", None)
    # adam's moments follow the params' layout (the plan made from the shardings)
    mu = reference.opt_state[0].mu
    assert mu["l1"]["kernel"].sharding.spec == P(None, "b")
    assert reference.plan.strategy == "given" and reference.plan.activation["batch"] == ("a",)


@pytest.mark.slow
def test_the_executable_train_runs_is_the_one_sk_jit_compiles(mesh2d):
    """train is a loop around sk.jit(sk.train_step(...), plan): the same HLO, for a
    plain plan and for a recipe plan (recompute, bf16 compute, micro-batches)."""
    batch = {"x": X[:16], "y": Y[:16]}
    plan = sk.plan(
        sk.describe(lambda: MLP(nnx.Rngs(0)), loss=plain_loss, batch=batch), mesh2d, "dp"
    )
    opt = optax.adam(1e-2)
    model = MLP(nnx.Rngs(0))
    info = sk.describe(model, loss=plain_loss, batch=batch)
    res = train(plain_loss, model, opt, [batch], steps=2, plan=plan, repeat=True, progress=False)
    (ran,) = res.planned.executables.values()
    step = sk.jit(sk.train_step(info, opt, plan), plan, donate_state=True)
    args = (info.abstract_params, jax.eval_shape(opt.init, info.abstract_params), info.batch)
    assert fingerprint(step.compile(*args)) == fingerprint(ran)

    def scanned(params, batch):  # four layers scanned over stacked weights
        def layer(h, w):
            return jnp.tanh(h @ w.astype(h.dtype)), None

        h, _ = jax.lax.scan(layer, batch["x"].astype(params["w"].dtype), params["w"])
        return jnp.mean(h.astype(jnp.float32) ** 2)

    params = {"w": jnp.full((4, 16, 16), 0.05)}
    data = [{"x": np.ones((8, 16), np.float32)}]
    info = sk.describe(params, loss=scanned, batch=data[0])
    recipe = Recipe(remat="full", compute_dtype="bfloat16", microbatches=2)
    plan = sk.plan(info, mesh2d, "fsdp", recipe=recipe, estimator="analytic")
    res = train(scanned, params, opt, data, steps=1, plan=plan, progress=False)
    (ran,) = res.planned.executables.values()
    step = sk.jit(sk.train_step(info, opt, plan), plan, donate_state=True)
    args = (info.abstract_params, jax.eval_shape(opt.init, info.abstract_params), info.batch)
    assert fingerprint(step.compile(*args)) == fingerprint(ran)


def test_verify_prints_the_table_of_the_step_about_to_run(mesh):
    out = io.StringIO()
    run(mesh, 1, out=out, progress=True, verify=True)
    text = out.getvalue()
    assert "the step about to run, verified" in text and "collectives total" in text


# -- training without a plan -----------------------------------------------------------------


def test_without_a_plan_train_plans_over_every_device():
    """No plan: auto on the loader's (Explicit) mesh, printed once; the params live
    on all 8 devices; a string field compiles once over 10 steps and, with
    accum_steps=2, each micro-batch is traced with its own slice of it."""
    mesh = sk.make_mesh(data=8)
    seen = []

    def named_loss(model, batch):
        seen.append(list(batch["name"]))
        return plain_loss(model, batch)

    source = {"x": X, "y": Y, "name": [f"ex{i}" for i in range(64)]}
    out = io.StringIO()
    data = ShardedLoader(source, NamedSharding(mesh, P("data")), batch_size=16)
    res = train(named_loss, MLP(nnx.Rngs(0)), optax.sgd(0.1), data, steps=10, out=out,
                log_every=10)  # fmt: skip
    assert res.compiles == 1 and res.losses[-1] < res.losses[0]
    assert out.getvalue().count("no plan given") == 1 and "data=8" in out.getvalue()
    assert len(res.params.l1.kernel[...].sharding.device_set) == 8
    seen.clear()
    data = ShardedLoader(source, NamedSharding(mesh, P("data")), batch_size=16)
    res = train(named_loss, MLP(nnx.Rngs(0)), optax.sgd(0.1), data, steps=3, accum_steps=2,
                progress=False)  # fmt: skip
    assert res.compiles == 1 and res.plan.recipe.microbatches == 2
    # the step's traces (planning traced the loss on the whole batch)
    traced = [list(t) for t in dict.fromkeys(map(tuple, seen)) if len(t) == 8]
    assert traced == [[f"ex{i}" for i in range(0, 16, 2)], [f"ex{i}" for i in range(1, 16, 2)]]


def test_without_a_mesh_train_runs_data_parallel_on_all_devices():
    batches = [{"x": X[:16], "y": Y[:16]}, {"x": X[16:32], "y": Y[16:32]}]
    res = train(plain_loss, MLP(nnx.Rngs(0)), optax.sgd(0.1), batches, steps=3, repeat=True,
                progress=False)  # fmt: skip
    assert res.plan.strategy == "dp" and dict(res.plan.mesh.shape) == {"data": 8}
    assert len(res.params.l2.kernel[...].sharding.device_set) == 8


# -- a given plan's notes ----------------------------------------------------------------------

#: The three plans of issue 43 that say more than was asked: a typo'd mesh axis, a
#: batch of 6 on data=4, and auto's own choice (for this MLP, priced on the CPU
#: devices it runs on: replicated, with the best sharded plan's step beside it).
NOTED = {
    "typo": ({"dat": 2, "model": 4}, "megatron", 16, "idle_axis"),
    "batch": ({"data": 4, "model": 2}, "dp", 6, "batch_axes"),
    "auto": ({"data": 2, "model": 4}, "auto", 16, "replicated"),
}


def make_mlp():
    return MLP(nnx.Rngs(0))


@pytest.mark.parametrize("case", NOTED)
def test_a_given_plans_notes_are_warned_by_plan_and_printed_once_by_train(case):
    axes, strategy, size, kind = NOTED[case]
    batch = {"x": X[:size], "y": Y[:size]}
    with pytest.warns(sk.PlanNoteWarning) as caught:
        p = sk.plan(make_mlp, sk.make_mesh(**axes), strategy, loss=plain_loss, batch=batch)
    assert kind in [n.kind for n in p.notes]
    assert [str(w.message) for w in caught] == [str(n) for n in p.notes]
    out = io.StringIO()
    with warnings.catch_warnings():
        warnings.simplefilter("error", sk.PlanNoteWarning)  # train prints, not warns
        train(plain_loss, MLP(nnx.Rngs(0)), optax.sgd(0.1), [batch], steps=1, plan=p, out=out)
    text = out.getvalue()
    assert text.index(f"train: the plan has {len(p.notes)} note(s):") < text.index("step 1")
    for note in p.notes:
        assert text.count(str(note)) == 1, text


def test_a_plan_made_by_train_prints_its_notes_with_its_table_only():
    batches = [{"x": X[:6], "y": Y[:6]}]  # a batch of 6 on 8 devices: noted
    out = io.StringIO()
    with warnings.catch_warnings():
        warnings.simplefilter("error", sk.PlanNoteWarning)
        res = train(plain_loss, MLP(nnx.Rngs(0)), optax.sgd(0.1), batches, steps=1, out=out)
    (note,) = [n for n in res.plan.notes if n.kind == "batch_axes"]
    assert out.getvalue().count(str(note)) == 1 and "the plan has" not in out.getvalue()


# -- accumulation and plans ------------------------------------------------------------------


def test_accumulation_matches_the_plain_step_and_averages_aux(mesh):
    def with_rows(model, batch):
        return plain_loss(model, batch), {"rows": jnp.float32(batch["x"].shape[0])}

    plain = run(mesh, 4, loss=with_rows)
    acc = run(mesh, 4, accum_steps=2, loss=with_rows)
    np.testing.assert_allclose(acc.losses, plain.losses, rtol=1e-5)
    assert plain.history[0]["rows"] == 16 and acc.history[0]["rows"] == 8  # micro-batches
    assert acc.plan.recipe.microbatches == 2


def zero1_plan(mesh, **kw):
    """Params replicated, optimizer moments split over ``a`` where they divide (ZeRO-1)."""
    shapes = {"l1/kernel": (8, 16), "l1/bias": (16,), "l2/kernel": (16, 1), "l2/bias": (1,)}
    opt = {p: P("a") if s[0] % 2 == 0 else P() for p, s in shapes.items()}
    return sk.Plan(mesh, {p: P() for p in shapes}, opt, {"batch": ("a",)}, **kw)


@pytest.mark.slow
def test_plan_gives_param_and_optimizer_shardings(tmp_path, mesh, reference):
    out = io.StringIO()
    res = train(
        loss_fn,
        MLP(nnx.Rngs(0)),
        optax.adam(1e-2),
        loader(mesh, "a"),
        steps=4,
        plan=zero1_plan(mesh, strategy="zero1"),
        rng=1,
        ckpt=Manager(tmp_path),
        log_every=2,
        out=out,
    )
    np.testing.assert_allclose(res.losses, reference.losses[:4], rtol=1e-5)
    assert res.opt_state[0].mu["l1"]["kernel"].sharding.spec == P("a")
    assert res.params.l1.kernel[...].sharding.spec == P()
    meta = Manager(tmp_path).metadata()
    assert json.loads(meta["plan"])["strategy"] == "zero1"
    assert meta["mesh"]["axes"] == {"a": 2, "b": 4}
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and "step 4/4" in lines[-1] and "loss" in lines[-1]


@pytest.mark.slow
def test_the_plan_recipe_runs_micro_batches_zero2_and_offload(mesh):
    """Micro-batches split inside the step, gradients constrained to the plan's
    gradient specs, optimizer state in host memory between steps: the same losses
    as the plain run."""
    grads = {"l1/kernel": P("a"), "l1/bias": P("a"), "l2/kernel": P("a")}
    plan = zero1_plan(mesh, recipe=Recipe(microbatches=2, offload_opt=True), grads=grads)
    res = train(plain_loss, MLP(nnx.Rngs(0)), optax.adam(1e-2), loader(mesh, "a"), steps=4,
                plan=plan, progress=False)  # fmt: skip
    assert {x.sharding.memory_kind for x in jax.tree.leaves(res.opt_state)} == {"pinned_host"}
    assert res.opt_state[0].mu["l1"]["kernel"].sharding.spec == P("a")
    np.testing.assert_allclose(res.losses, run(mesh, 4, loss=plain_loss).losses, rtol=1e-5)


def test_a_recipe_conflicting_with_train_options_raises(mesh):
    plan = zero1_plan(mesh, recipe=Recipe(microbatches=2))
    with pytest.raises(TrainError, match=r"accum_steps=4, plan\.recipe\.microbatches=2"):
        train(loss_fn, MLP(nnx.Rngs(0)), optax.sgd(0.1), loader(mesh, "a"), steps=1,
              plan=plan, accum_steps=4)  # fmt: skip


def test_plain_params_and_aux_metrics(mesh):
    params = {"w": jnp.zeros((8, 1))}

    def loss(p, batch):
        pred = batch["x"] @ p["w"]
        return jnp.mean((pred - batch["y"]) ** 2), {"pred_mean": jnp.mean(pred)}

    res = train(loss, params, optax.sgd(0.1), loader(mesh, "a"), steps=2, progress=False)
    assert set(res.history[0]) == {"step", "loss", "pred_mean"}
    assert res.history[0]["pred_mean"] == 0.0 and res.history[1]["pred_mean"] != 0.0
    assert len(res.params["w"].sharding.device_set) == 8


def test_params_made_on_an_explicit_mesh_train_under_the_plan(mesh2d):
    """sk.init_sharded on sk.make_mesh's Explicit axes gives parameters typed with that
    mesh; the step runs under the plan's Auto axes, and train takes them as they are
    (an optimizer with state, adam, builds it from their shapes)."""
    info = sk.describe(lambda: MLP(nnx.Rngs(0)), loss=plain_loss, batch={"x": X[:16], "y": Y[:16]})
    plan = sk.plan(info, mesh2d, "fsdp", estimator="analytic")
    params = sk.init_sharded(info, plan)
    assert params["l1"]["kernel"].sharding.mesh.axis_types[0] == jax.sharding.AxisType.Explicit
    res = train(
        info.loss_fn,
        params,
        optax.adam(0.1),
        loader(mesh2d, "a"),
        steps=1,
        plan=plan,
        progress=False,
    )
    assert res.step == 1 and np.isfinite(res.losses[0])


def test_bad_configurations_raise(mesh):
    with pytest.raises(TrainError, match="resume=True comes with a checkpoint manager"):
        run(mesh, 1, resume=True)
    with pytest.raises(TrainError, match="not both"):
        train(loss_fn, MLP(nnx.Rngs(0)), optax.sgd(0.1), [], steps=1, plan=object(),
              shardings=({}, None))  # fmt: skip
    with pytest.raises(TrainError, match=r"an sk\.plan Plan"):
        train(loss_fn, MLP(nnx.Rngs(0)), optax.sgd(0.1), [], steps=1, plan=object())
    with pytest.raises(TrainError, match="accum_steps"):
        run(mesh, 1, accum_steps=0)
    with pytest.raises(TrainError, match="at least one batch"):
        train(loss_fn, MLP(nnx.Rngs(0)), optax.sgd(0.1), [], steps=1)
    with pytest.raises(TrainError, match="an iterable of batches"):
        train(loss_fn, MLP(nnx.Rngs(0)), optax.sgd(0.1), lambda: [], steps=1)
    with pytest.raises(TrainError, match="rng=None"):
        run(mesh, 1, rng=None)


def test_a_batch_of_another_size_than_the_plans_is_refused(mesh):
    """A plan made for batches of 16, fed batches of 8: refused before anything runs."""
    batch = {"x": X[:16], "y": Y[:16]}
    p = sk.plan(lambda: MLP(nnx.Rngs(0)), mesh, "dp", loss=plain_loss, batch=batch,
                estimator="analytic")  # fmt: skip
    assert p.batch_size == 16
    with pytest.raises(TrainError, match=r"plan was made for \(16\).*a batch of 8") as e:
        train(plain_loss, MLP(nnx.Rngs(0)), optax.sgd(0.1), loader(mesh, ("a", "b"), 8),
              steps=1, plan=p, progress=False)  # fmt: skip
    assert "feed batches of 16" in e.value.fix


@pytest.mark.slow
def test_every_batch_is_checked_as_it_comes(mesh):
    """The second batch of a list, after a step has run."""
    batch = {"x": X[:16], "y": Y[:16]}
    p = sk.plan(lambda: MLP(nnx.Rngs(0)), mesh, "dp", loss=plain_loss, batch=batch,
                estimator="analytic")  # fmt: skip
    with pytest.raises(TrainError, match="a batch of 8"):
        train(plain_loss, MLP(nnx.Rngs(0)), optax.sgd(0.1), [batch, {"x": X[:8], "y": Y[:8]}],
              steps=2, plan=p, progress=False)  # fmt: skip


# -- checkpoints and resume ---------------------------------------------------------------------


@pytest.mark.slow
def test_resume_is_bit_identical_on_the_same_mesh(tmp_path, mesh, reference):
    first = run(mesh, 3, ckpt=Manager(tmp_path, save_interval_steps=100), rng=1)
    assert first.losses == reference.losses[:3]
    mgr = Manager(tmp_path)
    assert mgr.latest_step() == 3
    assert mgr.metadata()["data"] == {"epoch": 0, "batch": 3}
    out = io.StringIO()
    second = run(mesh, 6, ckpt=mgr, resume=True, rng=1, progress=True, out=out, log_every=10)
    assert second.start_step == 3 and [h["step"] for h in second.history] == [4, 5, 6]
    assert second.losses == reference.losses[3:]  # bit-identical
    assert f"restored step 3 from {tmp_path}" in out.getvalue()
    assert "saved on mesh (a=2, b=4)" in out.getvalue()


@pytest.mark.slow
@pytest.mark.heavy
def test_resume_on_another_mesh_matches_within_tolerance(tmp_path, mesh, reference):
    run(mesh, 3, ckpt=Manager(tmp_path), rng=1)
    other = Mesh(np.array(jax.devices()).reshape(4, 2), ("d", "m"))
    second = run(other, 6, ckpt=Manager(tmp_path), resume=True, axes=("d", "m"), rng=1)
    np.testing.assert_allclose(second.losses, reference.losses[3:], rtol=1e-5)
    assert second.params.l1.kernel[...].sharding.spec == P(None, "m")


def test_a_list_of_batches_resumes_where_it_stopped(tmp_path, mesh):
    """A plain list resumes at the next batch; an iterator is refused; an empty
    checkpoint directory says there was nothing to restore."""
    batches = [{"x": X[i : i + 8], "y": Y[i : i + 8], "first": i} for i in range(0, 40, 8)]
    firsts = []

    def logged(p, batch):
        return jnp.mean((batch["x"] @ p["w"] - batch["y"]) ** 2), {"first": batch["first"]}

    def go(steps, **kw):
        out = io.StringIO()
        res = train(logged, {"w": jnp.zeros((8, 1))}, optax.sgd(0.1), batches, steps=steps,
                    ckpt=Manager(tmp_path), out=out, log_every=100, **kw)  # fmt: skip
        firsts.append([int(h["first"]) for h in res.history])
        return out.getvalue()

    said = go(3, resume=True)
    assert f"nothing to restore in {tmp_path}; starting at step 0" in said
    with pytest.raises(TrainError, match=r"a list of 5 batches.*repeat=True"):
        go(7, resume=True)  # refused before anything runs: no silent second epoch
    said = go(7, resume=True, repeat=True)
    assert "restored step 3" in said and "batch 3 of 5" in said
    assert firsts == [[0, 8, 16], [24, 32, 0, 8]]  # the second epoch starts over
    with pytest.raises(TrainError, match="one-shot iterator"):
        train(logged, {"w": jnp.zeros((8, 1))}, optax.sgd(0.1), iter(batches), steps=9,
              ckpt=Manager(tmp_path), resume=True)  # fmt: skip


@pytest.mark.slow
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


# -- batch trees ---------------------------------------------------------------------------------


def test_string_ids_and_nested_fields_pass_around_the_step(mesh):
    """Non-tensor leaves (a list of example ids) and a nested array field pass through
    the loader and the compiled step; the ids are the step's static part, compared by
    structure: one compile for every batch."""
    seen = []

    def nested_loss(model, batch):
        ids = batch["meta"]["ids"]
        assert isinstance(ids, list) and all(isinstance(i, str) for i in ids)
        seen.append(ids)  # at trace time: the non-tensor part is static
        return plain_loss(model, {"x": batch["inp"]["x"], "y": batch["y"]})

    source = {"inp": {"x": X}, "y": Y, "meta": {"ids": [f"ex{i}" for i in range(64)]}}
    data = ShardedLoader(source, NamedSharding(mesh, P("a")), batch_size=16)
    res = train(nested_loss, MLP(nnx.Rngs(0)), optax.adam(1e-2), data, steps=3,
                shardings=(tp_shardings(mesh, "a", "b"), None), progress=False)  # fmt: skip
    plain = run(mesh, 3, loss=plain_loss)
    np.testing.assert_allclose(res.losses, plain.losses, rtol=1e-6)
    assert res.compiles == 1 and seen[0] == [f"ex{i}" for i in range(16)]


def test_bucketed_lengths_compile_per_bucket_and_match_the_unpadded_loss(mesh):
    """Five different lengths, three buckets: at most three compiled steps, and each
    step's loss (and so its update) equals the computation on the unpadded examples."""
    lengths = [3, 5, 6, 7, 9] * 4
    rs = np.random.RandomState(1)
    tokens = [rs.randint(0, 16, n).astype(np.int32) for n in lengths]
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
    rep = NamedSharding(mesh, P())
    params = {k: jnp.asarray(v) for k, v in init.items()}
    sh = ({k: rep for k in params}, None)
    res = train(masked_loss, params, optax.sgd(0.1), data, steps=5, shardings=sh, progress=False)
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


# -- model state ---------------------------------------------------------------------------------


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
    return train(plain_loss, model, optax.adam(1e-2), loader(mesh, "a"), steps=steps,
                 shardings=(sh, None), progress=False, **kw)  # fmt: skip


@pytest.mark.slow
def test_batch_stats_are_carried_not_optimized_and_checkpointed(tmp_path, mesh):
    """An NNX module's BatchStats: updated every step (not by the optimizer, which
    has no state for them), written back into the module, saved as model_state and
    restored on resume: 3 steps + resume to 5 == 5 uninterrupted."""
    whole = run_bn(mesh, 5)
    first = BatchNormMLP(nnx.Rngs(0)).bn.mean[...]
    assert not np.allclose(whole.model_state["bn"]["mean"][...], first)
    np.testing.assert_array_equal(whole.params.bn.mean[...], whole.model_state["bn"]["mean"][...])
    assert set(whole.opt_state[0].mu["bn"]) == {"scale", "bias"}  # no mean/var moments
    run_bn(mesh, 3, ckpt=Manager(tmp_path))
    mgr = Manager(tmp_path)
    assert {"model_state/bn/mean", "model_state/bn/var"} <= set(mgr.saved_shapes())
    second = run_bn(mesh, 5, ckpt=mgr, resume=True)
    assert second.losses == whole.losses[3:]
    for a, b in zip(*map(jax.tree.leaves, (second.model_state, whole.model_state)), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_variables_dict_carries_its_collections_through_the_micro_batches(mesh):
    """A linen-style variables dict: ``params`` trained, the other collections carried
    as state, updated by the loss's ``(loss, updates)`` through each micro-batch in
    order (micro-batch i: rows i, i+2, ...)."""
    variables = {"params": {"w": jnp.zeros((8, 1))}, "stats": {"mean": jnp.zeros((8,))}}

    def loss(v, batch):
        new = {"mean": 0.5 * v["stats"]["mean"] + 0.5 * batch["x"].mean(0)}
        return jnp.mean((batch["x"] @ v["params"]["w"] - batch["y"]) ** 2), {"stats": new}

    sh = ({"params": {"w": NamedSharding(mesh, P())}}, None)
    res = train(loss, variables, optax.sgd(0.1), loader(mesh, "a"), steps=2, shardings=sh,
                accum_steps=2, progress=False)  # fmt: skip
    want = np.zeros(8)
    for start in (0, 16):
        for i in range(2):
            want = 0.5 * want + 0.5 * X[start : start + 16][i::2].mean(0)
    np.testing.assert_allclose(res.model_state["stats"]["mean"], want, rtol=1e-5)
    assert res.model_state["stats"]["mean"].sharding.spec == P()
    assert set(res.params) == {"params", "stats"}  # handed back as it was given


# -- randomness and linen -----------------------------------------------------------------------


class Dropped(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(8, 16, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.l2 = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, x):
        h = self.drop(jnp.tanh(self.l1(x)))
        return self.l2(h), h


def dropout_loss(model, batch):  # dropout as users write it: the module holds its Rngs
    y, h = model(batch["x"])
    return jnp.mean((y - batch["y"]) ** 2), {"kept": (h[0] != 0).astype(jnp.float32)}


@pytest.mark.slow
def test_dropout_draws_a_new_mask_every_step_and_resumes_its_stream(tmp_path):
    """The per-step key reaches nnx.Dropout: consecutive steps drop different units,
    one seed gives bit-identical runs, and stopped + resumed equals uninterrupted."""
    batches = [{"x": X[:16], "y": Y[:16]}]
    plan = None

    def go(steps, **kw):
        kw.setdefault("rng", 7)
        return train(dropout_loss, Dropped(nnx.Rngs(0)), optax.sgd(0.1), batches, steps=steps,
                     plan=plan, repeat=True, progress=False, **kw)  # fmt: skip

    whole = go(4)
    plan = whole.plan
    masks = [h["kept"] for h in whole.history]
    assert not any(np.array_equal(a, b) for a, b in itertools.pairwise(masks))
    again = go(4)
    assert again.losses == whole.losses
    assert go(4, rng=8).losses != whole.losses
    go(2, ckpt=Manager(tmp_path))
    resumed = go(4, ckpt=Manager(tmp_path), resume=True)
    assert resumed.losses == whole.losses[2:]
    np.testing.assert_array_equal(resumed.history[-1]["kept"], masks[-1])


@pytest.mark.slow
def test_a_linen_cnn_with_batch_norm_and_dropout_resumes_on_another_mesh(tmp_path):
    """One loss for a linen model (variables, batch, rng) -> (loss, updates): train
    splits the variables dict itself, draws dropout from the step key, carries the
    batch statistics, and resumes onto another mesh."""
    import flax.linen as nn

    class CNN(nn.Module):
        @nn.compact
        def __call__(self, x, train=True):
            x = nn.Conv(8, (3, 3))(x)
            x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
            x = nn.Dropout(0.3, deterministic=not train)(nn.relu(x))
            return nn.Dense(4)(x.mean((1, 2)))

    def loss(variables, batch, rng):
        logits, updates = CNN().apply(
            variables, batch["img"], rngs={"dropout": rng}, mutable=["batch_stats"]
        )
        xent = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
        return xent.mean(), updates

    rs = np.random.RandomState(0)
    source = {"img": rs.randn(32, 8, 8, 3).astype(np.float32), "label": rs.randint(0, 4, 32)}

    def go(mesh, steps, **kw):
        variables = CNN().init(jax.random.key(0), source["img"][:2], train=False)
        data = ShardedLoader(source, NamedSharding(mesh, P("data")), batch_size=8)
        kw.setdefault("progress", False)
        return train(loss, variables, optax.adam(1e-2), data, steps=steps, **kw)

    whole = go(sk.make_mesh(data=8), 4)
    assert set(whole.params) == {"params", "batch_stats"}
    assert set(whole.model_state) == {"batch_stats"}
    go(sk.make_mesh(data=8), 2, ckpt=Manager(tmp_path))
    out = io.StringIO()
    resumed = go(sk.make_mesh(data=4, model=2), 4, ckpt=Manager(tmp_path), resume=True,
                 progress=True, out=out)  # fmt: skip
    assert "restored step 2" in out.getvalue() and "saved on mesh (data=8)" in out.getvalue()
    np.testing.assert_allclose(resumed.losses, whole.losses[2:], rtol=1e-5)


@pytest.mark.slow
def test_delayed_fp8_histories_are_carried_checkpointed_and_restored(tmp_path, mesh):
    """``Recipe(compute_dtype="float8", fp8_scaling="delayed")``: the amax histories
    are the step's state: replicated, saved with the checkpoint and restored, so
    resuming at step 2 is bit-identical to 4 uninterrupted steps; they come back
    in ``model_state`` (one per float8 weight matmul: the MLP's last layer, its
    head, stays bf16), not in the model."""
    batch = {"x": X[:16], "y": Y[:16]}
    rcp = Recipe(compute_dtype="float8", fp8_scaling="delayed")
    p = sk.plan(lambda: MLP(nnx.Rngs(0)), mesh, "fsdp", loss=plain_loss, batch=batch,
                recipe=rcp, estimator="analytic")  # fmt: skip

    def go(steps, **kw):
        return train(plain_loss, MLP(nnx.Rngs(0)), optax.adam(1e-2), loader(mesh, "a"),
                     steps=steps, plan=p, progress=False, **kw)  # fmt: skip

    whole = go(4)
    hist = whole.model_state
    assert sorted(hist) == ["fp8_amax_0000"]
    for h in hist.values():
        assert h.shape == (3, 16) and h.sharding.is_fully_replicated
        assert np.all(np.asarray(h[:, :4]) > 0) and np.all(np.asarray(h[:, 4:]) == 0)
    go(2, ckpt=Manager(tmp_path, save_interval_steps=100))
    assert any(p.startswith("model_state/fp8_amax_") for p in Manager(tmp_path).saved_shapes())
    resumed = go(4, ckpt=Manager(tmp_path), resume=True)
    assert resumed.losses == whole.losses[2:]
    jax.tree.map(np.testing.assert_array_equal, resumed.model_state, hist)
