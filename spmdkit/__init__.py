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
from spmdkit.inference import (
    ArgReshard,
    InferenceResult,
    infer_backward,
    infer_forward,
    infer_grad,
)
from spmdkit.mesh import abstract_mesh, make_mesh, use_virtual_cpu_devices
from spmdkit.registry import get_rule, register_rule, registered_ops, unregister_rule
from spmdkit.rule import POLICIES, Example, FactorRule, Rule, RuleContext
from spmdkit.spec import REDUCE_OPS, TensorSpec

__all__ = [
    "POLICIES",
    "REDUCE_OPS",
    "ArgReshard",
    "Example",
    "FactorRule",
    "InferenceResult",
    "Notation",
    "Rule",
    "RuleContext",
    "get_rule",
    "infer_backward",
    "infer_forward",
    "infer_grad",
    "parse_notation",
    "register_rule",
    "registered_ops",
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
