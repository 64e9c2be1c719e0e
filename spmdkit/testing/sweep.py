"""The numeric sweep: every sampled input-spec combination of a rule's examples.

:func:`check_rule` runs the forward cases of each example (and, with
``grads``, grad cases with a random cotangent spec each) through
:mod:`spmdkit.testing.cases` and collects a :class:`RuleReport`: claims that are
numerically wrong, uneven dims the rule replicates without declaring it
(:func:`undeclared_replications`), and, where the rule resharded, output specs
the op would have produced right on the inputs as given (*missing*
placements: the rule is conservative there).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from spmdkit.engine.registry import get_rule
from spmdkit.engine.rule import Example, Rule, RuleContext
from spmdkit.spec import MeshLike, TensorSpec, axis_sizes
from spmdkit.testing.cases import (
    Case,
    CaseFailure,
    find_missing_placement,
    prepare_forward_case,
    prepare_grad_case,
    run_cases,
    temporarily_registered,
    unsharded_outputs,
)
from spmdkit.testing.pieces import (
    enumerate_specs,
    example_input_specs,
    random_value,
    spec_combinations,
)

__all__ = ["MissingPlacement", "RuleReport", "check_rule", "undeclared_replications"]


def check_rule(
    rule: Rule | str,
    *,
    mesh: Mesh,
    examples: Sequence[Example] | None = None,
    max_cases: int | None = 48,
    max_grad_cases: int | None = 16,
    grads: bool = True,
    missing: bool = True,
    seed: int = 0,
) -> RuleReport:
    """Run the numeric sweep (forward and grad) of ``rule`` on ``mesh``.

    Args:
      rule: a Rule or a registered op name.
      mesh: a real mesh (virtual CPU devices are fine).
      examples: inputs to sweep (default: the rule's own ``examples``).
      max_cases: forward cases per example; beyond it a deterministic sample
        (always including all-replicated) is taken. ``None``: every combination.
      max_grad_cases: grad cases per example (each with a random cotangent spec).
      grads: also check the grad rule.
      missing: also look for valid placements the rule did not claim.
      seed: seed of the values, splits and sampling.

    Returns:
      A :class:`RuleReport`; ``report.ok`` is False when any claim is wrong.
    """
    with temporarily_registered(rule) as checked:
        return _sweep_rule(checked, mesh, examples, max_cases, max_grad_cases, grads, missing, seed)


@dataclass
class RuleReport:
    """Result of :func:`check_rule`.

    Attributes:
      op: the op checked.
      mesh: the mesh, as ``{axis: size}``.
      forward_cases / grad_cases: how many cases ran.
      wrong: cases where the rule's claim is numerically wrong.
      replicated: cases where the rule replicated an uneven dim it does not declare
        in :attr:`~spmdkit.engine.rule.Rule.must_divide` (see :func:`undeclared_replications`).
      missing: valid placements the rule did not claim (it resharded instead).
      skipped: cases that could not run (and why).
    """

    op: str
    mesh: dict[str, int]
    forward_cases: int = 0
    grad_cases: int = 0
    wrong: list[CaseFailure] = field(default_factory=list)
    replicated: list[CaseFailure] = field(default_factory=list)
    missing: list[MissingPlacement] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when no case is wrong or replicated and at least one case ran."""
        return not self.wrong and not self.replicated and self.forward_cases > 0

    def __str__(self) -> str:
        lines = [
            f"{self.op} on {self.mesh}: {self.forward_cases} forward, "
            f"{self.grad_cases} grad cases, {len(self.wrong)} wrong, "
            f"{len(self.replicated)} replicated, {len(self.missing)} missing, "
            f"{len(self.skipped)} skipped"
        ]
        lines += [f"  WRONG {w}" for w in self.wrong[:10]]
        lines += [f"  REPLICATED {w}" for w in self.replicated[:10]]
        lines += [f"  missing {m}" for m in self.missing[:5]]
        return "\n".join(lines)


@dataclass(frozen=True)
class MissingPlacement:
    """Inputs the rule resharded although the op could run on them as given."""

    attrs: Mapping[str, Any]
    given: tuple[TensorSpec, ...]
    valid_output: TensorSpec

    def __str__(self) -> str:
        g = ", ".join(map(str, self.given))
        return f"{dict(self.attrs)}: ({g}) could give {self.valid_output} without a reshard"


def undeclared_replications(
    rule: Rule | str,
    specs: Sequence[TensorSpec],
    mesh: MeshLike,
    *,
    attrs: Mapping[str, Any] | None = None,
    out_grads: Sequence[TensorSpec] | None = None,
) -> list[str]:
    """Sharded dims the rule replicates because their axes do not divide them, where
    it does not declare (:attr:`~spmdkit.engine.rule.Rule.must_divide`) that they must.

    The rule is asked twice: on ``mesh``, and on its *even twin*, the same axes of
    size 1, which divide every dim. A layout decision that depends on the axis
    sizes is a divisibility decision, so an axis the twin keeps on an operand dim
    and the real mesh drops is the rule replicating an uneven dim. Each such dim
    must be one :meth:`~spmdkit.engine.rule.Rule.divisible_dims` names for the call.
    Checks the forward inference, or the grad inference when ``out_grads`` is given
    (its required inputs and cotangents).

    Returns:
      One line per undeclared replicated dim (empty when every given spec is even).

    Example::

        >>> undeclared_replications("matmul", (T((32, 64), P(None, "c")),
        ...                                    T((64, 32))), sk.abstract_mesh(c=3))
        []
    """
    checked = get_rule(rule) if isinstance(rule, str) else rule
    attrs = dict(attrs or {})
    sizes = axis_sizes(mesh)
    specs, grads = tuple(specs), tuple(out_grads or ())
    given = (*specs, *grads)
    if all(s.is_even(mesh) for s in given):
        return []
    ctx = RuleContext(op=checked.name, axis_sizes=sizes, attrs=attrs)
    twin = RuleContext(op=checked.name, axis_sizes={a: 1 for a in sizes}, attrs=attrs)

    def required(c: RuleContext) -> tuple[TensorSpec, ...]:
        if out_grads is None:
            return checked.forward(c, specs).inputs
        res = checked.grad(c, specs, grads)
        return (*res.inputs, *res.out_grads)

    real, even = required(ctx), required(twin)
    declared = checked.divisible_dims(ctx, specs, grads)
    out = []
    for i, (r, e, g, ok) in enumerate(zip(real, even, given, declared, strict=True)):
        what = f"input {i}" if i < len(specs) else f"out_grad {i - len(specs)}"
        for d, n in enumerate(g.shape):
            lost = [a for a in e.dims[d] if a not in r.dims[d]]
            if lost and n > 1 and d not in ok:  # a size-1 dim is never sharded
                out.append(f"{what} dim {d} (size {n}) loses {lost}: not declared must_divide")
    return out


# ---------------------------------------------------------------------------
# The sweep
# ---------------------------------------------------------------------------


def _sweep_rule(
    rule: Rule,
    mesh: Mesh,
    examples: Sequence[Example] | None,
    max_cases: int | None,
    max_grad_cases: int | None,
    grads: bool,
    missing: bool,
    seed: int,
) -> RuleReport:
    """:func:`check_rule` on a registered ``rule``: each example's forward cases, and
    its grad cases where it has differentiable inputs and floating outputs, all run
    together (:func:`run_cases`: compiling is what a sweep spends its time on, and
    each program has a fixed cost); then, for the forward cases the rule resharded,
    a search for placements it missed."""
    report = RuleReport(rule.name, dict(axis_sizes(mesh)))
    rng = np.random.default_rng(seed)
    batches: list[_Batch] = []
    for ex in examples or rule.examples:
        values = _example_values(ex, rng)
        ref = unsharded_outputs(rule, ex.attrs, values)
        batches.append(_forward_cases(rule, ex, mesh, values, ref, max_cases, rng, missing))
        if not grads:
            continue
        diff = ex.differentiable or (True,) * len(ex.shapes)
        if not any(diff) or not all(jnp.issubdtype(r.dtype, jnp.floating) for r in ref):
            continue
        batches.append(_grad_cases(rule, ex, mesh, values, ref, tuple(diff), max_grad_cases, rng))
    cases = [c for b in batches for c in b.cases]
    failures = iter(run_cases(cases, mesh, [b.rtol for b in batches for _ in b.cases]))
    for batch in batches:
        for case, given in zip(batch.cases, batch.given, strict=True):
            batch.record(report, case, given, next(failures))
    return report


@dataclass
class _Batch:
    """One example's forward or grad cases, ready to run: what each was given (the
    input specs, with the cotangent specs for a grad case) and how a result is
    recorded."""

    rule: Rule
    ex: Example
    mesh: Mesh
    cases: list[Case]
    given: list[tuple[Any, ...]]
    rtol: float
    grad: bool
    values: Sequence[np.ndarray] = ()
    ref: Sequence[np.ndarray] = ()
    missing: bool = False

    def record(
        self, report: RuleReport, case: Case, given: tuple[Any, ...], failure: CaseFailure | None
    ) -> None:
        """Count ``case`` in ``report`` with its failure, undeclared replications and,
        for a forward case the rule resharded, a placement it missed."""
        attrs = dict(self.ex.attrs)
        if self.grad:
            report.grad_cases += 1
            plain, gs = given
            _record_replications(report, self.rule, case, plain, self.mesh, attrs, gs)
        else:
            report.forward_cases += 1
            specs, seed = given
            _record_replications(report, self.rule, case, specs, self.mesh, attrs)
        if failure:
            report.wrong.append(failure)
            return
        if self.grad or not self.missing:
            return
        if tuple(case.res.inputs) != tuple(specs) and len(self.ref) == 1:
            own = np.random.default_rng([seed, 1])
            ex = self.ex
            cand = find_missing_placement(
                self.rule, specs, self.mesh, self.values, attrs, self.ref, ex.rtol, ex.domain, own
            )
            if cand is not None:
                report.missing.append(MissingPlacement(attrs, tuple(specs), cand))


def _example_values(ex: Example, rng: np.random.Generator) -> list[np.ndarray]:
    """The global input values of ``ex``: its own ``values``, or random ones."""
    if ex.values is not None:
        return [np.asarray(v) for v in ex.values(rng)]
    dtypes = ex.dtypes or ("float32",) * len(ex.shapes)
    return [
        random_value(s, d, domain=ex.domain, rng=rng)
        for s, d in zip(ex.shapes, dtypes, strict=True)
    ]


def _forward_cases(
    rule: Rule,
    ex: Example,
    mesh: Mesh,
    values: Sequence[np.ndarray],
    ref: Sequence[np.ndarray],
    max_cases: int | None,
    rng: np.random.Generator,
    missing: bool = False,
) -> _Batch:
    """The forward cases of one example (a missed-placement search, if ``missing``,
    draws from each case's own seed: the cases a sweep runs do not depend on it)."""
    attrs = dict(ex.attrs)
    combos = spec_combinations(example_input_specs(ex, mesh), max_cases, rng)
    seeds = [int(rng.integers(1 << 30)) for _ in combos]
    cases = [
        prepare_forward_case(rule, specs, mesh, values, attrs, ref, ex.domain, seed)
        for specs, seed in zip(combos, seeds, strict=True)
    ]
    given = [(specs, seed) for specs, seed in zip(combos, seeds, strict=True)]
    return _Batch(rule, ex, mesh, cases, given, ex.rtol, False, values, ref, missing)


def _grad_cases(
    rule: Rule,
    ex: Example,
    mesh: Mesh,
    values: Sequence[np.ndarray],
    ref: Sequence[np.ndarray],
    diff: tuple[bool, ...],
    max_grad_cases: int | None,
    rng: np.random.Generator,
) -> _Batch:
    """The grad cases of one example, each with a random cotangent spec."""
    attrs = dict(ex.attrs)
    out_cands = [
        enumerate_specs(r.shape, mesh, dtype=r.dtype, partial_ops=("sum",), even_only=not ex.uneven)
        for r in ref
    ]
    cases, given = [], []
    for specs in spec_combinations(example_input_specs(ex, mesh), max_grad_cases, rng):
        plain = tuple(s.without_partial() for s in specs)
        gs = tuple(c[int(rng.integers(len(c)))] for c in out_cands)
        cots = [random_value(r.shape, r.dtype.name, rng=rng) for r in ref]
        seed = int(rng.integers(1 << 30))
        cases.append(
            prepare_grad_case(rule, plain, gs, mesh, values, cots, attrs, diff, ex.domain, seed)
        )
        given.append((plain, gs))
    return _Batch(rule, ex, mesh, cases, given, max(ex.rtol, 1e-5), True)


def _record_replications(
    report: RuleReport,
    rule: Rule,
    case: Case,
    specs: Sequence[TensorSpec],
    mesh: Mesh,
    attrs: Mapping[str, Any],
    out_grads: Sequence[TensorSpec] | None = None,
) -> None:
    """Record a case's undeclared replications of uneven dims in ``report``."""
    why = undeclared_replications(rule, specs, mesh, attrs=attrs, out_grads=out_grads)
    if why:
        report.replicated.append(case.fail("; ".join(why)))
