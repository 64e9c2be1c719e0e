"""spmdkit.planner.notes: every choice a plan makes without being asked is a note
(and, with ``strict=True``, an error)."""

import functools
import json
import warnings

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit.introspect import describe
from spmdkit.models import get_model
from spmdkit.planner import Plan, UnknownLogicalAxisError, plan
from spmdkit.planner.notes import (
    PlanNote,
    PlanNoteError,
    PlanNoteWarning,
    quiet_notes,
    refuse_typod_axes,
)
from tests.plan_model import _param, toy_batch, toy_init, toy_loss


@functools.cache
def toy_info(b):
    """The toy model described once per batch size (its traced step is memoized on it)."""
    return describe(toy_init, loss=toy_loss, batch=toy_batch(b=b))


def toy_plan(mesh, strategy, b=8, **kw):
    kw.setdefault("estimator", "analytic")
    return plan(toy_info(b), mesh, strategy, **kw)


def kinds(p):
    return [n.kind for n in p.notes]


@pytest.fixture(scope="module")
def llama_8b_b12():
    """What ``spmdkit plan llama --config 8b --mesh data=8,model=8 --batch-size 12``
    plans (on an abstract mesh: nothing compiled)."""
    return describe(get_model("llama"), config="8b", batch_size=12)


def test_a_typod_axis_is_an_idle_axis_note_and_a_strict_error():
    mesh = sk.abstract_mesh(dat=2, model=4)
    p = toy_plan(mesh, "megatron")
    idle = [n for n in p.notes if n.kind == "idle_axis"]
    assert len(idle) == 1 and "'dat' (2 devices)" in idle[0].message
    assert "did you mean 'data'?" in idle[0].fix
    assert "notes:\n  - [idle_axis] mesh axis 'dat'" in p.table()
    with pytest.raises(PlanNoteError, match="'dat'"):
        toy_plan(mesh, "megatron", strict=True)


def test_a_batch_that_does_not_divide_its_axes_says_where_it_went():
    mesh = sk.abstract_mesh(data=4, model=2)
    p = toy_plan(mesh, "dp", b=6)
    (note,) = [n for n in p.notes if n.kind == "batch_axes"]
    assert "batch of 6 does not divide data×model (8 devices)" in note.message
    assert "went on model (2 devices)" in note.message
    assert "data (4 devices) holds copies" in note.message
    assert "multiple of 8" in note.fix
    assert "idle_axis" in kinds(p)  # data carries nothing else under dp
    with pytest.raises(PlanNoteError, match="batch of 6"):
        toy_plan(mesh, "dp", b=6, strict=True)


def test_a_plan_that_uses_every_axis_has_no_notes_and_passes_strict():
    p = toy_plan(sk.abstract_mesh(data=2, model=4), "fsdp", strict=True)
    assert p.notes == () and "notes:" not in p.table()


def test_batch_12_on_data_8_is_noted_by_a_preset_and_split_by_auto(llama_8b_b12):
    mesh = sk.abstract_mesh(data=8, model=8)
    p = plan(llama_8b_b12, mesh, "megatron", estimator="analytic")
    (note,) = [n for n in p.notes if n.kind == "batch_axes"]
    assert "batch of 12 does not divide data (8 devices)" in note.message
    assert "multiple of 8 (e.g. 16)" in note.fix
    with pytest.raises(PlanNoteError, match="batch of 12"):
        plan(llama_8b_b12, mesh, "megatron", estimator="analytic", strict=True)
    # auto splits the data axis into data × context: the batch on data=4, each
    # sequence over context=2, no device holding a copy of another's work
    p = plan(llama_8b_b12, mesh, estimator="analytic")
    assert p.context is not None and p.context.degree == 2
    assert p.activation["batch"] == ("data",)
    assert not [n for n in p.notes if n.kind == "batch_axes"]


