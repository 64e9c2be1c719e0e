"""Every compiled collective traced to the equation, rule and pass that made it.

``sk.jit`` replays a planned step node by node, each under its own name scope
(:func:`~spmdkit.propagation.graph.node_tags`: ``sk_eq`` and the node's number),
so the compiled HLO's ``op_name`` metadata names the equation each collective
came from, whether the plan's own collectives made it (under ``shard_map``) or
XLA's partitioner did (to reach a pinned layout). :func:`attribute` reads those
names back and puts each compiled collective next to:

* its :class:`Origin`: the equation (its primitive, the rule that laid it out
  and its strategy, its source line) and its pass: ``forward``, ``backward``,
  ``gradient`` (a backward reduction of a value shaped like a step input that
  the step also returns: a parameter's gradient) or ``optimizer`` (after the
  backward pass). A collective outside every node (no tag in its name) is
  traced through its own metadata: the equation named last in its ``op_name``
  and the user's line among its frames (``source_file``/``source_line``, or
  the module's stack-frame tables);
* the predicted collectives it runs (:class:`Predicted`): first those of its own
  equation, then any left over of the same kind and size. On CPU a predicted
  reduce-scatter may run as an all-reduce of the same operand, and a 16-bit
  float collective moves twice its bytes (float32), so both count as matches.

What is left on either side (:attr:`Attribution.unmatched_compiled`,
:attr:`Attribution.unmatched_predicted`) is where the plan and XLA disagree,
each with its origin.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

from spmdkit.propagation.graph import TAG_PREFIX, node_tags
from spmdkit.propagation.provenance import caller, decided_by
from spmdkit.propagation.records import EqnRecord, Propagation
from spmdkit.propagation.steps import Step
from spmdkit.util import fmt_bytes as _fmt
from spmdkit.util import is_own_source
from spmdkit.verification.hlo import HloCollective, dtype_bytes

__all__ = [
    "PHASES",
    "Attribution",
    "Blamed",
    "Origin",
    "Predicted",
    "attribute",
    "split_combined",
    "tags_in",
]

#: The passes an origin names.
PHASES = ("forward", "backward", "gradient", "optimizer")

_TAG = re.compile(rf"{TAG_PREFIX}(\d+)")
_REDUCTIONS = ("all_reduce", "reduce_scatter")
#: Most unmatched collectives printed per side (all are in the data).
MAX_PRINTED = 12


@dataclass(frozen=True)
class Origin:
    """Where a collective comes from.

    Attributes:
      equation: the jax primitive of the equation (``"dot_general"``), or the
        step's ``"output"`` / a loop's ``"carry"`` for their reshards.
      rule: the registered rule that laid the equation out (None: no rule, or
        known from the HLO metadata only).
      strategy: the rule's strategy (``""`` when unknown).
      phase: one of :data:`PHASES`.
      source: ``file:line`` (and function) of the user code that made it
        (``""`` when unknown).
      decided: how the equation's layouts were decided (``"forward rule"``,
        ``"constraint"``…; ``""`` from the HLO metadata alone).
      tag: the equation's name scope in the compiled HLO (``""``: none).
      reason: why a collective without metadata of its own is put on this
        equation (the nearest instruction that has some,
        :attr:`~spmdkit.verification.hlo.HloCollective.nearest`); ``""`` when its
        own metadata names it.
    """

    equation: str
    rule: str | None
    strategy: str
    phase: str
    source: str
    decided: str = ""
    tag: str = ""
    reason: str = ""

    def __str__(self) -> str:
        rule = f" rule {self.rule}" + (f"/{self.strategy}" if self.strategy else "")
        rule = rule if self.rule else ""
        how = f", {self.decided}" if self.decided else ""
        why = f"; {self.reason}" if self.reason else ""
        at = f" at {self.source}" if self.source else ""
        return f"{self.equation}{rule} ({self.phase}{how}{why}){at}"


@dataclass(frozen=True)
class Predicted:
    """One collective the plan predicts.

    Attributes:
      kind: collective kind (``"all_gather"``…).
      axes: the mesh axes it runs over.
      payload_bytes: per-device payload bytes per run.
      runs: runs per step (loop trips).
      arg: which operand it moves (``"input 0"``…).
      origin: the equation that needs it.
    """

    kind: str
    axes: tuple[str, ...]
    payload_bytes: int
    runs: int
    arg: str
    origin: Origin

    def __str__(self) -> str:
        times = f" ×{self.runs}" if self.runs != 1 else ""
        axes = ",".join(self.axes)
        return f"{self.kind}({axes}) {_fmt(self.payload_bytes)}{times} of {self.arg}"


@dataclass(frozen=True)
class Blamed:
    """One compiled collective with its origin and the predictions it runs.

    Attributes:
      collective: the compiled instruction.
      runs: how often it runs per step.
      origin: where it comes from (None: its metadata names no equation and no line).
      predicted: the predicted collectives it runs (``()``: none, unpredicted).
    """

    collective: HloCollective
    runs: float
    origin: Origin | None
    predicted: tuple[Predicted, ...] = ()

    def __str__(self) -> str:
        c = self.collective
        times = f" ×{self.runs:g}" if self.runs != 1 else ""
        pairs = zip(c.dtypes, c.shapes, strict=True)
        shapes = ",".join(f"{t}[{','.join(map(str, s))}]" for t, s in pairs)
        head = f"{c.kind} {shapes} {c.group_size}×: {_fmt(c.payload_bytes)}{times}"
        return f"{head}  from {self.origin if self.origin else 'nowhere: ' + c.op_name}"


@dataclass(frozen=True)
class Attribution:
    """Compiled collectives matched to predicted ones and to their origins.

    Attributes:
      collectives: every compiled collective that moves data (group size > 1, or a
        permute), with its origin and matches.
      unmatched_predicted: predicted collectives no compiled one runs.
    """

    collectives: tuple[Blamed, ...] = ()
    unmatched_predicted: tuple[Predicted, ...] = ()

    @property
    def unmatched_compiled(self) -> tuple[Blamed, ...]:
        """Compiled collectives the plan did not predict."""
        return tuple(b for b in self.collectives if not b.predicted)

    @property
    def unattributed(self) -> tuple[Blamed, ...]:
        """Compiled collectives with no origin (no equation, no source line)."""
        return tuple(b for b in self.collectives if b.origin is None)

    @property
    def matched(self) -> tuple[Blamed, ...]:
        """Compiled collectives that run predicted ones."""
        return tuple(b for b in self.collectives if b.predicted)

    def to_json(self) -> dict:
        """The attribution as JSON-able data."""

        def origin(o: Origin | None) -> dict | None:
            return None if o is None else dict(o.__dict__)

        def pred(p: Predicted) -> dict:
            return {
                "kind": p.kind,
                "axes": list(p.axes),
                "payload_bytes": p.payload_bytes,
                "runs": p.runs,
                "arg": p.arg,
                "origin": origin(p.origin),
            }

        return {
            "collectives": [
                {
                    "kind": b.collective.kind,
                    "name": b.collective.name,
                    "payload_bytes": b.collective.payload_bytes,
                    "runs": b.runs,
                    "op_name": b.collective.op_name,
                    "origin": origin(b.origin),
                    "predicted": [pred(p) for p in b.predicted],
                }
                for b in self.collectives
            ],
            "unmatched_predicted": [pred(p) for p in self.unmatched_predicted],
        }

    def lines(self) -> list[str]:
        """The report's attribution section, one line each."""
        out = [
            f"attributed: {len(self.collectives) - len(self.unattributed)} of "
            f"{len(self.collectives)} compiled collectives; {len(self.matched)} run "
            f"predicted ones"
        ]
        for title, items in (
            ("compiled, not predicted", self.unmatched_compiled),
            ("predicted, not compiled", self.unmatched_predicted),
        ):
            if not items:
                continue
            out.append(f"{title} ({len(items)}):")
            for item in items[:MAX_PRINTED]:
                text = str(item)
                if isinstance(item, Predicted):
                    text += f"  from {item.origin}"
                out.append(f"  {text}")
            if len(items) > MAX_PRINTED:
                out.append(f"  … and {len(items) - MAX_PRINTED} more (report.attribution)")
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())


