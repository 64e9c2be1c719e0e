"""Describe a flax model abstractly: parameters, state, logical axis names, loss and batch.

A planner needs five things from a model, and nothing else: the parameters' paths,
shapes and dtypes; the logical axis names of each parameter dim (flax metadata);
the model's mutable state (batch statistics), which the step carries but never
differentiates; a loss over a params pytree; and an abstract batch.
:func:`describe` extracts them, as a :class:`ModelInfo`, from any of:

- a model spec (``spmdkit.models.get_model(name)``: ``build(cfg, rngs)``,
  ``loss(model, batch)``, ``batch(cfg, batch_size, rng)``, ``batch_axes``);
- a zero-argument function returning an NNX module (with ``loss=`` and ``batch=``);
- an NNX module (concrete or abstract; with ``loss=`` and ``batch=``);
- a linen module (with ``loss=`` taking ``(variables, batch)``, ``batch=`` and
  ``init_args=``): boxed ``LogicallyPartitioned`` names are logical, boxed
  ``Partitioned`` names are mesh axes and are kept as given (pinned);
- a pytree of arrays with ``loss=`` and ``batch=``: a params pytree, or a linen
  variables dict (``params`` plus other collections, which are state).

NNX parameters carry logical names in the flax-standard ``out_sharding``
metadata (``nnx.with_partitioning(init, ("embed", "mlp"))``). Linen models bridged
into NNX keep their box type in ``linen_meta_type``. A parameter with no names is
*unannotated* here; the planner names it from its role in the traced loss, or
from ``names=`` by path (:mod:`spmdkit.planner.naming`).

Mutable state, randomness, the loss
-----------------------------------
Parameters are what the optimizer trains: NNX ``nnx.Param`` variables, linen's
``params`` collection. Everything else a model holds that its forward pass reads
and may update is *state*: NNX ``nnx.BatchStat`` (and any other non-``Param``
variable type except the RNG streams), linen's other collections
(``batch_stats``, caches). The state is never differentiated and never given to
the optimizer; the planner lays it out (:mod:`spmdkit.planner.search`) and the
step returns it updated.

The user writes one loss per model kind (:mod:`spmdkit.introspect.losses`): NNX
``loss(model, batch)`` (batch statistics read back from the module, its RNG
streams drawn from the step's key), linen ``loss(variables, batch)`` returning
the loss or ``(loss, updates)`` as ``module.apply(..., mutable=[...])`` gives
them, a params pytree's ``loss(params, batch)``; any may return ``(loss, aux)``
and take the step's key as ``rng=``. A described model hands on:

- :attr:`ModelInfo.train_loss`: the :class:`~spmdkit.step.loss.Loss` a train step
  runs (``sk.train_step(info, ...)``, ``train``): state, key and aux as they are;
- ``loss_fn(params, batch) -> loss`` and, with state, ``state_loss_fn(params,
  batch, state) -> (loss, new_state)``: the planner's traces of the loss alone,
  on placeholder state and placeholder keys, aux dropped (``sk.jit`` refuses a
  step that would draw from those keys).

Nothing here materialises a model on one device: shapes come from
``nnx.eval_shape`` / ``jax.eval_shape``. Creating the parameters sharded is
:mod:`spmdkit.compile.annotate`'s job; this module never imports the planner (the
planner imports it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import jax
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from spmdkit.batch import as_traced
from spmdkit.introspect.losses import (
    STATE_FILTER,
    ModelError,
    Run,
    dict_run,
    has_aux,
    model_losses,
    nnx_run,
    train_loss,
)
from spmdkit.step.loss import Loss, is_key, takes_rng
from spmdkit.util import path_str

__all__ = [
    "STATE_FILTER",
    "ModelError",
    "ModelInfo",
    "ParamInfo",
    "bind_axis_names",
    "describe",
    "path_str",
    "unbound_axis_error",
    "variable_names",
    "variable_value",
]


T = TypeVar("T")


@dataclass(frozen=True)
class ParamInfo:
    """One parameter as the planner sees it.

    Attributes:
      path: ``"/"``-joined key path (``"layers/0/mlp/kernel"``).
      shape: global shape.
      dtype: dtype name.
      logical: logical axis name per dim (None for an unnamed dim), or None when
        the parameter carries no names at all (unannotated).
      pinned: a PartitionSpec given in mesh axes by the model (linen
        ``Partitioned``); plans keep it.
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    logical: tuple[str | None, ...] | None = None
    pinned: P | None = None

    @property
    def nbytes(self) -> int:
        """Global bytes."""
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    @property
    def numel(self) -> int:
        """Number of elements."""
        return int(np.prod(self.shape, dtype=np.int64))