@pytest.mark.slow
def test_batch_12_on_data_8_as_the_cli_plans_it(llama_8b_b12):
    """The default estimator (the CLI's): the data axis split into data 4 × context 2
    (12 sequences on data, each over context: no idle axis, no copies; it was
    megatron_sp with data idle before context parallelism), the presets auto
    dropped named, runner-ups over the budget (if any) marked."""
    p = plan(llama_8b_b12, sk.abstract_mesh(data=8, model=8))
    assert p.context is not None and p.context.degree == 2
    assert "dropped" in kinds(p) and not {"batch_axes", "idle_axis"} & set(kinds(p))
    (dropped,) = [n for n in p.notes if n.kind == "dropped"]
    assert "dp (" in dropped.message and "over 2× the memory budget" in dropped.message
    over = [a for a in p.table().splitlines() if "OVER BUDGET (80.0 GiB)" in a]
    # marked exactly those over the budget (auto's search may leave none in the list)
    assert len(over) == sum(c.peak_bytes > 80 * 2**30 for _, c in p.alternatives)
    assert len({name for name, _ in p.alternatives}) == len(p.alternatives)


def test_auto_notes_the_recipe_it_chose_unless_one_was_given(plans, amesh):
    auto = plans["auto"]
    assert not auto.recipe.is_default
    (note,) = [n for n in auto.notes if n.kind == "recipe"]
    assert auto.recipe.short() in note.message and "jax.value_and_grad" in note.message
    assert "recipe=sk.Recipe()" in note.fix
    fixed = toy_plan(amesh, "auto", recipe=sk.Recipe())
    assert "recipe" not in kinds(fixed)


def test_runner_ups_show_their_recipe_and_are_marked_over_the_budget(amesh):
    # one recipe: auto's micro-batch growth leaves no runner-up over the budget
    p = toy_plan(amesh, "auto", memory_budget=130 * 2**10, recipe=sk.Recipe())
    names = [name for name, _ in p.alternatives]
    assert len(set(names)) == len(names)
    lines = p.table().splitlines()
    for name, cost in p.alternatives:
        (line,) = [ln for ln in lines if ln.startswith(f"  {name} ")]
        assert ("OVER BUDGET" in line) == (cost.peak_bytes > 130 * 2**10)
    assert any("OVER BUDGET" in ln for ln in lines)
    assert not all("OVER BUDGET" in ln for ln in lines if ln.startswith("  searched"))


def test_notes_round_trip_through_json(amesh):
    p = toy_plan(sk.abstract_mesh(data=4, model=2), "dp", b=6)
    back = Plan.from_json(p.to_json())
    assert back.notes == p.notes and back.batch_size == 6
    assert json.loads(p.to_json())["notes"][0]["kind"] == p.notes[0].kind


def test_a_note_kind_is_checked():
    with pytest.raises(sk.PlanError, match="kind is one of"):
        PlanNote("idle", "x", "y")


class Unnamed(nnx.Module):
    def __init__(self, rngs):
        self.w = nnx.Param(jnp.ones((16, 32)), out_sharding=("my_dim", "embed"))

    def __call__(self, x):
        return x @ self.w[...]


def test_auto_refuses_a_logical_name_without_a_rule(amesh):
    batch = {"x": jnp.ones((8, 16))}

    def loss(m, b):
        return jnp.mean(m(b["x"]) ** 2)

    with pytest.raises(UnknownLogicalAxisError, match="'my_dim'"):
        plan(lambda: Unnamed(nnx.Rngs(0)), amesh, loss=loss, batch=batch, estimator="analytic")
    given = plan(
        lambda: Unnamed(nnx.Rngs(0)),
        amesh,
        loss=loss,
        batch=batch,
        estimator="analytic",
        rules=[("my_dim", "model")],
    )
    costed = {given.chosen} | {name.split("+")[0] for name, _ in given.alternatives}
    assert "megatron" in costed  # the presets are costed again, not dropped


# -- rule tables from other projects ----------------------------------------------------------


