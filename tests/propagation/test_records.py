"""The records' memory facts: the operands XLA:CPU lays out anew for a collective."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit.engine.inference import ArgReshard
from spmdkit.propagation.records import gathered_copy_bytes, relayout_bytes
from spmdkit.resharding import plan_reshard
from spmdkit.spec import TensorSpec


def _reshard(src, dst, mesh):
    return ArgReshard("input 0", src, dst, plan_reshard(src, dst, mesh))


def test_a_gather_or_scatter_over_a_minor_dim_copies_its_operand():
    mesh = sk.abstract_mesh(data=2, model=4)
    shape = (8, 16, 16, 16)
    partial = TensorSpec(shape, P("data"), dtype="float32", partial={"model": "sum"})
    # the channels (minor): the whole partial block, f32[4,16,16,16], is copied
    channels = TensorSpec(shape, P("data", None, None, "model"), dtype="float32")
    assert relayout_bytes(_reshard(partial, channels, mesh), mesh) == 4 * 16 * 16 * 16 * 4
    # the rows after the batch's: the batch dim holds 4 rows per device, so a copy too
    rows = TensorSpec(shape, P("data", "model"), dtype="float32")
    assert relayout_bytes(_reshard(partial, rows, mesh), mesh) == 4 * 16 * 16 * 16 * 4
    # the major dim: its blocks are contiguous already
    whole = TensorSpec(shape, dtype="float32", partial={"model": "sum"})
    major = TensorSpec(shape, P("model"), dtype="float32")
    assert relayout_bytes(_reshard(whole, major, mesh), mesh) == 0
    # a gather copies the local block it sends, unless every dim before it is one wide
    sharded = TensorSpec((8, 32), P("data", "model"), dtype="float32")
    gathered = TensorSpec((8, 32), P("data"), dtype="float32")
    assert relayout_bytes(_reshard(sharded, gathered, mesh), mesh) == 4 * 8 * 4
    thin = TensorSpec((2, 32), P("data", "model"), dtype="float32")
    assert relayout_bytes(_reshard(thin, thin.replace(dims=(("data",), ())), mesh), mesh) == 0


def test_xla_cpu_copies_a_reduce_scatters_operand_over_a_minor_dim():
    """What :func:`relayout_bytes` counts, compiled: a contraction's partial result
    reduce-scattered over its columns is copied (column-major) first, both live at
    once; over its rows it is scattered as it is."""
    mesh = sk.make_mesh(x=4, axis_types="auto")
    a = jax.ShapeDtypeStruct((64, 64), jnp.float32)
    b = jax.ShapeDtypeStruct((64, 256), jnp.float32)
    block = 64 * 256 * 4  # the partial product on each device

    def temp(dim):
        def body(a, b):
            return jax.lax.psum_scatter(a @ b, "x", scatter_dimension=dim, tiled=True)

        f = jax.shard_map(
            body, mesh=mesh, in_specs=(P(None, "x"), P("x")), out_specs=P(*[None] * dim, "x")
        )
        return jax.jit(f).lower(a, b).compile().memory_analysis().temp_size_in_bytes

    assert temp(1) >= 2 * block
    assert temp(0) < 2 * block


def test_a_contraction_copies_an_operand_gathered_over_a_minor_dim():
    mesh = sk.abstract_mesh(data=2, model=4)
    # gathered over the columns, 64 rows before them: the whole gathered block
    cols = TensorSpec((192, 64), P(None, "data"), dtype="float32")
    whole = TensorSpec((192, 64), dtype="float32")
    assert gathered_copy_bytes(_reshard(cols, whole, mesh), mesh) == 192 * 64 * 4
    # over the rows (major): the dot reads it as gathered
    rows = TensorSpec((192, 64), P("data"), dtype="float32")
    assert gathered_copy_bytes(_reshard(rows, whole, mesh), mesh) == 0
    # a slice or a reduction gathers nothing
    assert gathered_copy_bytes(_reshard(whole, cols, mesh), mesh) == 0


def test_xla_cpu_copies_a_weight_gathered_over_its_columns_before_a_dot():
    """What :func:`gathered_copy_bytes` counts, compiled: a weight all-gathered over
    its minor dim is copied row-major before the dot reads it, the gathered block
    and its copy live at once; gathered over its rows it is read as it is."""
    mesh = sk.make_mesh(x=4, axis_types="auto")
    x = jax.ShapeDtypeStruct((8, 256), jnp.float32)
    w = jax.ShapeDtypeStruct((256, 256), jnp.float32)
    block = 256 * 256 * 4  # the gathered weight

    def temp(dim):
        def body(x, w):
            return x @ jax.lax.all_gather(w, "x", axis=dim, tiled=True)

        spec = P(*[None] * dim, "x")
        f = jax.shard_map(body, mesh=mesh, in_specs=(P("x"), spec), out_specs=P("x"))
        return jax.jit(f).lower(x, w).compile().memory_analysis().temp_size_in_bytes

    assert temp(1) >= 2 * block
    assert temp(0) < 2 * block


@pytest.mark.slow
def test_a_once_run_backward_reads_what_the_once_run_forward_gathered():
    """DeepSeek's single dense layer is a stack of one: a scan of length 1 in the
    forward pass and another in the backward, which slices the forward's stacked
    residuals. XLA inlines both loops and folds the slice of the stack, so the
    weight gradients of the sequence-parallel projections (the dense MLP's, and
    MLA's low-rank and rope-key ones) read the activation the forward gathered:
    no gather again. Predicted so, megatron_sp on data=2 x model=4 predicts the
    compiled all-gathers exactly (it counted three re-gathers, 32 KiB, 12% over)."""
    from tests.verification.steps import verified

    assert sk.models.get_model("deepseek").config("tiny").n_dense_layers == 1
    report = verified("deepseek", "megatron_sp", mesh=(2, 4))
    rows = {kind: (p, c) for kind, p, c, _ in report.rows}
    predicted, compiled = rows["all_gather"]
    assert predicted == compiled > 0, str(report)
