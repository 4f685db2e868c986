"""Options that take one of a fixed set of values.

`one_of(values)` is such an option's callback: it refuses any other value (each value of
a repeatable option too) with the option's name and every value it takes, and it carries
`choices()`, the values themselves, from which tests/tools/test_cli_help.py checks that
the option's help names every one of them. `values` may be a function returning them:
`values_of(module, name)` reads them from a module the command imports only when it
runs, at the first check (`hps -h` and `hps --version` import none of those modules).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Iterable
from typing import Any

import typer


def one_of(values: Iterable[str] | Callable[[], Iterable[str]]) -> Callable[[Any], Any]:
    """A typer option callback accepting only `values`, or what `values()` returns when
    the first value is checked (None: the option left out)."""
    listed = None if callable(values) else tuple(values)  # an iterator is read once, now

    @functools.cache
    def choices() -> tuple[str, ...]:
        return listed if listed is not None else tuple(values())  # type: ignore[operator]

    def check(value: Any) -> Any:
        for one in value if isinstance(value, (list, tuple)) else [value]:
            if one is not None and one not in choices():
                raise typer.BadParameter(f"{one!r} is not one of {', '.join(choices())}")
        return value

    check.choices = choices  # type: ignore[attr-defined]
    return check


def values_of(module: str, *names: str) -> Callable[[], tuple[str, ...]]:
    """A function returning the values `names` hold in `module` (each a string or a
    collection of them), in that order; the module is imported when it is called."""

    def values() -> tuple[str, ...]:
        found = importlib.import_module(module)
        out: list[str] = []
        for name in names:
            value = getattr(found, name)
            out.extend([value] if isinstance(value, str) else value)
        return tuple(out)

    return values
