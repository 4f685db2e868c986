"""Every `-h` names every value its options take: an option with a fixed set of values
(`one_of`, or an Enum / Literal type) names each of them in its own help, and refuses any
other value naming them all."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import typer.main

from hps.tools.cli import app
from tests.tools.test_cli import hps


def _options(command: Any, path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], Any]]:
    for name, sub in sorted(getattr(command, "commands", {}).items()):
        yield from _options(sub, (*path, name))
    for param in command.params:
        yield path, param


def _choices(param: Any) -> tuple[str, ...]:
    """The values `param` takes when they are a fixed set, else ()."""
    checked = getattr(param.callback, "choices", None)  # choices.one_of's
    if checked is not None:
        return checked()
    descriptor = getattr(param, "type_descriptor", None)  # typer's Enum / Literal options
    if descriptor is not None and getattr(descriptor, "is_choice", False):
        return tuple(str(getattr(c, "value", c)) for c in descriptor.choices)
    return tuple(getattr(getattr(param, "type", None), "choices", ()) or ())


ALL = [(path, param) for path, param in _options(typer.main.get_command(app), ("hps",))
       if _choices(param)]


def test_the_options_with_fixed_values_are_found() -> None:
    found = {(" ".join(path), param.opts[0]) for path, param in ALL}
    assert {("hps bench gpu", "--profile"), ("hps bench http", "--load-client"),
            ("hps bench load", "--format"), ("hps bench torch", "--device"),
            ("hps inspect", "--format"), ("hps convert", "--format"), ("hps convert", "--to"),
            ("hps validate", "--format"), ("hps models keys", "--kind")} <= found


@pytest.mark.parametrize(("path", "param"), ALL,
                         ids=[f"{' '.join(p)} {q.opts[0]}" for p, q in ALL])
def test_each_value_is_named_in_the_options_help(path: tuple[str, ...], param: Any) -> None:
    text = " ".join((param.help or "").split())
    missing = [c for c in _choices(param) if not re.search(rf"(?<![\w.]){re.escape(c)}\b", text)]
    assert not missing, f"{' '.join(path)} {param.opts[0]} takes {missing}, its help names none"


def test_a_value_outside_the_set_is_refused_naming_them_all() -> None:
    refused = hps("bench", "gpu", "--profile", "threads", "--profile", "thread")
    assert refused.returncode == 2
    text = " ".join(refused.stderr.split())
    assert "'thread' is not one of kernels, public, threads, hugectr" in text
