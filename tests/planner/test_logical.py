"""Logical-rule tables, axis roles and presets (no model, no tracing)."""

import pytest
from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit.planner.candidates import preset_tables
from spmdkit.planner.logical import (
    LogicalRules,
    PlanError,
    UnknownLogicalAxisError,
    axis_roles,
    preset_rules,
)


def test_rules_first_free_entry_wins(amesh):
    rules = LogicalRules((("embed", "model"), ("mlp", "model"), ("mlp", "data"), ("mlp", None)))
    assert rules.resolve(("embed", "mlp"), (64, 256), amesh) == P("model", "data")
    assert rules.resolve(("mlp", "embed"), (256, 64), amesh) == P("model")


def test_rules_skip_entries_that_do_not_divide(amesh):
    rules = LogicalRules((("vocab", "model"), ("vocab", "data")))
    assert rules.resolve(("vocab",), (6,), amesh) == P("data")


def test_unknown_logical_name_raises_not_replicates(amesh):
    rules = LogicalRules((("embed", "model"),))
    with pytest.raises(UnknownLogicalAxisError, match="hidden"):
        rules.resolve(("embed", "hidden"), (8, 8), amesh, where="w")


def test_rule_naming_missing_mesh_axis_raises(amesh):
    with pytest.raises(PlanError, match="mesh axes"):
        LogicalRules((("embed", "fsdp"),)).resolve(("embed",), (8,), amesh)


def test_coerce_accepts_pairs_and_mappings():
    from_map = LogicalRules.coerce({"embed": ["model", None], "mlp": ("data", "model")})
    assert from_map.entries == (("embed", ("model",)), ("embed", None), ("mlp", ("data", "model")))
    assert LogicalRules.coerce([("embed", "model")]).prepend({"mlp": None}).names == (
        "mlp",
        "embed",
    )
    with pytest.raises(PlanError, match="LogicalRules"):
        LogicalRules.coerce(3)


def test_axis_roles_by_name_and_position():
    assert axis_roles(sk.abstract_mesh(a=2, b=4))["model"] == ("b",)
    assert axis_roles(sk.abstract_mesh(x=8))["data"] == ("x",)
    roles = axis_roles(sk.abstract_mesh(model=4, data=2))
    assert roles["data"] == ("data",) and roles["model"] == ("model",)


def test_unknown_preset_names_near_match(amesh):
    with pytest.raises(PlanError, match="fsdp"):
        preset_rules("fdsp", amesh)


def test_on_mesh_drops_the_axes_the_mesh_lacks_and_keeps_the_entry():
    mesh = sk.abstract_mesh(data=2, model=4)
    table = LogicalRules(
        (("embed", ("fsdp", "expert")), ("embed", "model"), ("mlp", ("data", "tensor")))
    )
    fitted, dropped = table.on_mesh(mesh)
    assert dropped == {"fsdp": ("embed",), "expert": ("embed",), "tensor": ("mlp",)}
    # the emptied entry still wins over its fallback, as a size-1 axis would
    assert fitted.resolve(("embed", "mlp"), (64, 64), mesh) == P(None, "data")
    with pytest.raises(sk.PlanError, match="rule axes are mesh axes"):
        table.resolve(("embed",), (64,), mesh)


def test_aliased_names_take_the_entries_of_their_partner_either_way():
    mesh = sk.abstract_mesh(data=2, model=4)
    table = LogicalRules((("heads", "model"), ("q_heads", "data"), ("vocab", "model")))
    both = table.aliased({"q_heads": "heads", "embed_vocab": "vocab", "x": "y"})
    assert both.resolve(("q_heads", "embed_vocab"), (8, 64), mesh) == P("data", "model")
    assert "x" not in both.names and "y" not in both.names
    chained = LogicalRules((("vocab", "model"),)).aliased({"a": "b", "b": "vocab"})
    assert chained.resolve(("a",), (8,), mesh) == P("model")


def test_distributed_optimizer_presets_take_zero1s_state_table(amesh):
    """``megatron_sp+zero1``: the preset's parameter table, fsdp's for the optimizer
    state (merged on the axes a parameter leaves free, as zero1's)."""
    rules, opt = preset_tables("megatron_sp+zero1", None, amesh)
    assert rules == preset_rules("megatron_sp", amesh)
    assert opt == preset_rules("fsdp", amesh)
    assert preset_tables("megatron_sp", None, amesh)[1] == preset_rules("megatron_sp", amesh)
    with pytest.raises(PlanError, match=r"megatron\+zero1"):
        preset_rules("megatron+zer01", amesh)


def test_an_entry_naming_one_axis_twice_is_refused():
    from spmdkit.errors import DuplicateAxisError

    with pytest.raises(DuplicateAxisError, match=r"'data' twice.*'batch', \('data', 'expert'\)"):
        LogicalRules((("batch", ("data", "data", "expert")),))
    with pytest.raises(DuplicateAxisError, match="once"):
        LogicalRules.coerce({"embed": ["model", ("fsdp", "fsdp")]})
