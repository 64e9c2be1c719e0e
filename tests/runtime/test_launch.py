"""spmdkit.runtime.launch: local multi-process runs, a failing process stops the rest, and
2 processes x 4 devices train + save, then 1 process x 8 devices restores and goes on."""

import io
import json
import os
import sys
import textwrap

import numpy as np
import pytest

from spmdkit.runtime.launch import (
    ENV_COORDINATOR,
    ENV_LOCAL_DEVICES,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    LaunchError,
    child_env,
    initialize_from_env,
    launch,
)

# The model, data and training call shared by the child processes and the
# single-process reference run in this test process.
_COMMON = textwrap.dedent(
    """
    import json
    import jax, jax.numpy as jnp, numpy as np, optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from spmdkit.runtime.checkpoint import Manager
    from spmdkit.runtime.data import ShardedLoader
    from spmdkit.runtime.train import train

    B, D, H = 16, 8, 16
    _rs = np.random.RandomState(0)
    X = _rs.randn(64, D).astype(np.float32)
    Y = np.tanh(X @ _rs.randn(D, 1)).astype(np.float32)

    def loss(p, b):
        return jnp.mean((jnp.tanh(b["x"] @ p["w1"]) @ p["w2"] - b["y"]) ** 2)

    def run(shape, steps, ckdir, resume):
        # dp x tp: batch over "data", w1 column- and w2 row-sharded over "model"
        mesh = Mesh(np.array(jax.devices()).reshape(shape), ("data", "model"))
        npc, pid = jax.process_count(), jax.process_index()
        local = lambda a: a.reshape(-1, npc, B // npc, *a.shape[1:])[:, pid].reshape(
            -1, *a.shape[1:])
        k1, k2 = jax.random.split(jax.random.key(0))
        sh = {"w1": NamedSharding(mesh, P(None, "model")),
              "w2": NamedSharding(mesh, P("model", None))}
        init = {"w1": jax.random.normal(k1, (D, H)) * 0.3,
                "w2": jax.random.normal(k2, (H, 1)) * 0.3}
        params = {k: jax.device_put(np.asarray(v), sh[k]) for k, v in init.items()}
        data = ShardedLoader({"x": local(X), "y": local(Y)}, NamedSharding(mesh, P("data")),
                             batch_size=B // npc)
        mgr = Manager(ckdir) if ckdir else None
        res = train(loss, params, optax.adam(1e-2), data, steps=steps, shardings=(sh, None),
                    ckpt=mgr, resume=resume, progress=False)
        if mgr is not None:
            mgr.close()
        return res.losses
    """
)

_CHILD = (
    "import sys\n"
    "from spmdkit.runtime.launch import initialize_from_env\n"
    "initialize_from_env()\n"
    + _COMMON
    + textwrap.dedent(
        """
        shape = tuple(int(n) for n in sys.argv[1].split("x"))
        losses = run(shape, int(sys.argv[2]), sys.argv[3], sys.argv[4] == "resume")
        if jax.process_index() == 0:
            with open(sys.argv[5], "w") as f:
                json.dump(losses, f)
        """
    )
)


def _env():
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    return env


@pytest.mark.slow
@pytest.mark.heavy
def test_two_processes_train_then_one_process_restores_on_another_mesh(tmp_path):
    ns: dict = {}
    exec(_COMMON, ns)
    reference = ns["run"]((2, 4), 6, None, False)  # one process, 8 devices

    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    ck = str(tmp_path / "ck")
    err = io.StringIO()
    cmd = [sys.executable, str(script)]
    rc = launch(
        2,
        [*cmd, "2x4", "3", ck, "fresh", str(tmp_path / "a.json")],
        devices_per_process=4,
        timeout=120,
        env=_env(),
        err=err,
    )
    assert rc == 0, err.getvalue()
    first = json.loads((tmp_path / "a.json").read_text())
    np.testing.assert_allclose(first, reference[:3], rtol=1e-5)

    # one process with 8 devices restores onto dp=4 x tp=2 and continues
    rc = launch(
        1,
        [*cmd, "4x2", "6", ck, "resume", str(tmp_path / "b.json")],
        devices_per_process=8,
        timeout=120,
        env=_env(),
        err=err,
    )
    assert rc == 0, err.getvalue()
    second = json.loads((tmp_path / "b.json").read_text())
    assert len(second) == 3
    np.testing.assert_allclose(second, reference[3:], rtol=1e-5)


_DIES = textwrap.dedent(
    """
    import os, signal
    from spmdkit.runtime.launch import initialize_from_env
    initialize_from_env()
    import jax, jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    mesh = jax.make_mesh((jax.device_count(),), ("x",))
    x = jax.device_put(jnp.ones(jax.device_count()), NamedSharding(mesh, P("x")))
    total = jax.jit(lambda v: v.sum())(x)  # both processes are up and talking
    if jax.process_index() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    while True:  # process 0 would wait in collectives forever
        total = jax.jit(lambda v: v.sum())(x + total)
        total.block_until_ready()
    """
)


@pytest.mark.slow
@pytest.mark.heavy
def test_a_killed_process_stops_the_others_with_a_clear_error(tmp_path):
    script = tmp_path / "dies.py"
    script.write_text(_DIES)
    err = io.StringIO()
    # timeout is the bound: a hang would return 124 instead of the child's signal
    rc = launch(
        2,
        [sys.executable, str(script)],
        devices_per_process=2,
        timeout=90,
        grace_s=2,
        env=_env(),
        err=err,
    )
    assert rc == 128 + 9, err.getvalue()
    assert "process 1 of 2 failed (signal 9); stopping the other processes" in err.getvalue()


def test_child_environment():
    env = child_env(
        {"XLA_FLAGS": "--xla_force_host_platform_device_count=3 --foo"},
        coordinator="127.0.0.1:1234",
        nproc=2,
        pid=1,
        ndev=4,
        heartbeat=7,
    )
    assert env[ENV_COORDINATOR] == "127.0.0.1:1234"
    assert (env[ENV_NUM_PROCESSES], env[ENV_PROCESS_ID], env[ENV_LOCAL_DEVICES]) == ("2", "1", "4")
    assert env["XLA_FLAGS"] == "--foo --xla_force_host_platform_device_count=4"
    assert env["JAX_PLATFORMS"] == "cpu"


def test_bad_launch_arguments_raise(monkeypatch):
    with pytest.raises(LaunchError, match="nproc"):
        launch(0, ["true"])
    with pytest.raises(LaunchError, match="a command"):
        launch(2, [])
    monkeypatch.delenv(ENV_COORDINATOR, raising=False)
    assert initialize_from_env() is False  # not launched: a single process, nothing done
    monkeypatch.setenv(ENV_COORDINATOR, "127.0.0.1:1")
    monkeypatch.setenv(ENV_NUM_PROCESSES, "two")
    with pytest.raises(LaunchError, match="ints"):
        initialize_from_env()


def test_failing_exit_status_is_returned(tmp_path):
    err = io.StringIO()
    rc = launch(2, [sys.executable, "-c", "import os, sys; sys.exit(3)"], env=_env(), err=err)
    assert rc == 3 and "exit status 3" in err.getvalue()
