"""Planner test fixtures: an abstract 2×4 mesh and every preset's plan of the toy model."""

import pytest

import spmdkit as sk
from spmdkit.planner import PRESETS, plan
from tests.plan_model import toy_batch, toy_init, toy_loss


@pytest.fixture(scope="session")
def amesh():
    """An abstract mesh ``data=2, model=4`` (planning only)."""
    return sk.abstract_mesh(data=2, model=4)


@pytest.fixture(scope="session")
def plans(amesh):
    """Strategy → the toy model's analytic plan on :func:`amesh` (every preset and auto)."""
    batch = toy_batch()
    return {
        s: plan(toy_init, amesh, s, loss=toy_loss, batch=batch, estimator="analytic")
        for s in (*PRESETS, "auto")
    }
