"""Pipelined steps that several slow tests compile alike, built once per process.

tests/pipeline/test_execute.py's schedule matrix, its enforced-step and tick-branch
tests and tests/verification/test_pipelined.py's peak-memory cases compile the same
unenforced steps (model, rows, mesh, strategy, pipeline). :func:`unenforced_step`
builds and compiles each once per process (jax arrays and compiled executables are
immutable), and :func:`shared` marks the tests that read one (``xdist_group``), which
tests/conftest.py runs next to each other so that xdist mostly gives them to one
worker. Wherever they run they pass; each worker compiles what it runs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spmdkit as sk
from spmdkit.introspect.model import describe
from spmdkit.models import get_model
from spmdkit.pipeline import Pipeline


@functools.cache
def model(name: str, rows: int) -> tuple:
    """``(info, params, batch)``: the ``tiny_pipe`` model, its initial parameters and
    a batch of ``rows`` random tokens (seed 0)."""
    info = describe(get_model(name), config="tiny_pipe", batch_size=rows)
    rng = np.random.default_rng(0)
    batch = jax.tree.map(lambda s: jnp.asarray(rng.integers(0, 200, s.shape), s.dtype), info.batch)
    return info, info.init_fn(), batch


@functools.cache
def reference(name: str, rows: int) -> tuple:
    """The one-device loss and grads of :func:`model`'s parameters and batch."""
    info, params, batch = model(name, rows)
    return jax.jit(jax.value_and_grad(info.loss_fn))(params, batch)


def unenforced_step(
    name: str, axes: dict, strategy: str, pipe: Pipeline, rows: int = 16
) -> sk.PlannedFunction:
    """``sk.jit(sk.value_and_grad(loss, plan), plan, enforce=False)`` of :func:`model`
    planned with ``strategy`` on a mesh of ``axes`` and ``pipe``, compiled for its
    parameters and batch."""
    return _step(name, tuple(axes.items()), strategy, pipe, rows)


@functools.cache
def _step(name: str, axes: tuple, strategy: str, pipe: Pipeline, rows: int):
    info, params, batch = model(name, rows)
    plan = sk.plan(info, sk.make_mesh(**dict(axes)), strategy, pipeline=pipe)
    step = sk.jit(sk.value_and_grad(info.loss_fn, plan), plan, enforce=False)
    step.compile(params, batch)
    return step


def shared(name: str, axes: dict, strategy: str, pipe: Pipeline, rows: int = 16):
    """The ``xdist_group`` mark of the tests that read :func:`unenforced_step` of
    these arguments."""
    mesh = "x".join(f"{a}{n}" for a, n in axes.items())
    where = f"{name}-{rows}-{mesh}-{strategy}-{pipe.schedule}-m{pipe.microbatches}"
    return pytest.mark.xdist_group(f"{where}-v{pipe.virtual}")