# -- building -----------------------------------------------------------------------


@dataclass
class _Index:
    """The propagation's records by tag, with their origins and predictions."""

    origins: dict[str, Origin] = field(default_factory=dict)
    #: tag → the predictions its node runs, and those of the reductions of its
    #: pending sums that its readers ask for (the replay runs them at the maker);
    #: ``""``: the step outputs' reshards
    predicted: dict[str, list[Predicted]] = field(default_factory=dict)
    all: list[Predicted] = field(default_factory=list)
    #: value id → the tag of the node that made it
    maker: dict[int, str] = field(default_factory=dict)

    def put(self, tag: str, preds: Sequence[Predicted]) -> None:
        self.predicted.setdefault(tag, []).extend(preds)


def attribute(prop: Propagation, compiled: Sequence[HloCollective], runs: dict) -> Attribution:
    """Match the compiled collectives of a step ``sk.jit`` replayed to the
    predicted ones of its propagation, and trace each to its origin (module
    docstring).

    Args:
      prop: the step's propagation (its records and decided steps).
      compiled: the compiled HLO's collectives.
      runs: collective name → runs per step (``CompiledReport.executions``).

    Example::

        >>> a = attribute(prop, rep.collectives, rep.executions)
        >>> [str(b.origin) for b in a.unmatched_compiled]
        []
    """
    index = _index(prop)
    taken: set[int] = set()
    blamed: list[Blamed] = []
    for whole in compiled:
        if whole.group_size <= 1 and whole.kind != "collective_permute":
            continue
        for c in split_combined(whole):
            tags = tags_in(c.op_name)
            origin = index.origins.get(tags[0]) if tags else None
            if origin is None:
                origin = _from_metadata(c)
            if origin is None and c.nearest:
                origin = _from_nearest(c, index)
            own = [p for t in tags or [""] for p in index.predicted.get(t, ())]
            found = _take(c, own, taken)
            blamed.append(Blamed(c, runs.get(whole.name, 1), _refined(origin, c, found), found))
    # what a neighbouring equation's scope ran (a reshard XLA placed at the reader
    # of a value, or at its maker): matched against any prediction left
    rest = [p for ps in index.predicted.values() for p in ps]
    for i, b in enumerate(blamed):
        if not b.predicted:
            found = _take(b.collective, rest, taken)
            if found:
                origin = _refined(b.origin, b.collective, found)
                blamed[i] = Blamed(b.collective, b.runs, origin, found)
    left = [p for p in index.all if id(p) not in taken]
    return Attribution(tuple(blamed), tuple(left))