class Foreign(nnx.Module):
    """A model named as a MaxText-style codebase names its dims."""

    def __init__(self, vocab=64, d=32, h=4, hd=8, f=64, *, rngs):
        self.table = _param(rngs, ("embed_vocab", "embed"), (vocab, d))
        self.q = _param(rngs, ("embed", "q_heads", "kv_head_dim"), (d, h, hd))
        self.o = _param(rngs, ("q_heads", "kv_head_dim", "embed"), (h, hd, d))
        self.up = _param(rngs, ("embed", "mlp"), (d, f))
        self.down = _param(rngs, ("mlp", "embed"), (f, d))

    def __call__(self, tokens):
        x = jnp.take(self.table[...], tokens, axis=0)
        v = jnp.tanh(jnp.einsum("bsd,dhk->bshk", x, self.q[...]))
        x = x + jnp.einsum("bshk,hkd->bsd", v, self.o[...])
        x = x + jax.nn.gelu(x @ self.up[...]) @ self.down[...]
        return x @ self.table[...].T


#: Its rule table: its own names, mesh axes a data × model mesh lacks, no "batch".
MAXTEXT_RULES = [
    ("activation_batch", ("data", "fsdp", "expert")),
    ("activation_length", ("sequence",)),
    ("embed_vocab", ("tensor",)),
    ("q_heads", ("tensor",)),
    ("kv_head_dim", None),
    ("mlp", ("fsdp_transpose", "tensor")),
    ("embed", ("fsdp", "expert")),
    ("embed", None),
]


@functools.cache
def foreign_info():
    batch = toy_batch()
    axes = {k: ("activation_batch", "activation_length") for k in batch}
    return describe(lambda: Foreign(rngs=nnx.Rngs(0)), loss=toy_loss, batch=batch, batch_axes=axes)


def test_a_foreign_table_drops_the_axes_the_mesh_lacks_and_finds_the_batch(amesh):
    with pytest.warns(sk.PlanNoteWarning, match=r"\[absent_axes\]"):
        p = plan(foreign_info(), amesh, MAXTEXT_RULES, estimator="analytic")
    assert p.activation["batch"] == ("data",)
    assert p.batch_specs(toy_batch())["tokens"] == P("data")
    (absent,) = [n for n in p.notes if n.kind == "absent_axes"]
    for axis in ("fsdp", "expert", "tensor", "sequence", "fsdp_transpose"):
        assert repr(axis) in absent.message
    assert "'tensor' (in the rules for embed_vocab, q_heads, mlp)" in absent.message
    assert "batch_replicated" not in kinds(p)
    with pytest.raises(PlanNoteError, match="does not have"):
        plan(foreign_info(), amesh, MAXTEXT_RULES, estimator="analytic", strict=True)


def test_aliases_put_a_foreign_model_on_the_presets_without_names(amesh):
    with pytest.raises(UnknownLogicalAxisError, match="aliases="):
        plan(foreign_info(), amesh, "megatron", estimator="analytic")
    aliases = {"q_heads": "heads", "kv_head_dim": "head_dim", "embed_vocab": "vocab"}
    p = plan(foreign_info(), amesh, "megatron", estimator="analytic", aliases=aliases)
    assert p.params["q"] == P(None, "model") and p.params["o"] == P("model")
    assert p.params["table"] == P("model") and p.params["up"] == P(None, "model")
    assert p.activation["batch"] == ("data",) and p.notes == ()
    assert p.info["q"][2] == ("embed", "q_heads", "kv_head_dim")  # the model's own names


# -- notes reach the user as warnings ---------------------------------------------------------


