"""Every command-line option of mpidp and of the examples has a help text, its default and its
choices; every --help is plain text (no reST markup) with a whole description."""

from __future__ import annotations

import argparse
import importlib
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from mpidp import cli

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
MARKUP = re.compile(r"``|:(?:func|class|meth|mod|attr|data):`|^\.\. ", re.M)


def example_parser(name: str) -> argparse.ArgumentParser:
    sys.path.insert(0, str(EXAMPLES))  # inference.py imports train.py as its neighbour
    try:
        module = importlib.import_module(name)
    finally:
        sys.path.remove(str(EXAMPLES))
    parser: argparse.ArgumentParser = module.build_parser()
    return parser


def parsers() -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """Every parser: mpidp's, each subcommand's, and each example's."""
    top = cli.build_parser()
    yield "mpidp", top
    for action in top._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield f"mpidp {name}", sub
    for name in ("train", "inference", "uneven_shards", "demo", "rebalance"):
        yield f"examples/{name}.py", example_parser(name)


PARSERS = dict(parsers())


@pytest.mark.parametrize("name", list(PARSERS))
def test_every_option_has_help_default_and_choices(name):
    parser = PARSERS[name]
    formatter = parser._get_formatter()
    text = parser.format_help()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if action.help == argparse.SUPPRESS:  # an old spelling kept hidden for a release
            assert any(
                a is not action and a.dest == action.dest and a.help != argparse.SUPPRESS
                for a in parser._actions
            ), f"{name} {action.option_strings}: hidden, and no shown option sets {action.dest}"
            continue
        flag = "/".join(action.option_strings) or action.dest
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                assert (choice.help or "").strip(), f"{name} {choice.dest}: no help"
            continue
        assert (action.help or "").strip(), f"{name} {flag}: no help text"
        shown = formatter._get_help_string(action) or ""
        if action.default not in (None, False, "", []) and action.option_strings:
            assert "default" in shown, f"{name} {flag}: its default is not shown"
        for choice in action.choices or ():
            assert str(choice) in text, f"{name} {flag}: choice {choice} is not listed"


@pytest.mark.parametrize("name", list(PARSERS))
def test_help_is_plain_text_with_a_whole_description(name):
    parser = PARSERS[name]
    text = parser.format_help()
    assert not MARKUP.search(text), f"{name} --help has reST markup: {MARKUP.search(text)}"
    description = (parser.description or "").strip()
    assert description, f"{name}: no description"
    assert description.endswith("."), f"{name}: the description stops mid-sentence"


def test_mpidp_help_lists_each_subcommand_on_one_line():
    """The real command, as a user runs it."""
    res = subprocess.run(
        [sys.executable, "-m", "mpidp", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stderr
    for name in ("info", "plan", "explain", "sample-data", "profile-report"):
        lines = [line for line in res.stdout.splitlines() if line.strip().startswith(name + " ")]
        assert lines, f"mpidp --help: no one-line entry for {name}"
    assert not MARKUP.search(res.stdout)


def test_train_flags_show_the_config_defaults():
    """train.py's flags default to None (a YAML file's value stands): each help names the
    Config field's default instead."""
    parser = PARSERS["examples/train.py"]
    for action in parser._actions:
        if action.option_strings and action.dest not in ("help", "config"):
            assert "(default: " in (action.help or ""), f"train.py {action.dest}: no default"
