"""Test setup: 8 virtual CPU devices, set before JAX starts any backend."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import pytest

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
