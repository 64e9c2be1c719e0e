"""Held residual sets per schedule, and the compiled peaks they predict."""

from __future__ import annotations

import pytest

import spmdkit as sk
from spmdkit.flax.model import describe
from spmdkit.models import get_model
from spmdkit.models.llama import LlamaConfig
from spmdkit.pipeline import Pipeline, build_schedule
from spmdkit.pipeline.execute import chunk_residuals
from spmdkit.pipeline.memory import held_residual_sets, peak_bytes, saved_bytes
from spmdkit.verification.compiled import report


def test_held_sets_per_schedule():
    gp, fb, ob = (
        Pipeline(stages=4, microbatches=8, schedule=s) for s in ("gpipe", "fthenb", "1f1b")
    )
    assert held_residual_sets(gp) == 8 + 4 - 1
    assert held_residual_sets(fb) == 8 + 1
    assert held_residual_sets(ob) == max(build_schedule(ob).peak_in_flight) + 1
    assert saved_bytes(ob, gp, 10.0, 1.0) == (11 - 5) * 10.0 + 11 * 1.0
    assert peak_bytes(fb, 10.0, 1.0, 7.0) == 9 * 10.0 + 7.0


def _bytes(shapes) -> int:
    return sum(s.size * s.dtype.itemsize for s in shapes)


@pytest.mark.slow
def test_fthenb_and_1f1b_peaks_below_gpipe_by_the_predicted_amount():
    cfg = LlamaConfig(n_layers=4, scan_layers=True, seq_len=128, d_model=64, d_mlp=128, vocab=128)
    info = describe(get_model("llama"), config=cfg, batch_size=32)
    peaks, pipes = {}, {}
    for schedule in ("gpipe", "fthenb", "1f1b"):
        pipe = pipes[schedule] = Pipeline(stages=4, microbatches=8, schedule=schedule)
        plan = sk.plan(info, sk.make_mesh(pipe=4), "dp", pipeline=pipe)
        step = sk.jit(sk.value_and_grad(info.loss_fn, plan), plan, enforce=False)
        peaks[schedule] = report(step.compile(info.abstract_params, info.batch)).peak_bytes
    args = (info.loss_fn, pipes["gpipe"], info.abstract_params, info.batch)
    r, h = _bytes(chunk_residuals(*args)), _bytes(chunk_residuals(*args, head=True))
    for schedule in ("fthenb", "1f1b"):
        measured = peaks["gpipe"] - peaks[schedule]
        predicted = saved_bytes(pipes[schedule], pipes["gpipe"], r, h)
        assert measured > 0
        assert abs(measured - predicted) <= 0.2 * predicted, (schedule, measured, predicted)
