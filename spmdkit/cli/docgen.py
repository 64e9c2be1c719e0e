"""Generate ``docs/rules.md`` from the registry: every op, its notation, strategies
and semantics.

The page is generated, never edited by hand: ``python -m spmdkit rules --markdown
> docs/rules.md`` rewrites it, and a test fails when the committed page differs
from what the registry says.
"""

from __future__ import annotations

import importlib
import inspect
from collections import defaultdict

from spmdkit.registry import get_rule, registered_ops
from spmdkit.rule import Example, FactorRule, Rule

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
`jit`). Every factor-notation rule keeps such a dim sharded wherever the padding
can be kept out of real elements: a dim that runs through every operand and
result (elementwise ops, the batch dims of matmul, the rows of a norm), a
contracted or reduced dim (matmul's `k`, `reduce_sum`/`max`/`min`: the padding
is filled with the reduction's identity before the local computation), and a dim
a broadcast operand lacks (its grad sums the cotangent, whose padding is zeroed).
The norms zero the padding of every input and output, so their rows — and, under
`sharded_stats`, the normalized dims (statistics divided by the global count) —
may be uneven. The numeric sweep checks all of it on a 2 × 3 mesh with dims of 32
and 64 (`tests/rules/test_all_rules.py::test_numeric_sweep_2x3`, slow).

Still required to divide, and why:

* a dim reduced by `reduce_mean` (partial `avg`): each device would divide by its
  padded block, so the mean of the partial means would be wrong;
* the shape family's merged or split dims and the dims a data input lacks (see
  that family's notes: a reshape cannot keep padding contiguous, and a gather's
  VJP sum would take the padding in);
* what runs under `shard_map` — `spmdkit.ops` and the planner's regions, the
  reshard executor's own collectives: `shard_map` takes even blocks only; an
  uneven layout there is an error from `spmdkit.ops`, and the replay of a region
  (or reshard) with one leaves it to XLA, which pads.

The hand-written rules (attention, cross-entropy, embedding, index_put) mask
their own padding (their notes say how)."""


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
            "| op | rule | partial policy | strategies | semantics |",
            "|---|---|---|---|---|",
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
                f"{_cell(rule.doc or '')} |"
            )
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"
