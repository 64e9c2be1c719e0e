"""spmdkit.runtime.train_data: each batch once unless repeat=True; data that runs
out is a typed error; resuming with another optimizer says how to start a fresh one."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import spmdkit as sk
from spmdkit.errors import CheckpointMismatchError
from spmdkit.runtime.checkpoint import Manager
from spmdkit.runtime.train import TrainError, train

_rs = np.random.RandomState(0)
BATCHES = [
    {"x": _rs.randn(8, 4).astype(np.float32), "y": _rs.randn(8, 1).astype(np.float32)}
    for _ in range(3)
]


def linear(p, batch):
    return jnp.mean((batch["x"] @ p["w"] - batch["y"]) ** 2)


def params():
    return {"w": jnp.zeros((4, 1))}


def test_a_list_shorter_than_steps_is_refused_unless_repeat():
    with pytest.raises(TrainError, match=r"list of 3 batches.*Fix: .*steps=3, or repeat=True"):
        train(linear, params(), optax.sgd(0.1), BATCHES, steps=5, progress=False)
    res = train(linear, params(), optax.sgd(0.1), BATCHES, steps=5, repeat=True, progress=False)
    assert res.step == 5


def test_a_generator_runs_and_running_out_is_a_typed_error():
    res = train(linear, params(), optax.sgd(0.1), (b for b in BATCHES), steps=3, progress=False)
    assert res.step == 3
    with pytest.raises(TrainError, match="ran out after step 3"):
        train(linear, params(), optax.sgd(0.1), (b for b in BATCHES), steps=4, progress=False)


def test_resuming_with_another_optimizer_names_restore_opt_state_false(tmp_path):
    with Manager(tmp_path) as ckpt:
        train(linear, params(), optax.adam(0.1), BATCHES, steps=1, ckpt=ckpt, progress=False)
    with Manager(tmp_path) as ckpt, pytest.raises(CheckpointMismatchError) as e:
        train(linear, params(), optax.sgd(0.1, momentum=0.9), BATCHES, steps=2, ckpt=ckpt,
              resume=True, progress=False)  # fmt: skip
    text = str(e.value)
    assert "restore_opt_state=False" in text and "only in the checkpoint: " in text
    assert len(text) < 700  # a summary, not every key
    with Manager(tmp_path) as ckpt:
        res = train(linear, params(), optax.sgd(0.1, momentum=0.9), BATCHES, steps=2,
                    ckpt=ckpt, resume=True, restore_opt_state=False, progress=False)  # fmt: skip
    assert res.start_step == 1 and res.step == 2


def test_sk_jit_warns_once_for_a_batch_size_the_plan_was_not_made_for():
    info = sk.describe(params(), loss=linear, batch=BATCHES[0])
    plan = sk.plan(info, sk.make_mesh(data=2), "dp", estimator="analytic")
    step = sk.jit(jax.value_and_grad(linear), plan)
    with warnings.catch_warnings():
        warnings.simplefilter("error", sk.compile.UnplannedBatchWarning)
        step(params(), BATCHES[0])  # the planned size: no warning
    short = {k: v[:4] for k, v in BATCHES[0].items()}
    with pytest.warns(sk.compile.UnplannedBatchWarning, match=r"batch of 4.*batches of 8"):
        step(params(), short)
    with warnings.catch_warnings():
        warnings.simplefilter("error", sk.compile.UnplannedBatchWarning)
        step(params(), short)  # warned once per size
    assert len(step.executables) == 2
