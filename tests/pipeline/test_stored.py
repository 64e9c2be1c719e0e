"""Where a stack the pipe axis does not divide is stored (spmdkit.pipeline.stored)."""

import dataclasses

import pytest
from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit.introspect import describe
from spmdkit.models import get_model
from spmdkit.pipeline import Pipeline, PipelineError
from spmdkit.pipeline.stored import stack_dim, stored_stack_specs

SIZES = {"pipe": 2, "data": 4, "model": 2}


def test_the_pipe_axis_moves_minor_most_to_the_largest_dim_it_divides():
    """7 layers over 2 stages: the pipe axis leaves the layers for the largest other
    dim every given spec's axes there and the pipe axis divide, behind those axes;
    the optimizer state and gradient specs move alike, None stays None."""
    got = stored_stack_specs(
        [P("pipe", None, "data"), P("pipe", "data", "model"), None], (7, 8, 16), "pipe", SIZES
    )
    assert got == (P(None, None, ("data", "pipe")), P(None, "data", ("model", "pipe")), None)
    assert stack_dim(got[0], "pipe") == 2 and stack_dim(P("pipe", "data"), "pipe") is None
    # 8 cannot take the pipe axis behind data x model (16 devices): the smaller 6 can
    got = stored_stack_specs([P("pipe"), P("pipe", ("data", "model"))], (5, 8, 6), "pipe", SIZES)
    assert got == (P(None, None, "pipe"), P(None, ("data", "model"), "pipe"))


@pytest.mark.parametrize(
    ("specs", "shape"),
    [
        ([P("pipe", "data")], (8, 16)),  # the pipe axis divides the layers: unchanged
        ([P(None, "data")], (7, 16)),  # no pipe axis on the layers
        ([P("pipe")], (7,)),  # a per-layer scalar: no other dim
        ([P("pipe", None)], (7, 3)),  # no dim the pipe axis divides
    ],
)
def test_a_stack_stays_as_given_where_nothing_moves(specs, shape):
    assert stored_stack_specs(specs, shape, "pipe", SIZES) == tuple(specs)


def test_a_stack_with_no_dim_the_pipe_axis_divides_is_refused_by_sk_jit():
    """The typed error for what still cannot run: a stacked parameter left split on
    its 7 layers over 2 stages (here by hand) cannot be placed; sk.jit says so
    before placing anything."""
    from models.gpt import GPTConfig

    info = describe(get_model("gpt"), config=GPTConfig(n_layers=7, scan_layers=True), batch_size=16)
    pipe = Pipeline(stages=2, microbatches=4, layout=(3, 4))
    plan = sk.plan(info, sk.make_mesh(pipe=2, data=4), "dp", pipeline=pipe)
    assert stack_dim(plan.params["blocks/ln1/scale"], "pipe") == 1
    plan = dataclasses.replace(plan, params={**plan.params, "blocks/ln1/scale": P("pipe")})
    step = sk.jit(sk.value_and_grad(info.loss_fn, plan), plan, enforce=False)
    with pytest.raises(PipelineError, match="7 over") as e:
        step.place(info.abstract_params, info.batch)
    assert "divides 7" in e.value.fix
