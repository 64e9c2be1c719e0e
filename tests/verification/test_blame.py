"""plan.verify's attribution: every compiled collective traced to an equation and line,
matched to the predicted ones; seeded faults named by the line that caused them."""

import inspect
import itertools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit.errors import UnknownAxisError
from spmdkit.models.moe import route
from spmdkit.planner import PRESETS
from spmdkit.planner.notes import PlanNoteWarning
from spmdkit.verification.blame import (
    PHASES,
    Attribution,
    Blamed,
    Origin,
    split_combined,
    tags_in,
)
from spmdkit.verification.hlo import HloCollective, parse_collectives
from tests.sampling import latin, sampled
from tests.verification.steps import run as _run
from tests.verification.steps import verified as _verified

# -- the HLO's names and frames --------------------------------------------------------

_HLO = """HloModule m, num_partitions=4

ENTRY %main (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  %ar = (f32[8]{0}, f32[2]{0}) all-reduce(%p, %p), replica_groups={{0,1,2,3}}, \
to_apply=%add, metadata={op_name="jit(f)/(sk_eq3/transpose(jvp())/dot_general:\
sk_eq7/shard_map/psum)" stack_frame_id=3}
  ROOT %ag = f32[32]{0} all-gather(%p), replica_groups={{0,1,2,3}}, dimensions={0}, \
metadata={op_name="jit(f)/sk_eq1/while/body/sk_eq12/reshape" source_file="/u/model.py" \
source_line=42}
}

FileNames
1 "/u/train.py"
2 "/u/model.py"

FunctionNames
1 "main"
2 "Block.__call__"

FileLocations
1 {file_name_id=1 function_name_id=1 line=10 end_line=10 column=1 end_column=1}
2 {file_name_id=2 function_name_id=2 line=31 end_line=31 column=5 end_column=5}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=1}
3 {file_location_id=2 parent_frame_id=2}
"""


def test_frames_come_from_the_stack_tables_or_the_source_fields():
    ar, ag = parse_collectives(_HLO)
    assert ar.frames[0] == "/u/model.py:31 (Block.__call__)"
    assert ar.frames[-1] == "/u/train.py:10 (main)" and ar.source == ar.frames[0]
    assert ag.frames == ("/u/model.py:42",) and ag.source == "/u/model.py:42"


def test_a_combined_collective_splits_into_its_results_each_with_its_name():
    ar, ag = parse_collectives(_HLO)
    parts = split_combined(ar)
    assert [p.shapes for p in parts] == [((8,),), ((2,),)]
    assert [p.payload_bytes for p in parts] == [32, 8]
    assert [tags_in(p.op_name) for p in parts] == [["sk_eq3"], ["sk_eq7"]]
    assert split_combined(ag) == [ag] and tags_in(ag.op_name) == ["sk_eq12"]  # the innermost node


def test_only_the_first_part_of_a_combined_collective_keeps_its_frames():
    """XLA keeps the first combined instruction's frames: a later part (megatron
    GPT's cross-entropy reductions combined behind an attention gradient's) must
    not be put on the first part's line."""
    ar, _ = parse_collectives(_HLO)
    first, second = split_combined(ar)
    assert first.source == "/u/model.py:31 (Block.__call__)"
    assert second.frames == () and second.source == ""


def test_a_frame_in_the_rules_package_is_spmdkits_own_not_the_users():
    """``spmdkit.rules`` lives in the repository's ``rules/``: its frames are
    skipped like ``spmdkit/``'s; the reference models (``models/``) are examples
    and stay sources."""
    import spmdkit.models.gpt
    import spmdkit.rules.norms
    from spmdkit.util import is_own_source

    rules_file = spmdkit.rules.norms.__file__
    assert is_own_source(f"{rules_file}:40 (impl)")
    assert not is_own_source(f"{spmdkit.models.gpt.__file__}:124 (GPTAttention.__call__)")
    c = HloCollective(
        "all_reduce",
        ((8,),),
        ("f32",),
        32,
        4,
        (),
        frames=(f"{rules_file}:40 (impl)", "/u/model.py:3 (Block.__call__)"),
    )
    assert c.source == "/u/model.py:3 (Block.__call__)"


# -- reference models -------------------------------------------------------------------


