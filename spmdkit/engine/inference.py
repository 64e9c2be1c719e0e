"""Public inference calls: ``infer_forward``, ``infer_backward``, ``infer_grad``.

Each looks the op up in the registry, checks the specs against the mesh, runs
the rule, and plans the reshards that turn what was given into what the rule
requires. Results are cached on (op, specs, attrs, mesh axis names and sizes,
registry generation): a registry change makes every older answer unreachable.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from jax.sharding import AbstractMesh, Mesh

from spmdkit.engine.registry import generation, get_rule
from spmdkit.engine.rule import RuleContext
from spmdkit.errors import ShardingConflictError, SpecError, SpmdError
from spmdkit.spec import MeshLike, TensorSpec, axis_sizes
from spmdkit.state import register_cache
from spmdkit.util import freeze

if TYPE_CHECKING:
    from spmdkit.resharding.plan import ReshardPlan

__all__ = [
    "ArgReshard",
    "InferenceResult",
    "infer_forward",
    "infer_backward",
    "infer_grad",
    "clear_cache",
    "cache_info",
]

_CACHE_SIZE = 65536
_CACHE: OrderedDict[Any, InferenceResult] = register_cache(
    OrderedDict(),
    module=__name__,
    name="_CACHE",
    why="rule answers by (op, attrs, specs, mesh, registry generation).",
)
_STATS = {"hits": 0, "misses": 0}


@dataclass(frozen=True)
class ArgReshard:
    """One argument that must move: which, from → to, and the planned collectives.

    Attributes:
      arg: ``"input 0"``, ``"output 1"``, ``"out_grad 0"``…
      src: the spec given.
      dst: the spec the rule requires.
      plan: the :class:`spmdkit.resharding.ReshardPlan` (collectives, bytes per device, time).
      in_place: the value comes from an op that XLA reduces where it is made
        (scatter, gather): all its pending reductions run, on the whole block,
        before it moves (see ``spmdkit.propagation``).
    """

    arg: str
    src: TensorSpec
    dst: TensorSpec
    plan: ReshardPlan
    in_place: bool = False

    @property
    def payload_bytes(self) -> int:
        """Per-device payload bytes of the collectives."""
        return self.plan.payload_bytes

    def __str__(self) -> str:
        return f"{self.arg}: {self.plan}"


@dataclass(frozen=True)
class InferenceResult:
    """What a rule answered.

    Attributes:
      op: the op name.
      kind: ``"forward"``, ``"backward"`` or ``"grad"``.
      inputs: the specs the (forward) inputs must have.
      outputs: output specs; for ``grad``, the input cotangents.
      reshards: the arguments that must move, with their plans.
      out_grads: for ``grad``, the specs the output cotangents must have.
      forward_outputs: for ``grad``, the forward outputs under ``inputs``.
      collectives: the op's own communication (its local computation's
        collectives, e.g. a statistic all-reduce), besides the reshards.
    """

    op: str
    kind: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    reshards: tuple[ArgReshard, ...]
    out_grads: tuple[TensorSpec, ...] = ()
    forward_outputs: tuple[TensorSpec, ...] = ()
    collectives: tuple[Any, ...] = ()

    @property
    def payload_bytes(self) -> int:
        """Total per-device payload bytes of every reshard and of the op's own collectives."""
        own = sum(c.payload_bytes for c in self.collectives)
        return sum(r.payload_bytes for r in self.reshards) + own

    @property
    def time_s(self) -> float:
        """Modelled time of the reshards and the op's own collectives (s)."""
        own = sum(c.time_s for c in self.collectives)
        return sum(r.plan.time_s for r in self.reshards) + own

    def __str__(self) -> str:
        ins = ", ".join(map(str, self.inputs))
        if self.kind == "grad":
            gs = ", ".join(map(str, self.out_grads))
            head = f"{self.op} grad: ({ins}; d: {gs}) -> d: {', '.join(map(str, self.outputs))}"
        else:
            head = f"{self.op} {self.kind}: {ins} -> {', '.join(map(str, self.outputs))}"
        lines = [head, *(f"  {r}" for r in self.reshards)]
        lines += [f"  op: {c}" for c in self.collectives]
        return "\n".join(lines)


def clear_cache() -> None:
    """Drop every cached inference result (benchmarks time the uncached rules)."""
    _CACHE.clear()


def cache_info() -> dict[str, int]:
    """Cache hits, misses and size."""
    return {**_STATS, "size": len(_CACHE)}


