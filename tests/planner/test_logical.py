"""Logical-rule tables, axis roles and presets (no model, no tracing)."""

import flax.linen as nn
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
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
    # the table's order decides, not the dims': embed's entry comes first either way
    assert rules.resolve(("mlp", "embed"), (256, 64), amesh) == P("data", "model")


def test_two_dims_wanting_one_axis_go_by_rule_order_as_in_flax(amesh):
    """The colleague's case: ``expert`` is listed first, so it takes ``model`` even
    though ``embed`` is the earlier dim (dim order gave ``P('model')``)."""
    rules = LogicalRules((("expert", "model"), ("embed", "model")))
    assert rules.resolve(("embed", "expert"), (8, 8), amesh) == P(None, "model")
    assert nn.logical_to_mesh_axes(("embed", "expert"), rules.entries) == P(None, "model")
    dims, steps = rules.resolve_steps(("embed", "expert"), (8, 8), amesh)
    assert dims == ((), ("model",))
    assert [(s.dim, s.outcome, s.holder) for s in steps] == [(1, "taken", None), (0, "held", 1)]


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


# -- spmdkit reads a table as flax does ------------------------------------------------

_AXES = ("a", "b", "c")
_NAMES = ("n0", "n1", "n2", "n3")


def _flax_dims(spec: P, ndim: int) -> tuple:
    dims = [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in tuple(spec)]
    return tuple(dims + [()] * (ndim - len(dims)))


_entry_axes = st.one_of(
    st.none(),
    st.sampled_from(_AXES),
    st.lists(st.sampled_from(_AXES), unique=True, max_size=3).map(tuple),
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rules=st.lists(st.tuples(st.sampled_from(_NAMES), _entry_axes), max_size=10),
    names=st.lists(st.one_of(st.none(), st.sampled_from(_NAMES)), max_size=4).filter(
        lambda ns: len([n for n in ns if n]) == len({n for n in ns if n})
    ),
)
def test_resolve_matches_flax_logical_to_mesh_axes(rules, names):
    """Random tables (None entries, tuples of axes, fallbacks) and names: spmdkit's
    resolve equals flax's ``logical_to_mesh_axes`` on every input spmdkit accepts.
    Every dim is 8 over axes of size 2, so divisibility never passes an entry over;
    the names spmdkit refuses (no entry: it raises, flax replicates) are left out
    (:func:`test_where_spmdkit_deliberately_departs_from_flax`)."""
    mesh = sk.abstract_mesh(a=2, b=2, c=2)
    table = LogicalRules(tuple(rules))
    assume(all(n is None or n in table.names for n in names))
    shape = (8,) * len(names)
    flax_spec = nn.logical_to_mesh_axes(tuple(names), tuple(rules))
    ours = table.resolve(tuple(names), shape, mesh)
    assert _flax_dims(ours, len(names)) == _flax_dims(flax_spec, len(names))


def test_where_spmdkit_deliberately_departs_from_flax(amesh):
    """What flax accepts and spmdkit refuses (or reads further), each on purpose."""
    from spmdkit.errors import DuplicateAxisError

    # a name with no entry: flax replicates the dim silently, spmdkit refuses
    assert nn.logical_to_mesh_axes(("embed", "hidden"), (("embed", "model"),)) == P("model", None)
    with pytest.raises(UnknownLogicalAxisError):
        LogicalRules((("embed", "model"),)).resolve(("embed", "hidden"), (8, 8), amesh)
    # one mesh axis twice in an entry: flax writes P(('data', 'data')), spmdkit refuses
    twice = (("batch", ("data", "data")),)
    assert nn.logical_to_mesh_axes(("batch",), twice) == P(("data", "data"))
    with pytest.raises(DuplicateAxisError):
        LogicalRules(twice)
    # the unconstrained sentinel as a name: flax passes it through, spmdkit plans every dim
    assert nn.logical_to_mesh_axes((P.UNCONSTRAINED,), ()) == P(P.UNCONSTRAINED)
    with pytest.raises(PlanError, match="string or None"):
        LogicalRules((("embed", "model"),)).resolve((P.UNCONSTRAINED,), (8,), amesh)
    # an entry whose axes do not divide the dim: flax has no shapes, spmdkit falls back
    rules = (("vocab", "model"), ("vocab", "data"))
    assert nn.logical_to_mesh_axes(("vocab",), rules) == P("model")
    assert LogicalRules(rules).resolve(("vocab",), (6,), amesh) == P("data")
    # a name repeated within one array: flax refuses it, spmdkit gives each entry
    # to the first of its dims still unassigned
    with pytest.raises(ValueError, match="more than once"):
        nn.logical_to_mesh_axes(("embed", "embed"), (("embed", "model"), ("embed", "data")))
    both = LogicalRules((("embed", "model"), ("embed", "data")))
    assert both.resolve(("embed", "embed"), (8, 8), amesh) == P("model", "data")