@dataclass
class ModelInfo:
    """Everything the planner reads from a model (see the module docstring).

    Attributes:
      params: the parameters, in tree order.
      abstract_params: the params pytree with ``jax.ShapeDtypeStruct`` leaves.
      loss_fn: ``loss_fn(params, batch) -> scalar`` (for a model with state: the
        state at placeholder zeros and its updates dropped; train with
        :attr:`state_loss_fn`).
      batch: abstract batch (pytree of ``ShapeDtypeStruct``).
      batch_axes: batch field → logical names per dim.
      init_fn: zero-argument function returning the concrete params pytree, for
        born-sharded initialisation (None when the model cannot be re-initialised).
      kind: ``"nnx"``, ``"linen"`` or ``"fn"``.
      merge: for NNX, ``merge(params) -> module`` (None otherwise).
      name: a short name for reports.
      state: the mutable state leaves (batch statistics), in tree order; empty
        for a model without state.
      abstract_state: the state pytree with ``jax.ShapeDtypeStruct`` leaves
        (None without state).
      init_state_fn: zero-argument function returning the concrete initial
        state (None without state, or when the model cannot be re-initialised).
      state_loss_fn: ``state_loss_fn(params, batch, state) -> (loss, new_state)``
        for a model with state (module docstring), None without.
      rng: the loss draws random numbers (NNX RNG streams, a loss taking
        ``rng=``): its train step takes a key (:attr:`train_loss`).
      run: ``run(params, batch, state, key) -> (out, new_state)``, the user's
        loss on pure arrays (:mod:`spmdkit.introspect.losses`); None for a ModelInfo
        built by hand.
    """

    params: list[ParamInfo]
    abstract_params: Any
    loss_fn: Callable[..., Any]
    batch: Any
    batch_axes: dict[str, tuple[str | None, ...]]
    init_fn: Callable[[], Any] | None = None
    kind: str = "nnx"
    merge: Callable[[Any], Any] | None = None
    name: str = "model"
    state: list[ParamInfo] = field(default_factory=list)
    abstract_state: Any = None
    init_state_fn: Callable[[], Any] | None = None
    state_loss_fn: Callable[..., Any] | None = None
    rng: bool = False
    run: Run | None = field(default=None, repr=False, compare=False)
    _memo: dict[Hashable, object] = field(default_factory=dict, repr=False, compare=False)

    def by_path(self) -> dict[str, ParamInfo]:
        """Path → ParamInfo."""
        return {p.path: p for p in self.params}

    @property
    def has_state(self) -> bool:
        """Whether the model carries mutable state (:attr:`state_loss_fn` takes and returns it)."""
        return bool(self.state)

    @property
    def has_aux(self) -> bool:
        """Whether the loss returns ``(loss, aux)`` (read off an abstract trace, once)."""
        return self.train_loss.has_aux

    @property
    def train_loss(self) -> Loss:
        """The loss a train step runs (:class:`spmdkit.step.loss.Loss`):
        ``fn(params, batch[, state][, key])``, the model's state and the step's
        key as it has them, the loss's aux kept; what ``sk.train_step(info, ...)``
        and ``train`` run.

        Raises:
          ModelError: the ModelInfo was built by hand, without the user's loss.

        Example::

            >>> info.train_loss
            Loss(Net: state, rng)
        """
        return self.memo(("describe", "train_loss"), self._train_loss)

    def _train_loss(self) -> Loss:
        if self.run is None:
            raise ModelError(
                op="ModelInfo.train_loss",
                must="the model was described from its loss",
                given=f"a ModelInfo for {self.name} without its run function",
                fix="describe the model with sk.describe(model, loss=..., batch=...)",
            )
        key = jax.random.key(0) if self.rng else None
        aux = has_aux(self.run, (self.abstract_params, self.batch, self.abstract_state, key))
        return train_loss(self.run, stateful=self.has_state, rng=self.rng, aux=aux, name=self.name)

    def trace_args(self) -> tuple[Any, ...]:
        """The abstract arguments of the step's loss, in :attr:`train_loss`'s order:
        ``(params, batch)``, then the model's state when it has some, then the
        step's key (an abstract typed PRNG key) when it draws random numbers. The
        planner traces the loss on these, so a key is an input of what it plans,
        as of what runs."""
        args: tuple[Any, ...] = (self.abstract_params, self.batch)
        if self.has_state:
            args += (self.abstract_state,)
        key = self.abstract_key
        return args if key is None else (*args, key)

    @property
    def abstract_key(self) -> Any:
        """The step's key as the planner traces it (an abstract typed PRNG key),
        None when the step takes none (no random numbers, or no loss to run)."""
        return jax.eval_shape(jax.random.key, 0) if self.rng and self.run is not None else None

    def scalar_loss(self, params: Any, batch: Any, *rest: Any) -> Any:
        """The loss value alone (new state and aux dropped) of :attr:`train_loss`,
        for traces that only need the loss's dataflow: ``scalar_loss(*info.trace_args())``.
        A ModelInfo built by hand (no loss to run) uses :attr:`loss_fn` /
        :attr:`state_loss_fn`.

        Example::

            >>> jax.make_jaxpr(info.scalar_loss)(*info.trace_args())
        """
        if self.run is None:
            if self.state_loss_fn is not None and rest:
                return self.state_loss_fn(params, batch, *rest)[0]
            return self.loss_fn(params, batch)
        out = self.train_loss(params, batch, *rest)
        if self.has_state:
            out = out[0]
        return out[0] if self.train_loss.has_aux else out

    def memo(self, key: Hashable, compute: Callable[[], T]) -> T:
        """``compute()``, run once per model and key; later calls with the same key
        return the first result.

        Facts derived from a model that later stages need once per model (the
        planner's abstract trace of the train step, the train step itself) are kept
        on its ModelInfo, so planning one model for many meshes or strategies
        traces it once. A caller namespaces its keys (``("planner.trace",
        id(optimizer))``); the memo lives as long as the ModelInfo.

        Example::

            >>> info.memo(("mine", "flops"), lambda: count_flops(info))
            1.2e9
            >>> info.memo(("mine", "flops"), lambda: 0.0)  # not recomputed
            1.2e9
        """
        if key not in self._memo:
            self._memo[key] = compute()
        return cast(T, self._memo[key])


