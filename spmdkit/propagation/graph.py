"""Tracing and the flattened program IR the propagator walks.

:func:`trace` turns a function (a whole train step: forward, ``jax.grad`` and the
optimizer update) into a jaxpr from abstract inputs; nothing is computed.
:class:`FlatProgram` turns that jaxpr into a :class:`Graph`: value ids with
shapes and dtypes, and a flat list of :class:`Node` s. Calls that only group
equations (``jit``, ``custom_jvp_call``, ``custom_vjp_call``, ``remat``) are
inlined, so the walk sees one flat list and memory liveness runs over it; remat
regions remember their :class:`Group` so the replay can run them whole. Loops
and branches (``scan``, ``while``, ``cond``) stay one node each with their
bodies as sub-graphs. :func:`dce` drops results nobody uses (as XLA does).

The graph queries at the end (:func:`uses`, :func:`producers`,
:func:`stationary`, :func:`vids`) read the IR only; they know nothing of specs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.extend.core
import numpy as np

from spmdkit import jaxprs

__all__ = [
    "FILL",
    "FlatProgram",
    "Graph",
    "Group",
    "Node",
    "TAG_PREFIX",
    "dce",
    "is_fill",
    "node_tags",
    "producers",
    "stationary",
    "trace",
    "trace_with_tree",
    "uses",
    "vids",
    "widened",
]

# -- tracing --------------------------------------------------------------------


def _abstract(x: Any) -> Any:
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return jax.ShapeDtypeStruct(tuple(x.shape), x.dtype)
    return x


def trace(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """The closed jaxpr of ``fn(*args, **kwargs)``, from abstract values only.

    Array leaves may be ``jax.Array`` or ``jax.ShapeDtypeStruct`` (shardings are
    dropped: propagation decides layouts). Keyword arguments are static.

    Example::

        >>> x = jax.ShapeDtypeStruct((8, 4), "float32")
        >>> trace(lambda x: x @ x.T, x).jaxpr.eqns[0].primitive.name
        'dot_general'
    """
    return trace_with_tree(fn, *args, **kwargs)[0]


def trace_with_tree(fn: Callable, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
    """:func:`trace`, plus the output pytree structure (pass it to
    ``propagate(closed, ..., out_tree=)`` to give ``out_specs`` as a pytree)."""
    abstract = jax.tree.map(_abstract, args)
    f = functools.partial(fn, **kwargs) if kwargs else fn
    closed, shapes = jax.make_jaxpr(f, return_shape=True)(*abstract)
    return closed, jax.tree.structure(shapes)


# -- the flattened program --------------------------------------------------------


@dataclass
class Node:
    """One equation of the flattened program: operand and result value ids.

    ``kind`` is ``"eqn"`` for a plain equation, else ``"scan"``, ``"while"``,
    ``"cond"`` (``subs``: the body graphs) or ``"shard_map"``; ``group`` is the
    remat equation the node was inlined from (the replay runs it whole);
    ``backward`` marks equations of the backward pass (``transpose(jvp(...))``);
    ``outer`` holds the call-like equations (``custom_vjp_call``, ``jit``,
    ``remat``…) and loops it was inlined from or lies in, outermost first: where
    its source line is when its own traceback stops inside spmdkit (jax records
    only the frames of the call's body for the equations of a ``custom_vjp``'s
    forward, :func:`spmdkit.propagation.provenance.caller`).
    """

    prim: str
    eqn: Any
    ins: list[int]
    outs: list[int]
    backward: bool
    kind: str = "eqn"
    subs: list[Graph] = field(default_factory=list)
    group: Group | None = None
    outer: tuple[Any, ...] = ()


@dataclass(eq=False)
class Group:
    """A remat (checkpoint) equation whose body was inlined: replayed whole."""

    eqn: Any
    ins: list[int]
    outs: list[int] = field(default_factory=list)


@dataclass
class Graph:
    """A (sub-)program: input and output value ids and its nodes in order
    (``all_nodes``: before :func:`dce`)."""

    invars: list[int]
    outvars: list[int]
    nodes: list[Node]
    all_nodes: list[Node] = field(default_factory=list)


class FlatProgram:
    """Values (shape, dtype, constness, constant values) and the graphs that use
    them; call-like equations are inlined into their callers' node lists."""

    def __init__(self) -> None:
        self.shapes: list[tuple[int, ...]] = []
        self.dtypes: list[np.dtype] = []
        self.const: list[bool] = []
        self.values: dict[int, Any] = {}  # constant id -> its value
        self.host: set[int] = set()  # ids of values in host memory (offloaded)

    def new(self, aval: Any, const: bool = False) -> int:
        """A new value id for ``aval``."""
        self.shapes.append(tuple(int(s) for s in getattr(aval, "shape", ())))
        dtype = getattr(aval, "dtype", None)
        try:
            dtype = np.dtype(dtype) if dtype is not None else np.dtype("float32")
        except TypeError:  # extended dtypes (PRNG keys): count 4 bytes per element
            dtype = np.dtype("uint32")
        self.dtypes.append(dtype)
        self.const.append(const)
        if "host" in str(getattr(aval, "memory_space", "")).lower():
            self.host.add(len(self.shapes) - 1)
        return len(self.shapes) - 1

    def const_ids(self) -> set[int]:
        """Ids of literals and constants (their layout is free to choose)."""
        return {i for i, c in enumerate(self.const) if c}

    def graph(
        self,
        closed: Any,
        ins: Sequence[int] | None = None,
        backward: bool = False,
        outer: tuple[Any, ...] = (),
    ) -> tuple[Graph, dict[Any, int]]:
        """The graph of a (closed) jaxpr, and its jaxpr variable → value id map
        (``outer``: the equations it lies in, :attr:`Node.outer`)."""
        jaxpr, consts = jaxprs.open_jaxpr(closed)
        env: dict[Any, int] = {}
        self._bind_consts(jaxpr.constvars, consts, env)
        invars = []
        for i, v in enumerate(jaxpr.invars):
            vid = ins[i] if ins is not None else self.new(v.aval)
            env[v] = vid
            invars.append(vid)
        nodes: list[Node] = []
        self._walk(jaxpr, env, nodes, backward, outer=outer)
        outvars = [self._read(env, v) for v in jaxpr.outvars]
        return Graph(invars, outvars, nodes), env

    def _bind_consts(self, constvars: Sequence[Any], consts: list, env: dict[Any, int]) -> None:
        padded = [*consts, *[None] * (len(constvars) - len(consts))]
        for v, c in zip(constvars, padded, strict=True):
            env[v] = self.new(v.aval, const=True)
            if c is not None:
                self.values[env[v]] = c

    def _read(self, env: dict[Any, int], v: Any) -> int:
        if isinstance(v, jax.extend.core.Literal):
            vid = self.new(v.aval, const=True)
            self.values[vid] = v.val
            return vid
        return env[v]

    def _walk(
        self,
        jaxpr: Any,
        env: dict[Any, int],
        nodes: list[Node],
        backward: bool,
        group: Group | None = None,
        outer: tuple[Any, ...] = (),
    ) -> None:
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            if name in jaxprs.MARKER_PRIMITIVES:  # facts for verify, no values
                continue
            bwd = backward or "transpose(" in str(eqn.source_info.name_stack)
            ins = [self._read(env, v) for v in eqn.invars]
            body = jaxprs.call_body(eqn)
            if body is not None:
                self._inline(eqn, body, ins, env, nodes, bwd, group, outer)
                continue
            outs = [self.new(v.aval) for v in eqn.outvars]
            for v, o in zip(eqn.outvars, outs, strict=True):
                env[v] = o
            node = Node(name, eqn, ins, outs, bwd, group=group, outer=outer)
            inside = (*outer, eqn)
            if name == "scan":
                node.kind = "scan"
                node.subs = [self.graph(jaxprs.scan(eqn).body, backward=bwd, outer=inside)[0]]
            elif name == "while":
                node.kind = "while"
                loop = jaxprs.while_loop(eqn)
                node.subs = [
                    self.graph(loop.cond, backward=bwd, outer=inside)[0],
                    self.graph(loop.body, backward=bwd, outer=inside)[0],
                ]
            elif name == "cond":
                node.kind = "cond"
                node.subs = [
                    self.graph(b, backward=bwd, outer=inside)[0] for b in jaxprs.cond_branches(eqn)
                ]
            elif name == "shard_map":
                node.kind = "shard_map"
            nodes.append(node)

    def _inline(
        self,
        eqn: Any,
        body: Any,
        ins: list[int],
        env: dict[Any, int],
        nodes: list[Node],
        backward: bool,
        group: Group | None,
        outer: tuple[Any, ...] = (),
    ) -> None:
        """Walk a call-like equation's body into ``nodes`` (a remat body as one group;
        ``outer``: the equations ``eqn`` lies in)."""
        inner, consts = jaxprs.open_jaxpr(body)
        sub_env: dict[Any, int] = {}
        self._bind_consts(inner.constvars, consts, sub_env)
        for v, vid in zip(inner.invars, ins, strict=True):
            sub_env[v] = vid
        g = group
        if g is None and eqn.primitive.name in jaxprs.REMAT_PRIMITIVES:
            g = Group(eqn, ins)
        self._walk(inner, sub_env, nodes, backward, g, (*outer, eqn))
        for v, o in zip(eqn.outvars, inner.outvars, strict=True):
            env[v] = self._read(sub_env, o)
        if g is not None and g is not group:
            g.outs = [env[v] for v in eqn.outvars]


