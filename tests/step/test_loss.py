"""spmdkit.step.loss: the Loss a train step runs, keys as step inputs, placeholder keys refused."""

import jax
import jax.numpy as jnp
import pytest

from spmdkit.step.loss import (
    Loss,
    LossError,
    as_loss,
    is_key,
    note_placeholder_key,
    placeholder_keys,
    takes_rng,
)


def test_takes_rng_reads_the_signature():
    assert takes_rng(lambda variables, batch, rng: 0)
    assert takes_rng(lambda model, batch, rng=None: 0)
    assert not takes_rng(lambda model, batch: 0)
    assert is_key(jax.random.key(0)) and not is_key(jnp.zeros(2))


def test_as_loss_keeps_a_described_loss_and_wraps_a_function():
    described = Loss(lambda p, b, k: 0.0, rng=True, name="net")
    holder = type("Info", (), {"train_loss": described})()
    assert as_loss(holder) is described and as_loss(described) is described
    plain = as_loss(lambda p, b: 0.0, has_aux=True)
    assert plain.has_aux and not plain.rng
    with pytest.raises(LossError, match="has_state=True"):
        as_loss(described, has_state=True)
    assert repr(described) == "Loss(net: rng)"


def test_a_loss_that_draws_random_numbers_needs_its_key():
    loss = Loss(lambda p, b, k: 0.0, rng=True, name="net")
    loss.check_key((jax.random.key(1),), op="t", call="f(key)")
    with pytest.raises(LossError, match=r"pass the step's key last: f\(key\)"):
        loss.check_key((), op="t", call="f(key)")


def test_placeholder_keys_are_collected_only_inside():
    note_placeholder_key("outside")  # nobody listening: ignored
    with placeholder_keys() as seen:
        note_placeholder_key("net: info.loss_fn")
    assert seen == ["net: info.loss_fn"]