# -- metadata --------------------------------------------------------------------


def variable_names(var: nnx.Variable) -> tuple[tuple[str | None, ...] | None, P | None]:
    """``(logical names, pinned spec)`` of an NNX variable from its sharding
    metadata: names of a linen ``Partitioned`` box are mesh axes (pinned), other
    names are logical; ``(None, None)`` without names."""
    meta = var.get_metadata()
    names = meta.get("out_sharding") or meta.get("sharding_names") or meta.get("sharding")
    if not names:
        return None, None
    names = tuple(names)
    linen_type = meta.get("linen_meta_type")
    if linen_type is not None and linen_type.__name__ == "Partitioned":
        return None, P(*names)
    return names, None


def variable_value(v: nnx.Variable | jax.Array | jax.ShapeDtypeStruct) -> Any:
    """The value of an NNX variable (anything else as is)."""
    return v.get_value() if isinstance(v, nnx.Variable) else v


def _params_from_nnx_state(state: Any) -> list[ParamInfo]:
    out = []
    leaves = jax.tree_util.tree_flatten_with_path(
        state, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )[0]
    for keypath, var in leaves:
        value = variable_value(var)
        logical, pinned = variable_names(var) if isinstance(var, nnx.Variable) else (None, None)
        out.append(
            ParamInfo(
                path_str(keypath),
                tuple(value.shape),
                np.dtype(value.dtype).name,
                logical,
                pinned,
            )
        )
    return out


def _params_from_linen(boxed: Any) -> tuple[list[ParamInfo], Any]:
    import flax.linen as nn

    def is_box(x: Any) -> bool:
        return isinstance(x, nn.Partitioned)

    out = []
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(boxed, is_leaf=is_box)[0]:
        logical = pinned = None
        value = leaf
        if isinstance(leaf, nn.LogicallyPartitioned):
            logical, value = tuple(leaf.names), leaf.value
        elif isinstance(leaf, nn.Partitioned):
            pinned, value = P(*leaf.names), leaf.value
        out.append(
            ParamInfo(
                path_str(keypath), tuple(value.shape), np.dtype(value.dtype).name, logical, pinned
            )
        )
    return out, nn.unbox(boxed)


