"""spmdkit.cli.train: the ``train`` and ``launch`` subcommands' parsing and launch."""

import argparse
import sys

import pytest

from spmdkit.cli.train import COMMANDS, parse_mesh, pipeline_of
from spmdkit.errors import SpmdError


def _parser(name):
    (cmd,) = [c for c in COMMANDS if c.name == name]
    parser = argparse.ArgumentParser()
    cmd.configure(parser)
    return parser, cmd


def test_parse_mesh():
    assert parse_mesh("data=2,model=4") == {"data": 2, "model": 4}
    for bad in ("data2", "data=0", "=2", "data=x"):
        with pytest.raises(SpmdError, match="NAME=SIZE"):
            parse_mesh(bad)


def test_train_arguments():
    parser, _ = _parser("train")
    args = parser.parse_args(
        ["gpt", "--mesh", "data=4,model=2", "--steps", "5", "--ckpt", "/tmp/x", "--resume"]
    )
    assert (args.model, args.mesh, args.steps, args.ckpt, args.resume, args.verify) == (
        "gpt",
        "data=4,model=2",
        5,
        "/tmp/x",
        True,
        False,
    )
    assert parser.parse_args(["gpt", "--verify"]).verify


def test_pipe_axis_picks_a_pipeline():
    parser, _ = _parser("train")
    args = parser.parse_args(["gpt", "--mesh", "pipe=2,data=4"])
    assert pipeline_of(args, {"pipe": 2, "data": 4}).short() == "pp2 1f1b m4"
    args = parser.parse_args(["gpt", "--virtual", "2", "--microbatches", "2"])
    assert pipeline_of(args, {"pipe": 2}).short() == "pp2x2 interleaved m2"
    assert pipeline_of(parser.parse_args(["gpt"]), {"data": 8}) is None
    with pytest.raises(SpmdError, match="pipe"):
        pipeline_of(parser.parse_args(["gpt", "--schedule", "gpipe"]), {"data": 8})


@pytest.mark.slow
def test_train_cli_pipelines_over_a_pipe_axis(capsys):
    from spmdkit.cli import main

    argv = ["train", "gpt", "--config", "tiny_pipe", "--mesh", "pipe=2,data=2,model=2"]
    argv += ["--strategy", "fsdp", "--batch-size", "16", "--steps", "2", "--log-every", "2"]
    assert main([*argv, "--verify"]) == 0
    out = capsys.readouterr().out
    assert "pipeline: pp2 1f1b m4" in out and "trained steps 1..2" in out
    assert "the step about to run, verified" in out and "collectives total" in out


def test_launch_runs_the_command_in_n_processes(tmp_path, capfd):
    parser, cmd = _parser("launch")
    code = (
        "import os; print('proc', os.environ['SPMDKIT_PROCESS_ID'], "
        "os.environ['SPMDKIT_NUM_PROCESSES'], os.environ['SPMDKIT_LOCAL_DEVICES'])"
    )
    args = parser.parse_args(
        ["--nproc", "2", "--devices-per-process", "3", "--", sys.executable, "-c", code]
    )
    assert cmd.run(args, sys.stdout) == 0
    lines = sorted(line for line in capfd.readouterr().out.splitlines() if line.startswith("proc"))
    assert lines == ["proc 0 2 3", "proc 1 2 3"]
    args = parser.parse_args(["--nproc", "2", "--", sys.executable, "-c", "raise SystemExit(4)"])
    assert cmd.run(args, sys.stdout) == 4
    args = parser.parse_args(["--nproc", "0", "--", "true"])
    assert cmd.run(args, sys.stdout) == 2
