"""Fixtures of tests/step's tests."""

import jax
import pytest

from tests.step.dense_stack import batch, init, scanned_loss


@pytest.fixture(scope="module")
def reference():
    """``(loss, grads)`` of the plain ``jax.value_and_grad`` of the shared model."""
    return jax.jit(jax.value_and_grad(scanned_loss))(init(), batch())
