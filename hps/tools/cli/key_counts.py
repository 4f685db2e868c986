"""The one reading of a key count on the command line: `100000`, `100k`, `1M`, `2_000_000`,
`1.5M`; a comma list for the options that take several (`1,256,16k`).

Every option of `hps bench` that counts keys, rows or slots is read by `count_option` (one
number) or `counts_option` (a comma list), so `--keys 100k` means the same to every command; a
bad value is refused before anything runs, with an example of what works.
"""

from __future__ import annotations

from typing import Any

import typer

_SCALES = {"k": 1_000, "m": 1_000_000, "g": 1_000_000_000}
EXAMPLES = "e.g. 100000, 100k, 1M, 2_000_000"


def parse_count(text: str) -> int:
    """'100k' / '1M' / '2_000_000' / '1.5M' → a positive whole count; ValueError else."""
    part = text.strip().lower().replace("_", "")
    scale = _SCALES.get(part[-1:], 1)
    number = part[:-1] if scale > 1 else part
    try:
        value = float(number) * scale
    except ValueError:
        raise ValueError(f"not a key count: {text!r} ({EXAMPLES})") from None
    if not (1 <= value < float("inf")) or value != int(value):
        raise ValueError(f"not a key count: {text!r} ({EXAMPLES})")
    return int(value)


def parse_counts(text: str) -> list[int]:
    """A comma list of counts ('1,256,16k' / '1M,10M'); ValueError for an empty list or a
    part that is not a count."""
    parts = [p for p in text.split(",") if p.strip()]
    if not parts:
        raise ValueError(f"expected key counts, comma-separated ({EXAMPLES}), got {text!r}")
    return [parse_count(p) for p in parts]


def count_option(text: Any) -> int:
    """The parser of a one-count option (typer.Option(..., parser=count_option)): click's
    one-line usage error, naming the option, for anything that is not a count."""
    if isinstance(text, int):
        return text
    try:
        return parse_count(str(text))
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


def counts_option(text: Any) -> list[int]:
    """The parser of a comma-list option (typer.Option(..., parser=counts_option))."""
    if isinstance(text, list):
        return text
    try:
        return parse_counts(str(text))
    except ValueError as exc:
        raise typer.BadParameter(f"takes positive key counts, comma-separated: {exc}") from None
