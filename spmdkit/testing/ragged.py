"""``jax.lax.ragged_all_to_all`` as documented, built from a padded all-to-all.

XLA:CPU has no ragged all-to-all (its thunk emitter refuses the op, jax 0.10.2
through 0.12), so a program that sends only the rows routed (the ``moe_experts``
op's exchange on a GPU or TPU) cannot run on virtual CPU devices.
:func:`ragged_all_to_all_reference` computes what the documented semantics say the
collective returns, with collectives XLA:CPU has: each slice padded to the
operand's rows, one tiled all-to-all of the slices and one of the output offsets,
then each received slice written at its offset. It checks a caller's offsets and
sizes on CPU, not XLA's kernel.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from spmdkit.errors import SpmdError

__all__ = ["ragged_all_to_all_reference"]


def ragged_all_to_all_reference(
    operand: jax.Array,
    output: jax.Array,
    input_offsets: jax.Array,
    send_sizes: jax.Array,
    output_offsets: jax.Array,
    recv_sizes: jax.Array,
    *,
    axis_name: Any,
) -> jax.Array:
    """What ``jax.lax.ragged_all_to_all`` returns, for one slice per peer.

    Args:
      operand: the rows to send; slice ``i`` is
        ``operand[input_offsets[i]:input_offsets[i] + send_sizes[i]]``, sent to
        peer ``i`` of ``axis_name``.
      output: what the result holds where nothing is received.
      input_offsets, send_sizes: ``[n]`` int32, ``n`` the axis size.
      output_offsets: ``[n]``: where on peer ``i`` this device's slice lands.
      recv_sizes: ``[n]``: the rows received from peer ``i``.
      axis_name: the mapped axis (or axes) of a ``shard_map``.

    Returns:
      ``output`` with each received slice written at the offset its sender gave.

    Raises:
      SpmdError: the offsets are not one per peer.

    Example::

        >>> # inside shard_map over an axis "x" of 2 devices, per the jax docstring:
        >>> # device 0 sends [1] to 0 and [2, 2] to 1; device 1 sends [3] to 0 and
        >>> # [4] to 1; device 0 gets [1, 3, 0, 0], device 1 [2, 2, 4, 0]
    """
    n = input_offsets.shape[0]
    peers = jax.lax.axis_size(axis_name)
    if n != peers:
        raise SpmdError(
            op="ragged_all_to_all_reference",
            must="one slice per peer of the axis (offsets and sizes of its size)",
            given=f"{n} offsets over {peers} devices",
            fix="pass one offset and size per device of the axis",
        )
    rows = operand.shape[0]
    r = jnp.arange(rows, dtype=input_offsets.dtype)
    rest = (1,) * (operand.ndim - 1)
    take = input_offsets[:, None] + r[None, :]
    sent = (r[None, :] < send_sizes[:, None]).reshape(n, rows, *rest)
    pieces = jnp.where(sent, operand.at[take].get(mode="fill", fill_value=0), 0)
    got = jax.lax.all_to_all(pieces, axis_name, 0, 0, tiled=True)  # [from, rows, ...]
    offsets = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
    kept = r[None, :] < recv_sizes[:, None]
    at = jnp.where(kept, offsets[:, None] + r[None, :], output.shape[0])  # off the end: none
    return output.at[at.reshape(-1)].set(
        got.reshape(n * rows, *operand.shape[1:]).astype(output.dtype), mode="drop"
    )
