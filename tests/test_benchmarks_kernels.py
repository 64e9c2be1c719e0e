"""benchmarks/kernels.py: on CPU it times its small GEMMs, the elementwise pass and
the attention case, prices each with the H100 topology and writes the documented
JSON; the price is the topology's own (a GEMM's by ``matmul_time``)."""

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
    assert kinds == ["gemm", "gemm", "elementwise", "attention"]
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
    assert "CPU timings, not a GPU's" in capsys.readouterr().out
