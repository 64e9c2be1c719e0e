"""Factor notation: one einsum-like line from which a rule's inference follows.

``"... m k, k n -> ... m n"`` names a *factor* for every dim of every operand.
A factor that appears in an output is a pass-through factor: all dims carrying
it share one layout. A factor that appears only in inputs is a reduction factor:
if it is sharded, every device holds a partial result and the output becomes
partial over those axes with the rule's reduce op (``sum`` for matmul, ``max``
for ``reduce_max``...). A need-replication factor must never be sharded (the
softmax axis). ``1`` marks a dim of size 1 that broadcasts and is never
sharded. ``...`` stands for leading batch dims, right-aligned across operands as
in numpy broadcasting.

This is the same language Shardy and ``custom_partitioning``'s
``sharding_rule=`` use, so a rule written here can be handed to the compiler.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from spmdkit.errors import RegistrationError, ShardingConflictError

__all__ = ["Notation", "parse_notation", "BROADCAST"]

#: Factor name of a size-1 dim that broadcasts (never sharded).
BROADCAST = "1"

_TOKEN = re.compile(r"\.\.\.|[A-Za-z_][A-Za-z_0-9]*|1")


@dataclass(frozen=True)
class Notation:
    """A parsed, ellipsis-expanded factor notation for one call's ranks.

    Attributes:
      inputs: per input, the factor of each dim (``"1"`` = broadcast dim).
      outputs: per output, the factor of each dim.
      need_replication: factors that must stay unsharded.
      reduce: reduce op that a sharded reduction factor leaves on the output
        (``None``: reduction factors must stay unsharded).
    """

    inputs: tuple[tuple[str, ...], ...]
    outputs: tuple[tuple[str, ...], ...]
    need_replication: frozenset[str] = field(default_factory=frozenset)
    reduce: str | None = "sum"

    @property
    def factors(self) -> tuple[str, ...]:
        """Every factor once, in order of first appearance (inputs, then outputs)."""
        seen: dict[str, None] = {}
        for dims in (*self.inputs, *self.outputs):
            for f in dims:
                if f != BROADCAST:
                    seen.setdefault(f, None)
        return tuple(seen)

    @property
    def reduction_factors(self) -> tuple[str, ...]:
        """Factors of inputs that no output carries."""
        out = {f for dims in self.outputs for f in dims}
        return tuple(f for f in self.factors if f not in out)

    def __str__(self) -> str:
        text = ", ".join(" ".join(d) for d in self.inputs) + " -> "
        text += ", ".join(" ".join(d) for d in self.outputs)
        if self.reduction_factors:
            text += f"  [reduce {','.join(self.reduction_factors)}: {self.reduce}]"
        if self.need_replication:
            text += f"  [replicated: {','.join(sorted(self.need_replication))}]"
        return text


def _split_operands(side: str) -> list[list[str]]:
    operands = []
    for raw in side.split(","):
        part = raw.strip()
        tokens = _TOKEN.findall(part)
        if "".join(tokens) != part.replace(" ", ""):
            raise RegistrationError(
                op="parse_notation",
                must="operands are space-separated factor names, '1' or '...'",
                given=repr(part),
                fix="write e.g. '... m k, k n -> ... m n'",
            )
        operands.append(tokens)
    return operands


def parse_notation(
    text: str,
    ranks: tuple[int, ...],
    *,
    need_replication: tuple[str, ...] | frozenset[str] = (),
    reduce: str | None = "sum",
    op: str = "parse_notation",
) -> Notation:
    """Parse ``text`` for inputs of the given ``ranks``, expanding ``...``.

    Args:
      text: ``"in0, in1 -> out"``; factor names are identifiers, ``1`` is a
        broadcast dim, ``...`` leading batch dims.
      ranks: rank of each input (to size the ellipsis).
      need_replication: factors that must stay unsharded.
      reduce: reduce op for sharded reduction factors, or ``None``.
      op: op name for error messages.

    Raises:
      RegistrationError: malformed text.
      ShardingConflictError: the ranks do not fit the notation.

    Example::

        >>> str(parse_notation("... m k, k n -> ... m n", (3, 2)))
        '_b0 m k, k n -> _b0 m n  [reduce k: sum]'
    """
    if "->" not in text:
        raise RegistrationError(
            op=op,
            must="a notation has inputs, '->', outputs",
            given=repr(text),
            fix="write e.g. 'm k, k n -> m n'",
        )
    lhs, rhs = text.split("->")
    ins = _split_operands(lhs)
    outs = _split_operands(rhs) if rhs.strip() else [[]]
    if len(ins) != len(ranks):
        raise ShardingConflictError(
            op=op,
            must=f"the op takes {len(ins)} inputs ({lhs.strip()})",
            given=f"{len(ranks)} inputs",
            fix="pass one TensorSpec per operand",
        )
    batch_len = 0
    for tokens, rank in zip(ins, ranks, strict=True):
        explicit = len([t for t in tokens if t != "..."])
        if "..." in tokens:
            if rank < explicit:
                raise ShardingConflictError(
                    op=op,
                    must=f"operand '{' '.join(tokens)}' has rank ≥ {explicit}",
                    given=f"rank {rank}",
                    fix="check the operand order and shapes",
                )
            batch_len = max(batch_len, rank - explicit)
        elif rank != explicit:
            raise ShardingConflictError(
                op=op,
                must=f"operand '{' '.join(tokens)}' has rank {explicit}",
                given=f"rank {rank}",
                fix="check the operand order and shapes",
            )
    batch = [f"_b{i}" for i in range(batch_len)]

    def expand(tokens: list[str], rank: int | None) -> tuple[str, ...]:
        if "..." not in tokens:
            return tuple(tokens)
        explicit = len(tokens) - 1
        n = batch_len if rank is None else rank - explicit
        i = tokens.index("...")
        return (*tokens[:i], *batch[batch_len - n :], *tokens[i + 1 :])

    inputs = tuple(expand(t, r) for t, r in zip(ins, ranks, strict=True))
    outputs = tuple(expand(t, None) for t in outs)
    known = {f for dims in inputs for f in dims}
    for dims in outputs:
        for f in dims:
            if f not in known and f != BROADCAST:
                raise RegistrationError(
                    op=op,
                    must="every output factor appears in some input",
                    given=f"{f!r} in {text!r}",
                    fix="name output dims after input dims",
                )
    return Notation(inputs, outputs, frozenset(need_replication), reduce)
