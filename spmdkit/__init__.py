"""spmdkit: explicit, predictable, testable SPMD sharding for JAX and flax."""

# The planner layer (imports flax). ``plan`` and ``report`` are functions here;
# their modules stay reachable with ``from spmdkit.plan import ...``.
from spmdkit.compile import PlannedFunction, jit
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
from spmdkit.factor import Notation, parse_notation
from spmdkit.flaxlib import ModelInfo, describe, init_sharded, shard
from spmdkit.hlo import (
    HloCollective,
    check_plan,
    compiled_collectives,
    parse_collectives,
    parse_replica_groups,
    summarize,
)
from spmdkit.inference import (
    ArgReshard,
    InferenceResult,
    infer_backward,
    infer_forward,
    infer_grad,
)
from spmdkit.memory import MemoryEstimate, estimate_memory
from spmdkit.mesh import abstract_mesh, make_mesh, use_virtual_cpu_devices
from spmdkit.plan import (
    PRESETS,
    Cost,
    LogicalRules,
    Plan,
    PlanError,
    UnknownLogicalAxisError,
    axis_roles,
    plan,
    preset_rules,
)
from spmdkit.propagate import EqnRecord, Propagation, propagate, register_primitive, trace
from spmdkit.registry import get_rule, register_rule, registered_ops, unregister_rule
from spmdkit.report import CompiledReport, VerifyReport, report, verify
from spmdkit.resharding import Collective, ReshardPlan, plan_reshard, reshard
from spmdkit.rule import POLICIES, Example, FactorRule, Rule, RuleContext
from spmdkit.spec import REDUCE_OPS, TensorSpec
from spmdkit.topology import DEFAULT_TOPOLOGY, Topology

#: Submodules loaded on first use (they import orbax, optax or run-time machinery).
_LAZY_MODULES = ("checkpoint", "data", "launch", "models", "ops", "testing", "train")


def __getattr__(name: str):
    if name in _LAZY_MODULES:
        import importlib

        return importlib.import_module(f"spmdkit.{name}")
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
    "Plan",
    "PlanError",
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
    "Topology",
    "Example",
    "FactorRule",
    "InferenceResult",
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
