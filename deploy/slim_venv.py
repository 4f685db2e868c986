"""Slim an installed virtual environment for a runtime image (the build stage of
deploy/Dockerfile.cpu), keeping every feature the image serves.

    python slim_venv.py /opt/hps      # needs binutils' strip and readelf on PATH

What goes, and why it is safe:
- the dependencies' test suites (`tests` folders, numpy's SIMD test module and its test
  extension modules such as _multiarray_tests: only the test suites import them) and
  build-time files: type stubs (.pyi), static libraries (.a), C and C++ headers and
  sources, Cython sources (.pyx, .pxd);
- parts of dependencies that cannot run in a CPU image without a compiler: numba's CUDA
  target (numba/cuda, loaded only for target="cuda"; hps's GPU cache is CuPy, in the GPU
  image), numpy's f2py (it generates C extensions for a compiler to build) and
  numpy.distutils (it builds C and Fortran extensions; imported only by setup scripts);
- Swagger UI's files that the `/docs` page does not load (hps/http/docs_page.py serves
  three of swagger-ui-bundle's folder: its other bundles, source maps and own pages are
  ~7 MB that no route answers; the smoke check fetches the three through the server);
- botocore's models of every AWS service but those the S3 path uses: s3, and sts, sso,
  sso-oidc and signin, which botocore's credential chain builds clients for (assume-role,
  web identity, SSO, login profiles); its shared files (endpoints, partitions, retry
  and default configurations) stay. Likewise boto3's resource models (boto3.resource)
  of every service but s3: hps and deploy/upload_model.py use clients only;
- the debug symbols of shared libraries (`strip --strip-unneeded`): llvmlite's LLVM, uvloop,
  RocksDB, hiredis and the other extension modules. Libraries that auditwheel repaired
  stay as they are: those in a wheel's `.libs` folder and those with an RPATH/RUNPATH,
  which patchelf rewrote; strip re-lays their sections and has broken them (numpy's
  OpenBLAS);
- every `__pycache__`: pip compiles all modules, most of which a server never imports.
  The image's runtime stage then runs deploy/smoke_check.py as root, whose imports write
  bytecode for the modules the image runs; the rest compiles in memory if ever imported.

Prints the bytes each step freed; exit status 0, or 1 with the error when a step fails.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from slim_files import drop_bytecode, remove

BUILD_ONLY_SUFFIXES = (".pyi", ".a", ".h", ".hpp", ".c", ".cpp", ".pyx", ".pxd")
#: globs under site-packages (and bin/) that nothing in a CPU image without a compiler runs
UNSERVED = ("numba/cuda", "numpy/f2py", "numpy/distutils")
#: globs under site-packages of test modules outside `tests` folders
TEST_MODULES = ("numpy/_core/_simd.*", "numpy/_core/_*_tests.*")
UNSERVED_SCRIPTS = ("f2py",)
#: the Swagger UI files hps/http/docs_page.py serves (its ASSETS), kept in their folder
SWAGGER_UI_ASSETS = frozenset({"swagger-ui-bundle.js", "swagger-ui.css", "favicon-32x32.png"})
#: botocore service models kept: s3 itself, and the services of the credential chain
BOTOCORE_SERVICES = frozenset({"s3", "sts", "sso", "sso-oidc", "signin"})
#: boto3 resource models kept (boto3.resource("s3")); hps itself builds clients only
BOTO3_RESOURCES = frozenset({"s3"})
ELF_MAGIC = b"\x7fELF"


def site_packages(venv: Path) -> Path:
    found = sorted(venv.glob("lib/python3*/site-packages"))
    if len(found) != 1:
        raise SystemExit(f"{venv}: expected one lib/python3*/site-packages, found {found}")
    return found[0]


def drop_tests_and_build_files(site: Path) -> int:
    tests = [p for p in site.rglob("tests") if p.is_dir()]
    tests += [p for pattern in TEST_MODULES for p in site.glob(pattern)]
    build_files = [p for p in site.rglob("*") if p.suffix in BUILD_ONLY_SUFFIXES
                   and p.is_file()]
    return remove(tests) + remove(build_files)


def drop_unserved(venv: Path, site: Path) -> int:
    paths = [p for pattern in UNSERVED for p in site.glob(pattern)]
    return remove(paths + [venv / "bin" / name for name in UNSERVED_SCRIPTS])


def drop_unserved_swagger_ui(site: Path) -> int:
    """swagger-ui-bundle's files but those the /docs page loads."""
    folders = [p for p in site.glob("swagger_ui_bundle/vendor/swagger-ui-*") if p.is_dir()]
    return remove([p for folder in folders for p in folder.iterdir()
                   if p.name not in SWAGGER_UI_ASSETS])


def _drop_services(data: Path, kept: frozenset[str]) -> int:
    if not data.is_dir():
        return 0
    return remove([p for p in data.iterdir() if p.is_dir() and p.name not in kept])


def drop_aws_models(site: Path) -> int:
    """botocore's service models and boto3's resource models of services hps never calls."""
    return (_drop_services(site / "botocore" / "data", BOTOCORE_SERVICES)
            + _drop_services(site / "boto3" / "data", BOTO3_RESOURCES))


def _shared_libraries(site: Path) -> Iterator[Path]:
    for path in site.rglob("*.so*"):
        if path.is_file() and not path.is_symlink():
            with path.open("rb") as f:
                if f.read(4) == ELF_MAGIC:
                    yield path


def _repaired_by_auditwheel(path: Path) -> bool:
    if any(part.endswith(".libs") for part in path.parts):
        return True
    dynamic = subprocess.run(["readelf", "-d", str(path)], check=True, capture_output=True,
                             text=True).stdout
    return "(RPATH)" in dynamic or "(RUNPATH)" in dynamic


def strip_shared_libraries(site: Path) -> tuple[int, list[Path]]:
    """Strip every shared library but those auditwheel repaired; returns (freed, kept)."""
    freed, kept = 0, []
    for path in _shared_libraries(site):
        if _repaired_by_auditwheel(path):
            kept.append(path)
            continue
        before = path.stat().st_size
        subprocess.run(["strip", "--strip-unneeded", str(path)], check=True)
        freed += before - path.stat().st_size
    return freed, kept


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python slim_venv.py VENV", file=sys.stderr)
        return 2
    venv = Path(argv[1])
    site = site_packages(venv)
    mb = 1e6
    try:
        print(f"tests and build-time files: {drop_tests_and_build_files(site) / mb:.1f} MB")
        print("numba's CUDA target, f2py, numpy.distutils: "
              f"{drop_unserved(venv, site) / mb:.1f} MB")
        print("Swagger UI files the /docs page does not load: "
              f"{drop_unserved_swagger_ui(site) / mb:.1f} MB")
        print(f"AWS models of unused services: {drop_aws_models(site) / mb:.1f} MB")
        freed, kept = strip_shared_libraries(site)
        print(f"debug symbols of shared libraries: {freed / mb:.1f} MB "
              f"({len(kept)} repaired by auditwheel left as they are)")
        print(f"bytecode of every module: {drop_bytecode(venv) / mb:.1f} MB")
    except (OSError, subprocess.CalledProcessError) as exc:
        print(f"slim_venv: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