#: The name scope the replay runs each node under (``sk_eq`` and the node's number,
#: :func:`node_tags`): the compiled HLO's ``op_name`` metadata then names the
#: equation each collective came from.
TAG_PREFIX = "sk_eq"


def node_tags(graph: Graph) -> dict[int, str]:
    """``id(node)`` → its name scope (:data:`TAG_PREFIX` and a number), for every
    node of ``graph`` and of its bodies, numbered in program order (the same
    numbers for the same graph: the replay and ``plan.verify`` both read them).

    Example::

        >>> tags = node_tags(prop.program.graph)
        >>> tags[id(prop.steps[0].node)]
        'sk_eq0'
    """
    tags: dict[int, str] = {}

    def walk(g: Graph) -> None:
        for node in g.all_nodes or g.nodes:
            if id(node) not in tags:
                tags[id(node)] = f"{TAG_PREFIX}{len(tags)}"
            for sub in node.subs:
                walk(sub)

    walk(graph)
    return tags


def dce(graph: Graph) -> None:
    """Drop nodes whose results nobody uses (XLA does the same)."""
    graph.all_nodes = list(graph.nodes)
    live = set(graph.outvars)
    keep = []
    for node in reversed(graph.nodes):
        effects = getattr(node.eqn, "effects", None)
        if effects or any(o in live for o in node.outs):
            keep.append(node)
            live.update(node.ins)
            for sub in node.subs:
                dce(sub)
    graph.nodes = keep[::-1]


