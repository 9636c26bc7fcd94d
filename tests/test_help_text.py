"""The entry points' --help: every flag described, every default stated, one default K and a dtype by backend."""

import argparse
import inspect

import pytest

from convert.__main__ import build_parser as convert_parser
from jaxspec.defaults import DEFAULT_NUM_STEPS, default_dtype
from jaxspec.generate import build_parser as generate_parser
from jaxspec.plan import build_parser as plan_parser
from jaxspec.plan import make_plan


@pytest.mark.parametrize("build", [convert_parser, plan_parser], ids=["convert", "plan"])
def test_every_flag_is_described_with_its_default(build):
    parser = build()
    text = parser.format_help()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help, f"{action.option_strings or action.dest} has no help"
        if action.default not in (None, False):
            assert f"(default: {action.default})" in " ".join(text.split()), action.dest


def test_one_default_k_and_a_dtype_by_backend():
    assert plan_parser().parse_args([]).num_steps == DEFAULT_NUM_STEPS
    assert inspect.signature(make_plan).parameters["num_steps"].default == DEFAULT_NUM_STEPS
    help_text = " ".join(generate_parser().format_help().split())
    assert f"default {DEFAULT_NUM_STEPS}" in help_text and "float32 on CPU" in help_text
    assert generate_parser().parse_args([]).dtype is None  # resolved by backend at run time
    assert default_dtype("cpu") == "float32" and default_dtype("gpu") == "bfloat16"
