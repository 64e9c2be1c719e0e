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
from spmdkit.mesh import abstract_mesh, make_mesh, use_virtual_cpu_devices
from spmdkit.spec import REDUCE_OPS, TensorSpec

__all__ = [
    "REDUCE_OPS",
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
