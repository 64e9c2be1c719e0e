"""Generate ``docs/rule-reference.md`` from the registry: every op, its notation, strategies
and semantics.

The page is generated, never edited by hand: ``python -m spmdkit rules --markdown
> docs/rule-reference.md`` rewrites it, and a test fails when the committed page differs
from what the registry says.
"""

from __future__ import annotations

import importlib
import inspect
from collections import defaultdict

from spmdkit.engine.factor_rule import FactorRule
from spmdkit.engine.registry import get_rule, registered_ops
from spmdkit.engine.rule import Example, Rule

__all__ = ["rules_markdown"]


def _call(ex: Example) -> str:
    shapes = ", ".join(str(tuple(s)) for s in ex.shapes)
    return shapes + "".join(f", {k}={v!r}" for k, v in dict(ex.attrs).items())


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _notation(rule: Rule) -> str:
    if isinstance(rule, FactorRule) and isinstance(rule.notation, str):
        return f"`{rule.notation}`"
    if rule.examples:
        ex = rule.examples[0]
        try:
            text = rule.describe(ex.shapes, **dict(ex.attrs))
        except Exception:  # a hand-written describe that needs more than shapes
            text = rule.describe()
        return f"`{_cell(text)}` (for {_cell(_call(ex))})"
    return _cell(rule.describe())


def _family_doc(family: str) -> str:
    try:
        module = importlib.import_module(f"spmdkit.rules.{family}")
    except ImportError:
        return ""
    return inspect.cleandoc(module.__doc__ or "")


_UNEVEN = """\
### Uneven dims: what stays sharded, what must divide

A dim that its mesh axes do not divide (32 rows over an axis of 3) is padded on
the devices (ceil blocks; bytes are priced padded, as XLA pads them inside
`jit`). Every rule keeps such a dim sharded wherever the op's math allows,
and its local computation keeps the padding out of real elements: a dim that
runs through every operand and result (elementwise ops, the batch dims of
matmul, the rows of a norm, the pass-through dims of the shape ops) only ever
meets padding; a contracted or reduced dim (matmul's `k`, `reduce_sum`/`max`/
`min`) has its padding filled with the reduction's identity, and `reduce_mean`
rescales each device's mean of a padded block to the global count; a dim an
operand lacks (a broadcast operand, a gather's index batch dims, a padding
value) has the outputs' padding zeroed, so its grad's sum takes none in. The
norms zero the padding of every input and output; attention, cross-entropy,
embedding and index_put mask theirs (their notes say how).

The dims that still must divide are declared by each rule (`Rule.must_divide`:
which dims, and why) and listed per family below, in the column *must divide*
and the notes under each table. The numeric sweep checks the declaration: on
every uneven case it asks the rule again with each mesh axis of size 1 (which
divides every dim), and any dim kept there but replicated on the real mesh must
be a declared one (`spmdkit.testing.undeclared_replications`; the 2 × 3 sweep,
`tests/rules/test_all_rules.py::test_numeric_sweep_2x3`, slow, runs every rule
on a mesh with an axis of 3 and dims of 32 and 64).

What runs under `shard_map` — `spmdkit.ops` on concrete arrays, the planner's
regions, the reshard executor's own collectives — takes even blocks only: an
uneven layout there is an error from `spmdkit.ops`, and the replay of a region
(or reshard) with one leaves the op to XLA, which pads."""


def _divides(rule: Rule) -> str:
    """The *must divide* cell: the declared dims, or that every dim may be uneven."""
    entries = rule.must_divide
    if not entries:
        return "none"
    return "; ".join(_cell(m.dims) for m in entries)


def _divide_notes(rules: list[Rule]) -> list[str]:
    """Why each declared dim must divide, one bullet per declaration."""
    return [
        f"* **{rule.name}** — {_cell(m.dims)}: {_cell(m.why)}."
        for rule in rules
        for m in rule.must_divide
    ]


def rules_markdown() -> str:
    """The Markdown reference of every registered rule, grouped by family.

    Example::

        >>> text = rules_markdown()
        >>> "| matmul |" in text
        True
    """
    by_family: dict[str, list[Rule]] = defaultdict(list)
    for name in registered_ops():
        rule = get_rule(name)
        by_family[getattr(rule, "family", "user")].append(rule)
    lines = [
        "# Rule reference",
        "",
        "Generated from the rule registry by `python -m spmdkit rules --markdown`; "
        "do not edit by hand (a test fails when this page is stale).",
        "",
        f"{sum(len(v) for v in by_family.values())} ops in {len(by_family)} families. "
        "Notation: one factor per dim, `,` between operands, `->` before the results; "
        "a factor missing from the results is a reduction factor (its mesh axes become "
        "partial on the output); `[replicated: f]` factors must stay unsharded. "
        "Strategies: the first is the default (the reference semantics); others are "
        "picked with `strategy=` and costed by the planner.",
        "",
    ]
    lines += [_UNEVEN, ""]
    for family in sorted(by_family, key=lambda f: (f == "user", f)):
        rules = by_family[family]
        lines += [f"## {family}", ""]
        doc = _family_doc(family)
        if doc:
            lines += [doc, ""]
        lines += [
            "| op | rule | partial policy | strategies | must divide | semantics |",
            "|---|---|---|---|---|---|",
        ]
        for rule in rules:
            policy = (
                getattr(rule, "partial", "hand-written")
                if isinstance(rule, FactorRule)
                else ("hand-written")
            )
            strategies = ", ".join(f"`{s}`" for s in rule.strategies)
            lines.append(
                f"| {rule.name} | {_notation(rule)} | {policy} | {strategies} | "
                f"{_divides(rule)} | {_cell(rule.doc or '')} |"
            )
        lines.append("")
        notes = _divide_notes(rules)
        if notes:
            lines += ["Dims that must divide, and why:", "", *notes, ""]
    return "\n".join(lines).rstrip() + "\n"
