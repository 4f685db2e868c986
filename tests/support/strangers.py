"""Another user of the host, for the checks that refuse what is not this user's (the
shared-memory files: hps/runtime/shm_files.py): `nobody` (uid 65534, on every Linux),
made the owner of a path with lchown, or the user of a child process with setuid. Both
need root, as CI and the test machines run; a checkout run by another user fails these
tests with a line saying so rather than skipping them."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

NOBODY = 65534


@dataclass(frozen=True)
class Stranger:
    """A user other than this process's."""

    uid: int = NOBODY

    def owns(self, path: Path) -> None:
        """Gives `path` itself (a link, not what it names) to this user."""
        os.lchown(path, self.uid, self.uid)

    def chown_line(self, variable: str) -> str:
        """A line of Python that gives the path in `variable` to this user."""
        return f"os.lchown({variable}, {self.uid}, {self.uid})"

    def process(self) -> subprocess.Popen[bytes]:
        """A process of this user's that sleeps (`sleep`: this user may not run a Python
        of root's home)."""
        return subprocess.Popen(["sleep", "600"], user=self.uid, group=self.uid)


@pytest.fixture()
def stranger() -> Stranger:
    assert os.geteuid() == 0, ("these tests make files and processes of another user "
                               "(lchown, setuid): run them as root")
    return Stranger()
