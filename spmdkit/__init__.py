"""spmdkit: explicit, predictable, testable SPMD sharding for JAX and flax.

Every public name is imported on first use (PEP 562): ``import spmdkit`` loads
no JAX, so the command line checks its flags in a fraction of a second before
anything heavy is imported. ``sk.plan`` imports :mod:`spmdkit.planner` the
first time it is read, and so on (:data:`_EXPORTS`). The run-time modules keep
short names (:data:`_LAZY_MODULES`): ``sk.checkpoint`` is
:mod:`spmdkit.runtime.checkpoint`, and ``from spmdkit.checkpoint import Manager``
imports it under that name too (:class:`_ShortNames`).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
from typing import TYPE_CHECKING, Any

# Package names never repeat a function name exported here (``sk.plan`` is a
# function; its module is ``spmdkit.planner``), so ``import spmdkit.X as m``
# always gives a module.
if TYPE_CHECKING:
    from spmdkit.compile import PlannedFunction, jit
    from spmdkit.compile.annotate import init_sharded, shard
    from spmdkit.compile.tune import tune
    from spmdkit.engine.factor import Notation, parse_notation
    from spmdkit.engine.factor_rule import FactorRule
    from spmdkit.engine.inference import (
        ArgReshard,
        InferenceResult,
        infer_backward,
        infer_forward,
        infer_grad,
    )
    from spmdkit.engine.registry import (
        get_rule,
        register_primitive,
        register_rule,
        registered_ops,
        unregister_primitive,
        unregister_rule,
    )
    from spmdkit.engine.rule import POLICIES, Example, MustDivide, Rule, RuleContext
    from spmdkit.errors import (
        DuplicateAxisError,
        NoRuleError,
        PartialConflictError,
        RegistrationError,
        ReshardError,
        ShardingConflictError,
        SpecError,
        SpmdError,
        UnknownAxisError,
    )
    from spmdkit.introspect import ModelInfo, describe
    from spmdkit.mesh import abstract_mesh, make_mesh, use_virtual_cpu_devices
    from spmdkit.pipeline import Pipeline
    from spmdkit.planner import (
        PRESETS,
        Cost,
        CostModel,
        LogicalRules,
        OverBudgetError,
        Plan,
        PlanError,
        PlanNoteWarning,
        SearchOptions,
        UnknownLogicalAxisError,
        axis_roles,
        diff,
        plan,
        preset_rules,
    )
    from spmdkit.propagation import EqnRecord, Propagation, propagate, trace
    from spmdkit.propagation.memory import MemoryEstimate, estimate_memory
    from spmdkit.resharding import Collective, ReshardPlan, plan_reshard, reshard
    from spmdkit.spec import REDUCE_OPS, TensorSpec
    from spmdkit.state import clear_caches
    from spmdkit.step.grad import train_step, value_and_grad
    from spmdkit.step.recipe import Recipe, RecipeError
    from spmdkit.topology import DEFAULT_TOPOLOGY, Topology
    from spmdkit.verification.compiled import CompiledReport, VerifyReport, report, verify
    from spmdkit.verification.hlo import (
        HloCollective,
        check_plan,
        compiled_collectives,
        parse_collectives,
        parse_replica_groups,
        summarize,
    )

#: Public name → the module it is imported from on first use.
_EXPORTS: dict[str, str] = {
    name: module
    for module, names in {
        "spmdkit.compile": (
            "PlannedFunction",
            "jit",
        ),
        "spmdkit.compile.annotate": (
            "init_sharded",
            "shard",
        ),
        "spmdkit.engine.factor": (
            "Notation",
            "parse_notation",
        ),
        "spmdkit.engine.factor_rule": ("FactorRule",),
        "spmdkit.engine.inference": (
            "ArgReshard",
            "InferenceResult",
            "infer_backward",
            "infer_forward",
            "infer_grad",
        ),
        "spmdkit.engine.registry": (
            "get_rule",
            "register_primitive",
            "register_rule",
            "registered_ops",
            "unregister_primitive",
            "unregister_rule",
        ),
        "spmdkit.engine.rule": (
            "POLICIES",
            "Example",
            "MustDivide",
            "Rule",
            "RuleContext",
        ),
        "spmdkit.errors": (
            "DuplicateAxisError",
            "NoRuleError",
            "PartialConflictError",
            "RegistrationError",
            "ReshardError",
            "ShardingConflictError",
            "SpecError",
            "SpmdError",
            "UnknownAxisError",
        ),
        "spmdkit.introspect": (
            "ModelInfo",
            "describe",
        ),
        "spmdkit.mesh": (
            "abstract_mesh",
            "make_mesh",
            "use_virtual_cpu_devices",
        ),
        "spmdkit.pipeline": ("Pipeline",),
        "spmdkit.planner": (
            "PRESETS",
            "Cost",
            "CostModel",
            "LogicalRules",
            "OverBudgetError",
            "Plan",
            "PlanError",
            "PlanNoteWarning",
            "SearchOptions",
            "UnknownLogicalAxisError",
            "axis_roles",
            "diff",
            "plan",
            "preset_rules",
        ),
        "spmdkit.propagation": (
            "EqnRecord",
            "Propagation",
            "propagate",
            "trace",
        ),
        "spmdkit.propagation.memory": (
            "MemoryEstimate",
            "estimate_memory",
        ),
        "spmdkit.step.grad": (
            "train_step",
            "value_and_grad",
        ),
        "spmdkit.step.recipe": (
            "Recipe",
            "RecipeError",
        ),
        "spmdkit.resharding": (
            "Collective",
            "ReshardPlan",
            "plan_reshard",
            "reshard",
        ),
        "spmdkit.spec": (
            "REDUCE_OPS",
            "TensorSpec",
        ),
        "spmdkit.compile.tune": ("tune",),
        "spmdkit.state": ("clear_caches",),
        "spmdkit.topology": (
            "DEFAULT_TOPOLOGY",
            "Topology",
        ),
        "spmdkit.verification.compiled": (
            "CompiledReport",
            "VerifyReport",
            "report",
            "verify",
        ),
        "spmdkit.verification.hlo": (
            "HloCollective",
            "check_plan",
            "compiled_collectives",
            "parse_collectives",
            "parse_replica_groups",
            "summarize",
        ),
    }.items()
    for name in names
}

#: Submodules loaded on first use (they import orbax, optax or run-time machinery),
#: by the name ``spmdkit`` gives them.
_LAZY_MODULES = {
    "checkpoint": "spmdkit.runtime.checkpoint",
    "data": "spmdkit.runtime.data",
    "export": "spmdkit.runtime.export",
    "launch": "spmdkit.runtime.launch",
    "models": "spmdkit.models",
    "ops": "spmdkit.ops",
    "nn": "spmdkit.nn",
    "testing": "spmdkit.testing",
    "train": "spmdkit.runtime.train",
}


class _ShortNames:
    """An import finder for ``spmdkit.<short name>`` of :data:`_LAZY_MODULES` whose
    module lives elsewhere (``spmdkit.checkpoint`` → ``spmdkit.runtime.checkpoint``):
    ``import spmdkit.checkpoint`` and ``from spmdkit.checkpoint import Manager`` give
    that module itself, one module under two names (``sk.checkpoint`` is the same
    object), imported on first use."""

    @staticmethod
    def find_spec(fullname: str, path: object = None, target: object = None) -> Any:
        parent, _, short = fullname.rpartition(".")
        real = _LAZY_MODULES.get(short) if parent == __name__ else None
        if real is None or real == fullname:  # not ours, or a package of its own
            return None
        return importlib.machinery.ModuleSpec(fullname, _Alias(real))


class _Alias:
    """The loader :class:`_ShortNames` gives: the real module, imported under its
    own name, returned as is."""

    def __init__(self, real: str) -> None:
        self.real = real
        self.spec: Any = None

    def create_module(self, spec: Any) -> Any:
        module = importlib.import_module(self.real)
        self.spec = module.__spec__
        return module

    def exec_module(self, module: Any) -> None:
        module.__spec__ = self.spec  # the import system set the short name's spec


# once per process, a reload of this module included
if not any(getattr(f, "__qualname__", "") == "_ShortNames" for f in sys.meta_path):
    sys.meta_path.append(_ShortNames)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # later reads skip this hook
        return value
    if name in _LAZY_MODULES:
        return importlib.import_module(_LAZY_MODULES[name])
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        # a subpackage (``sk.topology``), as when the imports above were eager
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'spmdkit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS, *_LAZY_MODULES})


__all__ = [
    "DEFAULT_TOPOLOGY",
    "PRESETS",
    "CompiledReport",
    "Cost",
    "CostModel",
    "EqnRecord",
    "LogicalRules",
    "MemoryEstimate",
    "ModelInfo",
    "OverBudgetError",
    "Plan",
    "PlanError",
    "PlanNoteWarning",
    "Pipeline",
    "PlannedFunction",
    "Propagation",
    "SearchOptions",
    "UnknownLogicalAxisError",
    "VerifyReport",
    "axis_roles",
    "describe",
    "diff",
    "estimate_memory",
    "init_sharded",
    "jit",
    "plan",
    "preset_rules",
    "propagate",
    "register_primitive",
    "report",
    "shard",
    "trace",
    "verify",
    "POLICIES",
    "REDUCE_OPS",
    "ArgReshard",
    "Collective",
    "HloCollective",
    "ReshardPlan",
    "Recipe",
    "RecipeError",
    "train_step",
    "tune",
    "value_and_grad",
    "Topology",
    "Example",
    "FactorRule",
    "InferenceResult",
    "MustDivide",
    "Notation",
    "Rule",
    "RuleContext",
    "check_plan",
    "compiled_collectives",
    "get_rule",
    "infer_backward",
    "infer_forward",
    "infer_grad",
    "parse_collectives",
    "parse_notation",
    "parse_replica_groups",
    "plan_reshard",
    "register_rule",
    "unregister_primitive",
    "registered_ops",
    "reshard",
    "summarize",
    "unregister_rule",
    "DuplicateAxisError",
    "NoRuleError",
    "PartialConflictError",
    "RegistrationError",
    "ReshardError",
    "ShardingConflictError",
    "SpecError",
    "SpmdError",
    "TensorSpec",
    "UnknownAxisError",
    "clear_caches",
    "abstract_mesh",
    "make_mesh",
    "use_virtual_cpu_devices",
]
