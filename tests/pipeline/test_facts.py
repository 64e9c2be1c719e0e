"""What the planner and plan.verify read about a pipeline: the permutes it runs."""

from __future__ import annotations

from spmdkit.pipeline import Pipeline, build_schedule
from spmdkit.pipeline.facts import permute_count
from spmdkit.pipeline.tables import build_tables


def test_permute_count_follows_the_sends():
    pipe = Pipeline(stages=2, microbatches=4, schedule="fthenb")
    t = build_tables(build_schedule(pipe))
    assert permute_count(pipe) == sum(t.send_f) + sum(t.send_b)
    flags = [s[2:] for s in t.segments()]
    assert flags[0] == (True, False) and (True, True) not in flags  # no tick sends both ways
    assert (False, True) in flags
