"""print(plan): the table's rows, its cut and its sections."""

from jax.sharding import PartitionSpec as P

from spmdkit.planner.plan_table import axes_text, plan_table, spec_text


def test_specs_and_axes_read_per_dim():
    assert spec_text(P(None, "model")) == "[_,model]"
    assert spec_text(P(("data", "model"))) == "[(data,model)]"
    assert spec_text(P()) == "[]"
    assert axes_text(("data",)) == "data" and axes_text(("data", "model")) == "(data,model)"


def test_the_table_is_the_plans_print_cut_to_max_rows_and_notes_optional(plans):
    p = plans["auto"]
    text = plan_table(p)
    assert text == str(p) == p.table()
    head = text.splitlines()[0]
    assert head.startswith(f"Plan {p.strategy!r}") and "devices)" in head
    lines = text.splitlines()
    header = lines[1].split()
    assert header[:3] == ["param", "n", "shape"] and header[-1] == "bytes/dev"
    rows = next(i for i, line in enumerate(lines[2:]) if not line.startswith("  "))
    assert rows > 1, text
    cut = plan_table(p, max_rows=1).splitlines()
    assert cut[3] == f"  ... {rows - 1} more rows" and cut[4:] == lines[2 + rows :]
    noted = next((q for q in plans.values() if q.notes), None)
    if noted is not None:
        assert "notes:" in plan_table(noted) and "notes:" not in plan_table(noted, notes=False)
