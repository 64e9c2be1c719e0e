"""The jit check: compiled collectives that betray a wrong rule."""

from spmdkit.testing import check_jit


def test_jit_check_reports_wrong_collectives(bad_rules, mesh2d):
    report = check_jit("t_bad_sum", mesh=mesh2d, max_cases=None)
    assert not report.ok
    assert "not in the plan" in str(report)
