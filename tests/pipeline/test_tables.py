"""The tick tables' runs and their folding (spmdkit/pipeline/tables.py)."""

from __future__ import annotations

import numpy as np
import pytest

import spmdkit as sk
from spmdkit.pipeline import Pipeline, build_schedule
from spmdkit.pipeline.tables import MAX_UNIT, build_tables

PIPELINES = [
    Pipeline(2, 8, "1f1b"),
    Pipeline(2, 3, "1f1b"),
    Pipeline(4, 16, "1f1b"),
    Pipeline(2, 8, "interleaved", virtual=2),
    Pipeline(2, 32, "interleaved", virtual=4),
    Pipeline(4, 8, "fthenb"),
]


@pytest.mark.parametrize("pipe", PIPELINES, ids=str)
def test_blocks_run_the_segments_in_order(pipe):
    """Unfolded, the blocks are the segments: the same runs, ticks and sends, in order."""
    t = build_tables(build_schedule(pipe))
    runs, tick = [], 0
    for start, reps, unit in t.blocks():
        assert start == tick and reps >= 1 and 1 <= len(unit) <= MAX_UNIT
        for _ in range(reps):
            for n, send_f, send_b in unit:
                runs.append((tick, tick + n, send_f, send_b))
                tick += n
    assert runs == [(a, b, bool(f), bool(g)) for a, b, f, g in t.segments()]
    assert tick == t.n_ticks


def test_a_two_stage_1f1b_folds_its_steady_state():
    """Two stages under 1F1B alternate ticks that send both ways with ticks that
    send nothing: a run per tick, as many as the micro-batches; folded, the same
    few blocks whatever the micro-batches."""
    for m in (8, 64):
        t = build_tables(build_schedule(Pipeline(2, m, "1f1b")))
        assert len(t.segments()) > 2 * m
        blocks = t.blocks()
        assert len(blocks) <= 6, blocks
        assert max(reps for _, reps, _ in blocks) >= m - 2


@pytest.mark.heavy
def test_the_pipelined_program_does_not_grow_with_the_microbatches():
    """The lowered step of a 2-stage 1F1B pipeline: with 4 times the micro-batches
    (and rows), about the same program, not 4 times the tick bodies (the pre part,
    once per micro-batch, grows a little)."""
    llama = sk.models.get_model("llama")
    cfg = llama.config("tiny_pipe")
    sizes = {}
    for m in (4, 16):
        batch = llama.batch(cfg, 4 * m, np.random.default_rng(0))
        info = sk.describe(llama, config=cfg, batch=batch)
        pipe = Pipeline(stages=2, microbatches=m, schedule="1f1b")
        plan = sk.plan(info, sk.make_mesh(pipe=2, data=4), "fsdp", pipeline=pipe)
        step = sk.jit(sk.value_and_grad(info.loss_fn, plan), plan)
        text = step.lower(sk.init_sharded(info, plan), batch).as_text()
        sizes[m] = len(text.splitlines())
    assert sizes[16] < 1.5 * sizes[4], sizes
