"""Test setup: 8 virtual CPU devices, set before JAX starts any backend."""

import os

# The suite compiles thousands of small programs: LLVM's -O0 halves XLA:CPU's
# codegen time and leaves HLO passes (fusion, buffer assignment, collectives),
# and so every memory and HLO figure the tests compare, unchanged.
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_backend_optimization_level" not in _flags:
    _flags += " --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402 (after the flags above)
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


@pytest.fixture(scope="session")
def mesh1d():
    """A 1-D mesh of 4 devices, axis ``x`` (Explicit axes)."""
    import spmdkit as sk

    return sk.make_mesh(x=4)


@pytest.fixture(scope="session")
def mesh2d():
    """A 2-D mesh of 2×4 devices, axes ``a`` and ``b`` (Explicit axes)."""
    import spmdkit as sk

    return sk.make_mesh(a=2, b=4)