def _refined(origin: Origin | None, c: HloCollective, found: Sequence[Predicted]) -> Origin | None:
    """``origin`` with the pass of the predictions it runs when they all reduce a
    gradient, and the user's line from the HLO's frames when the equation's own
    traceback stops inside spmdkit (an op's region)."""
    if origin is None:  # no metadata (the step outputs' reshards): the prediction's
        return found[0].origin if found else None
    grads = all(p.origin.phase == "gradient" for p in found)
    if found and grads and origin.phase in ("backward", "optimizer"):
        origin = replace(origin, phase="gradient")
    own = is_own_source(origin.source) or not origin.source
    if own and c.source and not is_own_source(c.source):
        origin = replace(origin, source=c.source)
    return origin


def split_combined(c: HloCollective) -> list[HloCollective]:
    """A combined collective as the ones XLA combined: one per result, each with
    its own name from the combined ``op_name`` (``prefix/(a:b:c)``, one name per
    result), its payload its result's share. The frames (``source_file``, the
    stack-frame id) are the first combined instruction's, which XLA's combiner
    keeps: the first part keeps them, the others have none (their origin is
    their own equation's line, never the first one's)."""
    if not c.is_combined:
        return [c]
    names = c.op_name.split(":")
    if len(names) != len(c.shapes):
        names = [c.op_name] * len(c.shapes)
    sizes = [math.prod(s) * dtype_bytes(t) for t, s in zip(c.dtypes, c.shapes, strict=True)]
    total = sum(sizes) or 1
    return [
        replace(
            c,
            shapes=(shape,),
            dtypes=(dtype,),
            payload_bytes=round(c.payload_bytes * size / total),
            op_name=name,
            frames=c.frames if i == 0 else (),
        )
        for i, (shape, dtype, size, name) in enumerate(
            zip(c.shapes, c.dtypes, sizes, names, strict=True)
        )
    ]


def tags_in(op_name: str) -> list[str]:
    """The innermost node tag of each name ``op_name`` holds (XLA joins the names of
    combined instructions with ``:``)."""
    out = []
    for part in op_name.split(":"):
        found = _TAG.findall(part)
        if found:
            tag = f"{TAG_PREFIX}{found[-1]}"
            if tag not in out:
                out.append(tag)
    return out


def _from_metadata(c: HloCollective) -> Origin | None:
    """An origin from the instruction's own metadata: the last equation its
    ``op_name`` names and its innermost user frame."""
    name = c.op_name.split(":")[-1].rstrip(")")
    equation = name.rsplit("/", 1)[-1] if name else ""
    if not equation and not c.source:
        return None
    phase = "backward" if "transpose(" in c.op_name else "forward"
    return Origin(equation or "?", None, "", phase, c.source)


#: What a collective without metadata does for the nearest equation, by
#: :attr:`~spmdkit.verification.hlo.HloCollective.nearest_role`.
_NEAREST = {
    "result": "no metadata: XLA's reshard of this equation's result",
    "output": "no metadata: XLA's reshard of this equation's result into a step output's layout",
    "input": "no metadata: XLA's reshard of a step input this equation reads",
}


def _from_nearest(c: HloCollective, index: _Index) -> Origin | None:
    """The origin of a collective whose instruction has no metadata (XLA's
    partitioner made it between instructions: a reshard no equation asked for):
    the nearest equation's, with the reason."""
    tags = tags_in(c.nearest)
    origin = index.origins.get(tags[0]) if tags else None
    if origin is None:
        origin = _from_metadata(replace(c, op_name=c.nearest))
    if origin is None:
        return None
    return replace(origin, reason=_NEAREST.get(c.nearest_role, ""))


