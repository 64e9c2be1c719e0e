"""Create a flax model's parameters sharded as a plan (or a rule table) says: "born sharded".

:func:`init_sharded` runs a described model's initialisers inside ``jax.jit`` with
``out_shardings`` from a :class:`~spmdkit.planner.plans.Plan`, so no device ever
holds a whole parameter the plan shards. :func:`shard` makes an NNX module class
do that on construction, from a plan, a preset name or a logical-rule table.

It lives beside ``sk.jit`` because both turn a plan into JAX shardings; the
:mod:`spmdkit.introspect` package, which the planner itself reads models through,
never imports the planner.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from spmdkit.compile.place import place_state, state_layout
from spmdkit.introspect.model import ModelError, describe, variable_names, variable_value
from spmdkit.planner.logical import LogicalRules, RulesLike, preset_rules
from spmdkit.planner.plans import Plan, PyTree
from spmdkit.util import path_str

__all__ = ["init_sharded", "shard"]


def init_sharded(info_or_model: object, plan: Plan, **describe_kwargs: Any) -> PyTree:
    """Initialise a model's params directly into the plan's shardings.

    The initialisers run inside ``jax.jit`` with ``out_shardings`` from the plan,
    so no device ever holds a whole parameter the plan shards. The arrays live on
    the plan's mesh as the user made it (``sk.make_mesh``'s Explicit axes stay
    Explicit, so ``jax.jit`` under ``jax.set_mesh(mesh)`` runs on them); ``sk.jit``
    takes them as they are (it relabels them onto its Auto view without a copy).

    Args:
      info_or_model: a :class:`~spmdkit.introspect.ModelInfo`, or anything
        :func:`~spmdkit.introspect.model` accepts.
      plan: a :class:`spmdkit.planner.Plan` whose mesh has devices.
      **describe_kwargs: passed to :func:`~spmdkit.introspect.model` when a model is given.

    Returns:
      The params pytree (NNX ``State`` or linen dict) of sharded ``jax.Array``;
      floating leaves in bf16 when the plan's recipe keeps the fp32 master in the
      optimizer state (``master_weights="optimizer"``, :mod:`spmdkit.step.master`).

    Example::

        >>> params = init_sharded(spec, plan, config="tiny")
        >>> params["embed"]["embedding"].sharding.spec
        PartitionSpec('model', None)
    """
    info = describe(info_or_model, **describe_kwargs)
    if info.init_fn is None:
        raise ModelError(
            op="init_sharded",
            must="the model can be re-initialised (an init function or a model spec)",
            given="a module instance",
            fix="pass lambda: MyModule(..., rngs=nnx.Rngs(0)) instead of the instance, "
            "or jax.device_put(state, plan.param_shardings(state))",
        )
    # on the plan's own mesh (Explicit axes stay Explicit: jax.jit under
    # jax.set_mesh(plan.mesh) takes them); sk.jit relabels them, without a copy;
    # bf16 under master_weights="optimizer" (the fp32 master is made from them)
    layout = state_layout(plan, info.abstract_params, mesh=plan.mesh)
    return place_state(plan, info.init_fn, layout=layout)["params"]


def shard(
    plan_or_rules: Plan | str | RulesLike, *, mesh: Mesh | None = None
) -> Callable[[type], type]:
    """Class decorator: instances of the decorated NNX module are created sharded.

    Construction runs the module's ``__init__`` inside ``jax.jit`` whose
    ``out_shardings`` come from the plan (or from a logical-rule table resolved on
    ``mesh``), then merges the sharded state back into a module. Instances are
    instances of the decorated class.

    Args:
      plan_or_rules: a :class:`spmdkit.planner.Plan`, a preset name (``"fsdp"``), or a
        logical-rule table (``LogicalRules`` or ``[("embed", "data"), ...]``).
      mesh: the device mesh (default: the plan's mesh).

    Example::

        >>> @shard("fsdp", mesh=mesh)
        ... class MLP(nnx.Module): ...
        >>> MLP(rngs=nnx.Rngs(0)).w1.kernel.sharding.spec
        PartitionSpec('data', None)
    """
    if isinstance(plan_or_rules, Plan):
        target_mesh = mesh if mesh is not None else plan_or_rules.mesh
    elif mesh is None:
        raise ModelError(
            op="shard",
            must="a mesh is given with a preset name or a rule table",
            given=f"{plan_or_rules!r} and no mesh",
            fix="write @sk.shard('fsdp', mesh=mesh) or @sk.shard(plan)",
        )
    else:
        target_mesh = mesh

    def rules_for() -> LogicalRules | None:
        if isinstance(plan_or_rules, Plan):
            return plan_or_rules.rules
        if isinstance(plan_or_rules, str):
            return preset_rules(plan_or_rules, target_mesh)
        return LogicalRules.coerce(plan_or_rules)

    def shardings_for(state: nnx.State) -> PyTree:
        specs = _specs_for_state(state, plan_or_rules, rules_for(), target_mesh)
        return jax.tree.map(
            lambda s: NamedSharding(target_mesh, s), specs, is_leaf=lambda x: isinstance(x, P)
        )

    return functools.partial(_sharded_class, shardings_for=shardings_for)


def _sharded_class(cls: type, *, shardings_for: Callable[[nnx.State], PyTree]) -> type:
    """A subclass of ``cls`` whose construction builds the state sharded."""
    meta = type(cls)

    class _ShardedMeta(meta):
        def __call__(self, *args: Any, **kwargs: Any) -> nnx.Module:
            # Graph nodes among the arguments (nnx.Rngs) must enter the traces as
            # arguments of nnx transforms, not as closures.
            def build(*a: Any, **k: Any) -> nnx.Module:
                with nnx.use_eager_sharding(False):
                    return meta.__call__(self, *a, **k)

            abstract = nnx.eval_shape(build, *args, **kwargs)
            graphdef, state = nnx.split(abstract)

            def init(*a: Any, **k: Any) -> nnx.State:
                return nnx.split(build(*a, **k))[1]

            shardings = shardings_for(state)
            sharded_state = nnx.jit(init, out_shardings=shardings)(*args, **kwargs)
            return nnx.merge(graphdef, sharded_state)

    sharded = _ShardedMeta(
        cls.__name__,
        (cls,),
        {
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "__doc__": cls.__doc__,
        },
    )
    functools.update_wrapper(sharded, cls, assigned=(), updated=())
    return sharded


def _specs_for_state(
    state: nnx.State, plan: Plan | object, rules: LogicalRules | None, mesh: Mesh
) -> PyTree:
    """PartitionSpec per leaf of an abstract NNX state (Variables keep their structure)."""

    def spec_of(keypath: tuple, var: nnx.Variable) -> P:
        value = variable_value(var)
        path = path_str(keypath)
        if isinstance(plan, Plan) and path in plan.params:
            return plan.params[path]
        if not isinstance(var, nnx.Param):
            return P()
        logical, pinned = variable_names(var)
        if pinned is not None:
            return pinned
        if rules is None:
            return P()
        return rules.resolve(logical, tuple(value.shape), mesh, where=path)

    return jax.tree_util.tree_map_with_path(
        spec_of, state, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
