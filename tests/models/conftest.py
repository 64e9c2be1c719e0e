"""Shared, cached tiny models for the model tests (building and compiling dominate runtime)."""

import functools

import jax
import pytest
from flax import nnx

from spmdkit import models as zoo


@functools.cache
def _built(name: str):
    spec = zoo.get_model(name)
    cfg = spec.configs["tiny"]()
    # rbg keys: the same initializers, much cheaper to compile than threefry on CPU.
    with nnx.use_eager_sharding(False):
        model = spec.build(cfg, nnx.Rngs(jax.random.key(0, impl="rbg")))
    return spec, cfg, model


@pytest.fixture(scope="session")
def tiny():
    """``tiny(name) -> (spec, cfg, model)``: the model's tiny config, built once per session.

    Tests that mutate the model must restore what they change.
    """
    return _built
