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


@pytest.mark.slow
def test_train_cli_says_each_plan_note_once(capsys):
    """The plan's table leaves its notes to train, which prints them before step 1."""
    from spmdkit.cli import main

    argv = ["train", "gpt", "--mesh", "dat=2,model=4", "--strategy", "megatron"]
    assert main([*argv, "--batch-size", "8", "--steps", "1", "--log-every", "1"]) == 0
    captured = capsys.readouterr()
    note = "[idle_axis] mesh axis 'dat'"
    assert captured.out.count(note) == 1 and note not in captured.err, captured
    assert captured.out.index(note) < captured.out.index("step 1/1")


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


@pytest.fixture
def no_devices(monkeypatch):
    """Fail the test if the command gets as far as starting devices (planning and
    training come after that)."""
    import spmdkit.cli.train as train_cli

    def refuse(axes):
        raise AssertionError("flags were not checked before the devices started")

    monkeypatch.setattr(train_cli, "start_devices", refuse)


def test_train_resume_without_ckpt_fails_before_planning(no_devices, capsys):
    from spmdkit.cli import main

    assert main(["train", "gpt", "--resume"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("spmdkit train --resume: --resume comes with --ckpt")
    assert "Traceback" not in err and "Manager(" not in err


def test_train_ckpt_that_is_a_file_fails_before_planning(no_devices, tmp_path, capsys):
    from spmdkit.cli import main

    f = tmp_path / "ckpt.txt"
    f.write_text("not a directory")
    assert main(["train", "gpt", "--ckpt", str(f)]) == 2
    assert "spmdkit train --ckpt: --ckpt names a checkpoint directory" in capsys.readouterr().err
    assert main(["train", "gpt", "--config", "tiniest"]) == 2
    assert "spmdkit train --config: the config be one of" in capsys.readouterr().err
    assert f.read_text() == "not a directory"


def test_train_measure_off_auto_fails_before_planning(no_devices, capsys):
    from spmdkit.cli import main

    assert main(["train", "gpt", "--measure", "--strategy", "fsdp"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("spmdkit train --measure: --measure times auto's candidates")
    assert "--strategy fsdp" in err and "drop --measure" in err


@pytest.mark.slow
def test_train_measure_trains_the_plan_tune_picked(capsys, monkeypatch):
    """``--measure``: the plan trained is the one sk.tune timed fastest (its note
    printed with the others before the first step). Three candidates, one pass each:
    the CLI's path (sk.tune's ranking is tests/compile/test_tune.py's)."""
    import functools

    import spmdkit.compile.tune as tuning
    from spmdkit.cli import main

    quick = functools.partial(tuning.tune, candidates=3, passes=1, min_time_s=0, runoff=0)
    monkeypatch.setattr(tuning, "tune", quick)

    assert main(["train", "gpt", "--config", "tiny", "--mesh", "data=8", "--steps", "2",
                 "--measure"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "[measured] auto timed" in out and "trained steps" in out


def test_train_help_shows_defaults_and_model_configs(capsys):
    from spmdkit.cli import main

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "(default: data=2,model=4)" in text and "(default: tiny, or a model spec" in text
    assert "pkg.module:factory" in text
    assert "gpt (configs: tiny, tiny_pipe" in text and "124m" in text
    with pytest.raises(SystemExit):
        main(["train", "gpt", "--steps", "-1"])
    assert "argument --steps: must be an integer >= 0, given '-1'" in capsys.readouterr().err
