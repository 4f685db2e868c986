"""Writes docs/cli.md, the reference of the `hps` command, from the commands' own help.

    python scripts/cli_reference.py            # rewrites docs/cli.md
    python scripts/cli_reference.py --check    # exit status 1 when docs/cli.md is not current

The page holds every command's and subcommand's help (usage, text, arguments, options,
subcommands) in the command tree's own order, as `hps COMMAND -h` prints it. The help is
laid out by click's plain formatter at a fixed width, without colour and never through
rich, so the page is the same whatever the terminal: tests/test_docs_site.py renders it
in memory and compares it with the file.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import typer

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "cli.md"
#: columns of the help text: the 80-column terminal the command's output is made for,
#: less the two that click's formatter keeps free at the right
WIDTH = 78

HEADER = """\
# The `hps` command

<!-- Written by scripts/cli_reference.py from the commands' own help; do not edit it by
hand: run `python scripts/cli_reference.py` after changing a command. -->

Every command and subcommand of `hps`, with the help it prints (`hps COMMAND -h`).
`python -m hps.tools.cli` runs the same command where the `hps` entry point is not
installed. Log records and Python warnings go to stderr in one format; `-v` adds progress
records. `hps load`, `hps lookup`, `hps serve`, `hps demo`, `hps convert` and `hps publish`
show each table's load as a progress bar on a terminal (keys so far of all, keys/s, time
left) and as a line every 2 s where stderr is no terminal (a pipe, a file, CI's log); a
first run on a machine says that it compiles (a read from numba's cache is no compile).
The other steps that can take seconds show the same way, each once it has run 2 s, with a
count and unit of its own: the warm-up of a version's lookup paths before it serves
(`warming the lookup paths of model demo: 12 of 32 lookups run (38%), 4 s so far`), a GPU
cache filled from the files (`keys in the cache`), `hps serve --workers N`'s workers
starting (`starting 2 workers: 1 of 2 workers ready (50%), 6 s so far`) and one started
again after it died (then `worker 1 is back: ready 2.5 s after it was started again`),
and `hps demo` writing its model and reading its files back to check the lookups. A
count that has not moved yet says `none of N … yet` and the seconds so far, never
"0 of N (0%)". `hps demo` reports the load time, the lookup rate, the memory it took and
whether every vector matched the model files.

Where the commands fit: [HTTP and KServe v2](http.md) for `hps serve` and `hps models`,
[Model files](model-files.md) for `hps inspect` and `hps convert`, [Online
updates](updates.md) for `hps publish`, [Benchmarks](benchmarks.md) for `hps bench`.
"""


def walk(command: Any, ctx: Any) -> Iterator[tuple[Any, Any]]:
    """(context, command) for `command` and every visible subcommand below it, depth
    first, in the order the group lists them."""
    yield ctx, command
    list_commands = getattr(command, "list_commands", None)
    if list_commands is None:
        return
    for name in list_commands(ctx):
        sub = command.get_command(ctx, name)
        if sub is None or sub.hidden:
            continue
        yield from walk(sub, sub.context_class(sub, info_name=name, parent=ctx,
                                               **sub.context_settings))


def help_text(command: Any, ctx: Any) -> str:
    """What `-h` prints for `command`, laid out by click's plain formatter.

    The steps of click's own `Command.format_help`, called one by one: typer's
    `format_help` would hand the whole help to rich when its markup mode is on, and rich
    lays it out for the terminal it finds.
    """
    formatter = ctx.make_formatter()
    command.format_usage(ctx, formatter)
    command.format_help_text(ctx, formatter)
    command.format_options(ctx, formatter)
    command.format_epilog(ctx, formatter)
    return "\n".join(line.rstrip() for line in formatter.getvalue().splitlines()).strip("\n")


def render() -> str:
    """The page: the header, then one section per command."""
    from hps.tools.cli import app

    root = typer.main.get_command(app)
    # the settings the command itself gives its context (-h beside --help), then the
    # fixed width; subcommands' contexts take the width and colour from their parent's
    ctx = root.context_class(root, info_name="hps", **{
        **root.context_settings, "terminal_width": WIDTH, "max_content_width": WIDTH,
        "color": False})
    sections = [HEADER]
    for sub_ctx, command in walk(root, ctx):
        # `hps` and its commands at one level, the subcommands of a group under theirs
        heading = "##" if len(sub_ctx.command_path.split()) <= 2 else "###"
        sections.append(f"{heading} `{sub_ctx.command_path}`\n\n"
                        f"```text\n{help_text(command, sub_ctx)}\n```\n")
    return "\n".join(sections)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="only compare: exit status 1 when docs/cli.md is not current")
    args = parser.parse_args()
    page = render()
    current = PAGE.read_text(encoding="utf-8") if PAGE.exists() else ""
    if args.check:
        if page != current:
            print(f"{PAGE.relative_to(ROOT)} is not current: run python scripts/cli_reference.py",
                  file=sys.stderr)
            return 1
        return 0
    if page != current:
        PAGE.write_text(page, encoding="utf-8")
        print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
