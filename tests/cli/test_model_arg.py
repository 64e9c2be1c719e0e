"""spmdkit.cli.model_arg: MODEL as a reference model or the user's ``module:factory``
(tests/cli/mymodel.py, a model defined outside spmdkit.models)."""

import os
import pathlib
import subprocess
import sys

import pytest

from spmdkit.cli import main
from spmdkit.cli.model_arg import check_model_arg, resolve_model
from spmdkit.errors import UsageError
from spmdkit.models import UnknownModelError

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


@pytest.fixture
def in_tests_cli(monkeypatch):
    """Run from tests/cli with it off sys.path: ``mymodel`` is found as ``python -m``
    finds a module, in the current directory."""
    monkeypatch.chdir(HERE)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", HERE)])
    monkeypatch.delitem(sys.modules, "mymodel", raising=False)


def test_plan_a_model_defined_outside_spmdkit_models(capsys):
    argv = ["plan", "tests.cli.mymodel:make_spec", "--abstract", "--mesh", "data=8"]
    assert main([*argv, "--strategy", "fsdp", "--estimator", "analytic"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("global batch 8, sequence 8 (64 tokens/step)")
    assert "Plan 'fsdp' on mesh data=8" in out
    assert "blocks/up/kernel    1  2×16×32  layers,embed,mlp (inferred)" in out
    # --config picks among the spec's configs (its first, "small", by default)
    assert main([*argv, "--config", "wide", "--estimator", "analytic"]) == 0
    assert "blocks/up/kernel    1  2×32×64" in capsys.readouterr().out


def test_a_factory_returning_a_model_info_gets_the_batch_size(in_tests_cli, capsys):
    argv = ["plan", "mymodel:make_info", "--abstract", "--estimator", "analytic"]
    assert main([*argv, "--batch-size", "16"]) == 0
    assert capsys.readouterr().out.startswith("global batch 16, sequence 8")
    model = resolve_model("spmdkit plan", "mymodel:make_info")
    assert model.spec is None and model.batch_size == 8  # the factory's default


@pytest.mark.parametrize(
    ("model", "flags", "message"),
    [
        ("nomodule:make", [], "no module 'nomodule' (current directory"),
        ("tests.nopkg.mymodel:make", [], "no module 'tests.nopkg'"),
        ("mymodel:make_spce", [], "mymodel has no 'make_spce'. Fix: did you mean 'make_spec'?"),
        ("mymodel.make_spec", [], "'mymodel.make_spec'. Fix: did you mean mymodel:make_spec?"),
        ("mymodel", [], "mymodel is a module: name its factory, mymodel:<function>"),
        ("gtp", [], "did you mean 'gpt'?"),
        ("mymodel:make-it", [], "dotted Python names, one colon"),
        ("mymodel:make_module", [], "returned TinyLM. Fix: a bare module has no loss or batch"),
        ("mymodel:make_with_seed", [], "requires seed"),
        ("mymodel:Config", [], "returned Config"),
        ("mymodel:make_info", ["--config", "wide"], "spmdkit plan --config: --config reaches"),
        ("mymodel:make_spec", ["--config", "smal"], "did you mean 'small'?"),
    ],
)  # fmt: skip
def test_model_errors_name_the_argument_and_the_fix(in_tests_cli, capsys, model, flags, message):
    assert main(["plan", model, "--abstract", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert err.startswith("spmdkit plan ") and "Traceback" not in err


def test_report_and_train_need_a_model_spec(in_tests_cli):
    model = resolve_model("spmdkit report", "mymodel:make_info")
    with pytest.raises(UsageError, match=r"spmdkit report MODEL: .*returns a ModelInfo"):
        model.require_spec("spmdkit report")
    assert resolve_model("spmdkit train", "mymodel:SPEC").require_spec("x").name == "tinylm"


def test_check_model_arg_names_model_or_config():
    check_model_arg("spmdkit plan", "gpt", "tiny")
    with pytest.raises(UnknownModelError, match=r"spmdkit plan MODEL: .*did you mean 'gpt'"):
        check_model_arg("spmdkit plan", "gtp", "tiny")
    config = r"spmdkit plan --config: the config be one of tiny, .*'tiniest'"
    with pytest.raises(UnknownModelError, match=config):
        check_model_arg("spmdkit plan", "gpt", "tiniest")


def test_bad_flags_fail_before_jax_is_imported():
    """A bad --strategy, or a factory whose module does not exist, fails in the
    parse or flag check: exit 2 with the flag, the choices and the near match, no
    internal function name, and jax never imported."""
    code = (
        "import sys\n"
        "from spmdkit.cli import main\n"
        "for argv in (['plan', 'gpt', '--strategy', 'megatrn'],\n"
        "             ['train', 'mymodels:make_lm', '--strategy', 'fsdp']):\n"
        "    try:\n"
        "        print('status', main(argv))\n"
        "    except SystemExit as e:\n"
        "        print('status', e.code)\n"
        "print('jax imported', 'jax' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert done.stdout.splitlines() == ["status 2", "status 2", "jax imported False"], done
    err = done.stderr
    assert "argument --strategy: must be one of auto, dp, fsdp" in err
    assert "given 'megatrn': did you mean 'megatron'?" in err
    assert "spmdkit train MODEL: MODEL's module is importable" in err
    assert "preset_rules" not in err


@pytest.mark.slow
def test_train_and_report_a_user_model(tmp_path, capsys):
    """``spmdkit train`` and ``spmdkit report`` (plan.verify) on a model of the
    user's, from a subprocess run in its directory as a user would."""
    argv = ["train", "tests.cli.mymodel:make_spec", "--mesh", "data=4,model=2", "--steps", "2"]
    assert main([*argv, "--strategy", "megatron", "--verify", "--ckpt", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "trained steps 1..2" in out and "collectives total" in out
    env = {**os.environ, "PYTHONPATH": ROOT}
    done = subprocess.run(
        [sys.executable, "-m", "spmdkit", "report", "mymodel:SPEC", "--strategy", "fsdp"],
        check=False,
        capture_output=True,
        text=True,
        cwd=HERE,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    assert "Plan 'fsdp' on mesh data=2 × model=4" in done.stdout


@pytest.mark.slow
def test_the_cli_guides_own_model_example_runs(tmp_path):
    """docs/cli.md's "Your own model": its module saved as mymodels.py and each of
    its command lines run in that directory, as a reader would."""
    import re

    page = pathlib.Path(ROOT, "docs", "cli.md").read_text()
    section = page.split("## Your own model", 1)[1].split("\n## ", 1)[0]
    (module,) = re.findall(r"^```python\n(.*?)^```", section, flags=re.S | re.M)
    (lines,) = re.findall(r"^```bash\n(.*?)^```", section, flags=re.S | re.M)
    (tmp_path / "mymodels.py").write_text(module)
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
    for line in lines.splitlines():
        argv = line.split()
        assert argv[0] == "spmdkit" and "mymodels:" in argv[2], line
        done = subprocess.run(
            [sys.executable, "-m", "spmdkit", *argv[1:]],
            check=False,
            capture_output=True,
            text=True,
            cwd=tmp_path,
            env=env,
            timeout=600,
        )
        assert done.returncode == 0, (line, done.stderr[-3000:])
        assert "Plan '" in done.stdout, (line, done.stdout)
