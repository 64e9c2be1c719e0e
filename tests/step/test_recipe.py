"""spmdkit.step.recipe: recipes as data (validation, names, JSON round trips)."""

import dataclasses

import jax.numpy as jnp
import pytest

from spmdkit.step import recipe as rc
from spmdkit.step.recipe import Recipe, RecipeError


def test_recipe_validates_and_round_trips():
    r = Recipe(remat="names", save_names=("proj",), compute_dtype=jnp.bfloat16, microbatches=2)
    assert r.compute_dtype == "bfloat16"
    assert r.short() == "remat=names, save=proj, bf16, microbatches=2"
    assert Recipe.from_json(r.to_json()) == r and Recipe().is_default
    for bad in (
        {"remat": "some"},
        {"remat": "names"},
        {"save_names": ("a",)},
        {"compute_dtype": "int8"},
        {"microbatches": 0},
        {"remat": "full", "remat_offload": True},
        {"remat_offload": True},
        {"remat_every": 2},
        {"remat": "full", "remat_every": 0},
    ):
        with pytest.raises(RecipeError):
            Recipe(**bad)


def test_named_policies_are_maxtexts_and_round_trip():
    r = Recipe(remat="save_qkv_proj", remat_offload=True, compute_dtype="bfloat16")
    assert r.short() == "remat=save_qkv_proj→host, bf16"
    assert Recipe.from_json(r.to_json()) == r
    assert r.saved_names == ("query_proj", "key_proj", "value_proj", "qkv_proj")
    assert (
        set(rc.NAMED_POLICIES["save_dot_except_mlp"])
        < set(rc.NAMED_POLICIES["save_dot_except_mlpwi"])
        < set(rc.NAMED_POLICIES["minimal"])
    )
    assert Recipe(remat="dots").saved_names == () and Recipe(remat="full").saved_names == ()


def test_replace_keeps_recipe_frozen():
    r = Recipe(remat="full")
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.remat = "none"  # type: ignore[misc]


def test_delayed_fp8_scaling_is_a_float8_option_that_round_trips():
    rcp = Recipe(compute_dtype="float8", fp8_scaling="delayed")
    assert Recipe.from_json(rcp.to_json()) == rcp and rcp.short() == "fp8(delayed)"
    assert Recipe.from_json({"compute_dtype": "float8"}).fp8_scaling == "current"
    with pytest.raises(RecipeError, match="only with compute_dtype='float8'"):
        Recipe(compute_dtype="bfloat16", fp8_scaling="delayed")
    with pytest.raises(RecipeError, match="fp8_scaling is one of"):
        Recipe(compute_dtype="float8", fp8_scaling="late")


def test_float8_keeps_the_lm_head_in_bf16_unless_told_and_refuses_other_names():
    """``fp8_exclude``: ("lm_head",) by default (as TE, torchao and MaxText), ()
    for every weight matmul in float8; it round-trips; a name other than
    "lm_head", a bare string, or a non-default value without float8 is a typed
    error."""
    rcp = Recipe(compute_dtype="float8")
    assert rcp.fp8_exclude == ("lm_head",) and rcp.short() == "fp8"
    every = Recipe(compute_dtype="float8", fp8_exclude=[])
    assert every.fp8_exclude == () and every.short() == "fp8(lm_head too)"
    for r in (rcp, every):
        assert Recipe.from_json(r.to_json()) == r
    assert Recipe.from_json({"compute_dtype": "float8"}) == rcp
    for bad in (("output",), "lm_head"):
        with pytest.raises(RecipeError, match=r"each one of \('lm_head',\)"):
            Recipe(compute_dtype="float8", fp8_exclude=bad)
    with pytest.raises(RecipeError, match="only with compute_dtype='float8'"):
        Recipe(compute_dtype="bfloat16", fp8_exclude=())
