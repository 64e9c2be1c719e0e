"""plan.verify's attribution: every compiled collective traced to an equation and line,
matched to the predicted ones; seeded faults named by the line that caused them."""

import inspect
import itertools

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit.planner import PRESETS
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


# -- reference models -------------------------------------------------------------------


def _verified(model, strategy, *, mesh=(2, 4)):
    m = sk.models.get_model(model)
    cfg = m.config("tiny")
    batch = m.batch(cfg, 8, np.random.default_rng(0))
    info = sk.describe(m, config=cfg, batch=batch)
    mesh = sk.make_mesh(data=mesh[0], model=mesh[1])
    return _run(info, mesh, strategy, batch)


def _run(info, mesh, strategy, batch, **kw):
    plan = sk.plan(info, mesh, strategy, estimator="analytic", **kw)
    params = sk.init_sharded(info, plan)
    opt = optax.adam(1e-3)
    step = sk.jit(sk.train_step(info, opt, plan), plan)
    with jax.set_mesh(plan.mesh):
        opt_state = jax.jit(opt.init)(params)
    return plan.verify(step, params, opt_state, batch)


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
    phases = {b.origin.phase for b in a.collectives}
    assert "gradient" in phases and ("forward" in phases), phases


STRATEGIES = (*PRESETS, "auto")
MODELS = ("gpt", "llama")
MATRIX = sampled(
    list(itertools.product(MODELS, STRATEGIES)), latin(MODELS, STRATEGIES), marks=[pytest.mark.slow]
)


@pytest.mark.parametrize("model, strategy", MATRIX)
def test_no_compiled_collective_is_left_without_an_origin(model, strategy):
    _check_attributed(_verified(model, strategy))


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


def test_origin_reads_as_a_sentence():
    o = Origin("dot_general", "dot_general", "default", "forward", "m.py:3", "forward rule")
    assert str(o) == "dot_general rule dot_general/default (forward, forward rule) at m.py:3"
    c = HloCollective("all_gather", ((8,),), ("f32",), 32, 4, ((0, 1, 2, 3),), "jit(f)/x")
    assert "from nowhere: jit(f)/x" in str(Blamed(c, 1, None))
