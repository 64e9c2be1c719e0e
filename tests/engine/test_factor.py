"""Factor notation parsing and ellipsis expansion."""

import pytest

import spmdkit as sk
from spmdkit.engine.factor import parse_notation


def test_ellipsis_right_aligned():
    nt = parse_notation("... m k, k n -> ... m n", (4, 2))
    assert nt.inputs == (("_b0", "_b1", "m", "k"), ("k", "n"))
    assert nt.outputs == (("_b0", "_b1", "m", "n"),)
    assert nt.reduction_factors == ("k",)


def test_ellipsis_of_different_lengths_share_the_minor_factors():
    nt = parse_notation("... d, ... d -> ... d", (3, 2))
    assert nt.inputs == (("_b0", "_b1", "d"), ("_b1", "d"))


def test_broadcast_and_need_replication():
    nt = parse_notation("a 1, b -> a b", (2, 1), need_replication=("b",), reduce=None)
    assert nt.factors == ("a", "b")
    assert nt.need_replication == frozenset({"b"})
    assert "replicated: b" in str(nt)


@pytest.mark.parametrize(
    ("text", "ranks", "error"),
    [
        ("m k, k n", (2, 2), sk.RegistrationError),
        ("m k, k n -> m z", (2, 2), sk.RegistrationError),
        ("m k; k n -> m n", (2, 2), sk.RegistrationError),
        ("m k, k n -> m n", (3, 2), sk.ShardingConflictError),
        ("m k -> m", (2, 2), sk.ShardingConflictError),
        ("... m k -> m", (1,), sk.ShardingConflictError),
    ],
)
def test_bad_notation(text, ranks, error):
    with pytest.raises(error):
        parse_notation(text, ranks)
