"""``spmdkit diff``: two strategies or saved plans of one model compared."""

import argparse
import io

import pytest

from spmdkit.cli.app import main
from spmdkit.cli.compare import COMMANDS


def _run(argv):
    (cmd,) = COMMANDS
    parser = argparse.ArgumentParser()
    cmd.configure(parser)
    out = io.StringIO()
    return cmd.run(parser.parse_args(argv), out), out.getvalue()


@pytest.mark.heavy
def test_diff_of_two_strategies_and_a_saved_plan(tmp_path):
    saved = tmp_path / "fsdp.json"
    flags = ["--abstract", "--estimator", "analytic", "--strategy", "fsdp"]
    assert main(["plan", "llama", *flags, "--json", str(saved)]) == 0
    argv = ["llama", str(saved), "megatron", "--abstract", "--estimator", "analytic"]
    code, text = _run(argv)
    assert code == 0
    assert "diff fsdp → megatron" in text and "per collective kind:" in text


def test_a_missing_plan_file_is_a_usage_error(tmp_path, capsys):
    missing = str(tmp_path / "nope.json")
    assert main(["diff", "llama", missing, "fsdp", "--abstract"]) == 2
    assert "no such file" in capsys.readouterr().err


def test_an_unknown_strategy_is_refused_when_parsed(capsys):
    with pytest.raises(SystemExit):
        main(["diff", "llama", "fsdpp", "dp", "--abstract"])
    assert "fsdpp" in capsys.readouterr().err
