"""benchmarks/kernels.py: on CPU it times its small GEMMs, the elementwise pass, the
attention case and the grouped GEMMs, prices each with the H100 topology and writes
the documented JSON; the price is the topology's own (a GEMM's by ``matmul_time``, a
grouped GEMM's at its rows per expert, as the planner prices it)."""

import json

import pytest

from spmdkit.topology import Topology
from tests.scripts import loaded_script

CASE = {"kind", "label", "shape", "flops", "bytes", "predicted_s", "measured_s", "ratio",
        "measured_tflops", "measured_gbps", "efficiency_predicted",
        "efficiency_measured"}  # fmt: skip


@pytest.mark.slow
def test_cpu_run_writes_the_documented_schema(tmp_path, capsys):
    out = tmp_path / "kernels.json"
    with loaded_script("benchmarks/kernels.py") as bench:
        assert bench.main(["--repeat", "1", "--calls", "2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["platform"] == "cpu" and result["topology"] == "h100"
    kinds = [c["kind"] for c in result["cases"]]
    assert kinds == ["gemm", "gemm", "elementwise", "attention"] + ["ragged"] * 8
    topo = Topology.h100()
    for c in result["cases"]:
        assert set(c) == CASE
        assert c["measured_s"] > 0 and c["ratio"] == pytest.approx(
            c["predicted_s"] / c["measured_s"]
        )
        if c["kind"] == "gemm":
            m, k, n = c["shape"]
            assert c["predicted_s"] == pytest.approx(
                topo.matmul_time(2.0 * m * k * n, m, k, n, "bfloat16")
            )
        if c["kind"] == "ragged":  # (experts, rows per expert, k, n); backward: 2 GEMMs
            e, r, k, n = c["shape"]
            gemms = 2 if c["label"].endswith("up backward") else 1
            assert c["flops"] == gemms * 2.0 * e * r * k * n
            assert c["predicted_s"] == pytest.approx(
                topo.matmul_time(c["flops"], r, k, n, "bfloat16")
            )
    assert "CPU timings, not a GPU's" in capsys.readouterr().out


def test_kinds_choose_the_cases_and_an_unknown_one_is_refused(tmp_path):
    with loaded_script("benchmarks/kernels.py") as bench:
        with pytest.raises(SystemExit, match="--kinds ragd: not one of gemm, elementwise"):
            bench.main(["--kinds", "ragged,ragd", "--out", str(tmp_path / "k.json")])
        assert bench.main(["--kinds", "elementwise", "--repeat", "1", "--calls", "1",
                           "--out", str(tmp_path / "k.json")]) == 0  # fmt: skip
    assert [c["kind"] for c in json.loads((tmp_path / "k.json").read_text())["cases"]] == [
        "elementwise"
    ]
