"""spmdkit.testing.ragged: the ragged all-to-all's documented semantics on CPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit.errors import SpmdError
from spmdkit.testing.ragged import ragged_all_to_all_reference
from spmdkit.vma import shard_map


def _run(mesh, *per_device):
    """Each argument given per device (a list over the axis), run on its device."""

    def body(*a):
        return ragged_all_to_all_reference(*(x[0] for x in a), axis_name="x")[None]

    args = [jnp.asarray(np.stack(a)) for a in per_device]
    f = shard_map(body, mesh=mesh, in_specs=(P("x"),) * 6, out_specs=P("x"), check_vma=False)
    return np.asarray(jax.jit(f)(*args))


def test_the_jax_docstrings_example():
    """jax.lax.ragged_all_to_all's own example over an axis of 2."""
    mesh = sk.make_mesh(x=2, axis_types="auto")
    got = _run(
        mesh,
        [[1, 2, 2], [3, 4, 0]],  # operand
        [[0, 0, 0, 0], [0, 0, 0, 0]],  # output
        [[0, 1], [0, 1]],  # input_offsets
        [[1, 2], [1, 1]],  # send_sizes
        [[0, 0], [1, 2]],  # output_offsets
        [[1, 1], [2, 1]],  # recv_sizes
    )
    np.testing.assert_array_equal(got, [[1, 3, 0, 0], [2, 2, 4, 0]])


def test_rows_keep_their_trailing_dims_and_the_output_elsewhere():
    mesh = sk.make_mesh(x=2, axis_types="auto")
    operand = np.arange(2 * 3 * 2).reshape(2, 3, 2).astype(np.float32)
    got = _run(
        mesh,
        operand,
        np.full((2, 3, 2), -1.0, np.float32),
        [[0, 2], [0, 1]],
        [[2, 1], [1, 2]],
        [[1, 0], [0, 1]],  # device 0's slice for peer 1 lands at 0 there, device 1's at 1
        [[2, 1], [1, 2]],
    )
    # device 0 receives its own rows 0-1 at 1-2 and device 1's row 0 at 0
    np.testing.assert_array_equal(got[0], [operand[1, 0], operand[0, 0], operand[0, 1]])
    # device 1: device 0's row 2 at 0, its own rows 1-2 at 1-2
    np.testing.assert_array_equal(got[1], [operand[0, 2], operand[1, 1], operand[1, 2]])


def test_offsets_must_be_one_per_peer():
    mesh = sk.make_mesh(x=2, axis_types="auto")
    with pytest.raises(SpmdError, match="one slice per peer"):
        _run(mesh, [[1, 2], [3, 4]], [[0, 0], [0, 0]], *([[0], [0]] for _ in range(4)))