def _abstract(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def _abstract_batch(batch: Any) -> Any:
    """The batch as the step takes it (non-tensor fields in a
    :class:`spmdkit.batch.Batch` node's static part), its tensors abstract."""
    shapes = jax.eval_shape(lambda b: b, as_traced(batch))
    # no shardings: the batch's placement is the plan's to choose, not the example's
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=x.weak_type), shapes
    )


def _has_keys(abstract_rng: Any) -> bool:
    return any(is_key(x) for x in jax.tree.leaves(abstract_rng))


# -- collectives written for pmap --------------------------------------------------


def bind_axis_names(loss: Callable[..., Any], names: Sequence[str]) -> Callable[..., Any]:
    """``loss`` with the collective axis ``names`` bound, each to an axis of size 1.

    A model written for ``pmap`` (``nn.BatchNorm(axis_name="batch")``) averages
    its statistics over the devices with ``lax.pmean(x, "batch")``; under ``jit``
    the arrays are global and its statistics are over the whole batch already,
    so binding the name to a size-1 axis (``vmap`` with nothing mapped) keeps
    the meaning and lets the loss trace.

    Example::

        >>> loss = bind_axis_names(lambda v, b: model.apply(v, b["x"]).sum(), ["batch"])
    """
    for name in reversed(tuple(names)):
        loss = _bound(loss, str(name))
    return loss