def _freeze_attrs(attrs: Mapping[str, Any]) -> Any:
    items = tuple(sorted(attrs.items()))
    try:
        hash(items)  # fast path: attribute values are already hashable
    except TypeError:
        return freeze(attrs)
    return items


def _check_specs(
    op: str, specs: Sequence[Any], what: str, mesh: MeshLike
) -> tuple[TensorSpec, ...]:
    out = []
    for i, s in enumerate(specs):
        if not isinstance(s, TensorSpec):
            raise SpecError(
                op=op,
                must=f"every {what} is a TensorSpec",
                given=f"{type(s).__name__} at {what} {i}",
                fix="wrap it: sk.TensorSpec(shape, P(...)) or sk.TensorSpec.from_value(array)",
            )
        out.append(s.validate(mesh, op=op))
    return tuple(out)


def _lookup(key: Any) -> InferenceResult | None:
    if key is None:
        return None
    hit = _CACHE.get(key)
    if hit is not None:
        _STATS["hits"] += 1
    return hit


def _store(key: Any, result: InferenceResult) -> InferenceResult:
    _STATS["misses"] += 1
    if key is not None:
        _CACHE[key] = result
        if len(_CACHE) > _CACHE_SIZE:  # FIFO eviction keeps hits free of bookkeeping
            _CACHE.popitem(last=False)
    return result


def _key(kind: str, op: str, mesh: MeshLike, attrs: Mapping[str, Any], *groups: Any) -> Any:
    if not isinstance(mesh, (Mesh, AbstractMesh)):
        raise SpecError(
            op=op,
            must="mesh is a jax Mesh or AbstractMesh",
            given=type(mesh).__name__,
            fix="build one with sk.make_mesh(...) or sk.abstract_mesh(...)",
        )
    try:
        attrs_key = _freeze_attrs(attrs) if attrs else ()
        key = (generation(), kind, op, mesh.shape_tuple, attrs_key, *groups)
        hash(key)
    except TypeError:
        return None  # unhashable attributes or inputs: compute every time
    return key


def _reshards(
    label: str, given: Sequence[TensorSpec], required: Sequence[TensorSpec], mesh: MeshLike
) -> list[ArgReshard]:
    from spmdkit.resharding import plan_reshard

    out = []
    for i, (src, dst) in enumerate(zip(given, required, strict=True)):
        if src.dims != dst.dims or src.partial != dst.partial:
            src_t = src if src.dtype == dst.dtype else src.replace(dtype=dst.dtype)
            out.append(ArgReshard(f"{label} {i}", src, dst, plan_reshard(src_t, dst, mesh)))
    return out


def _ctx(op: str, mesh: MeshLike, attrs: Mapping[str, Any]) -> RuleContext:
    return RuleContext(op=op, axis_sizes=axis_sizes(mesh), attrs=dict(attrs))


def _guarded(op: str, attrs: Mapping[str, Any], infer: Any) -> Any:
    """``infer()``, with a rule's raw error on attributes or shapes it cannot take
    (``new_dtype=-1``, an axis out of range) turned into a typed one. Only the
    errors a notation raises when a case does not fit are turned: any other
    exception is a bug in the rule and surfaces as is."""
    try:
        return infer()
    except SpmdError:
        raise
    except (TypeError, ValueError, KeyError, IndexError) as e:  # what "does not fit" raises
        raise ShardingConflictError(
            op=op,
            must="the attributes and shapes are ones the op accepts",
            given=f"attrs {dict(attrs)}: {type(e).__name__}: {str(e)[:200]}",
            fix=f"check the op's signature and examples (spmdkit rules {op})",
        ) from e


