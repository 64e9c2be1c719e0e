"""Covering every input layout the sweep enumerates, at the cost of the distinct programs.

An op from ``spmdkit.ops`` does two things to its inputs: it moves each one from its
given spec to the spec the rule requires (``sk.reshard``, one operand at a time), then
runs one local program for that tuple of required specs. Thousands of enumerated
input combinations (2,816 for batch_norm's five operands on a 2x4 mesh) therefore
reach only a few dozen distinct local programs and a few dozen distinct per-operand
moves. :func:`cover` finds both; the op tests run the op end to end (values and
gradients against the unsharded computation) once per distinct program, from an
enumerated layout that needs no move when there is one, and :func:`check_moves` runs
every distinct move of every operand (values, layout, and the move's gradient) in one
compiled program per operand. Together they account for every enumerated combination.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

import spmdkit as sk
from spmdkit.testing import enumerate_specs

Specs = tuple[sk.TensorSpec, ...]


def enumerated(shapes: Sequence[tuple[int, ...]], dtypes: Sequence[object], mesh) -> list[Specs]:
    """Every input-spec combination the sweep enumerates (no partial inputs)."""
    per_input = [
        enumerate_specs(s, mesh, dtype=d, partial_ops=())
        for s, d in zip(shapes, dtypes, strict=True)
    ]
    return list(itertools.product(*per_input))


@dataclasses.dataclass
class Coverage:
    """What running every enumerated combination would exercise, deduplicated."""

    combos: int
    programs: list[Specs]  # one given layout per distinct required layout
    moves: list[set[tuple[sk.TensorSpec, sk.TensorSpec]]]  # per operand: (given, required)


def cover(combos: Sequence[Specs], required: Callable[[Specs], Specs]) -> Coverage:
    """Group ``combos`` by the layout the rule requires (``required``, in operand order)."""
    by_program: dict[Specs, list[Specs]] = {}
    moves: list[set] = [set() for _ in combos[0]]
    for given in combos:
        need = tuple(required(given))
        by_program.setdefault(need, []).append(given)
        for i, (g, r) in enumerate(zip(given, need, strict=True)):
            if g != r:
                moves[i].add((g, r))
    # prefer the combination that is already the required layout: its grads then leave
    # the op with the grad rule's own layouts, which the tests assert
    programs = [need if need in group else group[0] for need, group in by_program.items()]
    return Coverage(len(combos), programs, moves)


def check_moves(values: Sequence[np.ndarray], coverage: Coverage, mesh) -> int:
    """Run every distinct move of every operand with ``sk.reshard`` (as the ops do):
    the values arrive unchanged with the required layout, and for float operands the
    move's gradient is the incoming cotangent, back in the given layout. Returns the
    number of moves checked."""
    checked = 0
    for value, pairs in zip(values, coverage.moves, strict=True):
        if not pairs:
            continue
        moves = sorted(pairs, key=str)
        dsts = [r for _, r in moves]
        args = [jax.device_put(value, NamedSharding(mesh, g.to_partition_spec())) for g, _ in moves]

        def move_all(*xs, dsts=dsts):
            return [sk.reshard(x, d, mesh=mesh) for x, d in zip(xs, dsts, strict=True)]

        outs = jax.jit(move_all)(*args)
        for (g, r), out in zip(moves, outs, strict=True):
            np.testing.assert_array_equal(np.asarray(out), value, err_msg=f"{g} -> {r}")
            assert out.sharding.is_equivalent_to(
                NamedSharding(mesh, r.to_partition_spec()), out.ndim
            ), f"{g} -> {r}: {out.sharding.spec}"
        if jnp.issubdtype(value.dtype, jnp.floating):
            cot = np.random.default_rng(0).standard_normal(value.shape).astype(value.dtype)

            def pull(*xs, dsts=dsts, cot=cot):
                return sum(jnp.sum(y * cot) for y in move_all(*xs, dsts=dsts))

            grads = jax.jit(jax.grad(pull, argnums=tuple(range(len(args)))))(*args)
            for (g, r), grad in zip(moves, grads, strict=True):
                np.testing.assert_allclose(np.asarray(grad), cot, rtol=1e-6, err_msg=f"{g}->{r}")
                assert grad.sharding.is_equivalent_to(
                    NamedSharding(mesh, g.to_partition_spec()), grad.ndim
                ), f"{g} -> {r}: grad {grad.sharding.spec}"
        checked += len(moves)
    return checked


def check_every_layout(
    combos: Sequence[Specs],
    required: Callable[[Specs], Specs],
    check: Callable[[str, Specs], None],
    values: Sequence[np.ndarray],
    mesh,
) -> Coverage:
    """Every combination of ``combos``: ``check(mode, specs)`` once per distinct
    program in both axis modes, then every distinct move (:func:`check_moves`)."""
    cov = cover(combos, required)
    for specs in cov.programs:
        for mode in ("explicit", "auto"):
            check(mode, specs)
    check_moves(values, cov, mesh)
    return cov