def _compatible(c: HloCollective, p: Predicted) -> bool:
    if c.kind != p.kind and not (c.kind == "all_reduce" and p.kind == "reduce_scatter"):
        return False
    return _close(c.payload_bytes, p.payload_bytes)


def _close(got: int, want: int) -> bool:
    """Equal within 10%, or twice as large (a 16-bit float moved in float32 on CPU)."""
    slack = 0.1 * max(got, want) + 64
    return abs(got - want) <= slack or abs(got - 2 * want) <= 0.1 * got + 64


def _take(c: HloCollective, candidates: list[Predicted], taken: set[int]) -> tuple[Predicted, ...]:
    """The predictions ``c`` runs, marked ``taken``: the one nearest its size, or
    those that fill it when it runs several (XLA merged them)."""
    free = [p for p in candidates if id(p) not in taken]
    fits = [p for p in free if _compatible(c, p)]
    if fits:
        fits = [min(fits, key=lambda p: abs(p.payload_bytes - c.payload_bytes))]
    else:
        same = [p for p in free if p.kind == c.kind]
        total = 0
        for p in same:
            if total + p.payload_bytes <= 2 * c.payload_bytes + 64:
                fits.append(p)
                total += p.payload_bytes
        if not fits or not _close(c.payload_bytes, total):
            return ()
    taken.update(id(p) for p in fits)
    return tuple(fits)


def _index(prop: Propagation) -> _Index:
    index = _Index()
    program = prop.program
    if program is None or not prop.steps:
        return index
    tags = node_tags(program.graph)
    params = {tuple(s.shape) for s in prop.in_specs} & {tuple(s.shape) for s in prop.out_specs}
    top = prop.records[: len(prop.steps)]
    last_backward = max((i for i, r in enumerate(top) if r.backward), default=-1)
    for i, (rec, step) in enumerate(zip(top, prop.steps, strict=False)):
        after = last_backward >= 0 and i > last_backward
        _add(index, tags, params, rec, step, 1, after)
    for rec in prop.records[len(prop.steps) :]:  # the outputs' reshards
        origin = Origin("output", None, "", "optimizer" if last_backward >= 0 else "forward", "")
        preds = list(_predicted(rec, origin, 1, params))
        index.put("", preds)
        index.all.extend(preds)
    return index


def _add(
    index: _Index,
    tags: dict[int, str],
    params: set[tuple[int, ...]],
    rec: EqnRecord,
    step: Step,
    runs: int,
    after: bool,
) -> None:
    tag = tags.get(id(step.node), "")
    phase = "backward" if rec.backward else "optimizer" if after else "forward"
    source = caller(step.node.eqn, rec.source, step.node.outer)
    origin = Origin(rec.primitive, rec.op, rec.strategy, phase, source, decided_by(step), tag)
    if tag:
        index.origins[tag] = origin
    node = step.node
    for a in rec.reshards:
        i = int(a.arg.split()[1]) if a.arg.startswith("input ") else -1
        maker = index.maker.get(node.ins[i], "") if 0 <= i < len(node.ins) else ""
        made = index.origins.get(maker)
        # a pending sum the backward pass left that the optimizer reads: a gradient
        late = made is not None and made.phase == "backward" and phase == "optimizer"
        o = replace(origin, phase="gradient") if a.src.partial and late else origin
        preds = list(_predicted(rec, o, runs, params, [a]))
        index.put(tag, preds)
        index.all.extend(preds)
        if a.src.partial and maker:
            index.put(maker, preds)
    for o in node.outs:
        index.maker[o] = tag
    if rec.body and step.loop is not None:
        inner = runs * rec.repeat
        for r, s in zip(rec.body, step.loop.steps, strict=False):
            _add(index, tags, params, r, s, inner, after)
        carry = Origin("carry", None, "", phase, rec.source, "", tag)
        for extra in rec.body[len(step.loop.steps) :]:
            preds = list(_predicted(extra, carry, inner, params))
            index.put(tag, preds)
            index.all.extend(preds)


def _predicted(
    rec: EqnRecord,
    origin: Origin,
    runs: int,
    params: set[tuple[int, ...]],
    reshards: Sequence | None = None,
) -> Iterator[Predicted]:
    for a in rec.reshards if reshards is None else reshards:
        o = origin
        grad = a.src.partial and tuple(a.src.shape) in params
        if origin.phase in ("backward", "optimizer") and grad:
            o = replace(origin, phase="gradient")
        for c in a.plan.collectives:
            if c.payload_bytes or c.kind == "collective_permute":
                yield Predicted(c.kind, tuple(c.axes), int(c.payload_bytes), runs, a.arg, o)