def _check_attributed(report) -> Attribution:
    a = report.attribution
    assert isinstance(a, Attribution) and a.collectives, str(report)
    assert not a.unattributed, str(report)
    for b in a.collectives:
        o = b.origin
        assert o.phase in PHASES and (o.equation or o.source), b
        # the prediction's side too: every leftover names its equation
        for p in a.unmatched_predicted:
            assert p.origin.equation, p
    assert f"attributed: {len(a.collectives)} of {len(a.collectives)}" in str(a)
    # a verified report with nothing unpredicted keeps its table short
    text = str(report)
    quiet = report.ok and not a.unmatched_compiled
    assert ("attributed:" not in text) == quiet, text
    data = a.to_json()
    assert len(data["collectives"]) == len(a.collectives)
    assert all(c["origin"] is not None for c in data["collectives"])
    return a


@pytest.mark.heavy
@pytest.mark.parametrize("strategy", ["fsdp", "megatron"])
def test_every_compiled_collective_of_tiny_gpt_has_an_origin(strategy):
    report = _verified("gpt", strategy)
    a = _check_attributed(report)
    # the plan's own collectives: each runs a predicted one, from gpt.py's lines
    assert len(a.matched) == len(a.collectives), str(report)
    assert sum("models/gpt.py" in b.origin.source for b in a.collectives) > len(a.collectives) / 2
    # every origin is a line of the model: none stops in spmdkit's region or rules
    # (an op's forward region), and the loss's reductions are on the loss's line,
    # not on the attention line whose reduction XLA combined them with
    from spmdkit.util import is_own_source

    own = [str(b.origin) for b in a.collectives if is_own_source(b.origin.source)]
    assert not own, own
    loss = {b.origin.source for b in a.collectives if "cross_entropy" in (b.origin.rule or "")}
    assert loss and all("(gpt_loss)" in s for s in loss), loss
    phases = {b.origin.phase for b in a.collectives}
    assert "gradient" in phases and ("forward" in phases), phases


STRATEGIES = (*PRESETS, "auto")
#: the dropless MoE too: its routed experts' exchange runs in a region, every
#: all-to-all of it traced to the model's line like the others
MODELS = ("gpt", "llama", "qwen3_moe")
MATRIX = sampled(
    list(itertools.product(MODELS, STRATEGIES)), latin(MODELS, STRATEGIES), marks=[pytest.mark.slow]
)


@pytest.mark.parametrize("model, strategy", MATRIX)
def test_no_compiled_collective_is_left_without_an_origin(model, strategy):
    _check_attributed(_verified(model, strategy))


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [(2, 4), (4, 2)], ids=["2x4", "4x2"])
def test_tiny_gpt_under_auto_verifies_with_every_compiled_collective_predicted(mesh):
    """Tiny GPT's auto plan (weights tiled over ``(data, model)``, the optimizer
    in the gradients' layouts): every compiled collective runs a predicted one.
    Before, a weight gradient reduced where it was computed was moved a second
    time by its reader (853.8 KiB of all-gathers compiled, 619.0 predicted) and
    XLA moved the optimizer's results into the parameters' layout by permutes
    the plan did not have (2.6 KiB)."""
    report = _verified("gpt", "auto", mesh=mesh)
    assert report.ok, str(report)
    a = _check_attributed(report)
    assert not a.unmatched_compiled, str(a)


# -- seeded faults ----------------------------------------------------------------------


#: The faults' mesh (the model's own constraints name it, as a user's code would).
MESH = sk.make_mesh(data=2, model=4, axis_types="auto")


class Mlp(nnx.Module):
    """A two-layer MLP whose ``fault`` seeds one layout bug inside the model."""

    def __init__(self, fault, rngs):
        init = nnx.initializers.normal(0.02)
        self.up = nnx.Param(init(rngs.params(), (16, 256)), out_sharding=("embed", "mlp"))
        self.down = nnx.Param(init(rngs.params(), (256, 16)), out_sharding=("mlp", "embed"))
        self.fault = fault

    def __call__(self, x):
        up = self.up[...]
        whole = NamedSharding(MESH, P())
        if self.fault == "gathered weight":
            up = jax.lax.with_sharding_constraint(up, whole)  # FAULT: weight gathered
        if self.fault == "unsplit batch":
            x = jax.lax.with_sharding_constraint(x, whole)  # FAULT: batch replicated
        return jax.nn.relu(x @ up) @ self.down[...]


def _mlp_loss(model, batch):
    return ((model(batch["x"]) - batch["y"]) ** 2).mean()


def _fault_line(fault):
    lines, start = inspect.getsourcelines(Mlp.__call__)
    at = next(i for i, line in enumerate(lines) if f'"{fault}"' in line)
    return start + at + 1  # the constraint on the line after the test


def _faulty(fault, strategy):
    batch = {
        "x": np.random.default_rng(0).normal(size=(64, 16)).astype(np.float32),
        "y": np.zeros((64, 16), np.float32),
    }
    info = sk.describe(lambda: Mlp(fault, nnx.Rngs(0)), loss=_mlp_loss, batch=batch)
    return _run(info, MESH, strategy, batch)


