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


@pytest.fixture(scope="session")
def tiny_infos():
    """The reference GPT's and Llama's tiny configs, described once (batch 8)."""
    from models import get_model
    from spmdkit.introspect.model import describe

    return {m: describe(get_model(m), config="tiny", batch_size=8) for m in ("gpt", "llama")}


@pytest.fixture(scope="session")
def llama_fsdp(tiny_infos, amesh):
    """Tiny Llama's fsdp plan on :func:`amesh`, costed by propagation (provenance recorded)."""
    return plan(tiny_infos["llama"], amesh, "fsdp")
