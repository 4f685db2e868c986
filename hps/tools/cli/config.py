"""`hps config dump`: the ps.json a config amounts to, from ps.json, YAML, or a Python file
that builds HugeCTR's config objects (run as a module that is not __main__)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from hps.errors import HPSError
from hps.tools.cli.root import fail

config_app = typer.Typer(help="Configuration: ps.json, YAML, HugeCTR's Python objects.",
                         no_args_is_help=True)


@config_app.command("dump")
def config_dump(
    source: str = typer.Argument(
        ..., help="ps.json or YAML, or a Python file that builds a ParameterServerConfig "
                  "(FILE.py, or FILE.py:NAME to pick the variable)."),
    defaults: bool = typer.Option(False, "--defaults", help="Also print keys at their default."),
) -> None:
    """Print the ps.json equivalent to a config (validated; HugeCTR objects converted)."""
    from hps.hugectr.params import dump_json

    try:
        config: Any = _config_from_script(source) if _is_script(source) else source
        raw = dump_json(config, defaults=defaults)
    except HPSError as exc:
        fail(exc)
    print(json.dumps(raw, indent=2))


def _is_script(source: str) -> bool:
    return source.rpartition(":")[0].endswith(".py") or source.endswith(".py")


def _config_from_script(source: str) -> Any:
    """The config object a Python file builds: the variable NAME, or its only config.

    The file runs as a module that is not __main__ (its `if __name__ == "__main__":`
    block does not run), as `python -c "import file"` would run it.
    """
    import runpy

    from hps.config import PSConfig
    from hps.errors import ConfigError
    from hps.hugectr.params import ParameterServerConfig

    path, _, name = source.partition(".py:")
    path = path if not name else path + ".py"
    if not Path(path).is_file():
        raise ConfigError(f"{path!r} is not a file")
    found = {key: value for key, value in runpy.run_path(path).items()
             if isinstance(value, (ParameterServerConfig, PSConfig))}
    if name:
        if name not in found:
            raise ConfigError(f"{path} defines no config named {name!r} "
                              f"(configs: {', '.join(sorted(found)) or 'none'})")
        return found[name]
    if len(found) != 1:
        raise ConfigError(f"{path} defines {len(found)} configs "
                          f"({', '.join(sorted(found)) or 'none'}): pick one with {path}:NAME")
    return next(iter(found.values()))
