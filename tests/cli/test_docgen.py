"""docs/rule-reference.md is generated from the registry and must be current."""

import pathlib

import spmdkit as sk
from spmdkit.cli.docgen import rules_markdown

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "rule-reference.md"


def test_every_op_is_documented():
    text = rules_markdown()
    for op in sk.registered_ops():
        assert f"| {op} |" in text, op


def test_committed_page_is_current():
    assert DOC.read_text() == rules_markdown(), (
        "docs/rule-reference.md is stale: "
        "run `python -m spmdkit rules --markdown > docs/rule-reference.md`"
    )
