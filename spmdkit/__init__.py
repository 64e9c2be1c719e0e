"""spmdkit: explicit, predictable, testable SPMD sharding for JAX and flax."""

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
from spmdkit.mesh import abstract_mesh, make_mesh, use_virtual_cpu_devices
from spmdkit.registry import get_rule, register_rule, registered_ops, unregister_rule
from spmdkit.resharding import Collective, ReshardPlan, plan_reshard, reshard
from spmdkit.rule import POLICIES, Example, FactorRule, Rule, RuleContext
from spmdkit.spec import REDUCE_OPS, TensorSpec
from spmdkit.topology import DEFAULT_TOPOLOGY, Topology

__all__ = [
    "DEFAULT_TOPOLOGY",
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