def _blamed_on(a: Attribution, line: int) -> list[Blamed]:
    here = f"test_blame.py:{line}"
    return [b for b in a.collectives if here in b.origin.source]


@pytest.mark.slow
def test_a_weight_gathered_by_a_users_constraint_is_named_by_its_line():
    report = _faulty("gathered weight", "megatron")
    a = _check_attributed(report)
    blamed = _blamed_on(a, _fault_line("gathered weight"))
    assert any(b.collective.kind == "all_gather" for b in blamed), str(report)
    gathers = [b for b in blamed if b.collective.kind == "all_gather"]
    assert "forward" in {b.origin.phase for b in gathers}, str(report)
    assert all(b.origin.equation == "sharding_constraint" for b in gathers), str(report)
    clean = _faulty(None, "megatron").attribution
    assert not any(b.collective.kind == "all_gather" for b in clean.collectives), str(clean)


@pytest.mark.slow
def test_a_batch_left_unsplit_is_named_by_its_line():
    report = _faulty("unsplit batch", "dp")
    a = _check_attributed(report)
    blamed = _blamed_on(a, _fault_line("unsplit batch"))
    assert any(b.collective.kind == "all_gather" for b in blamed), str(report)


def _mlp_info():
    batch = {
        "x": np.random.default_rng(0).normal(size=(64, 16)).astype(np.float32),
        "y": np.zeros((64, 16), np.float32),
    }
    return sk.describe(lambda: Mlp(None, nnx.Rngs(0)), loss=_mlp_loss, batch=batch), batch


def _mlp_table(axis):
    """The MLP's rule table, its hidden dim over ``axis`` (megatron's layout on "model")."""
    return [("batch", "data"), ("embed", None), ("mlp", axis)]


def _gradient_reductions(a: Attribution) -> dict[str, int]:
    """Bytes of the gradients' all-reduces per origin (equation and line)."""
    out: dict[str, int] = {}
    for b in a.collectives:
        if b.collective.kind == "all_reduce" and b.origin.phase == "gradient":
            key = f"{b.origin.equation} at {b.origin.source}"
            out[key] = out.get(key, 0) + b.collective.payload_bytes
    return out


def test_a_typod_axis_that_looks_like_one_is_refused_naming_its_rule():
    """A rule table's axis one edit from a mesh axis ("modle"): planning stops there
    and names the rule, before anything compiles (issue 43)."""
    info, _ = _mlp_info()
    with pytest.raises(UnknownAxisError, match=r"the rule for 'mlp' names mesh axis 'modle'") as e:
        sk.plan(info, MESH, _mlp_table("modle"), estimator="analytic")
    assert "did you mean 'model'" in str(e.value)


@pytest.mark.slow
def test_a_typod_axis_that_is_dropped_is_named_and_its_ops_reductions_grow():
    """A rule table's axis that is no near miss of a mesh axis ("tensr", MaxText's
    "tensor" mistyped) is dropped as flax drops it: the plan note names the axis and
    its rule, the hidden dim is replicated, and the attribution puts the grown
    gradient reductions on the weights' matmuls."""
    info, batch = _mlp_info()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", PlanNoteWarning)
        faulty = _run(info, MESH, _mlp_table("tensr"), batch)
    notes = [str(w.message) for w in caught if issubclass(w.category, PlanNoteWarning)]
    assert any("'tensr' (in the rules for mlp)" in n for n in notes), notes
    intended = _run(info, MESH, _mlp_table("model"), batch)
    grown = _gradient_reductions(_check_attributed(faulty))
    base = _gradient_reductions(_check_attributed(intended))
    lines, start = inspect.getsourcelines(Mlp.__call__)
    line = start + next(i for i, t in enumerate(lines) if "return" in t)  # the two matmuls
    culprits = {k: v for k, v in grown.items() if f"test_blame.py:{line}" in k}
    assert len(culprits) == 2 and all(k.startswith("dot_general at") for k in culprits), grown
    # replicated over "model", each weight's gradient reduction moves 4x the bytes
    assert all(culprits[k] == 4 * base[k] for k in culprits), (grown, base)


