"""benchmarks/fingerprints.py: the reference plans' JSON and the compiled plain,
recipe and pipelined steps' HLO are those of the committed baseline (a refactor
changes neither; a change meant to move them regenerates the baseline, the
script's docstring says how). Slow: the plans take about a minute on 2 cores, the
three compiled steps several more."""

import json

import jax
import pytest

from tests.scripts import loaded_script


@pytest.fixture(scope="module")
def bench():
    with loaded_script("benchmarks/fingerprints.py") as module:
        yield module


def test_a_difference_names_the_case_and_the_source_is_ignored(bench):
    base = {"plans": {"a": "1", "b": "2"}, "steps": {"plain": "x"}}
    now = {"plans": {"a": "1", "b": "3"}, "steps": {"plain": "y"}}
    assert bench.differences(base, now) == ["plans b: 2 -> 3", "steps plain: x -> y"]
    assert bench.differences(base, {"plans": {"a": "1"}}) == ["plans b: gone"]
    assert bench.differences(base, base) == []

    class Compiled:
        def __init__(self, text):
            self.text = text

        def as_text(self):
            return self.text

    def hlo(path, line, op="add"):
        return Compiled(
            f'HloModule jit_f\n\nFileNames\n1 "{path}"\n\nENTRY %main {{\n'
            f'  %a = f32[2] {op}(%x, %y), metadata={{op_name="f" source_line={line}}}\n}}'
        )

    same = bench.hlo_fingerprint(hlo("/a/m.py", 3))
    assert same == bench.hlo_fingerprint(hlo("/b/m.py", 9))
    assert same != bench.hlo_fingerprint(hlo("/a/m.py", 3, op="subtract"))


def test_plans_only_and_another_core_count_compare_the_plans(bench):
    base = {"plans": {"a": "1"}, "steps": {"plain": "x"}, "cpus": 2}
    plans_only = {"plans": {"a": "1"}}  # --plans-only: no steps, no core count
    assert bench.comparable(base, plans_only) == (plans_only, None)
    same = {"plans": {"a": "1"}, "steps": {"plain": "x"}, "cpus": 2}
    assert bench.comparable(base, same) == (same, None)
    now, why = bench.comparable(base, {**same, "cpus": 16})
    assert now == {"plans": {"a": "1"}, "cpus": 16} and "16 cores" in why and "on 2" in why
    assert bench.differences(base, now) == []


@pytest.mark.slow
def test_plans_and_compiled_steps_match_the_baseline(bench):
    baseline = json.loads(bench.RESULTS.read_text())
    assert jax.__version__ in baseline, "no baseline for this jax: run the script with --write"
    base = baseline[jax.__version__]
    steps = base.get("cpus") in (None, bench.usable_cpus())
    now = bench.compute(steps=steps)
    assert len(now["plans"]) == len(base["plans"]) >= 39
    assert bench.differences(base, now) == []
    if not steps:  # XLA:CPU splits a step's work by the cores: another count, another HLO
        pytest.skip(f"plans compared; the steps' baseline is for {base['cpus']} cores")
