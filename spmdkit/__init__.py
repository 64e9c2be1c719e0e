"""spmdkit: explicit, predictable, testable SPMD sharding for JAX and flax."""

# Package names never repeat a function name exported here (``sk.plan`` is a
# function; its module is ``spmdkit.planner``), so ``import spmdkit.X as m``
# always gives a module.
from spmdkit.compile import PlannedFunction, jit
from spmdkit.compile.annotate import init_sharded, shard
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
from spmdkit.flax import ModelInfo, describe
from spmdkit.mesh import abstract_mesh, make_mesh, use_virtual_cpu_devices
from spmdkit.pipeline import Pipeline
from spmdkit.planner import (
    PRESETS,
    Cost,
    LogicalRules,
    OverBudgetError,
    Plan,
    PlanError,
    UnknownLogicalAxisError,
    axis_roles,
    plan,
    preset_rules,
)
from spmdkit.propagation import EqnRecord, Propagation, propagate, trace
from spmdkit.propagation.memory import MemoryEstimate, estimate_memory
from spmdkit.recipe import Recipe, RecipeError, train_step, value_and_grad
from spmdkit.resharding import Collective, ReshardPlan, plan_reshard, reshard
from spmdkit.spec import REDUCE_OPS, TensorSpec
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


def __getattr__(name: str):
    if name in _LAZY_MODULES:
        import importlib

        return importlib.import_module(_LAZY_MODULES[name])
    raise AttributeError(f"module 'spmdkit' has no attribute {name!r}")


__all__ = [
    "DEFAULT_TOPOLOGY",
    "PRESETS",
    "CompiledReport",
    "Cost",
    "EqnRecord",
    "LogicalRules",
    "MemoryEstimate",
    "ModelInfo",
    "OverBudgetError",
    "Plan",
    "PlanError",
    "Pipeline",
    "PlannedFunction",
    "Propagation",
    "UnknownLogicalAxisError",
    "VerifyReport",
    "axis_roles",
    "describe",
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
    "abstract_mesh",
    "make_mesh",
    "use_virtual_cpu_devices",
]