class Experts(nnx.Module):
    """GShard-style routed experts (models/moe.py's dispatch einsums) whose
    dispatched tokens ``[expert, group, capacity, embed]`` a user's constraint lays out:
    the experts over "model", the groups over "data"; ``twice`` maps "model" to the
    groups as well (MaxText's ``activation_batch_moe`` holding the expert axis), so
    the groups take it and the expert dim is left whole."""

    def __init__(self, twice, rngs):
        init = nnx.initializers.normal(0.02)
        self.router = nnx.Param(init(rngs.params(), (16, 4)), out_sharding=("embed", "expert"))
        up, down = ("expert", "embed", "mlp"), ("expert", "mlp", "embed")
        self.w_up = nnx.Param(init(rngs.params(), (4, 16, 64)), out_sharding=up)
        self.w_down = nnx.Param(init(rngs.params(), (4, 64, 16)), out_sharding=down)
        self.twice = twice

    def __call__(self, x):
        r = route(jnp.einsum("bsd,de->bse", x, self.router[...]), top_k=2, capacity=4)
        xe = jnp.einsum("bsec,bsd->ebcd", r.dispatch, x)
        spec = P(None, ("data", "model")) if self.twice else P("model", "data")
        xe = jax.lax.with_sharding_constraint(xe, NamedSharding(MESH, spec))  # the dispatch
        h = jax.nn.relu(jnp.einsum("ebcd,edm->ebcm", xe, self.w_up[...]))  # expert matmuls
        ye = jnp.einsum("ebcm,emd->ebcd", h, self.w_down[...])  # expert matmuls
        return jnp.einsum("bsec,ebcd->bsd", r.combine, ye)


def _experts(twice):
    batch = {
        "x": np.random.default_rng(0).normal(size=(8, 8, 16)).astype(np.float32),
        "y": np.zeros((8, 8, 16), np.float32),
    }
    info = sk.describe(lambda: Experts(twice, nnx.Rngs(0)), loss=_mlp_loss, batch=batch)
    return _check_attributed(_run(info, MESH, "ep", batch))


def _experts_line(marker):
    lines, start = inspect.getsourcelines(Experts.__call__)
    return [start + i for i, line in enumerate(lines) if f"# {marker}" in line]


@pytest.mark.slow
def test_an_expert_axis_mapped_twice_is_named_by_the_expert_matmuls():
    """The MaxText case: with "model" on both the groups and the experts of the
    dispatched tokens, the groups take it, the dispatch's all-to-all is gone, and
    the expert weights are all-gathered (their gradients reduce-scattered) by the
    expert matmuls, which the attribution names; laid out once, the dispatch is
    the all-to-all and no expert weight is gathered."""
    (dispatch,) = _experts_line("the dispatch")
    matmuls = {f"test_blame.py:{n}:" for n in _experts_line("expert matmuls")}

    def at(b, lines):
        return any(line in b.origin.source for line in lines)

    def weights(b):  # a stacked expert weight [4, ...] (or its share)
        return b.collective.shapes[0][1:] in ((16, 64), (64, 16))

    clean = _experts(False)
    swaps = [b for b in clean.collectives if at(b, [f"test_blame.py:{dispatch}:"])]
    assert [b.collective.kind for b in swaps] == ["all_to_all"], str(clean)
    assert swaps[0].origin.equation == "sharding_constraint", str(clean)
    assert not any(
        b.collective.kind == "all_gather" and b.origin.phase == "forward" and weights(b)
        for b in clean.collectives
    ), str(clean)

    faulty = _experts(True)
    assert not any(at(b, [f"test_blame.py:{dispatch}:"]) for b in faulty.collectives), str(faulty)
    moved = [b for b in faulty.collectives if weights(b)]
    gathers = [b for b in moved if b.collective.kind == "all_gather"]
    scatters = [b for b in moved if b.collective.kind == "reduce_scatter"]
    assert len(gathers) == 2 and len(scatters) == 2, str(faulty)
    for b in gathers + scatters:
        assert b.origin.equation == "dot_general" and b.origin.rule == "dot_general", b
        assert at(b, matmuls), b
    assert {b.origin.phase for b in gathers} == {"forward"}, str(faulty)
    assert {b.origin.phase for b in scatters} == {"gradient"}, str(faulty)


def test_origin_reads_as_a_sentence():
    o = Origin("dot_general", "dot_general", "default", "forward", "m.py:3", "forward rule")
    assert str(o) == "dot_general rule dot_general/default (forward, forward rule) at m.py:3"
    c = HloCollective("all_gather", ((8,),), ("f32",), 32, 4, ((0, 1, 2, 3),), "jit(f)/x")
    assert "from nowhere: jit(f)/x" in str(Blamed(c, 1, None))
    why = "no metadata: XLA's reshard of this equation's result"
    o = Origin("add", "add", "default", "optimizer", "m.py:9", "forward rule", "sk_eq5", why)
    assert str(o) == f"add rule add/default (optimizer, forward rule; {why}) at m.py:9"
