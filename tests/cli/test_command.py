"""spmdkit.cli.command: the checks every subcommand runs on its flags before it
plans, compiles or writes anything."""

import argparse

import pytest

from spmdkit.cli.command import (
    dir_to_write,
    existing_dir,
    model_help,
    non_negative_int,
    positive_int,
)
from spmdkit.errors import UsageError


def test_int_types_name_what_they_got():
    assert positive_int("3") == 3 and non_negative_int("0") == 0
    for bad in ("0", "-2", "x"):
        with pytest.raises(argparse.ArgumentTypeError, match="positive integer"):
            positive_int(bad)
    with pytest.raises(argparse.ArgumentTypeError, match=">= 0"):
        non_negative_int("-1")


def test_dir_to_write_refuses_a_file_or_a_path_under_one(tmp_path):
    dir_to_write("spmdkit train", "--ckpt", str(tmp_path))  # an existing directory
    dir_to_write("spmdkit train", "--ckpt", str(tmp_path / "new" / "deeper"))  # creatable
    assert not (tmp_path / "new").exists()  # checked, not created
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(UsageError, match=r"spmdkit train --ckpt: .*which is a file"):
        dir_to_write("spmdkit train", "--ckpt", str(f))
    with pytest.raises(UsageError, match=r"--ckpt.*is under the file"):
        dir_to_write("spmdkit train", "--ckpt", str(f / "sub"))


def test_existing_dir_names_the_argument(tmp_path):
    existing_dir("spmdkit export", "CKPT", str(tmp_path), what="a checkpoint", fix="f")
    with pytest.raises(UsageError, match=r"spmdkit export CKPT: .*does not exist"):
        existing_dir("spmdkit export", "CKPT", str(tmp_path / "no"), what="a checkpoint", fix="f")
    assert not (tmp_path / "no").exists()


def test_model_help_lists_the_reference_models_and_configs():
    assert "gpt (configs: tiny" in model_help() and "llama (configs:" in model_help()
