"""The command line: ``spmdkit rules [OP]``, the parser, ``python -m spmdkit``."""

import json
import subprocess
import sys
from pathlib import Path

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


@pytest.mark.heavy
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


def test_bad_flags_fail_before_jax_is_imported(tmp_path):
    """Command lines whose flags cannot work fail with their typed message without
    importing jax (or flax, optax, orbax): ``import spmdkit`` loads its names on
    first use, and the commands check flags before importing the models. One
    fresh process runs them all."""
    (tmp_path / "file").write_text("not a directory")
    cases = [
        ["train", "gpt", "--resume"],
        ["train", "gpt", "--ckpt", str(tmp_path / "file")],
        ["export", str(tmp_path / "missing"), str(tmp_path / "out")],
        ["plan", "gpt", "--json", str(tmp_path / "missing" / "plan.json")],
    ]
    code = (
        "import json, sys; from spmdkit.cli import main; "
        "rcs = [main(argv) for argv in json.loads(sys.argv[1])]; "
        "heavy = sorted(m for m in ('jax', 'flax', 'optax', 'orbax') if m in sys.modules); "
        "print(json.dumps([rcs, heavy]))"
    )
    root = Path(sk.__file__).resolve().parents[1]
    res = subprocess.run(
        [sys.executable, "-c", code, json.dumps(cases)],
        cwd=root,
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    rcs, heavy = json.loads(res.stdout)
    assert rcs == [2] * len(cases) and heavy == []
    errors = res.stderr.splitlines()
    assert [e.split(":")[0] for e in errors] == [
        "spmdkit train --resume",
        "spmdkit train --ckpt",
        "spmdkit export CKPT",
        "spmdkit plan --json",
    ]
    assert not (tmp_path / "out").exists()
