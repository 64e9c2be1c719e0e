"""A reference model's train step, planned, compiled and checked by ``plan.verify``
on the virtual CPU mesh: the helper the verification and propagation tests share."""

from __future__ import annotations

import jax
import numpy as np
import optax

import spmdkit as sk


def verified(model: str, strategy, *, mesh=(2, 4), **kw) -> sk.VerifyReport:
    """``plan.verify`` of the zoo ``model``'s tiny config (batch 8) under
    ``strategy`` on ``data=mesh[0] x model=mesh[1]``: its Adam train step."""
    m = sk.models.get_model(model)
    cfg = m.config("tiny")
    batch = m.batch(cfg, 8, np.random.default_rng(0))
    info = sk.describe(m, config=cfg, batch=batch)
    return run(info, sk.make_mesh(data=mesh[0], model=mesh[1]), strategy, batch, **kw)


def run(info, mesh, strategy, batch, **kw) -> sk.VerifyReport:
    """``plan.verify`` of ``info``'s Adam train step planned with ``strategy`` on
    ``mesh`` (``kw``: more for ``sk.plan``)."""
    plan = sk.plan(info, mesh, strategy, estimator="analytic", **kw)
    params = sk.init_sharded(info, plan)
    opt = optax.adam(1e-3)
    step = sk.jit(sk.train_step(info, opt, plan), plan)
    with jax.set_mesh(plan.mesh):
        opt_state = jax.jit(opt.init)(params)
    return plan.verify(step, params, opt_state, batch)
