"""XLA's buffer assignment of temporaries to the outputs' buffers, as modelled."""

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
