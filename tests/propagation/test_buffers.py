"""XLA's buffer assignment of temporaries to the outputs' buffers, as modelled."""

import functools

from spmdkit.propagation.buffers import Allocation, Span, hosted, peak


def test_peak_is_the_most_bytes_live_at_one_step():
    assert peak([]) == 0
    assert peak([Span(0, 3, 10), Span(4, 6, 7)]) == 10  # one after the other
    assert peak([Span(0, 3, 10), Span(3, 6, 7)]) == 17  # both live at step 3
    assert peak([Span(5, 4, 99), Span(0, 0, 1)]) == 1  # an empty span holds nothing


def test_an_output_holds_values_that_die_before_it_is_made():
    out = Allocation(128, [(10, 20)])
    assert hosted([Span(0, 9, 128)], [out]) == {0}
    assert hosted([Span(0, 10, 128)], [out]) == set()  # still live as it is made
    assert hosted([Span(0, 9, 129)], [out]) == set()  # larger than the buffer


def test_one_value_at_a_time_largest_first():
    """The 100-byte value takes the buffer first; the two small ones that
    overlap it stay out, though 28 bytes of it are never used."""
    temps = [Span(2, 5, 10), Span(4, 7, 100), Span(6, 8, 10)]
    assert hosted(temps, [Allocation(128, [(10, 20)])]) == {1}
    # without it, both small ones fit, one after the other
    assert hosted([temps[0], temps[2]], [Allocation(128, [(10, 20)])]) == {0, 1}


def test_the_smallest_buffer_that_fits_is_tried_first():
    big, small = Allocation(1024, [(10, 20)]), Allocation(64, [(10, 20)])
    # the 64-byte value goes to the small buffer, so the 512-byte one still fits the big one
    assert hosted([Span(0, 5, 64), Span(3, 7, 512)], [big, small]) == {0, 1}
    assert hosted([Span(0, 5, 64), Span(3, 7, 512)], [small]) == {0}


def test_an_operand_overwritten_in_place_ends_as_the_output_begins():
    temps = [Span(0, 10, 128)]  # read last by the op that makes the output at step 10
    assert hosted(temps, [Allocation(128, [(10, 20)])]) == set()
    assert hosted(temps, [Allocation(128, [(10, 20)], inplace={0: 9})]) == {0}


def test_a_donated_argument_holds_values_between_its_last_reader_and_its_output():
    donated = Allocation(256, [(0, 4), (12, 20)])
    assert hosted([Span(5, 11, 200)], [donated]) == {0}
    assert hosted([Span(3, 11, 200)], [donated]) == set()
    assert hosted([Span(5, 12, 200)], [donated]) == set()


def test_a_contractions_reduce_scatter_runs_at_once_its_all_reduce_at_the_end():
    from jax.sharding import PartitionSpec as P

    from spmdkit.propagation.buffers import scattered_at_once
    from spmdkit.spec import TensorSpec

    partial = TensorSpec((64, 1024), dtype="float32", partial={"data": "sum", "model": "sum"})
    scattered = TensorSpec((64, 1024), P(("data", "model")), dtype="float32")
    whole = TensorSpec((64, 1024), dtype="float32")
    assert scattered_at_once("dot_general", partial, scattered)
    assert scattered_at_once("conv_general_dilated", partial, scattered)
    assert not scattered_at_once("dot_general", partial, whole)  # all-reduced: combined
    assert not scattered_at_once("reduce_sum", partial, scattered)  # all-reduce + slice on CPU
    assert not scattered_at_once(None, partial, scattered)


def test_xla_cpu_reduce_scatters_each_partial_product_before_the_next_is_made():
    """What :func:`scattered_at_once` stands for, compiled: two weight gradients'
    partial products, each reduce-scattered under ``shard_map``, are never live
    at once (all-reduced, XLA:CPU combines them after both exist)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    import spmdkit as sk

    mesh = sk.make_mesh(x=8, axis_types="auto")
    x = jax.ShapeDtypeStruct((64, 64), jnp.float32)
    dy = jax.ShapeDtypeStruct((64, 256), jnp.float32)
    block = 64 * 256 * 4  # one partial product per device

    def temp(reduce, out):
        def body(x, dy1, dy2):
            return reduce(x.T @ dy1), reduce(x.T @ jnp.tanh(dy2))

        f = jax.shard_map(body, mesh=mesh, in_specs=(P("x"),) * 3, out_specs=(out, out))
        return jax.jit(f).lower(x, dy, dy).compile().memory_analysis().temp_size_in_bytes

    scatter = functools.partial(jax.lax.psum_scatter, axis_name="x", tiled=True)
    assert temp(scatter, P("x")) < 2 * block
    assert temp(functools.partial(jax.lax.psum, axis_name="x"), P()) >= 2 * block
