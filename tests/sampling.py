"""The slow step's samples: which cases of a slow matrix CI runs, and how to run them all.

A matrix whose cases run the same code on other inputs (every reference model x
strategy x mesh, every schedule x mesh x model, every op's full rule sweep) keeps
a sample in CI's slow step (``python -m pytest -m slow``); the other cases carry
the ``full`` marker, which tests/conftest.py deselects unless
``SPMDKIT_FULL_SWEEP=1`` is set (or ``-m`` names ``full``). A sample is chosen by
position, never at random, so a failure reproduces, and it is a Latin square over
the matrix's axes: every value of every axis, and every pair of values of the
first two axes, still runs in CI.

    SPMDKIT_FULL_SWEEP=1 python -m pytest -m slow    # every case
    python -m pytest -m full                          # only what CI leaves out

CI's slow step runs one half of the slow tests a commit (``--slow-half``, by the
commit's hash: :func:`in_half`), so that the whole ``.ci/run`` keeps to its 30 minutes
on 2 cores; consecutive commits' halves differ at random, and either half reproduces:

    python -m pytest -m slow --slow-half=0            # or 1; without it: both
"""

from __future__ import annotations

import itertools
import os
import zlib
from collections.abc import Callable, Iterable, Sequence

import pytest

#: Run every case of the sampled matrices (``SPMDKIT_FULL_SWEEP=1``).
FULL_SWEEP = os.environ.get("SPMDKIT_FULL_SWEEP", "") not in ("", "0")


def latin(*axes: Sequence) -> set[tuple]:
    """The cases of the matrix ``axes[0] x axes[1] x ... x axes[-1]`` that CI runs:
    for each combination of the first axes, one value of the last, rotating with
    the combination's position, so each value of the last axis runs with each value
    of every other axis (when that axis is at least as long).

    Example::

        >>> sorted(latin(["gpt", "llama"], ["dp", "fsdp"], [(8,), (2, 4)]))
        [('gpt', 'dp', (8,)), ('gpt', 'fsdp', (2, 4)), ('llama', 'dp', (2, 4)), ('llama', 'fsdp', (8,))]
    """  # noqa: E501 - a doctest line
    *heads, last = axes
    kept = set()
    for position in itertools.product(*(range(len(a)) for a in heads)):
        pick = last[sum(position) % len(last)]
        kept.add((*(a[i] for a, i in zip(heads, position, strict=True)), pick))
    return kept


def every_kth(names: Iterable[str], group: Callable[[str], str], k: int) -> frozenset[str]:
    """Every ``k``-th name of each group, in name order, the first included, so that
    every group keeps at least one.

    Example::

        >>> sorted(every_kth(["add", "sub", "mul", "sum"], lambda n: n[0] == "s", 2))
        ['add', 'sub']
    """
    groups: dict = {}
    for name in sorted(names):
        groups.setdefault(group(name), []).append(name)
    return frozenset(n for members in groups.values() for n in members[::k])


def sampled(cases: Sequence[tuple], keep: Callable[[tuple], bool] | set[tuple], **param) -> list:
    """``cases`` as ``pytest.param``s, those not kept marked ``full``.

    Args:
      cases: the matrix's cases, each a tuple of the test's parameters.
      keep: the sample: a set of cases, or a predicate on a case.
      param: passed to every ``pytest.param`` (``id=`` is not: give ``ids=`` to
        ``parametrize``).
    """
    inside = keep.__contains__ if isinstance(keep, set) else keep
    return [
        pytest.param(*case, **param) if inside(case) else full(*case, **param) for case in cases
    ]


def full(*values, **param):
    """One case that only ``SPMDKIT_FULL_SWEEP=1`` runs (a ``pytest.param``)."""
    marks = list(param.pop("marks", ()))
    return pytest.param(*values, marks=[*marks, pytest.mark.full], **param)


def in_half(key: str, half: int) -> bool:
    """Whether the slow test keyed ``key`` (its ``xdist_group``, else its node id, so a
    group that shares one compiled step stays together) runs in ``half`` (0 or 1) of a
    split slow step. By CRC-32 of the key: the same on every machine and Python, and
    about even by cost over the step's hundreds of tests.

    Example::

        >>> [in_half("tests/x.py::test_y", h) for h in (0, 1)]
        [True, False]
    """
    return zlib.crc32(key.encode()) % 2 == half
