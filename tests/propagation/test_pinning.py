"""What the enforced replay pins: Program.specs entries, by field."""

import jax
from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit.propagation import Program, propagate
from spmdkit.propagation.pinning import NodePins
from tests.propagation.programs import F32, S


def test_a_row_parallel_result_is_reduced_where_it_is_computed():
    """A contraction's sum-partial result read in one layout is reduced by a
    fused plan (all-reduce to what its reader wants); other nodes pin their
    operands and results."""
    mesh = sk.abstract_mesh(data=2, model=4)

    def f(x, w):
        return jax.numpy.tanh(x @ w)

    x, w = S((64, 32), F32), S((32, 16), F32)
    prop = propagate(f, x, w, in_specs=(P("data", "model"), P("model")), mesh=mesh)
    program = prop.program
    assert isinstance(program, Program)
    dot, tanh = program.graph.nodes
    pins = program.specs[id(dot)]
    assert isinstance(pins, NodePins)
    assert pins.required == (
        sk.TensorSpec((64, 32), P("data", "model"), dtype=F32),
        sk.TensorSpec((32, 16), P("model"), dtype=F32),
    )
    assert dict(pins.produced[0].partial) == {"model": "sum"}
    assert pins.steps == ((), ())
    assert pins.runs == 1
    assert pins.fused is not None
    assert [c.kind for c in pins.fused.collectives] == ["all_reduce"]
    assert pins.fused.dst == program.specs[id(tanh)].required[0]
    assert program.specs[id(tanh)].fused is None
