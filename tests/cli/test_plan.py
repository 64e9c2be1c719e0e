"""The plan CLI commands (planning on abstract meshes; the report's compile is slow)."""

import io
import json
import math
import re
import warnings

import pytest

import spmdkit.cli  # first: cli imports _cli_plan; importing _cli_plan first is circular
from spmdkit.cli.plan import PLAN_COMMANDS, parse_mesh
from spmdkit.errors import SpmdError


def test_parse_mesh():
    assert parse_mesh("data=2,model=4") == {"data": 2, "model": 4}
    with pytest.raises(SpmdError, match="NAME=SIZE"):
        parse_mesh("data:2")


def _run(name, argv):
    import argparse

    cmd = next(c for c in PLAN_COMMANDS if c.name == name)
    parser = argparse.ArgumentParser()
    cmd.configure(parser)
    out = io.StringIO()
    return cmd.run(parser.parse_args(argv), out), out.getvalue()


def test_plan_command_prints_table_and_saves_json_and_html(tmp_path):
    path, page = tmp_path / "plan.json", tmp_path / "plan.html"
    status, text = _run(
        "plan",
        ["gpt", "--mesh", "data=16,model=4", "--abstract", "--strategy", "megatron",
         "--estimator", "analytic", "--batch-size", "16", "--json", str(path),
         "--html", str(page)],
    )  # fmt: skip
    assert status == 0
    assert "Plan 'megatron'" in text and "bytes/dev" in text
    assert text.startswith("global batch 16, sequence 16 (256 tokens/step): est. ")
    assert json.loads(path.read_text())["strategy"] == "megatron"
    assert f"drew {page}" in text and "embed/embedding" in page.read_text()


def test_plan_command_prints_each_note_once_and_warns_none():
    """The table lists the notes; a PlanNoteWarning on top would say them twice."""
    argv = ["gpt", "--mesh", "dat=2,model=4", "--abstract", "--strategy", "megatron"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", spmdkit.PlanNoteWarning)
        status, text = _run("plan", [*argv, "--estimator", "analytic"])
    assert status == 0 and text.count("[idle_axis] mesh axis 'dat'") == 1, text


def test_plan_command_bad_strategy_exits_2(capsys):
    with pytest.raises(SystemExit) as e:
        _run("plan", ["gpt", "--abstract", "--strategy", "fdsp"])
    assert e.value.code == 2
    assert "argument --strategy: must be one of auto, dp" in capsys.readouterr().err


@pytest.mark.slow
def test_report_names_the_strategy_of_each_composite_op():
    """spmdkit report on GPT under megatron (a compile): the loss is vocab-parallel
    cross-entropy, and the prediction matches the compiled step."""
    status, text = _run("report", ["gpt", "--mesh", "data=2,model=4", "--strategy", "megatron"])
    # once: the plan table's ops section, with the fwd and grad region counts
    assert re.search(r"softmax_cross_entropy +vocab_parallel +1 +1", text), text
    assert text.count("vocab_parallel") == 1 and "ops (strategy): " not in text
    assert status == 0, text


def test_verify_is_report_under_its_own_name(capsys):
    """``spmdkit verify`` runs report's check; its errors name ``verify``."""
    verify = next(c for c in PLAN_COMMANDS if c.name == "verify")
    report = next(c for c in PLAN_COMMANDS if c.name == "report")
    assert verify.configure is report.configure
    status, _ = _run("verify", ["gpt", "--config", "8x"])
    assert status == 2 and "spmdkit verify --config" in capsys.readouterr().err


def test_plan_command_checks_json_and_config_before_planning(tmp_path, capsys):
    status, _ = _run("plan", ["gpt", "--abstract", "--json", str(tmp_path)])
    assert status == 2 and "spmdkit plan --json: --json names a file" in capsys.readouterr().err
    status, _ = _run("plan", ["gpt", "--abstract", "--html", str(tmp_path / "no" / "p.html")])
    assert status == 2 and "spmdkit plan --html: --html names a file" in capsys.readouterr().err
    status, _ = _run("plan", ["gpt", "--abstract", "--config", "8x"])
    assert status == 2 and "spmdkit plan --config" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_throughput_line_quotes_tok_s_and_mfu_as_the_readme_tables():
    """tok/s/GPU = batch × seq / step time / devices (benchmarks/planner.py's
    formula); MFU = model FLOPs / (step × devices × bf16 peak), within 1% of the
    textbook count for Llama-3 8B: 6 N T (N without the embedding table, a lookup)
    + 12 L d S T (attention, the full square)."""
    import spmdkit as sk
    from spmdkit.cli.plan import throughput_line
    from spmdkit.models import get_model

    info = sk.describe(get_model("llama"), config="8b", batch_size=16)
    recipe = sk.Recipe(remat="dots", compute_dtype="bfloat16", microbatches=2)
    p = sk.plan(info, sk.abstract_mesh(data=8), "fsdp", recipe=recipe, estimator="analytic")
    line = throughput_line(p, info)
    assert line.startswith("global batch 16, sequence 8192 (131,072 tokens/step): est. ")
    tok = float(re.search(r"est\. ([\d,]+) tok/s/GPU", line).group(1).replace(",", ""))
    assert abs(tok - 16 * 8192 / p.cost.step_time_s / 8) <= 1
    mfu = float(re.search(r"MFU ([\d.]+)% \(bf16 peak 989 TFLOP/s\)", line).group(1))
    n = sum(math.prod(q.shape) for q in info.params) - 128256 * 4096
    textbook = (6 * n + 12 * 32 * 4096 * 8192) * 16 * 8192 / (p.cost.step_time_s * 8 * 989e12)
    assert abs(mfu / 100 - textbook) < 0.01 * textbook, (mfu, textbook)


@pytest.mark.parametrize(
    "flags, given",
    [(["--strategy", "fsdp"], "--strategy fsdp"), (["--abstract"], "--strategy auto --abstract")],
)
def test_plan_measure_is_refused_off_auto_or_on_an_abstract_mesh(flags, given, capsys):
    """--measure runs steps: it is checked before any planning (a usage error)."""
    status, _ = _run("plan", ["gpt", "--mesh", "data=8", "--measure", *flags])
    err = capsys.readouterr().err
    assert status != 0
    assert "--measure" in err and given in err and "drop --measure" in err
