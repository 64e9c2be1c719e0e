"""Run a traced program with every equation pinned to its propagated layouts.

:func:`spmdkit.propagation.propagate` decides a layout for every value of a step and
prices the reshards between them. Left alone, XLA's partitioner makes its own
choices from the step's input and output shardings only, and the compiled program
can move different bytes than the plan says (it may gather an activation where the
plan gathers a weight, or keep a result sharded where the plan replicates it).

:func:`replay` re-emits the traced equations one by one and wraps each operand in
``with_sharding_constraint`` to the layout the rule asked for, and each result to
the layout the rule produced (an operand already pinned to the layout its reader
asks for is read as it is: one constraint, not two). XLA then has nothing left to
choose but *how* to move between two given layouts, so the compiled program does
what the plan predicted.
``sk.jit`` does this by default under Auto axes (``enforce=True``).

Three cases need more than a constraint on each side:
  - a reshard with no partial layout on the way and even blocks runs with the
    plan's own collectives under ``shard_map`` (the executor of
    :func:`spmdkit.reshard`), once per value and target; every reader that wants
    that layout reads the moved copy. Left to a constraint, XLA may move it
    another way (gather the larger dim first, or slice and permute where the
    plan gathers);
  - a multi-step reshard that cannot run so (a partial or uneven layout on the
    way) is pinned at every intermediate layout, so XLA still takes the plan's
    steps in the plan's order; when its collectives all come before the first
    partial layout (a bias gathered, then made partial to be added to a pending
    sum), they run under ``shard_map`` and only the local rest is left to XLA
    (left alone, XLA adds the bias after the sum and moves it by slice and
    permute where the plan gathers); a value that local steps alone make partial
    (a scatter-add's zeros joining the sum of its sharded updates) is pinned to
    the layout before it becomes partial (left with no constraint, XLA laid the
    zeros out whole and gathered the updates);
  - a contraction (``dot_general``, ``conv_general_dilated``) whose result is
    sum-partial, and whose readers want non-partial layouts that all slice from
    one of them, runs per device under ``shard_map`` and is reduced there with
    the plan's own collectives (``psum_scatter``, ``psum``). A partial value
    cannot be pinned: left alone, XLA may compute the contraction in another
    layout and move an activation where the plan moves the (smaller) product,
    or reduce-scatter and then gather where the plan all-reduces. When the
    partial passes a transpose (or, kept in its layout, a reshape or cast) on
    its way to the readers, it is reduced before it, in the layout the
    transpose maps the readers' layout back to. When a sum shrinks it on the
    way (grouped-query attention's key gradient, summed over each group's
    heads), the path runs per device inside the ``shard_map`` and its end is
    reduced, as the plan counts it (left alone, XLA all-reduced the product
    whole). So is a ``reduce_sum`` whose
    partial result only the step's outputs read (a bias's gradient summed over
    a sharded batch), whose output layout XLA would otherwise reach by reducing,
    slicing and permuting where the plan gathers and reduce-scatters. And so is a
    ``gather`` from a table sharded over the dims it indexes (each device looks
    its own rows up with a mask, the result partial over those axes): left
    alone, XLA splits the indices over the table's idle axes, all-reduces the
    smaller block and permutes it into the readers' layout (megatron_sp's
    position embedding). So is a grouped GEMM (``ragged_dot_general``) whose
    result is partial over its groups' axes and others, run per device by its
    rule's local computation: left alone, XLA reduces it once per factor. So is a
    ``top_k`` whose operand stays sharded on the dims it does not select along (a
    router's tokens): left alone, XLA gathers the whole operand of its TopK custom
    call, every device taking the top-k of every token.

The step's outputs leave in the layouts it returns them in: an output made in
another layout moves there with the plan's own collectives under ``shard_map``
(:attr:`~spmdkit.propagation.pinning.Program.outs`), as an operand does. Left to
the output sharding, XLA moved an optimizer's results from the gradient's layout
into the parameters' by a collective-permute and a gather over part of an axis,
where the plan gathers the whole axis.

Composite ops of :mod:`spmdkit.ops` traced as regions (:mod:`spmdkit.engine.region`) run
as their rule's ``shard_map`` program with the planned layouts and strategy, so their
collectives are the rule's own. Each program is traced once per op, layouts and
shapes (:func:`~spmdkit.engine.region.region_jaxpr`) and bound as one equation
holding that jaxpr: the layers whose regions run the same program bind equal
equations, which jax lowers once for all of them (each copy keeps its own name
scope in the compiled HLO).

What is not pinned:
  - other values with a pending reduction (``partial``): XLA keeps those
    internal and reduces them where the next constraint asks for a non-partial
    layout;
  - scalars and extended dtypes (PRNG keys);
  - the insides of ``while`` and ``cond`` bodies (their operands and results
    are pinned). ``scan`` bodies are pinned equation by equation, and each
    ``ys`` result every iteration to the slice of its stacked layout, so a
    pending sum (a layer's weight gradient) is reduced inside the loop into its
    shard as the plan counts it, not stacked at full size; so are remat
    (checkpoint) regions, whose pinned replay is bound again as a checkpoint
    with the region's own parameters (policy, ``prevent_cse``,
    ``differentiated``), so XLA still recomputes them where the traced step does
    and moves what the plan says inside them (a recipe's per-layer recompute
    runs each layer's forward again in the backward pass).

The replayed program computes the same values as the traced one: constraints do
not change values, and every equation is bound with its own parameters. Custom
differentiation rules of inlined ``custom_jvp``/``custom_vjp`` calls are not kept:
differentiate the step, then compile it (``sk.jit(jax.grad(loss), plan)``), not the
other way round.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core
import jax.numpy as jnp
from jax.interpreters import mlir
from jax.interpreters import partial_eval as pe
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from spmdkit import jaxprs
from spmdkit.engine.region import (
    FORWARD,
    KEPT_NOTHING,
    REGIONS,
    KeptLayout,
    check_kept,
    kept_dtypes,
    kept_layout,
    region_jaxpr,
)
from spmdkit.engine.registry import get_rule
from spmdkit.engine.rule import LocalContext
from spmdkit.errors import SpmdError
from spmdkit.propagation.graph import Graph, Node, is_fill, node_tags
from spmdkit.propagation.pinning import Program
from spmdkit.propagation.primitives import grouped_groups_split, lookup_dims
from spmdkit.propagation.records import Propagation
from spmdkit.resharding import ReshardPlan, run_plan, step_fn
from spmdkit.spec import TensorSpec, axis_sizes
from spmdkit.state import cached
from spmdkit.vma import shard_map

try:  # name stacks keep forward/backward labels in the compiled HLO's metadata
    from jax._src import source_info_util as _siu
except ImportError:  # pragma: no cover - a jax without the private module
    _siu = None

__all__ = ["replay", "enforced"]


#: Primitives jax lowers to their operand (``checkpoint_name``'s ``name``): a
#: constraint on the result would be a second one on the same value.
_LOWERED_AWAY = frozenset({"name"})


#: One equation standing for a region's traced ``shard_map`` program
#: (:func:`~spmdkit.engine.region.region_jaxpr`), bound with that jaxpr as its
#: parameter (:func:`_run_program`).
_program_p = jax.extend.core.Primitive("spmdkit_region_program")
_program_p.multiple_results = True


def _program_abstract(*avals: Any, jaxpr: Any) -> tuple[list[Any], Any]:
    return [v.aval for v in jaxpr.outvars], jaxpr.effects


def _program_lowering(ctx: Any, *args: Any, jaxpr: Any) -> Sequence[Any]:
    # the program's equations lowered in place, under the name stack of the
    # region's node (the op names plan.verify attributes collectives by)
    outs, tokens = mlir.jaxpr_subcomp(
        ctx.module_context,
        jaxpr,
        ctx.name_stack,
        ctx.tokens_in,
        [],
        *args,
        dim_var_values=ctx.dim_var_values,
        const_lowering=ctx.const_lowering,
        outer_traceback=None,
    )
    ctx.set_tokens_out(tokens)
    return outs


@cached(
    maxsize=1024,
    why="a region program's jaxpr with its unread results dropped (one object per "
    "program and results read, so equal regions still lower once).",
)
def _program_dce(jaxpr: Any, used: tuple[bool, ...]) -> tuple[Any, tuple[bool, ...]]:
    dced, used_ins = pe.dce_jaxpr(jaxpr, list(used))
    return dced, tuple(used_ins)


def _program_dce_rule(used_outputs: Sequence[bool], *rest: Any) -> tuple[list[bool], Any]:
    """Dead code dropped inside the program as jax drops it inside the
    ``shard_map`` it holds (``jit`` runs this before lowering); the last
    argument is the equation (jax 0.12 passes its live inputs before it)."""
    eqn = rest[-1]
    if not any(used_outputs) and not eqn.effects:
        return [False] * len(eqn.invars), None
    jaxpr, used_ins = _program_dce(jaxprs.program_jaxpr(eqn), tuple(used_outputs))
    new = eqn.replace(
        invars=[v for v, on in zip(eqn.invars, used_ins, strict=True) if on],
        outvars=[v for v, on in zip(eqn.outvars, used_outputs, strict=True) if on],
        params={**eqn.params, "jaxpr": jaxpr},
        effects=jaxpr.effects,
    )
    return list(used_ins), new


_program_p.def_effectful_abstract_eval(_program_abstract)
mlir.register_lowering(_program_p, _program_lowering)
pe.dce_rules[_program_p] = _program_dce_rule


def _run_program(closed: jax.extend.core.ClosedJaxpr, vals: Sequence[Any]) -> list[Any]:
    """A region's traced program run on ``vals`` as one equation whose parameter is
    the program's jaxpr itself: nothing of it is traced again, and every layer
    whose region has the same program (the same jaxpr, memoized per op, layouts
    and shapes) binds an equal equation, which jax's lowering cache lowers once
    for all of them (bound equation by equation, each layer's copy was traced
    and lowered anew). A program with constants is bound equation by equation."""
    if closed.consts:
        return list(jax.extend.core.jaxpr_as_fun(closed)(*vals))
    return list(_program_p.bind(*vals, jaxpr=closed.jaxpr))


def _pin(x: Any, spec: TensorSpec | None, mesh: Any) -> Any:
    if spec is None or spec.partial or not spec.dims:
        return x
    dtype = getattr(x, "dtype", None)
    if dtype is None or jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return x
    if tuple(getattr(x, "shape", ())) != tuple(spec.shape):
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec.to_partition_spec()))


def _partly_manual(node: Node, mesh: Any) -> bool:
    """Whether ``node`` is a ``shard_map`` manual over some of ``mesh``'s axes of
    size > 1 but not all of them."""
    if node.prim != "shard_map":
        return False
    manual = jaxprs.manual_axes(node.eqn)
    if not manual:
        return False
    others = {a for a, n in dict(mesh.shape).items() if n > 1} - manual
    return bool(others)


def _bind(eqn: Any, vals: Sequence[Any], *, local: bool = False) -> list[Any]:
    """Bind ``eqn``'s primitive on ``vals`` under the context it was traced in;
    ``local``: per device inside a ``shard_map``, where that context's mesh (the
    step's, when it was traced under ``jax.set_mesh``) would hide the manual one."""
    got = eqn.primitive.get_bind_params(eqn.params)
    # jax <= 0.4.x returned (subfuns, params); newer versions return params only
    subfuns, params = got if isinstance(got, tuple) else ((), got)
    ctx = None if local else getattr(getattr(eqn, "ctx", None), "manager", None)
    ctx = ctx or contextlib.nullcontext()
    if _siu is not None:
        stack = _siu.current_name_stack() + eqn.source_info.name_stack
        with _siu.user_context(eqn.source_info.traceback, name_stack=stack), ctx:
            out = eqn.primitive.bind(*subfuns, *vals, **params)
    else:  # pragma: no cover
        with ctx:
            out = eqn.primitive.bind(*subfuns, *vals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _grouped_gemm(
    eqn: Any, req: Sequence[TensorSpec], out: TensorSpec, mesh: Any
) -> Callable[..., Any] | None:
    """A ``ragged_dot_general``'s per-device computation (its rule's: the group
    sizes shifted to the device's own rows and groups, :mod:`spmdkit.rules.ragged`),
    for operands laid out as ``req`` and the partial result ``out``; None for
    another primitive (bound on its blocks as they are)."""
    if eqn.primitive.name != "ragged_dot_general":
        return None
    rule = get_rule("ragged_dot_general")
    lctx = LocalContext(rule.name, dict(eqn.params), tuple(req), (out,), axis_sizes(mesh))
    return rule.local_fn(lctx)


def _masked_lookup(eqn: Any, table: Any, indices: Any, spec: TensorSpec) -> Any:
    """A gather's per-device part when ``spec`` shards the table over dims it
    indexes point-wise: each device looks its rows up in its own block, zero for
    rows another device holds, so the sum over those axes is the gather. The
    gather's mode is kept for the whole table: indices clamped to it (``clip``),
    or a row outside it the fill value, counted once (on the first device)."""
    p = eqn.params
    dn, sizes, mode = p["dimension_numbers"], p["slice_sizes"], p["mode"]
    dims = lookup_dims(eqn, spec)
    fill = mode == jax.lax.GatherScatterMode.FILL_OR_DROP
    mine = jnp.ones(indices.shape[:-1], bool)  # the row is in this device's block
    outside = jnp.zeros(indices.shape[:-1], bool)  # the row is outside the table
    first = True  # this device counts the fill value
    cols = []
    for k, d in enumerate(dn.start_index_map):
        c = indices[..., k]
        last = spec.shape[d] - sizes[d]
        if fill:
            outside |= (c < 0) | (c > last)
        elif mode == jax.lax.GatherScatterMode.CLIP:
            c = jnp.clip(c, 0, last)
        if d in dims:
            block = table.shape[d]
            at = jax.lax.axis_index(dims[d])
            c = c - (at * block).astype(c.dtype)
            mine &= (c >= 0) & (c < block)
            c = jnp.clip(c, 0, block - 1)
            first = first & (at == 0)
        cols.append(c)
    # a dim taken whole (not indexed) may be sharded too (a batch's rows): its local block
    local = [t if n == g else n for n, g, t in zip(sizes, spec.shape, table.shape, strict=True)]
    y = jax.lax.gather(
        table,
        jnp.stack(cols, axis=-1),
        dn,
        tuple(local),
        indices_are_sorted=p["indices_are_sorted"],
        unique_indices=p["unique_indices"],
        mode=jax.lax.GatherScatterMode.CLIP,
    )
    batch = [i for i in range(y.ndim) if i not in dn.offset_dims]

    def spread(mask: Any) -> Any:
        return jax.lax.broadcast_in_dim(mask, y.shape, batch)

    y = jnp.where(spread(mine & ~outside), y, jnp.zeros((), y.dtype))
    if fill:
        y = jnp.where(spread(outside & first), jnp.asarray(p["fill_value"], y.dtype), y)
    return y


class _Replay:
    """Evaluates a :class:`~spmdkit.propagation.Program` equation by equation,
    pinning each node to its :class:`~spmdkit.propagation.pinning.NodePins`;
    remat regions run whole, ``scan`` bodies pinned inside (module docstring)."""

    def __init__(self, program: Program, mesh: Any) -> None:
        self.program = program
        self.mesh = mesh
        self.memo: dict[tuple, tuple[Any, Any]] = {}
        # (value, layout) → (the value, its copy in that layout) for moves that
        # start from a copy made for an earlier reader (as the records count them)
        self.copies: dict[tuple, tuple[Any, Any]] = {}
        # id of a pinned value → (the value, its layout): a reader that wants the
        # layout its value was produced in reads it as is, not pinned a second time
        self.pinned: dict[int, tuple[Any, TensorSpec]] = {}
        # each node runs under its own name scope, so the compiled HLO's op_name
        # names the equation every collective came from (plan.verify's blame)
        self.tags = node_tags(program.graph)
        # value id → the layout a forward region kept that residual under
        # (KEPT_NOTHING: its stand-in), carried into and out of scan bodies, so
        # each grad region checks it reads its forward's residuals on their layout
        self.kept: dict[int, KeptLayout | str] = {}
        # value id → the node broadcasting a scalar into it and the scalar it
        # broadcast: a reader that wants it in another layout gets it made anew
        # there (moved for nothing, as the plan prices it)
        self.filled: dict[int, tuple[Node, list[Any]]] = {}

    def pin(self, x: Any, spec: TensorSpec | None) -> Any:
        """``x`` pinned to ``spec`` (as :func:`_pin`), unless it already is: an
        identical constraint on a constrained value changes nothing but makes the
        program XLA compiles longer."""
        if spec is None or (0 in spec.shape and tuple(x.shape) != spec.shape):
            # a region's kept residual: its stand-in in the traced step is empty,
            # the value is the program's (its layout is its own, kept_spec)
            return x
        hit = self.pinned.get(id(x))
        if hit is not None and hit[0] is x and hit[1].dims == spec.dims:
            return x  # (the same value: the same shape)
        y = _pin(x, spec, self.mesh)
        if y is not x:
            self.pinned[id(y)] = (y, spec)
        return y

    def placed(self, x: Any, spec: TensorSpec | None) -> None:
        """Take ``x`` (an argument of the compiled step) as already laid out as
        ``spec``: ``jax.jit``'s ``in_shardings`` put it there, so a constraint to
        that layout would only lengthen the program XLA compiles."""
        if spec is not None and not spec.partial:
            self.pinned[id(x)] = (x, spec)

    def alias(self, ins: Sequence[Any], outs: Sequence[Any]) -> None:
        """Each of ``outs`` is the value of its operand in the lowered program (an
        equation lowered to nothing): pinned where its operand is."""
        for x, y in zip(ins, outs, strict=True):
            hit = self.pinned.get(id(x))
            if hit is not None and hit[0] is x:
                self.pinned[id(y)] = (y, hit[1])

    def through(self, x: Any, chain: Sequence[TensorSpec]) -> Any:
        """Pin ``x`` to each layout of a multi-step reshard in turn, so that XLA
        takes the plan's steps in the plan's order (left alone it may gather the
        larger dim first, moving more bytes than planned)."""
        for spec in chain:
            x = self.pin(x, spec)
        return x

    def graph(self, graph: Graph, ins: Sequence[Any]) -> list[Any]:
        env: dict[int, Any] = dict(zip(graph.invars, ins, strict=True))
        values = self.program.values

        def read(vid: int) -> Any:
            if vid in env:
                return env[vid]
            return values[vid]

        done: set[int] = set()
        nodes = graph.all_nodes or graph.nodes
        for node in nodes:
            group = node.group
            if group is not None:
                if id(group) in done:
                    continue
                done.add(id(group))
                outs = self.remat(group, [n for n in nodes if n.group is group], read)
                env.update(zip(group.outs, outs, strict=True))
                continue
            env.update(zip(node.outs, self.node(node, read), strict=True))
        return [read(v) for v in graph.outvars]

    def remat(self, group: Any, members: list[Node], read: Callable[[int], Any]) -> list[Any]:
        """A remat region's nodes replayed pinned, bound as the region's own
        checkpoint (module docstring)."""
        ins = [read(v) for v in group.ins]

        def body(*xs: Any) -> list[Any]:
            local: dict[int, Any] = dict(zip(group.ins, xs, strict=True))

            def look(vid: int) -> Any:
                return local[vid] if vid in local else read(vid)

            for node in members:
                local.update(zip(node.outs, self.node(node, look), strict=True))
            return [look(v) for v in group.outs]

        closed = jax.make_jaxpr(body)(*ins)
        jaxpr = closed.jaxpr
        opened = jaxpr.replace(constvars=[], invars=[*jaxpr.constvars, *jaxpr.invars])
        params = jaxprs.body_params(group.eqn, opened)
        return list(group.eqn.primitive.bind(*closed.consts, *ins, **params))

    def node(self, node: Node, read: Callable[[int], Any]) -> list[Any]:
        """One equation run with its operands and results pinned, under its name
        scope (:func:`~spmdkit.propagation.graph.node_tags`)."""
        tag = self.tags.get(id(node))
        if _siu is None or tag is None:  # pragma: no cover
            return self._node(node, read)
        with _siu.extend_name_stack(tag):
            return self._node(node, read)

    def _node(self, node: Node, read: Callable[[int], Any]) -> list[Any]:
        vals = [read(v) for v in node.ins]
        if is_fill(node):
            self.filled[node.outs[0]] = (node, vals)
        if node.prim == "name":  # checkpoint_name: the kept residuals it tags stay checked
            self.carry_kept(node.ins, node.outs)
        pins = self.program.specs.get(id(node))
        if pins is not None and pins.ran:  # computed in a contraction's chain
            return vals
        if pins is None or _partly_manual(node, self.mesh):
            # dead code (XLA drops it), not propagated, or a shard_map manual over
            # some axes only (the pipeline): its specs say nothing of the other
            # axes, so its operands and results are left as XLA lays them out there
            # (pinned, GPipe's residuals went replicated over data and model)
            outs = _bind(node.eqn, vals)
        else:
            vals = [
                self.moved(v, x, chain, s)
                for v, x, s, chain in zip(node.ins, vals, pins.required, pins.steps, strict=True)
            ]
            produced = pins.produced
            if self.same_constraint(node, pins):
                return vals  # pinned to the constraint's own layout just above
            if pins.fused is not None:
                outs = [
                    self.reduced(node.eqn, vals, pins.required, pins.fused, pins.chain, produced[0])
                ]
                produced = (pins.fused.dst,)
            elif node.kind == "scan":
                outs = self.scan(node, vals, produced)
            elif node.prim in REGIONS:
                outs = self.region(node, vals, pins)
            elif (split := self.split_groups(node, pins)) is not None:
                outs = [split(*vals)]
            elif (rows := self.local_top_k(node, pins)) is not None:
                outs = list(rows(*vals))
            else:
                outs = _bind(node.eqn, vals)
                if node.prim in _LOWERED_AWAY:
                    self.alias(vals, outs)
            outs = [self.pin(x, s) for x, s in zip(outs, produced, strict=True)]
        return outs

    def same_constraint(self, node: Node, pins: Any) -> bool:
        """Whether ``node`` is a sharding constraint that asks for exactly the layout
        its operand was just pinned to (and its result is pinned to): the pin is
        that constraint, so the equation adds nothing but a second and a third
        copy of it (the batch constraint ``sk.jit`` puts at the top of a step)."""
        if node.prim != "sharding_constraint" or len(node.ins) != 1 or pins.fused is not None:
            return False
        spec = pins.required[0]
        if spec is None or spec.partial or not spec.dims or pins.produced[0] != spec:
            return False
        want = node.eqn.params.get("sharding")
        if not isinstance(want, NamedSharding) or want.memory_kind not in (None, "device"):
            return False
        if dict(want.mesh.shape) != dict(self.mesh.shape):
            return False
        pspec = want.spec
        if any(e is P.UNCONSTRAINED for e in pspec) or getattr(pspec, "unreduced", None):
            return False
        try:
            return TensorSpec(spec.shape, pspec).dims == spec.dims
        except SpmdError:
            return False

    def moved(
        self, vid: int, x: Any, chain: Sequence[TensorSpec] | ReshardPlan, spec: TensorSpec | None
    ) -> Any:
        """``x`` (value ``vid``) moved to ``spec``, once per value and target (later
        readers reuse the moved copy, as the plan counts it): by the plan's own
        collectives when ``chain`` is a :class:`ReshardPlan`, else pinned at each
        intermediate layout of ``chain``; a constant fill made anew in ``spec``."""
        fill = self.filled.get(vid)
        if fill is not None and spec is not None and not spec.partial:
            hit = self.pinned.get(id(x))  # made pinned, not a pending sum
            if hit is not None and hit[0] is x and hit[1].dims != spec.dims:
                return self.pin(_bind(fill[0].eqn, fill[1])[0], spec)
        if not chain:
            copy = self.copies.get((vid, spec))
            return copy[1] if copy is not None and copy[0] is x else self.pin(x, spec)
        explicit = isinstance(chain, ReshardPlan)
        key = (vid, spec, chain if explicit else tuple(chain))
        hit = self.memo.get(key)
        if hit is None or hit[0] is not x:
            if explicit:
                copy = self.copies.get((vid, chain.src))
                start = copy[1] if copy is not None and copy[0] is x else x
                moved = run_plan(self.pin(start, chain.src), chain, self.mesh)
            else:
                moved = self.through(x, chain)
            hit = (x, self.pin(moved, spec))
            self.memo[key] = hit
            if spec is not None:
                self.copies[(vid, spec)] = hit
        return hit[1]

    def reduced(
        self,
        eqn: Any,
        vals: list[Any],
        req: Sequence[TensorSpec | None],
        plan: ReshardPlan,
        chain: Sequence[tuple[Any, TensorSpec]] = (),
        produced: TensorSpec | None = None,
    ) -> Any:
        """A contraction (or a masked lookup) with a sum-partial result, run per
        device under ``shard_map`` with the ``chain`` of nodes its partial passes
        (:attr:`~spmdkit.propagation.pinning.NodePins.chain`), and reduced there
        with the plan's own collectives (a partial value cannot be pinned; left
        alone XLA may compute the contraction in another layout and move operands
        the plan does not, or reduce the larger value before a sum). ``produced``:
        the node's own (partial) result layout, where the chain's end differs."""

        grouped = _grouped_gemm(eqn, req, plan.src if produced is None else produced, self.mesh)

        def local(*blocks: Any) -> Any:
            if eqn.primitive.name == "gather":
                y = _masked_lookup(eqn, *blocks, req[0])
            elif grouped is not None:
                y = grouped(*blocks)
            else:
                y = _bind(eqn, blocks, local=True)[0]
            for link, spec in chain:
                if link.primitive.name in ("reshape", "broadcast_in_dim"):
                    y = jnp.reshape(y, spec.local_shape(self.mesh))  # sizes are global
                else:
                    y = _bind(link, [y], local=True)[0]
            for step in plan.steps:
                y = step_fn(step)(y)
            return y

        return shard_map(
            local,
            mesh=self.mesh,
            in_specs=tuple(s.to_partition_spec() for s in req),
            out_specs=plan.dst.to_partition_spec(),
            check_vma=False,
        )(*vals)

    def split_groups(self, node: Node, pins: Any) -> Callable[..., Any] | None:
        """A ragged contraction whose result the plan splits over its groups (a
        grouped GEMM's weight cotangent, expert parallel), run per device under
        ``shard_map`` with its rule's local computation (the group sizes shifted
        to the device's own groups, computed from the replicated global ones);
        None for any other node, or uneven blocks. Left to XLA, the partitioned
        lowering all-gathers the group ends it splits with the groups, which no
        plan predicts (:func:`~spmdkit.propagation.primitives.grouped_groups_split`)."""
        out = pins.produced[0] if len(pins.produced) == 1 else None
        if not grouped_groups_split(node.eqn, out):
            return None
        specs = (*pins.required, out)
        if any(s is None or s.partial or not s.is_even(self.mesh) for s in specs):
            return None
        local = _grouped_gemm(node.eqn, pins.required, out, self.mesh)
        return shard_map(
            local,
            mesh=self.mesh,
            in_specs=tuple(s.to_partition_spec() for s in pins.required),
            out_specs=out.to_partition_spec(),
            check_vma=False,
        )

    def local_top_k(self, node: Node, pins: Any) -> Callable[..., Any] | None:
        """A ``top_k`` whose operand the plan keeps sharded (a router's tokens),
        run per device under ``shard_map`` as its rule's local computation does;
        None for any other node, an operand replicated, or uneven blocks. Left to
        XLA, the partitioner gathers the whole operand of the TopK custom call
        (its rows too), which no plan predicts (:mod:`spmdkit.rules.reduction`)."""
        if node.prim != "top_k":
            return None
        specs = (*pins.required, *pins.produced)
        if any(s is None or s.partial or not s.is_even(self.mesh) for s in specs):
            return None
        if not any(pins.required[0].dims):
            return None
        eqn = node.eqn
        return shard_map(
            lambda x: tuple(_bind(eqn, [x], local=True)),
            mesh=self.mesh,
            in_specs=(pins.required[0].to_partition_spec(),),
            out_specs=tuple(s.to_partition_spec() for s in pins.produced),
            check_vma=False,
        )

    def region(self, node: Node, vals: list[Any], pins: Any) -> list[Any]:
        """A composite op's region: the rule's ``shard_map`` program with the planned
        layouts and strategy; bound as traced (XLA partitions the op's unsharded
        computation) when those layouts cannot run so (uneven, partial)."""
        # traced once per layout (propagation has traced most already), bound per call
        params, attrs = node.eqn.params, pins.attrs or {}
        closed = region_jaxpr(node.prim, params, attrs, pins.required, pins.produced, self.mesh)
        self.check_residuals(node, vals, pins, closed is not None)
        if closed is None:
            return _bind(node.eqn, vals)
        return _run_program(closed, vals)

    def check_residuals(self, node: Node, vals: list[Any], pins: Any, planned: bool) -> None:
        """A forward region notes the layout its kept residuals are made under; a
        grad region that reads kept residuals checks they were made under its own
        (:func:`~spmdkit.engine.region.check_kept`). ``planned``: the region runs
        its rule's program (else it runs unsharded: keeps and reads nothing)."""
        params = node.eqn.params
        op = params["op"]
        n = len(params["diff"]) if node.prim != FORWARD else len(node.ins)
        n_kept = len(kept_dtypes(op, [v.dtype for v in vals[:n]]))
        if not n_kept:
            return
        args = (node.prim, params, pins.attrs or {}, pins.required, pins.produced, self.mesh)
        layout = kept_layout(*args) if planned else None
        if node.prim == FORWARD:
            for vid in node.outs[len(node.outs) - n_kept :]:
                self.kept[vid] = KEPT_NOTHING if layout is None else layout
            return
        made = {self.kept.get(vid) for vid in node.ins[n : n + n_kept]}
        shapes = [tuple(v.shape) for v in vals[n : n + n_kept]]
        check_kept(op, made.pop() if len(made) == 1 else None, layout, shapes)

    def carry_kept(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Carry the kept residuals' layouts from values ``src`` to ``dst``
        (position by position: a scan's operands into its body, and its body's
        results out)."""
        for a, b in zip(src, dst, strict=True):
            if a in self.kept:
                self.kept[b] = self.kept[a]

    def scan(self, node: Node, vals: list[Any], produced: Sequence[TensorSpec | None]) -> list[Any]:
        """A ``scan`` whose body is replayed pinned; each ``ys`` result is pinned,
        every iteration, to the slice of its stacked layout (a pending sum is
        reduced inside the body, as the plan counts it, not stacked)."""
        sc = jaxprs.scan(node.eqn)
        nc, nk = sc.num_consts, sc.num_carry
        body = node.subs[0]
        consts, init, xs = vals[:nc], vals[nc : nc + nk], vals[nc + nk :]
        slices = [
            TensorSpec(s.shape[1:], s.dims[1:], dtype=s.dtype)
            if s is not None and not s.partial and s.dims
            else None
            for s in produced[nk:]
        ]

        self.carry_kept(node.ins, body.invars)

        def step(carry: list, x: list) -> tuple[list, list]:
            outs = self.graph(body, [*consts, *carry, *x])
            self.carry_kept(body.outvars, node.outs)
            ys = [self.pin(y, s) for y, s in zip(outs[nk:], slices, strict=True)]
            return outs[:nk], ys

        carry, ys = jax.lax.scan(
            step,
            list(init),
            list(xs),
            length=sc.length,
            reverse=sc.reverse,
            unroll=sc.unroll,
        )
        return [*carry, *ys]


def replay(prop: Propagation, *flat_args: Any, placed: Sequence[bool] | None = None) -> list[Any]:
    """Evaluate the program of ``prop`` (a :class:`~spmdkit.propagation.Propagation`)
    on flat arguments, pinning every equation to its propagated layouts.

    Call it inside ``jax.jit`` with a mesh set (``jax.set_mesh``); it returns the
    flat outputs. ``placed``: per flat argument, whether it arrives laid out as
    ``prop.in_specs`` says (``jax.jit``'s ``in_shardings`` are those layouts, in
    device memory): those are not constrained again where they are read in that
    layout. None (default): every argument is pinned where it is read.

    Example::

        >>> prop = sk.propagate(step, params, batch, in_specs=..., mesh=mesh)
        >>> out = jax.jit(lambda *a: replay(prop, *a))(*jax.tree.leaves((params, batch)))
    """
    program = prop.program
    if program is None:
        raise ValueError("this Propagation carries no program to replay")
    explicit = [
        name
        for name, t in zip(prop.mesh.axis_names, getattr(prop.mesh, "axis_types", ()), strict=False)
        if t == jax.sharding.AxisType.Explicit
    ]
    if explicit:
        raise ValueError(
            f"replay pins layouts with sharding constraints, which need Auto mesh axes; "
            f"axes {explicit} are Explicit: propagate on a mesh made with "
            f"axis_types='auto' (sk.jit does this for you)"
        )
    rep = _Replay(program, prop.mesh)
    if placed is not None:
        if len(placed) != len(flat_args):
            raise SpmdError(
                op="replay",
                must="placed has one entry per flat argument",
                given=f"{len(placed)} entries for {len(flat_args)} arguments",
                fix="pass placed=[True or False for each of jax.tree.leaves(args)], or None",
            )
        for x, spec, on in zip(flat_args, prop.in_specs, placed, strict=True):
            if on:
                rep.placed(x, spec)
    outs = rep.graph(program.graph, flat_args)
    for i, plan in enumerate(program.outs):
        if plan is not None:
            outs[i] = rep.moved(program.graph.outvars[i], outs[i], plan, plan.dst)
    return outs


def enforced(prop: Propagation, placed: Sequence[bool] | None = None) -> Callable[..., Any]:
    """A function of the traced step's (pytree) arguments that runs
    :func:`replay` and returns outputs with the step's output structure
    (``placed``: as for :func:`replay`, per flat argument)."""
    out_tree = prop.program.out_tree

    def run(*args: Any) -> Any:
        outs = replay(prop, *jax.tree.leaves(args), placed=placed)
        return jax.tree.unflatten(out_tree, outs) if out_tree is not None else outs

    return run
