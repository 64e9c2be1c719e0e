"""spmdkit.strategies: the strategy names, the ones the planner lays out."""

import spmdkit as sk
from spmdkit.planner.logical import preset_rules
from spmdkit.strategies import STRATEGIES, unknown_strategy


def test_every_named_preset_has_a_table_and_near_misses_are_named():
    mesh = sk.abstract_mesh(data=2, model=2)
    assert STRATEGIES[0] == "auto"
    for name in STRATEGIES[1:]:
        assert preset_rules(name, mesh).entries
    assert unknown_strategy("megatron") is None
    assert unknown_strategy("megatrn") == "did you mean 'megatron'?"
    assert unknown_strategy("zzz").startswith("pick one of auto, dp, fsdp")
