"""spmdkit.step.passes: the levers as passes in one declared order, the plan typed."""

import ast
import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import pytest

import spmdkit as sk
from spmdkit.step import grad
from spmdkit.step.loss import as_loss
from spmdkit.step.passes import Pass, Step, StepPlan, run
from spmdkit.step.recipe import Recipe
from tests.plan_model import toy_batch, toy_init, toy_loss

STEP = pathlib.Path(sk.__file__).parent / "step"
#: What the step calls the plan (or a recipe that may be one) it is handed.
PLAN_NAMES = ("recipe", "plan", "recipe_or_plan")


def test_the_order_is_declared_once_and_names_every_lever():
    names = [p.name for p in grad.ORDER]
    assert names == [
        "context",
        "fp8",
        "remat",
        "cast",
        "grad",
        "pipeline",
        "microbatches",
        "master",
        "offload",
    ]
    assert all(isinstance(p, Pass) and callable(p.apply) for p in grad.ORDER)


def test_passes_apply_in_the_order_given():
    calls = []

    def tag(name):
        def apply(step):
            calls.append(name)
            inner = step.fn
            return dataclasses.replace(step, fn=lambda p, b: (name, inner(p, b)))

        return Pass(name, apply)

    step = Step(recipe=Recipe(), loss=as_loss(lambda p, b: 0.0), fn=lambda p, b: "loss")
    built = run((tag("a"), tag("b")), step)
    assert calls == ["a", "b"]
    assert built.fn(None, None) == ("b", ("a", "loss"))  # the later pass wraps the earlier


def test_a_pass_that_does_not_apply_returns_the_step_itself():
    step = grad.build(as_loss(lambda p, b: jnp.sum(p * b)), Recipe())
    assert step.plan is None and step.update is None
    plain = Step(recipe=Recipe(), loss=step.loss, fn=step.loss.fn)
    for p in grad.ORDER:
        if p.name in ("fp8", "remat", "pipeline", "master", "offload"):
            assert p.apply(plain) is plain, p.name
    value, g = step.grad(jnp.ones(3), jnp.arange(3.0))
    assert value == 3.0 and jnp.array_equal(g, jnp.arange(3.0))


def test_a_plan_is_a_step_plan():
    mesh = sk.abstract_mesh(data=2, model=2)
    plan = sk.plan(toy_init, mesh, "fsdp", loss=toy_loss, batch=toy_batch())
    assert isinstance(plan, StepPlan)
    assert not isinstance(Recipe(), StepPlan)
    step = grad.build(as_loss(lambda p, b: 0.0), plan)
    assert step.plan is plan and step.recipe == plan.recipe


def test_anything_else_is_refused_as_a_plan():
    with pytest.raises(sk.RecipeError, match="Recipe or a plan"):
        sk.value_and_grad(lambda p, b: 0.0, jax.numpy.zeros(2))


def _untyped_plan_uses(path: pathlib.Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        untyped = isinstance(node, ast.arg) and (
            node.annotation is None or ast.unparse(node.annotation) in ("Any", "object")
        )
        if untyped and node.arg in PLAN_NAMES:
            found.append(f"{path.name}:{node.lineno} {node.arg}: untyped")
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "getattr"
            and node.args
            and isinstance(node.args[0], ast.Name)
            and node.args[0].id in PLAN_NAMES
        ):
            found.append(f"{path.name}:{node.lineno} getattr({node.args[0].id}, ...)")
    return found


def test_the_plan_reaches_the_step_typed():
    """No module of the step takes the plan as ``Any`` or reads it by ``getattr``."""
    found = [u for path in sorted(STEP.glob("*.py")) for u in _untyped_plan_uses(path)]
    assert found == []


def test_the_typed_plan_check_catches_any_and_getattr(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from typing import Any\n"
        "def f(loss, recipe: Any):\n"
        "    return getattr(recipe, 'pipeline', None)\n"
    )
    assert _untyped_plan_uses(bad) == [
        "bad.py:2 recipe: untyped",
        "bad.py:3 getattr(recipe, ...)",
    ]
