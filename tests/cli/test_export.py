"""spmdkit.cli.export: the ``export`` and ``import`` subcommands."""

import argparse
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from spmdkit.cli.app import build_parser
from spmdkit.cli.export import COMMANDS
from spmdkit.models import get_model
from spmdkit.runtime.checkpoint import Manager, tree_paths
from spmdkit.runtime.export import export_params, exported_config, exported_shapes


def _run(name, argv):
    (cmd,) = [c for c in COMMANDS if c.name == name]
    parser = argparse.ArgumentParser()
    cmd.configure(parser)
    out = io.StringIO()
    return cmd.run(parser.parse_args(argv), out), out.getvalue()


def test_export_writes_a_checkpoints_params(tmp_path, mesh2d, capsys):
    w = jax.device_put(jnp.arange(32.0).reshape(8, 4), NamedSharding(mesh2d, P("a", "b")))
    state = {"params": {"l1": {"kernel": w}}, "opt_state": {"mu": w * 0}}
    with Manager(tmp_path / "ckpt", async_=False) as mgr:
        mgr.save(7, state, config={"hidden": 4})
    code, text = _run("export", [str(tmp_path / "ckpt"), str(tmp_path / "out")])
    assert code == 0 and "exported 1 tensors" in text and "step 7" in text
    assert set(exported_shapes(tmp_path / "out")) == {"l1/kernel"}
    assert exported_config(tmp_path / "out") == {"hidden": 4}
    with Manager(tmp_path / "empty", async_=False) as mgr:
        mgr.save(1, {"opt_state": {"mu": w}})
    code, _ = _run("export", [str(tmp_path / "empty"), str(tmp_path / "x")])
    assert code == 2 and "params/" in capsys.readouterr().err
    assert {"export", "import"} <= set(build_parser()._subparsers._group_actions[0].choices)


@pytest.mark.slow
def test_import_loads_an_export_onto_a_plan_and_saves_a_checkpoint(tmp_path):
    spec = get_model("gpt")
    with nnx.use_eager_sharding(False):
        model = spec.build(spec.config("tiny"), nnx.Rngs(3))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    export_params(params, tmp_path / "exp", config={"size": "tiny"})
    argv = [str(tmp_path / "exp"), "gpt", "--mesh", "data=4,model=2", "--strategy", "fsdp"]
    code, text = _run("import", [*argv, "--ckpt", str(tmp_path / "ckpt")])
    assert code == 0 and "onto plan 'fsdp'" in text
    mgr = Manager(tmp_path / "ckpt")
    assert mgr.metadata()["config"]["value"] == {"size": "tiny"}
    code, _ = _run("export", [str(tmp_path / "ckpt"), str(tmp_path / "again")])
    assert code == 0
    from spmdkit.runtime.export import import_params

    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.eval_shape(lambda: params)
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one), abstract)
    back = tree_paths(import_params(tmp_path / "again", target))
    for p, x in tree_paths(params).items():
        np.testing.assert_array_equal(np.asarray(back[p]), np.asarray(x), err_msg=p)


def test_export_of_a_missing_checkpoint_creates_nothing(tmp_path, capsys):
    code, _ = _run("export", [str(tmp_path / "missing"), str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and "spmdkit export CKPT: CKPT is a directory holding a checkpoint" in err
    assert "does not exist" in err and "start without resume" not in err
    assert sorted(tmp_path.iterdir()) == []
    (tmp_path / "empty").mkdir()
    code, _ = _run("export", [str(tmp_path / "empty"), str(tmp_path / "out")])
    assert code == 2 and "CKPT holds at least one complete checkpoint" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]
    assert list((tmp_path / "empty").iterdir()) == []


def test_export_in_a_fresh_process_prints_no_traceback(tmp_path):
    """An empty CKPT directory: orbax's manager is opened (and must be closed
    before the process exits, or its cleanup thread prints a traceback)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]  # this checkout's spmdkit
    (tmp_path / "empty").mkdir()
    res = subprocess.run(
        [sys.executable, "-m", "spmdkit", "export", str(tmp_path / "empty"), str(tmp_path / "o")],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2 and "spmdkit export CKPT: CKPT holds" in res.stderr
    assert "Traceback" not in res.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["empty"]
