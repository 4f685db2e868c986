"""Options that take one of a fixed set of values.

`one_of(values)` is such an option's callback: it refuses any other value (each value of
a repeatable option too) with the option's name and every value it takes, and it carries
`choices`, the values themselves, from which tests/tools/test_cli_help.py checks that the
option's help names every one of them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import typer


def one_of(values: Iterable[str]) -> Callable[[Any], Any]:
    """A typer option callback accepting only `values` (None: the option left out)."""
    choices = tuple(values)

    def check(value: Any) -> Any:
        for one in value if isinstance(value, (list, tuple)) else [value]:
            if one is not None and one not in choices:
                raise typer.BadParameter(f"{one!r} is not one of {', '.join(choices)}")
        return value

    check.choices = choices  # type: ignore[attr-defined]
    return check