def infer_forward(op: str, *inputs: TensorSpec, mesh: MeshLike, **attrs: Any) -> InferenceResult:
    """Forward inference: input specs → required input specs, output specs, reshards.

    Args:
      op: a registered op name (``sk.registered_ops()``).
      *inputs: one TensorSpec per operand.
      mesh: a ``Mesh`` or ``AbstractMesh``.
      **attrs: the op's attributes (``transpose_y=True``, ``axis=-1``…).

    Raises:
      NoRuleError: unknown op (the message names near matches).
      UnknownAxisError: a spec names an axis the mesh lacks.
      ShardingConflictError: shapes or attributes do not fit the op.

    Example::

        >>> mesh = sk.abstract_mesh(data=2, model=4)
        >>> x = sk.TensorSpec((64, 32), P("data", "model"))
        >>> w = sk.TensorSpec((32, 16), P("model", None))
        >>> print(sk.infer_forward("matmul", x, w, mesh=mesh).outputs[0])
        [64@data,16]{sum:model}
    """
    key = _key("fwd", op, mesh, attrs, inputs)
    hit = _lookup(key)
    if hit is not None:  # same op, specs, attrs and mesh shape: validated when first seen
        return hit
    rule = get_rule(op)
    specs = _check_specs(op, inputs, "input", mesh)
    ans = _guarded(op, attrs, lambda: rule.forward(_ctx(op, mesh, attrs), specs))
    result = InferenceResult(
        op,
        "forward",
        ans.inputs,
        ans.outputs,
        tuple(_reshards("input", specs, ans.inputs, mesh)),
        collectives=tuple(ans.collectives),
    )
    return _store(key, result)


def infer_backward(
    op: str,
    *inputs: TensorSpec,
    outputs: Sequence[TensorSpec],
    mesh: MeshLike,
    **attrs: Any,
) -> InferenceResult:
    """Backward ("reverse") inference: output specs → the input specs that give them.

    The input specs are read for their shapes (and dtypes) only. ``.outputs`` are
    the outputs those inputs produce; where they differ from what was asked, the
    output reshard is listed too.

    Example::

        >>> out = sk.TensorSpec((64, 16), P("data", "model"))
        >>> r = sk.infer_backward("matmul", sk.TensorSpec((64, 32)), sk.TensorSpec((32, 16)),
        ...                       outputs=(out,), mesh=mesh)
        >>> [str(s) for s in r.inputs]
        ['[64@data,32]', '[32,16@model]']
    """
    key = _key("bwd", op, mesh, attrs, inputs, tuple(outputs))
    hit = _lookup(key)
    if hit is not None:
        return hit
    rule = get_rule(op)
    specs = _check_specs(op, inputs, "input", mesh)
    outs = _check_specs(op, tuple(outputs), "output", mesh)
    ans = _guarded(op, attrs, lambda: rule.backward(_ctx(op, mesh, attrs), specs, outs))
    reshards = _reshards("input", specs, ans.inputs, mesh)
    if len(ans.outputs) != len(outs):
        raise ShardingConflictError(
            op=op,
            must=f"one output spec per output ({len(ans.outputs)})",
            given=f"{len(outs)} output specs",
            fix="pass outputs=(spec, ...) with one spec per op output",
        )
    reshards += _reshards("output", ans.outputs, outs, mesh)
    result = InferenceResult(
        op, "backward", ans.inputs, ans.outputs, tuple(reshards), collectives=tuple(ans.collectives)
    )
    return _store(key, result)


def infer_grad(
    op: str,
    *inputs: TensorSpec,
    out_grads: Sequence[TensorSpec],
    mesh: MeshLike,
    **attrs: Any,
) -> InferenceResult:
    """Grad inference: forward inputs + output cotangents → input cotangent specs.

    ``.inputs`` are the forward inputs the grad computation needs, ``.out_grads``
    the cotangent specs it needs, ``.outputs`` the input cotangents (partial
    sums where a sharded factor is summed away by the VJP).

    Example::

        >>> g = sk.TensorSpec((64, 16), P("data", None))
        >>> r = sk.infer_grad("matmul", x, w, out_grads=(g,), mesh=mesh)
        >>> print(r.outputs[1])   # dW sums over the data-sharded batch
        [32@model,16]{sum:data}
    """
    key = _key("grad", op, mesh, attrs, inputs, tuple(out_grads))
    hit = _lookup(key)
    if hit is not None:
        return hit
    rule = get_rule(op)
    specs = _check_specs(op, inputs, "input", mesh)
    gs = _check_specs(op, tuple(out_grads), "out_grad", mesh)
    ans = _guarded(op, attrs, lambda: rule.grad(_ctx(op, mesh, attrs), specs, gs))
    reshards = _reshards("input", specs, ans.inputs, mesh)
    reshards += _reshards("out_grad", gs, ans.out_grads, mesh)
    result = InferenceResult(
        op,
        "grad",
        ans.inputs,
        ans.input_grads,
        tuple(reshards),
        out_grads=ans.out_grads,
        forward_outputs=ans.forward_outputs,
        collectives=tuple(ans.collectives),
    )
    return _store(key, result)
