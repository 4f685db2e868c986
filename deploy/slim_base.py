"""Slim the base image's own files in the runtime stage of deploy/Dockerfile.cpu. The
final image copies that stage's whole file system into one layer (FROM scratch), so what
goes here is not in the image at all (a later layer's deletion would still be shipped).

    python3 slim_base.py [ROOT]      # as root, in the runtime stage; ROOT defaults to /

The standard library is the one of the Python that runs this script (Debian's
/usr/lib/python3.11, or python:3.11-slim's /usr/local/lib/python3.11), found under ROOT.

What goes, and why it is safe:
- parts of the standard library that a server never runs: its regression tests (test/ and
  the extension modules only they load, such as _testcapi), the 2to3 translator (lib2to3),
  help()'s topic texts (pydoc_data; pydoc itself stays), ensurepip with the pip and
  setuptools wheels it installs (python:3.11-slim keeps them inside it, Debian in
  /usr/share/python-wheels; the image has no installer), and IDLE, tkinter and turtle (the
  image has no Tk); the interpreter's C headers (only a compiler reads them;
  python:3.11-slim ships them);
- the standard library's bytecode: Debian compiles every module when it installs Python,
  most of which a server never imports. deploy/smoke_check.py, which the runtime stage
  runs next as root, writes back the bytecode of the modules the image runs, so the
  server starts as fast as before; the rest compiles in memory if ever imported;
- what building the base left behind: dpkg's and debconf's backups (*-old), log files
  under /var/log, apt's package caches and downloaded index files.
Package management stays: dpkg, apt and their state in /var/lib/dpkg (images built on
this one can install Debian packages, and image scanners read the package list there).

Prints the bytes each step freed; exit status 0, 1 with the error when a step fails, 2
for a usage error.
"""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

from slim_files import drop_bytecode, remove

#: globs, relative to the standard library, of what no server runs: the regression tests
#: and the extension modules only they load (and CPython's example modules, xxlimited)
UNRUN_STDLIB = ("test", "lib-dynload/_test*", "lib-dynload/_ctypes_test.*",
                "lib-dynload/_xxtestfuzz.*", "lib-dynload/xxlimited*", "lib2to3",
                "pydoc_data", "ensurepip", "idlelib", "tkinter", "turtledemo", "turtle.py")
#: Debian's copies of the wheels ensurepip installs (python3-pip-whl, python3-setuptools-whl)
ENSUREPIP_WHEELS = "usr/share/python-wheels"
#: globs, relative to ROOT, of the base build's backups, logs and package caches
BUILD_LEFTOVERS = ("var/lib/dpkg/*-old", "var/cache/debconf/*-old", "var/log/*.log",
                   "var/log/apt/*.log", "var/cache/apt/*.bin", "var/cache/apt/archives/*.deb",
                   "var/lib/apt/lists/*_*")


def _under(root: Path, path: str) -> Path:
    """An absolute path of the running system, taken under ROOT."""
    return root / Path(path).relative_to("/")


def stdlib(root: Path) -> Path:
    found = _under(root, sysconfig.get_paths()["stdlib"])
    if not (found / "os.py").is_file():
        raise SystemExit(f"{found}: no standard library there (no os.py)")
    return found


def drop_unrun_stdlib(root: Path, lib: Path) -> int:
    headers = _under(root, sysconfig.get_paths()["include"])
    return remove([p for pattern in UNRUN_STDLIB for p in lib.glob(pattern)]
                  + [root / ENSUREPIP_WHEELS, headers])


def drop_build_leftovers(root: Path) -> int:
    return remove([p for pattern in BUILD_LEFTOVERS for p in root.glob(pattern)
                   if p.is_file()])


def main(argv: list[str]) -> int:
    if len(argv) > 2:
        print("usage: python3 slim_base.py [ROOT]", file=sys.stderr)
        return 2
    root = Path(argv[1] if len(argv) == 2 else "/")
    lib = stdlib(root)
    mb = 1e6
    try:
        print("standard library parts no server runs, ensurepip's wheels, C headers: "
              f"{drop_unrun_stdlib(root, lib) / mb:.1f} MB")
        print(f"bytecode of the standard library: {drop_bytecode(lib) / mb:.1f} MB")
        print(f"backups, logs and package caches of the base's build: "
              f"{drop_build_leftovers(root) / mb:.1f} MB")
    except OSError as exc:
        print(f"slim_base: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
