"""Strict booleans and numbers for pydantic models read from JSON or YAML.

pydantic's lax mode reads "yes" as true, "256" as 256 and 1 as true; in a config file a
quoted number or a number for a flag is a mistake more often than not, so
`check_strict(annotation, value)` (a before-validator's body) refuses them with the fix
named. Integers stay accepted for floats; `X | None` and `list[X]` are checked as X.
`StrictSection` is the base of every config section (hps.config and the sections that
live beside the code they configure).
"""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

_SCALARS = (bool, int, float)
_NAMES = {bool: "true or false", int: "an integer", float: "a number"}


def scalar_kind(annotation: Any) -> tuple[type | None, bool]:
    """(bool, int or float, whether in a list) of a field's type; (None, False) for others."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if annotation in _SCALARS:
        return annotation, False
    origin = typing.get_origin(annotation)
    if origin is list and len(args) == 1 and args[0] in _SCALARS:
        return args[0], True
    if origin in (typing.Union, types.UnionType) and len(args) == 1 and args[0] in _SCALARS:
        return args[0], False
    return None, False


def check_strict(annotation: Any, value: Any) -> None:
    """ValueError when `value` has the wrong JSON type for a field of `annotation`: a
    string for a boolean or a number, a number for a boolean, a boolean for a number."""
    kind, is_list = scalar_kind(annotation)
    if kind is None:
        return
    if is_list and isinstance(value, (list, tuple)):
        for i, entry in enumerate(value):
            _check(entry, kind, f"entry [{i}] ")
    elif not is_list:
        _check(value, kind, "")


def _check(value: Any, kind: type, where: str) -> None:
    wrong = isinstance(value, str) or (
        isinstance(value, bool) != (kind is bool) and isinstance(value, (bool, int, float)))
    if not wrong:
        return
    fix = ""
    if isinstance(value, str):
        example = "true or false" if kind is bool else value.strip()
        try:
            float(example)
        except ValueError:
            example = _NAMES[kind]
        fix = f" (a string: write {example} without quotes)"
    raise ValueError(f"{where}must be {_NAMES[kind]}, got {value!r}{fix}")


class StrictSection(BaseModel):
    """A config section: unknown keys ignored (hps.config warns about them), scalars strict."""

    model_config = ConfigDict(extra="ignore", validate_assignment=True, frozen=False)

    @field_validator("*", mode="before")
    @classmethod
    def _strict_scalars(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic's lax mode reads "yes" as true and "256" as 256: a quoted value in a
        # config is a mistake more often than not, so it is refused with the fix named
        if info.field_name is not None:
            check_strict(cls.model_fields[info.field_name].annotation, value)
        return value