def _bound(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    @functools.wraps(fn)  # keeps the signature: a loss taking rng= still does
    def bound(*args: Any, **kw: Any) -> Any:
        out = jax.vmap(lambda *a: fn(*a, **kw), in_axes=None, axis_size=1, axis_name=name)(*args)
        return jax.tree.map(lambda x: x[0], out)

    return bound


def unbound_axis_error(err: NameError, where: str) -> ModelError | None:
    """The typed error for a loss that uses a collective axis name no mesh binds
    (None when ``err`` is another NameError)."""
    text = str(err)
    if "unbound axis name" not in text:
        return None
    name = text.rsplit("unbound axis name:", maxsplit=1)[-1].split(".", maxsplit=1)[0].strip()
    return ModelError(
        op=where,
        must="every collective axis name in the loss is bound",
        given=f"{text.splitlines()[0]} (a layer written for pmap, e.g. "
        f"nn.BatchNorm(axis_name={name!r}))",
        fix=f"pass axis_names=({name!r},) to sk.plan / describe (under jit the arrays "
        "are global: the statistics are over the whole batch already), or drop the "
        "layer's axis_name",
    )


# -- describe --------------------------------------------------------------------


def _is_model_spec(obj: Any) -> bool:
    return all(hasattr(obj, a) for a in ("build", "loss", "batch", "configs"))


def _default_batch_axes(batch: Any) -> dict[str, tuple[str | None, ...]]:
    """Dim 0 of every field is ``batch``; integer (token) fields of rank 2 are
    ``("batch", "seq")``; other dims are unnamed."""
    out = {}
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
        names: list[str | None] = [None] * len(leaf.shape)
        if names:
            names[0] = "batch"
        if len(names) == 2 and np.issubdtype(np.dtype(leaf.dtype), np.integer):
            names[1] = "seq"
        out[path_str(keypath)] = tuple(names)
    return out


def _describe_nnx(
    build: Callable[[], Any],
    loss: Callable[[Any, Any], Any],
    batch: Any,
    batch_axes: Mapping[str, tuple] | None,
    name: str,
) -> ModelInfo:
    with nnx.use_eager_sharding(False):
        abstract_model = nnx.eval_shape(build)
    graphdef, params, state, rng = nnx.split(abstract_model, nnx.Param, STATE_FILTER, ...)
    abstract_params = _abstract(params)
    abstract_state = _abstract(state)
    abstract_rng = _abstract(rng)
    has_state = bool(jax.tree.leaves(abstract_state))
    uses_rng = _has_keys(abstract_rng) or takes_rng(loss)
    run = nnx_run(graphdef, loss, abstract_state, abstract_rng)
    loss_fn, state_loss_fn = model_losses(
        run, abstract_state=abstract_state if has_state else None, rng=uses_rng, name=name
    )

    def merge(p: Any, s: Any = None) -> Any:
        return nnx.merge(graphdef, p, abstract_state if s is None else s, abstract_rng)

    def init_fn() -> Any:
        with nnx.use_eager_sharding(False):
            model = build()
        return nnx.split(model, nnx.Param, ...)[1]

    def init_state_fn() -> Any:
        with nnx.use_eager_sharding(False):
            model = build()
        return nnx.split(model, nnx.Param, STATE_FILTER, ...)[2]

    abstract_batch = _abstract_batch(batch)
    return ModelInfo(
        params=_params_from_nnx_state(params),
        abstract_params=abstract_params,
        loss_fn=loss_fn,
        batch=abstract_batch,
        batch_axes=dict(batch_axes) if batch_axes else _default_batch_axes(abstract_batch),
        init_fn=init_fn,
        kind="nnx",
        merge=merge,
        name=name,
        state=_params_from_nnx_state(state) if has_state else [],
        abstract_state=abstract_state if has_state else None,
        init_state_fn=init_state_fn if has_state else None,
        state_loss_fn=state_loss_fn,
        rng=uses_rng,
        run=run,
    )


def describe(
    model: Any,
    *,
    config: Any = None,
    batch: Any = None,
    batch_size: int = 8,
    loss: Callable[[Any, Any], Any] | None = None,
    batch_axes: Mapping[str, tuple] | None = None,
    init_args: tuple = (),
    rng_seed: int = 0,
    axis_names: Sequence[str] = (),
) -> ModelInfo:
    """Read a model into a :class:`ModelInfo` (module docstring: accepted forms).

    Args:
      model: a model spec, an NNX module, a function returning one, or a linen module.
      config: for a model spec, a config name in ``spec.configs`` or a config object
        (default: the first config).
      batch: an example or abstract batch (required except for model specs).
      batch_size: batch size for a model spec's batch.
      loss: ``loss(model, batch)`` (NNX) or ``loss(variables, batch)`` (linen).
      batch_axes: batch field → logical names per dim (default: model spec's, or
        ``("batch", None, ...)`` for every field).
      init_args: linen only: the arguments of ``module.init`` after the rng.
      rng_seed: seed of the rngs used to build the model.
      axis_names: collective axis names the model uses as if under ``pmap``
        (``nn.BatchNorm(axis_name="batch")``): bound around the loss (see
        :func:`bind_axis_names`); under ``jit`` the arrays are global, so the
        statistics the collective averages are already over the whole batch.

    Returns:
      The model's ModelInfo.

    Raises:
      ModelError: the model is not in a form listed above or lacks loss/batch.

    Example::

        >>> info = describe(lambda: MyMLP(rngs=nnx.Rngs(0)), loss=my_loss, batch=b)
        >>> [p.path for p in info.params]
        ['w1/bias', 'w1/kernel']
    """
    if isinstance(model, ModelInfo):
        return model
    loss = bind_axis_names(loss, axis_names) if loss is not None else None
    if _is_model_spec(model):
        return _describe_spec(model, config, batch, batch_size, loss, batch_axes, rng_seed)
    if loss is None or batch is None:
        raise ModelError(
            op="describe",
            must="a module or init function comes with loss= and batch=",
            given=f"{type(model).__name__} with loss={loss!r}, batch={'given' if batch else None}",
            fix="pass loss=lambda model, batch: ... and batch=<example or abstract batch>, "
            "or pass a model spec (spmdkit.models.get_model(name))",
        )
    try:
        import flax.linen as nn
    except ImportError:  # pragma: no cover - flax always ships linen
        nn = None
    if nn is not None and isinstance(model, nn.Module):
        return _describe_linen(model, loss, batch, batch_axes, init_args, rng_seed)
    if isinstance(model, nnx.Module):
        graphdef, state = nnx.split(model)
        abstract_state = _abstract(state)

        def build() -> Any:
            return nnx.merge(graphdef, jax.tree.map(lambda s: s, abstract_state))

        info = _describe_nnx(build, loss, batch, batch_axes, type(model).__name__)
        info.init_fn = None  # a given instance has no initialiser to replay
        info.init_state_fn = None
        return info
    if callable(model):
        return _describe_nnx(model, loss, batch, batch_axes, getattr(model, "__name__", "model"))
    leaves = jax.tree.leaves(model)
    if leaves and all(hasattr(x, "shape") and hasattr(x, "dtype") for x in leaves):
        return _describe_tree(model, loss, batch, batch_axes)
    raise ModelError(
        op="describe",
        must="model is a model spec, an NNX module, a function returning one, a linen "
        "module, or a pytree of arrays (params, or a linen variables dict)",
        given=type(model).__name__,
        fix="pass spmdkit.models.get_model(name), a module, or lambda: MyModule(rngs=nnx.Rngs(0))",
    )


def _describe_spec(
    spec: Any,
    config: Any,
    batch: Any,
    batch_size: int,
    loss: Callable[[Any, Any], Any] | None,
    batch_axes: Mapping[str, tuple] | None,
    rng_seed: int,
) -> ModelInfo:
    """A model spec (``spmdkit.models.get_model(name)``) with one of its configs."""
    cfg = config
    if cfg is None:
        cfg = next(iter(spec.configs.values()))()
    elif isinstance(cfg, str):
        if cfg not in spec.configs:
            raise ModelError(
                op="describe",
                must=f"config is one of {sorted(spec.configs)}",
                given=repr(cfg),
                fix="pass config=<name> from the model spec's configs, or a config object",
            )
        cfg = spec.configs[cfg]()
    spec_batch = batch if batch is not None else spec.batch(cfg, batch_size, None)
    return _describe_nnx(
        lambda: spec.build(cfg, nnx.Rngs(rng_seed)),
        loss or spec.loss,
        spec_batch,
        batch_axes or getattr(spec, "batch_axes", None),
        getattr(spec, "name", "model"),
    )


def _describe_linen(
    module: Any,
    loss: Callable[[Any, Any], Any],
    batch: Any,
    batch_axes: Mapping[str, tuple] | None,
    init_args: tuple,
    rng_seed: int,
) -> ModelInfo:
    def init_boxed() -> Any:
        return module.init(jax.random.key(rng_seed), *init_args)

    boxed = jax.eval_shape(init_boxed)
    infos, plain = _params_from_linen({k: v for k, v in boxed.items() if k == "params"})
    state_infos, state_plain = _params_from_linen({k: v for k, v in boxed.items() if k != "params"})

    def init_fn() -> Any:
        import flax.linen as nn

        return nn.unbox({k: v for k, v in init_boxed().items() if k == "params"})

    def init_state_fn() -> Any:
        import flax.linen as nn

        return nn.unbox({k: v for k, v in init_boxed().items() if k != "params"})

    info = _dict_info(
        loss,
        _abstract(plain),
        _abstract(state_plain) if state_infos else None,
        batch,
        batch_axes,
        type(module).__name__,
        params=infos,
        state=state_infos,
    )
    info.kind = "linen"
    info.init_fn = init_fn
    info.init_state_fn = init_state_fn if state_infos else None
    return info


def _describe_tree(
    tree: Any, loss: Callable[..., Any], batch: Any, batch_axes: Mapping[str, tuple] | None
) -> ModelInfo:
    """A params pytree with ``loss(params, batch)``, or a linen variables dict (a
    dict with ``params`` and other collections) with ``loss(variables, batch)``:
    ``params`` is trained, the other collections are state."""
    abstract = _abstract(tree)
    is_variables = (
        isinstance(tree, Mapping)
        and "params" in tree
        and len(tree) > 1
        and all(isinstance(v, Mapping) for v in tree.values())
    )
    params = {"params": abstract["params"]} if is_variables else abstract
    state = {k: v for k, v in abstract.items() if k != "params"} if is_variables else None
    info = _dict_info(
        loss,
        params,
        state,
        batch,
        batch_axes,
        getattr(loss, "__name__", "loss"),
        params=_params_from_nnx_state(params),
        state=_params_from_nnx_state(state) if state else [],
    )
    info.kind = "tree"
    return info


def _dict_info(
    loss: Callable[..., Any],
    abstract_params: Any,
    abstract_state: Any,
    batch: Any,
    batch_axes: Mapping[str, tuple] | None,
    name: str,
    *,
    params: list[ParamInfo],
    state: list[ParamInfo],
) -> ModelInfo:
    """The ModelInfo of a loss over a variables dict (linen's, or a pytree's)."""
    run = dict_run(loss, tuple(abstract_state or ()), name)
    uses_rng = takes_rng(loss)
    loss_fn, state_loss_fn = model_losses(
        run, abstract_state=abstract_state, rng=uses_rng, name=name
    )
    abstract_batch = _abstract_batch(batch)
    return ModelInfo(
        params=params,
        abstract_params=abstract_params,
        loss_fn=loss_fn,
        batch=abstract_batch,
        batch_axes=dict(batch_axes) if batch_axes else _default_batch_axes(abstract_batch),
        kind="linen",
        name=name,
        state=state,
        abstract_state=abstract_state,
        state_loss_fn=state_loss_fn,
        rng=uses_rng,
        run=run,
    )
