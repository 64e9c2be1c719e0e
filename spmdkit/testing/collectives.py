"""The jit check: the collectives a rule's shardings compile to, against the prediction.

Under ``jit`` a wrong rule still gives right numbers, because XLA inserts
whatever it needs; the collectives are what betray it. :func:`check_jit`
compiles the op with the rule's required input shardings and its claimed
outputs (partials resolved) and compares the collectives in the compiled HLO
with those the reshard planner predicts, as a :class:`JitReport`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from spmdkit.engine.inference import infer_forward
from spmdkit.engine.local import shard_program
from spmdkit.engine.rule import Example, Rule, without_strategy
from spmdkit.mesh import auto_mesh
from spmdkit.resharding import plan_reshard
from spmdkit.spec import axis_sizes
from spmdkit.testing.cases import temporarily_registered
from spmdkit.testing.pieces import every_combination, example_input_specs, sample_combinations
from spmdkit.verification.hlo import check_plan, compiled_collectives

__all__ = ["JitReport", "check_jit"]


def check_jit(
    rule: Rule | str,
    *,
    mesh: Mesh,
    examples: Sequence[Example] | None = None,
    max_cases: int | None = 8,
    seed: int = 0,
) -> JitReport:
    """Compile the op with the rule's shardings; compare HLO collectives with the prediction.

    For each sampled case without partial inputs: ``jax.jit(op,
    in_shardings=required inputs, out_shardings=claimed outputs with partials
    resolved)`` on an Auto-axes copy of ``mesh``. The predicted collectives are
    the reshard plan from the claimed output to that target (an all-reduce per
    pending reduction, nothing else). The compiled HLO must show the same count
    of collectives per kind and the same payload bytes per device.
    """

    with temporarily_registered(rule) as checked:
        return _jit_sweep(checked, mesh, examples, max_cases, seed)


@dataclass
class JitReport:
    """Result of :func:`check_jit`: predicted vs compiled collectives per case."""

    op: str
    mesh: dict[str, int]
    cases: int = 0
    mismatches: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when every compiled case matched the prediction."""
        return not self.mismatches and self.cases > 0

    def __str__(self) -> str:
        head = (
            f"{self.op} jit on {self.mesh}: {self.cases} cases, {len(self.mismatches)} mismatches"
        )
        return "\n".join([head, *(f"  {m}" for m in self.mismatches[:10])])


def _jit_sweep(
    rule: Rule, mesh: Mesh, examples: Sequence[Example] | None, max_cases: int | None, seed: int
) -> JitReport:
    report = JitReport(rule.name, dict(axis_sizes(mesh)))
    rng = np.random.default_rng(seed)
    amesh = auto_mesh(mesh)
    for ex in examples or rule.examples:
        attrs = dict(ex.attrs)
        fn = functools.partial(rule.impl, **without_strategy(attrs))
        combos = every_combination(example_input_specs(ex, mesh), rng, cap=4096)
        combos = [  # jit arguments hold no padded shards: even, whole values only
            c for c in combos if not any(s.partial for s in c) and all(s.is_even(mesh) for s in c)
        ]
        for specs in sample_combinations(combos, max_cases, rng):
            res = infer_forward(rule.name, *specs, mesh=mesh, **attrs)
            if any(s.partial for s in res.inputs) or not all(
                s.is_even(mesh) for s in (*res.inputs, *res.outputs)
            ):
                continue
            targets = [o.without_partial() for o in res.outputs]
            predicted = [
                c
                for o, t in zip(res.outputs, targets, strict=True)
                for c in plan_reshard(o, t, mesh).collectives
            ]
            dtypes = ex.dtypes or ("float32",) * len(ex.shapes)
            args = [
                jax.ShapeDtypeStruct(s.shape, np.dtype(d), sharding=s.to_named_sharding(amesh))
                for s, d in zip(res.inputs, dtypes, strict=True)
            ]
            if rule.has_custom_local_fn:
                # The rule runs its own local computation: compile exactly that program.
                if not all(s.is_even(mesh) for s in (*res.inputs, *res.outputs)):
                    continue
                predicted = [*res.collectives, *predicted]
                program = shard_program(rule, res, attrs, amesh)
                compiled = compiled_collectives(program, *args)
            else:
                out_sh = tuple(t.to_named_sharding(amesh) for t in targets)
                compiled = compiled_collectives(
                    lambda *a, fn=fn: fn(*a),
                    *args,
                    out_shardings=out_sh if len(out_sh) > 1 else out_sh[0],
                )
            report.cases += 1
            why = _collective_differences(predicted, compiled)
            if why:
                ins = ", ".join(map(str, res.inputs))
                outs = ", ".join(map(str, res.outputs))
                report.mismatches.append(f"{dict(attrs)} ({ins}) -> ({outs}): {why}")
    return report


def _collective_differences(predicted: Sequence[Any], compiled: Sequence[Any]) -> str | None:
    """Differences between predicted and compiled collectives (None when they agree).

    A pending reduction over several axes may compile as one all-reduce over all
    of them or one per axis (see :func:`spmdkit.verification.hlo.check_plan`); both are accepted.
    """
    diffs = check_plan(list(predicted), compiled, all_reduce_per_axis=True)
    return "; ".join(diffs) if diffs else None
