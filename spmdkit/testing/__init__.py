"""Rule-validation toolkit: check any rule against the unsharded op on a virtual mesh.

Two checks, usable on your own rules:

* :func:`check_rule` — the numeric sweep, in the style of PyTorch DTensor's
  strategy validation. For each example of the rule it enumerates input specs
  (replicated, sharded on each dim, partial with every reduce op) over the
  mesh, asks the rule for required input and output specs, builds every
  device's local pieces of the *required* inputs (partial values split
  *asymmetrically*, so coincidences fail), runs the op on each device's pieces
  with ``shard_map``, rebuilds the global result from the *claimed* output spec
  and compares with the unsharded op. A replicated claim is checked too: every
  copy must agree. Where the rule asked for a reshard, the op is also run on the
  pieces as given, and any output spec that would have been right is reported
  as a *missing* placement (the rule is conservative there). Grad rules are
  checked the same way against ``jax.vjp``.
* :func:`check_jit` — compiles the op with the rule's required input shardings
  and the claimed output (partials resolved) and checks that the collectives in
  the compiled HLO are exactly those the reshard planner predicts (count, kind
  and bytes). Under ``jit`` a wrong rule still gives right numbers, because XLA
  inserts whatever it needs; the collectives are what betray it.

Both run on a mesh of virtual CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=8``).

The modules, in the order a check uses them:

* ``pieces``: random values, every device's local pieces of a value under a
  spec and the value reassembled from them, the specs a sweep enumerates.
* ``cases``: one case checked (:func:`check_forward_case`,
  :func:`check_grad_case`), and the ``shard_map`` programs that run cases.
* ``sweep``: :func:`check_rule` and its :class:`RuleReport`, with
  :func:`undeclared_replications`.
* ``collectives``: :func:`check_jit` and its :class:`JitReport`.

And for a user's own tests, :func:`assert_plan_matches` (from
``spmdkit.verification.snapshots``): a plan's shardings against a stored
``plan.snapshot``, with a readable diff per tensor.

Example::

    >>> report = check_rule("matmul", mesh=sk.make_mesh(a=2, b=4))
    >>> report.ok, len(report.wrong), len(report.missing)
    (True, 0, 3)
"""

from spmdkit.testing.cases import CaseFailure, check_forward_case, check_grad_case
from spmdkit.testing.collectives import JitReport, check_jit
from spmdkit.testing.pieces import assemble, enumerate_specs, local_pieces, random_value
from spmdkit.testing.sweep import (
    MissingPlacement,
    RuleReport,
    check_rule,
    undeclared_replications,
)
from spmdkit.verification.snapshots import assert_plan_matches

__all__ = [
    "CaseFailure",
    "MissingPlacement",
    "RuleReport",
    "JitReport",
    "assemble",
    "assert_plan_matches",
    "check_rule",
    "check_jit",
    "check_forward_case",
    "check_grad_case",
    "enumerate_specs",
    "local_pieces",
    "random_value",
    "undeclared_replications",
]
