"""Pin a plan's layouts in a test: :func:`assert_plan_matches` against a snapshot.

A snapshot is the JSON ``plan.snapshot(path)`` writes
(:mod:`spmdkit.planner.snapshot`: per tensor its logical axes,
``PartitionSpec``, shape and mesh, MaxText's golden-dump layout). The check
fails with one line per tensor whose layout moved, so a change of rules,
presets or the search shows up as a readable diff in the user's own tests.

Rewrite the stored snapshots (after a change you meant) with
``SPMDKIT_UPDATE_SNAPSHOTS=1 python -m pytest ...`` or ``update=True``.
"""

from __future__ import annotations

import json
import os
from typing import Any

from spmdkit.planner.snapshot import snapshot_dict, snapshot_diff, write_snapshot

__all__ = ["UPDATE_ENV", "assert_plan_matches"]

#: The environment variable that makes :func:`assert_plan_matches` rewrite the
#: snapshot instead of comparing (``1``, ``true`` or ``yes``).
UPDATE_ENV = "SPMDKIT_UPDATE_SNAPSHOTS"


def _updating(update: bool | None) -> bool:
    if update is not None:
        return update
    return os.environ.get(UPDATE_ENV, "").strip().lower() in ("1", "true", "yes")


def assert_plan_matches(plan: Any, path: str | os.PathLike, *, update: bool | None = None) -> None:
    """Check that ``plan``'s shardings are those stored at ``path``.

    Args:
      plan: a :class:`~spmdkit.planner.plans.Plan`.
      path: the snapshot file (JSON written by ``plan.snapshot``).
      update: write the plan's snapshot to ``path`` instead of comparing; None:
        when the environment variable ``SPMDKIT_UPDATE_SNAPSHOTS`` is ``1``.

    Raises:
      AssertionError: the plan differs from the snapshot (one line per tensor:
        its path, the stored spec and the new one), or no snapshot is stored.

    Example::

        >>> sk.testing.assert_plan_matches(plan, "tests/snapshots/gpt_fsdp.json")
        AssertionError: plan 'fsdp' differs from the snapshot tests/snapshots/gpt_fsdp.json ...
          params/blocks/0/fc/kernel: spec stored [data,model] -> new [_,model]
    """
    if _updating(update):
        write_snapshot(plan, path)
        return
    if not os.path.exists(path):
        raise AssertionError(
            f"no plan snapshot at {os.fspath(path)}: write it with plan.snapshot(path), "
            f"or run the test once with {UPDATE_ENV}=1"
        )
    with open(path) as f:
        stored = json.load(f)
    lines = snapshot_diff(stored, snapshot_dict(plan))
    if lines:
        raise AssertionError(
            f"plan {plan.strategy!r} differs from the snapshot {os.fspath(path)} "
            f"({len(lines)} change{'s' if len(lines) > 1 else ''}; if meant, rerun with "
            f"{UPDATE_ENV}=1 to rewrite it):\n" + "\n".join("  " + line for line in lines)
        )
