"""`scripts/test.sh -h` prints the script's own usage before it installs anything."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: what the script would install or create with, each replaced by a stand-in that
#: records being called
INSTALLERS = ("apt-get", "sudo", "python3", "service")


@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_help_installs_nothing(flag: str, tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "cat", "dirname"):  # what printing the usage may use
        found = shutil.which(tool)
        assert found is not None
        os.symlink(found, bin_dir / tool)
    calls = tmp_path / "calls"
    for tool in INSTALLERS:
        shim = bin_dir / tool
        shim.write_text(f"#!/bin/sh\necho {tool} >> {calls}\n")
        shim.chmod(0o755)
    venv = tmp_path / "venv"
    done = subprocess.run([str(bin_dir / "bash"), str(ROOT / "scripts" / "test.sh"), flag],
                          capture_output=True, text=True, timeout=60,
                          env={"PATH": str(bin_dir), "HPS_VENV": str(venv)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: bash scripts/test.sh")
    assert "redis-server" in done.stdout and "pytest" in done.stdout  # what it does
    assert not calls.exists(), calls.read_text()
    assert not venv.exists()

