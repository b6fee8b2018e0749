"""`tiderl --help` and each command's help: every command listed with what it does, and the names
a flag takes (environments, data sources, fetchable models) listed from the registries, so a new
entry shows up without an edit to the CLI."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

import pytest

from tiderl import cli, registry
from tiderl.envs import registration as environments
from tiderl.models.fetch import MODELS


def help_text(*argv: str) -> str:
    """What `tiderl <argv> --help` prints, on a wide terminal (no line breaks inside names)."""
    out = subprocess.run([sys.executable, "-m", "tiderl.cli", *argv, "--help"], capture_output=True, text=True,
                         env={**os.environ, "COLUMNS": "400"}, check=True)
    return out.stdout


def commands() -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in cli._parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_the_top_level_help_lists_every_command_with_what_it_does():
    text = help_text()
    names = list(commands())
    assert len(names) >= 12  # train, eval, ..., export: the commands cli.main dispatches
    for name in names:
        line = re.search(rf"^\s+{re.escape(name)}\s+(\S.*)$", text, re.M)
        assert line, f"`tiderl --help` does not list {name!r} with a description:\n{text}"
    listed = re.search(r"Commands: (.*)\.", text).group(1).split(", ")
    assert listed == names


@pytest.mark.parametrize("name", sorted(commands()))
def test_every_command_has_its_own_help(name):
    text = help_text(name)
    assert text.startswith(f"usage: tiderl {name}")


def test_check_env_and_eval_list_the_registered_environments_and_sources():
    check_env, ev = help_text("check-env"), help_text("eval")
    for name in registry.ENVIRONMENTS:
        assert re.search(rf"\b{name}\b", check_env.split("positional arguments")[1]), name
        assert re.search(rf"--env ENV .*\b{name}\b", ev), name
        for source in environments.builtin(name).sources:
            assert re.search(rf"--data {{[^}}]*\b{source}\b", ev), source


def test_models_lists_the_fetchable_models():
    text = help_text("models")
    for name in MODELS:
        assert name in text


def test_a_new_registry_entry_shows_up_in_the_help(monkeypatch):
    """The lists are read from the registries when the parser is built, not written in cli.py."""
    monkeypatch.setitem(registry.ENVIRONMENTS, "myenv", registry.ENVIRONMENTS[next(iter(registry.ENVIRONMENTS))])
    parser = commands()["check-env"]
    assert "myenv" in parser.format_help()
