"""``train``'s options as two values (Checkpointing, Reporting), its keywords kept."""

import io

import optax
import pytest

from spmdkit.errors import TrainError
from spmdkit.runtime.checkpoint import Manager
from spmdkit.runtime.train import train
from spmdkit.runtime.train_options import Checkpointing, Reporting, given


def test_values_check_themselves():
    with pytest.raises(TrainError, match="resume=True comes with a checkpoint manager"):
        Checkpointing(resume=True)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(TrainError, match="log_every is a positive int"):
            Reporting(log_every=bad)


def test_given_keeps_the_keywords_as_a_thin_layer(tmp_path):
    built = Checkpointing(Manager(tmp_path), resume=True, config={"d": 4})
    assert given(None, built) is built
    value = Reporting(log_every=3, out=io.StringIO())
    assert given(value, Reporting()) is value
    with pytest.raises(TrainError, match="keywords log_every, out"):
        given(value, Reporting(log_every=5, out=io.StringIO()))
    with pytest.raises(TrainError, match="the value is a Checkpointing"):
        given(value, Checkpointing())


def test_train_refuses_an_option_given_twice_before_it_runs():
    """Both ways at once raise before the model or data is read (both are None)."""
    with pytest.raises(TrainError, match="keywords ckpt, resume"):
        train(
            None,
            None,
            optax.sgd(0.1),
            None,
            steps=1,
            resume=True,
            ckpt=Manager("/nonexistent"),
            checkpointing=Checkpointing(),
        )
    with pytest.raises(TrainError, match="keywords verify"):
        train(None, None, optax.sgd(0.1), None, steps=1, verify=True, reporting=Reporting())