def planned_and_warned(make):
    """The plan ``make()`` returns and the PlanNoteWarnings it warned (as recorded)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        p = make()
    return p, [w for w in caught if issubclass(w.category, PlanNoteWarning)]


#: The issue's three cases: a typo'd mesh axis, a batch of 6 on data=4, auto's
#: own recipe (with the toy model on 2×4: everything replicated, bf16).
CASES = {
    "typo": (lambda: toy_plan(sk.abstract_mesh(dat=2, model=4), "megatron"), "idle_axis"),
    "batch": (lambda: toy_plan(sk.abstract_mesh(data=4, model=2), "dp", b=6), "batch_axes"),
    "auto": (lambda: toy_plan(sk.abstract_mesh(data=2, model=4), "auto"), "recipe"),
}


@pytest.mark.parametrize("case", CASES)
def test_each_note_is_warned_once_on_the_line_that_called_plan(case):
    make, kind = CASES[case]
    p, warned = planned_and_warned(make)
    assert kind in kinds(p)
    # once per note of the returned plan, nothing for what auto costed and dropped
    assert [str(w.message) for w in warned] == [str(n) for n in p.notes]
    assert all(w.category is sk.PlanNoteWarning for w in warned)
    assert {(w.filename, w.lineno) for w in warned} == {(__file__, LINE_OF_PLAN)}


LINE_OF_PLAN = toy_plan.__code__.co_firstlineno + 2  # its ``return plan(...)``


def test_plan_note_warning_is_public_filterable_and_can_be_an_error():
    assert issubclass(sk.PlanNoteWarning, UserWarning) and "PlanNoteWarning" in sk.__all__
    mesh = sk.abstract_mesh(dat=2, model=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", sk.PlanNoteWarning)
        with pytest.raises(sk.PlanNoteWarning, match=r"\[idle_axis\] mesh axis 'dat'"):
            toy_plan(mesh, "megatron")
        warnings.filterwarnings("ignore", category=sk.PlanNoteWarning)
        assert "idle_axis" in kinds(toy_plan(mesh, "megatron"))  # quiet, still noted


def test_strict_raises_before_warning_and_quiet_notes_warn_nothing():
    mesh = sk.abstract_mesh(dat=2, model=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", sk.PlanNoteWarning)
        with pytest.raises(PlanNoteError, match="'dat'"):
            toy_plan(mesh, "megatron", strict=True)
    p, warned = planned_and_warned(lambda: _quietly(mesh))
    assert warned == [] and "idle_axis" in kinds(p)
    with pytest.warns(sk.PlanNoteWarning):  # the filter is back as it was
        toy_plan(mesh, "megatron")


def _quietly(mesh):
    with quiet_notes():
        return toy_plan(mesh, "megatron")


# -- a rule table's typo'd mesh axis ------------------------------------------------------------


def test_a_typod_axis_in_a_rule_table_is_an_error_that_names_the_axis_meant(amesh):
    table = [("batch", "data"), ("mlp", "modle"), ("heads", "model"), ("vocab", "model")]
    table += [("embed", None), ("head_dim", None), ("norm", None)]
    with pytest.raises(sk.UnknownAxisError) as raised:
        toy_plan(amesh, table)
    e = raised.value
    assert isinstance(e, sk.SpmdError) and e.op == "plan"
    assert "the rule for 'mlp' names mesh axis 'modle'" in e.given
    assert "the mesh's axes are 'data', 'model'" in e.given
    assert e.fix.startswith("did you mean 'model'?") and "('mlp', 'model')" in e.fix
    # the same typo in extra rules on top of a preset
    with pytest.raises(sk.UnknownAxisError, match="did you mean 'model'"):
        toy_plan(amesh, "megatron", rules=[("mlp", "modle")])
    fixed = toy_plan(amesh, [("mlp", "model"), *table[:1], *table[2:]])
    assert fixed.params["mixers/0/up"] == P(None, "model")


def test_only_near_misses_are_refused_other_absent_axes_are_dropped():
    mesh = sk.abstract_mesh(data=2, model=4)
    for typo, meant in (("dat", "data"), ("modle", "model"), ("mdoel", "model")):
        with pytest.raises(sk.UnknownAxisError, match=f"did you mean {meant!r}"):
            refuse_typod_axes({typo: ("embed",)}, mesh)
    # other projects' axes, absent here, are not typos (MaxText's, the role names)
    refuse_typod_axes({a: ("embed",) for a in ("fsdp", "tensor", "expert", "sequence")}, mesh)
    refuse_typod_axes({"fsdp": ("embed",), "data": ("batch",)}, sk.abstract_mesh(dp=2, tp=4))
    refuse_typod_axes({"pipeline": ("layers",)}, mesh)  # far from both
