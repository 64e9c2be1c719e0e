"""The command line: ``spmdkit rules [OP]``, the parser, ``python -m spmdkit``."""

import subprocess
import sys

import pytest

import spmdkit as sk
from spmdkit.cli import COMMANDS, build_parser, main


def test_rules_lists_every_registered_op(capsys):
    assert main(["rules"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith(f"{len(sk.registered_ops())} registered ops")
    listed = [line.split()[0] for line in lines[1:]]
    assert listed == list(sk.registered_ops())
    matmul = next(line for line in lines if line.split()[0] == "matmul")
    assert "matmul" in matmul.split()[1]  # the family column
    assert "m k, k n -> m n" in matmul
    assert "[partial: MULTIPLICATIVE]" in matmul


def test_rules_op_shows_doc_and_expanded_examples(capsys):
    assert main(["rules", "softmax"]) == 0
    out = capsys.readouterr().out
    rule = sk.get_rule("softmax")
    assert out.startswith("softmax  (family: softmax)")
    assert rule.doc in out
    assert "d0 d1 -> d0 d1  [replicated: d1]" in out  # axis=-1 on (8, 8)
    assert "[replicated: d0]" in out  # axis=0
    assert out.count("axis=") == len(rule.examples)


def test_rules_unknown_op_names_near_match(capsys):
    assert main(["rules", "matmal"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "'matmul'" in captured.err


def test_parser_has_the_commands_and_needs_one(capsys):
    parser = build_parser()
    assert parser.parse_args(["rules", "add"]).op == "add"
    assert parser.parse_args(["rules"]).op is None
    assert parser.parse_args(["demo", "--cpu"]).cpu is True
    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code == 2
    with pytest.raises(SystemExit):
        main(["--help"])
    helptext = capsys.readouterr().out
    for cmd in COMMANDS:
        assert cmd.name in helptext


def test_python_dash_m_spmdkit_runs_the_cli(tmp_path):
    res = subprocess.run(
        [sys.executable, "-m", "spmdkit", "rules", "reduce_sum"],
        cwd=tmp_path,
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("reduce_sum  (family: reduction)")
    assert "[reduce r1: sum]" in res.stdout
