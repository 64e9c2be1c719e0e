"""train() with a pipelined plan; its checkpoint restores onto pp=1 and pp=4 bit-exact."""

from __future__ import annotations

import io

import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import spmdkit as sk
import spmdkit.step.pipelined as pipelined_module
from spmdkit.introspect.model import describe
from spmdkit.models import get_model
from spmdkit.pipeline import Pipeline
from spmdkit.runtime.checkpoint import Manager, abstract_target
from spmdkit.runtime.data import ShardedLoader
from spmdkit.runtime.train import train
from tests.runtime.test_train import fingerprint


@pytest.mark.slow
def test_train_pipelined_then_restore_on_pp1_and_pp4(tmp_path, monkeypatch):
    ran = []  # train() must run the plan's pipeline, not a plain step on its layouts
    real = pipelined_module.pipelined_value_and_grad

    def spy(loss, pipe, *rest, **kw):
        ran.append(pipe)
        return real(loss, pipe, *rest, **kw)

    monkeypatch.setattr(pipelined_module, "pipelined_value_and_grad", spy)
    info = describe(get_model("gpt"), config="tiny_pipe", batch_size=8)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (32, 17)).astype(np.int32)
    source = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}
    mesh = sk.make_mesh(pipe=2, data=2, model=2, axis_types="auto")
    pipe = Pipeline(stages=2, microbatches=2, schedule="1f1b")
    plan = sk.plan(info, mesh, "fsdp", pipeline=pipe)
    params = jax.device_put(info.init_fn(), plan.param_shardings(info.abstract_params))
    data = ShardedLoader(source, NamedSharding(mesh, P(plan.activation["batch"])), batch_size=8)
    res = train(
        info.loss_fn, params, optax.adam(1e-3), data, steps=3, plan=plan,
        ckpt=Manager(tmp_path), out=io.StringIO(),
    )  # fmt: skip
    flat = sk.make_mesh(data=8, axis_types="auto")
    ref_plan = sk.plan(info, flat, "dp")
    ref_params = jax.device_put(info.init_fn(), ref_plan.param_shardings(info.abstract_params))
    ref = train(
        info.loss_fn, ref_params,
        optax.adam(1e-3), ShardedLoader(source, NamedSharding(flat, P("data")), batch_size=8),
        steps=3, plan=ref_plan, out=io.StringIO(),
    )  # fmt: skip
    assert ran == [pipe]
    np.testing.assert_allclose(res.losses, ref.losses, rtol=1e-5)
    # the executable train ran is the one sk.jit(sk.train_step(...)) compiles
    opt = optax.adam(1e-3)
    batch = {k: v[:8] for k, v in source.items()}
    stepped = describe(info.abstract_params, loss=info.loss_fn, batch=batch)
    step = sk.jit(sk.train_step(stepped, opt, plan), plan, donate_state=True)
    abstract = (info.abstract_params, jax.eval_shape(opt.init, info.abstract_params), batch)
    (executable,) = res.planned.executables.values()
    assert fingerprint(step.compile(*abstract)) == fingerprint(executable)
    saved = res.params
    mgr = Manager(tmp_path)
    for axes, other in (
        ({"data": 8}, None),
        ({"pipe": 4, "data": 2}, Pipeline(stages=4, microbatches=2, schedule="fthenb")),
    ):
        target_plan = sk.plan(info, sk.make_mesh(**axes), "dp", pipeline=other)
        shardings = target_plan.param_shardings(info.abstract_params)
        target = abstract_target(info.abstract_params, shardings)
        got = mgr.restore(target={"params": target}, items=["params"])
        restored = got.state["params"]
        for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(saved), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        layer = restored["blocks"]["fc"]["kernel"]
        assert ("pipe" in str(layer.sharding.spec)) == (other is not None)


@pytest.mark.slow
def test_distributed_optimizer_pipelined_trains_as_dp():
    """``megatron_sp+zero1`` pipelined (Megatron-LM's distributed optimizer): the
    optimizer state sharded over the data axis beside the model axis, the losses
    those of a data-parallel step."""
    info = describe(get_model("llama"), config="tiny_pipe", batch_size=8)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (16, 17)).astype(np.int32)
    source = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}
    losses = []
    for axes, strategy, pipe in (
        (
            {"pipe": 2, "data": 2, "model": 2},
            "megatron_sp+zero1",
            Pipeline(stages=2, microbatches=2, schedule="1f1b"),
        ),
        ({"data": 8}, "dp", None),
    ):
        mesh = sk.make_mesh(**axes, axis_types="auto")
        plan = sk.plan(info, mesh, strategy, pipeline=pipe)
        params = jax.device_put(info.init_fn(), plan.param_shardings(info.abstract_params))
        loader = ShardedLoader(
            source, NamedSharding(mesh, P(plan.activation["batch"])), batch_size=8
        )
        res = train(
            info.loss_fn, params, optax.adam(1e-3), loader, steps=2, plan=plan, out=io.StringIO()
        )
        losses.append(res.losses)
        if pipe is not None:
            assert plan.params["layers/attn/wq"] == P("pipe", None, "model")
            assert plan.opt["layers/attn/wq"] == P("pipe", "data", "model")
            mu = res.opt_state[0].mu["layers"]["attn"]["wq"]
            assert mu.sharding.spec == P("pipe", "data", "model")
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)
