"""Pieces and reassembly: every device's piece of a value, and the value rebuilt."""

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit.testing import assemble, enumerate_specs, local_pieces

T = sk.TensorSpec


@pytest.mark.parametrize(
    "spec",
    [
        T((8, 4), P("b", "a")),
        T((8, 4), P(("a", "b"))),
        T((8, 4), partial={"a": "sum", "b": "max"}),
        T((8, 4), P("b"), partial={"a": "avg"}),
        T((8, 4), P(None, "a"), partial={"b": "min"}),
    ],
)
def test_pieces_reassemble_to_the_value(spec, mesh2d):
    rng = np.random.default_rng(0)
    value = rng.standard_normal((8, 4)).astype(np.float32)
    pieces = local_pieces(value, spec, mesh2d, rng=rng)
    assert pieces.shape == (2, 4, *spec.local_shape(mesh2d))
    got, why = assemble(pieces, spec, mesh2d)
    assert why is None
    np.testing.assert_allclose(got, value, rtol=1e-5, atol=1e-5)


def test_partial_splits_are_asymmetric(mesh1d):
    rng = np.random.default_rng(0)
    value = np.ones((4, 4), np.float32)
    pieces = local_pieces(value, T((4, 4), partial="x"), mesh1d, rng=rng)
    assert not np.allclose(pieces[0], pieces[1])
    assert not np.allclose(pieces[0], value / 4)
    maxes = local_pieces(value, T((4, 4), partial={"x": "max"}), mesh1d, rng=rng)
    assert (maxes < 1).any() and np.allclose(maxes.max(axis=0), value)


def test_replicated_claim_is_checked(mesh1d):
    rng = np.random.default_rng(0)
    value = rng.standard_normal((4,)).astype(np.float32)
    pieces = local_pieces(value, T((4,), partial="x"), mesh1d, rng=rng)
    got, why = assemble(pieces, T((4,)), mesh1d)
    assert got is None and "replicated" in why


def test_enumerate_specs_covers_every_kind(mesh2d):
    specs = enumerate_specs((8, 4), mesh2d)
    texts = {str(s) for s in specs}
    assert "[8,4]" in texts and "[8@(a,b),4]" in texts and "[8@b,4@a]" in texts
    assert "[8,4]{max:a,sum:b}" in texts
    assert all(s.is_even(mesh2d) for s in specs)
    assert len(specs) == 7 * 7 - 1  # b on dim 1 (size 4) with a on dim 1 would be 8-way
