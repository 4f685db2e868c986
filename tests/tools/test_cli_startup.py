"""The `hps` command starts without importing what its commands use: `hps --version`,
`hps -h` and each group's `-h` import none of NumPy, numba, the tiers, the server or the
HTTP stack (each command imports those when it runs)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_public_api import heavy_in

_RUN = """
import json, sys
sys.argv = ["hps", *json.loads(sys.argv[1])]
from hps.tools.cli import main
try:
    main()
except SystemExit as exc:
    code = exc.code
else:
    code = 0
with open({out!r}, "w") as f:
    json.dump({{"code": code, "modules": list(sys.modules)}}, f)
"""


def _run_hps(tmp_path: Path, *args: str) -> tuple[object, set[str], str]:
    """Run `hps args` in a fresh interpreter: its exit code, the modules it imported by
    then, its stdout."""
    out = tmp_path / "modules.json"
    ran = subprocess.run([sys.executable, "-c", _RUN.format(out=str(out)), json.dumps(args)],
                         capture_output=True, text=True, timeout=120)
    found = json.loads(out.read_text())
    return found["code"], set(found["modules"]), ran.stdout


@pytest.mark.parametrize("args", [("--version",), ("-h",), ("bench", "-h"), ("models", "-h"),
                                  ("serve", "-h"), ("convert", "-h"), ("demo", "-h")])
def test_the_command_starts_without_the_heavy_modules(tmp_path: Path, args: tuple[str, ...]
                                                      ) -> None:
    code, modules, stdout = _run_hps(tmp_path, *args)
    assert code in (0, None)
    # typer (0.29) checks a command's option values through pydantic: the one heavy
    # import past `hps -h`, and typer's, not ours
    assert [m for m in heavy_in(modules) if m.partition(".")[0] != "pydantic"] == []
    if len(args) == 1:
        assert heavy_in(modules) == []
    assert stdout.strip()


def test_a_lazy_choice_is_still_checked(tmp_path: Path) -> None:
    """`hps convert --to` takes the formats hps.modelfiles.convert lists, read when the
    option is checked: a value outside them is refused, naming them."""
    code, modules, _ = _run_hps(tmp_path, "convert", "a", "b", "--to", "csv")
    assert code == 2
    assert "hps.modelfiles.convert" in modules


def test_version_alone_is_printed_before_typer_is_imported(tmp_path: Path) -> None:
    code, modules, stdout = _run_hps(tmp_path, "--version")
    assert code in (0, None) and stdout == "hps 0.1.0 (distribution hps-server)\n"
    assert not [m for m in modules if m.partition(".")[0] in ("typer", "click", "rich")]
    # beside other options, typer reads it: the same line
    code, modules, stdout = _run_hps(tmp_path, "-v", "--version")
    assert code in (0, None) and stdout == "hps 0.1.0 (distribution hps-server)\n"
    assert "typer" in modules
