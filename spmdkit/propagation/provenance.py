"""Who decided each layout, and whose tensor each predicted collective moves.

A :class:`~spmdkit.propagation.records.Propagation` keeps propagation's steps
beside its records (one step per record, a loop's body steps in its ``loop``).
:func:`trails` reads them once, after propagating, so propagation itself pays
nothing for it:

* **owners**: the caller labels some inputs (a parameter path) and outputs (the
  same parameter, updated). A label spreads forward through the values made
  from its tensor alone by views and casts (a bf16 copy, a transpose, the slice
  a ``scan`` body takes of a stacked weight) and backward from the output
  through the values of the same shape it is computed from (the update, the
  optimizer moments, the gradient, across a ``scan``'s stacked results).
* **buckets**: every collective of every record goes to exactly one bucket: the
  owner of the operand it moves (of the output it leaves in; of the region or
  op's first owned operand), else :data:`ACTIVATIONS`. A pending sum an
  equation left by reading a labelled tensor (a row-parallel weight's partial
  result) is that tensor's: its reduction is what the weight's layout causes. The buckets' bytes per
  kind add up to ``Propagation.comm_bytes_by_kind`` (loop bodies times their
  trips, as the totals count them).
* **uses**: per label, the equations where its tensor meets the rest of the
  step (the rule that read it, forward or backward, its strategy, its source
  line) and those that moved it; per ``checkpoint_name``, the equation that made
  the named activation and how its layout was decided (:func:`decided_by`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from spmdkit.engine.region import GRAD
from spmdkit.propagation.graph import Graph, Node
from spmdkit.propagation.primitives import GENERATORS
from spmdkit.propagation.records import EqnRecord, Propagation
from spmdkit.propagation.steps import Step
from spmdkit.spec import TensorSpec
from spmdkit.util import is_own_source

__all__ = ["ACTIVATIONS", "Move", "Trails", "Use", "caller", "decided_by", "trails"]

#: The bucket of collectives that move no labelled tensor: activations, their
#: gradients, a loop's carries.
ACTIVATIONS = "activations"

#: Equations whose one operand's layout passes to their result: a label spreads
#: through them (a cast, a view, a slice of a stacked weight).
_VIEWS = frozenset(
    {
        "convert_element_type",
        "reshape",
        "transpose",
        "squeeze",
        "expand_dims",
        "broadcast_in_dim",
        "copy",
        "copy_p",
        "slice",
        "dynamic_slice",
        "reduce_precision",
        "optimization_barrier",
        "name",
        "sharding_constraint",
        "reshard",
    }
)

#: Most uses kept per label (those that move it first).
MAX_USES = 16


@dataclass(frozen=True)
class Move:
    """One predicted collective: its kind, mesh axes, per-device payload bytes and
    modelled time, per run of its equation (``runs``: how often it runs a step)."""

    kind: str
    axes: tuple[str, ...]
    payload_bytes: int
    time_s: float
    runs: int = 1

    def __str__(self) -> str:
        axes = ",".join(self.axes)
        runs = f" ×{self.runs}" if self.runs > 1 else ""
        return f"{self.kind}({axes}) {self.payload_bytes} B{runs}"


@dataclass(frozen=True)
class Use:
    """One equation that read, made or moved a tensor.

    Attributes:
      primitive: the jax primitive.
      op: the registered rule that laid it out (None: no rule).
      strategy: the rule's strategy.
      phase: ``"forward"``, ``"backward"`` (the gradient pass) or ``"update"``
        (computing the tensor's new value: the optimizer, the gradient's reduction).
      decided: how the equation's result layouts were decided (:func:`decided_by`).
      source: ``file:line (function)`` of the user code that made the equation.
      spec: the layout the equation wanted the tensor in (its result's, for the
        equation that made it), as text.
      moves: the collectives it runs on the tensor.
      runs: how often the equation runs per step (loop trips).
    """

    primitive: str
    op: str | None
    strategy: str
    phase: str
    decided: str
    source: str
    spec: str
    moves: tuple[Move, ...] = ()
    runs: int = 1


@dataclass(frozen=True)
class Trails:
    """What :func:`trails` found.

    Attributes:
      uses: label → the :class:`Use` s of its tensor (moves first, at most :data:`MAX_USES`).
      named: ``checkpoint_name`` → the uses that made and read that activation.
      bytes: bucket (a label, or :data:`ACTIVATIONS`) → collective kind → payload
        bytes per step; summed over buckets, ``Propagation.comm_bytes_by_kind``.
      time_s: bucket → modelled collective time per step; summed,
        ``Propagation.comm_time_s``.
      kind_time_s: collective kind → modelled time per step; summed,
        ``Propagation.comm_time_s``.
    """

    uses: Mapping[str, tuple[Use, ...]] = field(default_factory=dict)
    named: Mapping[str, tuple[Use, ...]] = field(default_factory=dict)
    bytes: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    time_s: Mapping[str, float] = field(default_factory=dict)
    kind_time_s: Mapping[str, float] = field(default_factory=dict)


def decided_by(step: Step) -> str:
    """How a step's result layouts were decided, in words: ``"forward rule"`` (the
    rule's answer for its operands' layouts), ``"backward rule"`` (the layout a
    later equation wanted, carried back by the rules' backward inference and
    taken where it costs no more), ``"constraint"`` (a
    sharding constraint in the user's code), ``"shard_map specs"``, ``"loop body"``,
    ``"made as its readers want"`` (a fresh value), ``"no rule: replicated"``,
    ``"constant"``."""
    node, op = step.node, step.op
    if node.kind in ("scan", "while", "cond"):
        return "loop body"
    if node.kind == "shard_map":
        return "shard_map specs"
    if op is None:
        return "constant" if not node.ins else "no rule: replicated"
    if op in ("sharding_constraint", "reshard", "mesh_cast") and op == node.prim:
        return "constraint"
    if op in GENERATORS:
        sharded = any(o.sharding_axes for o in step.outputs)
        return "made as its readers want" if sharded else "made replicated"
    if step.hinted:
        return "backward rule"
    return "forward rule"


def trails(
    prop: Propagation, inputs: Mapping[int, str], outputs: Mapping[int, str] | None = None
) -> Trails:
    """Owners, buckets and uses of a propagated step (module docstring).

    Args:
      prop: what :func:`~spmdkit.propagation.propagate` returned.
      inputs: flat input position → label (a parameter's path).
      outputs: flat output position → label (the parameter, updated).

    Example::

        >>> t = trails(prop, {0: "w"}, {0: "w"})
        >>> sum(t.bytes["w"].values())  # the bytes moving w and its gradient
        8192
    """
    graph = prop.program.graph if prop.program is not None else None
    if graph is None or not prop.steps:
        return Trails()
    owner: dict[int, str] = {}
    for i, label in inputs.items():
        owner[graph.invars[i]] = label
    _forward_owners(prop.steps, owner)
    forward = frozenset(owner)  # the tensors and their views: the update stops there
    for i, label in (outputs or {}).items():
        owner.setdefault(graph.outvars[i], label)
    updated = _backward_owners(graph, prop.steps, owner, forward)
    walk = _Walk(owner, updated)
    walk.records(prop.records[: len(prop.steps)], prop.steps, 1)
    for rec in prop.records[len(prop.steps) :]:  # the outputs' reshards
        i = rec.attrs.get("output")
        label = (outputs or {}).get(i) or owner.get(graph.outvars[i], ACTIVATIONS)
        walk.add(label, rec.reshards, 1)
        if label != ACTIVATIONS:
            spec = _text(rec.outputs[0])
            use = Use("output", None, "default", "update", "out_specs", "", spec)
            walk.use(label, _with_moves(use, rec.reshards, 1))
    return walk.result()


# -- owners ---------------------------------------------------------------------------


def _forward_owners(steps: Sequence[Step], owner: dict[int, str]) -> None:
    """Labels spread to the results of views and casts of a labelled value alone,
    and into a scan body's inputs."""
    for step in steps:
        node = step.node
        if node.kind == "scan" and node.subs:
            body = node.subs[0]
            for v, b in zip(node.ins, body.invars, strict=False):
                if v in owner:
                    owner.setdefault(b, owner[v])
            if step.loop is not None:
                _forward_owners(step.loop.steps, owner)
            continue
        if node.prim not in _VIEWS or not node.ins:
            continue
        labels = {owner.get(v) for v in node.ins}
        if len(labels) == 1 and None not in labels:
            (label,) = labels
            for o in node.outs:
                owner.setdefault(o, label)


def _backward_owners(
    graph: Graph, steps: Sequence[Step], owner: dict[int, str], forward: frozenset[int]
) -> set[int]:
    """Labels spread from the labelled outputs back through the values of the same
    shape they are computed from (the update, the moments, the gradient), into
    scan bodies through their stacked results, never into the ``forward`` values
    (the tensors and their views); the ids of those values."""
    made: dict[int, Step] = {}
    for step in steps:
        for o in step.node.outs:
            made[o] = step
    updated: set[int] = set()
    todo = [v for v in graph.outvars if v in owner]
    while todo:
        v = todo.pop()
        step = made.get(v)
        if step is None or v in updated or v in forward:
            continue
        updated.add(v)
        label, node = owner[v], step.node
        shape = _shape(step, v)
        if node.kind == "scan" and node.subs and step.loop is not None:
            inner = _scan_result(node, v)
            if inner is not None:
                owner.setdefault(inner, label)
                body = node.subs[0]
                updated |= _backward_owners(
                    Graph(body.invars, [inner], body.nodes), step.loop.steps, owner, forward
                )
            continue
        view = node.prim in _VIEWS and node.prim != "broadcast_in_dim" and len(node.ins) == 1
        for u, given in zip(node.ins, step.given, strict=True):
            same = given.shape == shape or (view and math.prod(given.shape) == math.prod(shape))
            if same and owner.setdefault(u, label) == label:
                todo.append(u)
    return updated


def _scan_result(node: Node, v: int) -> int | None:
    """The body result a scan's result ``v`` is (its carry, or the slice of its
    stacked ``ys``)."""
    body = node.subs[0]
    for o, b in zip(node.outs, body.outvars, strict=False):
        if o == v:
            return b
    return None


def _shape(step: Step, v: int) -> tuple[int, ...]:
    for o, s in zip(step.node.outs, step.outputs, strict=False):
        if o == v:
            return s.shape
    return ()


# -- buckets and uses -------------------------------------------------------------------


class _Walk:
    """Every record's collectives into buckets, and the labelled tensors' uses."""

    def __init__(self, owner: Mapping[int, str], updated: set[int]) -> None:
        self.owner = owner
        self.updated = updated
        self.bytes: dict[str, dict[str, int]] = {}
        self.time: dict[str, float] = {}
        self.kind_time: dict[str, float] = {}
        self.uses: dict[str, list[Use]] = {}
        # pending sums a labelled weight made (a row-parallel matmul's result):
        # their reduction is that weight's
        self.partial: dict[int, str] = {}
        # value id → the record and step that made it (a named activation's producer)
        self.made: dict[int, tuple[EqnRecord, Step]] = {}
        self.named: dict[str, list[Use]] = {}

    def add(self, label: str, reshards: Sequence, runs: int) -> None:
        per = self.bytes.setdefault(label, {})
        for a in reshards:
            for c in a.plan.collectives:
                per[c.kind] = per.get(c.kind, 0) + c.payload_bytes * runs
                self.kind_time[c.kind] = self.kind_time.get(c.kind, 0.0) + c.time_s * runs
            self.time[label] = self.time.get(label, 0.0) + a.plan.time_s * runs

    def use(self, label: str, use: Use) -> None:
        self.uses.setdefault(label, []).append(use)

    def records(self, records: Sequence[EqnRecord], steps: Sequence[Step], runs: int) -> None:
        for rec, step in zip(records, steps, strict=False):
            self.record(rec, step, runs)

    def record(self, rec: EqnRecord, step: Step, runs: int) -> None:
        node = step.node
        self._pending(node, rec)
        by: dict[str, list] = {}
        for a in rec.reshards:
            by.setdefault(self._bucket(node, a.arg), []).append(a)
        for label, moved in by.items():
            self.add(label, moved, runs)
        if node.prim == "name":
            self._named(rec, step)
        for o in node.outs:
            self.made[o] = (rec, step)
        self._uses(rec, step, by, runs)
        if rec.body and step.loop is not None:
            inner = runs * rec.repeat
            self.records(rec.body, step.loop.steps, inner)
            for extra in rec.body[len(step.loop.steps) :]:  # the carries' reshards
                self.add(ACTIVATIONS, extra.reshards, inner)

    def _label(self, v: int) -> str | None:
        return self.owner.get(v) or self.partial.get(v)

    def _pending(self, node: Node, rec: EqnRecord) -> None:
        """Results left sum-partial by an equation that read a labelled tensor (or
        a pending sum of one, through a view): their reduction is caused by it."""
        labels = [x for v in node.ins if (x := self._label(v)) is not None]
        if not labels:
            return
        for o, spec in zip(node.outs, rec.outputs, strict=False):
            if spec.partial and o not in self.owner:
                self.partial[o] = labels[0]

    def _bucket(self, node: Node, arg: str) -> str:
        """The owner of the operand a reshard moves (``input i``; a pending sum's:
        the labelled tensor that made it), else of the node's first labelled
        result or operand."""
        if arg.startswith("input "):
            i = int(arg.split()[1])
            label = self._label(node.ins[i]) if i < len(node.ins) else None
            return label or ACTIVATIONS
        for v in (*node.outs, *node.ins):
            if v in self.owner:
                return self.owner[v]
        return ACTIVATIONS

    def _uses(self, rec: EqnRecord, step: Step, by: Mapping[str, list], runs: int) -> None:
        """Where a labelled tensor meets the rest of the step (an equation that is not
        a view of it alone), or is moved, or is updated."""
        node = step.node
        loop = node.kind in ("scan", "while", "cond")
        decided = decided_by(step)
        phase = "backward" if node.backward or node.prim == GRAD else "forward"
        if phase == "forward" and any(o in self.updated for o in node.outs):
            phase = "update"
        seen: set[str] = set()
        for i, v in enumerate(node.ins):
            label = self._label(v)
            if label is None or label in seen:
                continue
            quiet = loop or node.prim in _VIEWS or v in self.updated or phase == "update"
            quiet = quiet or v not in self.owner  # a pending sum it made: where it moves
            if quiet and not _moves(by.get(label, ())):
                continue
            seen.add(label)
            spec = _text(rec.inputs[i]) if i < len(rec.inputs) else ""
            source = _caller(node.eqn, rec.source, node.outer)
            use = Use(node.prim, rec.op, rec.strategy, phase, decided, source, spec, runs=runs)
            self.use(label, _with_moves(use, by.get(label, ()), runs))

    def _named(self, rec: EqnRecord, step: Step) -> None:
        """A ``checkpoint_name``: the equation that made the named value (its rule,
        how its layout was decided, its line), once per source line and layout."""
        name = str(step.node.eqn.params.get("name", ""))
        if not name or not rec.outputs:
            return
        rec, step = self.made.get(step.node.ins[0], (rec, step)) if step.node.ins else (rec, step)
        node = step.node
        phase = "backward" if node.backward or node.prim == GRAD else "forward"
        source = _caller(node.eqn, rec.source, node.outer)
        spec = _text(rec.outputs[0]) if rec.outputs else ""
        use = Use(node.prim, rec.op, rec.strategy, phase, decided_by(step), source, spec)
        have = self.named.setdefault(name, [])
        if use not in have:
            have.append(use)

    def result(self) -> Trails:
        uses = {k: tuple(_kept(v)) for k, v in self.uses.items()}
        named = {k: tuple(v[:MAX_USES]) for k, v in self.named.items()}
        return Trails(uses, named, self.bytes, self.time, self.kind_time)


def _kept(uses: list[Use]) -> Iterator[Use]:
    """At most :data:`MAX_USES` uses, those that move the tensor first, each
    (primitive, rule, phase, source, spec) once."""
    seen: set[tuple] = set()
    out = []
    for u in sorted(uses, key=lambda u: not u.moves):
        key = (u.primitive, u.op, u.phase, u.source, u.spec, u.moves)
        if key not in seen:
            seen.add(key)
            out.append(u)
    return iter(out[:MAX_USES])


def _caller(eqn: object, fallback: str, outer: Sequence[object] = ()) -> str:
    """``file:line:column (function)`` of the first frame of ``eqn``'s user
    traceback outside spmdkit, else of the innermost of ``outer`` (the equations
    it was inlined from) that has one (``fallback``: none, or no traceback)."""
    try:
        from jax._src import source_info_util  # no public equivalent

        for e in (eqn, *reversed(tuple(outer))):
            frames = source_info_util.user_frames(e.source_info.traceback)
            for f in frames:
                if f is not None and not is_own_source(os.path.abspath(f.file_name)):
                    return f"{f.file_name}:{f.start_line}:{f.start_column} ({f.function_name})"
    except Exception:  # a jax without these internals: the record's own source
        return fallback
    return fallback


def caller(eqn: object, fallback: str, outer: Sequence[object] = ()) -> str:
    """``file:line:column (function)`` of the first frame of an equation's user
    traceback outside spmdkit (the model line that called an ``spmdkit.ops``
    function). An equation whose traceback stops inside spmdkit (the forward
    region of a ``custom_vjp``: jax keeps only the frames of the call's body)
    takes the line of the innermost of ``outer``, the call-like equations it was
    inlined from (:attr:`~spmdkit.propagation.graph.Node.outer`), that has one;
    ``fallback`` when none has."""
    return _caller(eqn, fallback, outer)


def _moves(reshards: Sequence) -> bool:
    return any(c.payload_bytes for a in reshards for c in a.plan.collectives)


def _with_moves(use: Use, reshards: Sequence, runs: int) -> Use:
    moves = tuple(
        Move(c.kind, tuple(c.axes), int(c.payload_bytes), float(c.time_s), runs)
        for a in reshards
        for c in a.plan.collectives
        if c.payload_bytes
    )
    return Use(
        use.primitive,
        use.op,
        use.strategy,
        use.phase,
        use.decided,
        use.source,
        use.spec,
        moves,
        use.runs,
    )


def _text(spec: TensorSpec) -> str:
    return str(spec)