# -- graph queries ------------------------------------------------------------------


def vids(graph: Graph) -> frozenset[int]:
    """Every value id a graph defines (inputs and results, nested bodies included)."""
    cached = getattr(graph, "_vids", None)
    if cached is None:
        ids = set(graph.invars)
        for node in graph.nodes:
            ids.update(node.outs)
            for sub in node.subs:
                ids |= vids(sub)
        cached = frozenset(ids)
        graph._vids = cached
    return cached


def uses(graph: Graph, out: dict[int, int] | None = None) -> dict[int, int]:
    """Value id → number of equations (and graph results) reading it, bodies included."""
    out = {} if out is None else out
    for node in graph.nodes:
        for v in set(node.ins):
            out[v] = out.get(v, 0) + 1
        for sub in node.subs:
            uses(sub, out)
    for v in set(graph.outvars):
        out[v] = out.get(v, 0) + 1
    return out


#: :func:`producers`' name for a ``broadcast_in_dim`` of a scalar (a constant
#: fill: the zeros a transposed ``select_n`` reads, say). It moves for nothing:
#: the enforced replay makes it anew in each reader's layout
#: (:func:`spmdkit.compile.enforce.replay`).
FILL = "fill"


def is_fill(node: Node) -> bool:
    """Whether ``node`` broadcasts a scalar (:data:`FILL`)."""
    return node.prim == "broadcast_in_dim" and all(
        not getattr(v.aval, "shape", ()) for v in node.eqn.invars
    )


def producers(graph: Graph, out: dict[int, str] | None = None) -> dict[int, str]:
    """Value id → the primitive that makes it (:data:`FILL` for a broadcast scalar),
    bodies included."""
    out = {} if out is None else out
    for node in graph.nodes:
        made = FILL if is_fill(node) else node.prim
        for o in node.outs:
            out[o] = made
        for sub in node.subs:
            producers(sub, out)
    return out


def widened(graph: Graph, prog: FlatProgram, out: dict[int, Any] | None = None) -> dict[int, Any]:
    """Value id → the narrower float dtype of the operand a cast widened it from
    (``convert_element_type`` bf16 → f32, say), bodies included."""
    out = {} if out is None else out
    for node in graph.nodes:
        if node.prim == "convert_element_type" and len(node.ins) == 1 and len(node.outs) == 1:
            src, dst = prog.dtypes[node.ins[0]], prog.dtypes[node.outs[0]]
            if (
                jax.numpy.issubdtype(src, jax.numpy.floating)
                and jax.numpy.issubdtype(dst, jax.numpy.floating)
                and np.dtype(src).itemsize < np.dtype(dst).itemsize
            ):
                out[node.outs[0]] = out.get(node.ins[0], src)
        for sub in node.subs:
            widened(sub, prog, out)
    return out


def stationary(graph: Graph, seeds: set[int]) -> set[int]:
    """Values computed from ``seeds`` (the batch): activations and their gradients."""
    out = set(seeds)
    for node in graph.nodes:
        hit = [v in out for v in node.ins]
        if not any(hit):
            continue
        out.update(node.outs)
        subs = node.subs
        if node.kind == "scan":
            body = subs[0]
            sc = jaxprs.scan(node.eqn)
            nc, nk = sc.num_consts, sc.num_carry
            ins = {b for b, h in zip(body.invars, hit, strict=True) if h}
            for _ in range(2):  # a carry fed by the batch is an activation next time round
                got = stationary(body, ins)
                ins |= {body.invars[nc + k] for k in range(nk) if body.outvars[k] in got}
            out |= stationary(body, ins)
        elif node.kind == "cond":
            for b in subs:
                out |= stationary(b, {v for v, h in zip(b.invars, hit[1:], strict=False) if h})
        else:
            for b in subs:
                out |= stationary(b, set(b.invars))
    return out
