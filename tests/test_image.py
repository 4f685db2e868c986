"""The CPU image's build steps, run natively: deploy/slim_venv.py on a small environment
made of real files (real extension modules, stripped by binutils and loaded again),
deploy/slim_base.py on a small base image's tree, and
deploy/smoke_check.py against this checkout (what the image build runs after slimming).
scripts/compose_check.sh builds the image itself."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy

ROOT = Path(__file__).resolve().parents[1]
SLIM = ROOT / "deploy" / "slim_venv.py"
SLIM_BASE = ROOT / "deploy" / "slim_base.py"
SMOKE = ROOT / "deploy" / "smoke_check.py"
SITE = Path(numpy.__file__).parents[1]  # this venv's site-packages
# an extension module with debug symbols and no RPATH, and one that auditwheel repaired
PLAIN_EXT = next((SITE / "hiredis").glob("hiredis.cpython-*.so"))
REPAIRED_EXT = next((SITE / "numpy" / "linalg").glob("lapack_lite.cpython-*.so"))


def _tree(venv: Path) -> Path:
    site = venv / "lib" / "python3.11" / "site-packages"
    files = {
        "pkg/__init__.py": "X = 1\n",
        "pkg/__init__.pyi": "X: int\n",
        "pkg/__pycache__/__init__.cpython-311.pyc": "stale",
        "pkg/include/pkg.h": "int x;\n",
        "pkg/tests/test_pkg.py": "def test(): pass\n",
        "botocore/data/endpoints.json": "{}",
        "botocore/data/s3/2006-03-01/service-2.json.gz": "s3",
        "botocore/data/sts/2011-06-15/service-2.json.gz": "sts",
        "botocore/data/ec2/2016-11-15/service-2.json.gz": "ec2",
        "boto3/data/s3/2006-03-01/resources-1.json": "{}",
        "boto3/data/ec2/2016-11-15/resources-1.json": "{}",
        "swagger_ui_bundle/__init__.py": "",
        "swagger_ui_bundle/vendor/swagger-ui-4.15.5/swagger-ui-bundle.js": "js",
        "swagger_ui_bundle/vendor/swagger-ui-4.15.5/swagger-ui.css": "css",
        "swagger_ui_bundle/vendor/swagger-ui-4.15.5/favicon-32x32.png": "png",
        "swagger_ui_bundle/vendor/swagger-ui-4.15.5/swagger-ui-bundle.js.map": "map",
        "swagger_ui_bundle/vendor/swagger-ui-4.15.5/swagger-ui-es-bundle.js": "js",
        "swagger_ui_bundle/vendor/swagger-ui-4.15.5/index.html": "html",
        "numba/cuda/__init__.py": "",
        "numba/core/__init__.py": "",
        "numpy/f2py/__init__.py": "",
        "numpy/distutils/__init__.py": "",
        "numpy/_core/_multiarray_tests.cpython-311-x86_64-linux-gnu.so": "test module",
        "numpy/_core/_multiarray_umath.cpython-311-x86_64-linux-gnu.so": "numpy",
    }
    for rel, text in files.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text(text)
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "f2py").write_text("#!/bin/sh\n")
    (site / "hiredis").mkdir()
    shutil.copy2(PLAIN_EXT, site / "hiredis" / PLAIN_EXT.name)
    (site / "numpy" / "linalg").mkdir(parents=True)
    shutil.copy2(REPAIRED_EXT, site / "numpy" / "linalg" / REPAIRED_EXT.name)
    (site / "numpy.libs").mkdir()
    shutil.copy2(PLAIN_EXT, site / "numpy.libs" / "libgrafted.so")
    return site


def _symbols(path: Path) -> bool:
    sections = subprocess.run(["readelf", "-S", str(path)], check=True, capture_output=True,
                              text=True).stdout
    return ".symtab" in sections


def test_slim_venv_keeps_what_runs_and_drops_the_rest(tmp_path):
    venv = tmp_path / "venv"
    site = _tree(venv)
    assert _symbols(PLAIN_EXT)

    done = subprocess.run([sys.executable, str(SLIM), str(venv)], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    assert "debug symbols of shared libraries" in done.stdout

    kept = sorted(p.relative_to(site).as_posix() for p in site.rglob("*") if p.is_file())
    assert kept == sorted([
        "pkg/__init__.py",
        "botocore/data/endpoints.json",
        "botocore/data/s3/2006-03-01/service-2.json.gz",
        "botocore/data/sts/2011-06-15/service-2.json.gz",
        "boto3/data/s3/2006-03-01/resources-1.json",
        "swagger_ui_bundle/__init__.py",
        "swagger_ui_bundle/vendor/swagger-ui-4.15.5/swagger-ui-bundle.js",
        "swagger_ui_bundle/vendor/swagger-ui-4.15.5/swagger-ui.css",
        "swagger_ui_bundle/vendor/swagger-ui-4.15.5/favicon-32x32.png",
        "numba/core/__init__.py",
        "numpy/_core/_multiarray_umath.cpython-311-x86_64-linux-gnu.so",
        f"hiredis/{PLAIN_EXT.name}",
        f"numpy/linalg/{REPAIRED_EXT.name}",
        "numpy.libs/libgrafted.so",
    ])
    assert not (venv / "bin" / "f2py").exists()
    stripped = site / "hiredis" / PLAIN_EXT.name
    assert not _symbols(stripped)
    assert stripped.stat().st_size < PLAIN_EXT.stat().st_size
    # auditwheel's libraries are left byte for byte
    assert (site / "numpy" / "linalg" / REPAIRED_EXT.name).read_bytes() == \
        REPAIRED_EXT.read_bytes()
    assert (site / "numpy.libs" / "libgrafted.so").read_bytes() == PLAIN_EXT.read_bytes()

    # the stripped extension module still loads and works
    load = (
        "import importlib.util as u, sys\n"
        f"spec = u.spec_from_file_location('hiredis.hiredis', {str(stripped)!r})\n"
        "m = u.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "r = m.Reader(); r.feed(b'$5\\r\\nhello\\r\\n'); print(r.gets())\n"
    )
    ran = subprocess.run([sys.executable, "-c", load], capture_output=True, text=True)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip() == "b'hello'"


def test_slim_venv_keeps_each_swagger_ui_file_the_docs_page_serves():
    from hps.http.docs_page import ASSETS

    code = ("import sys; sys.path.insert(0, sys.argv[1]); import slim_venv; "
            "print(' '.join(sorted(slim_venv.SWAGGER_UI_ASSETS)))")
    done = subprocess.run([sys.executable, "-c", code, str(SLIM.parent)], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == sorted(ASSETS)


def test_slim_venv_refuses_a_folder_that_is_no_venv(tmp_path):
    done = subprocess.run([sys.executable, str(SLIM), str(tmp_path)], capture_output=True,
                          text=True)
    assert done.returncode != 0
    assert "site-packages" in done.stderr


def _base_tree(root: Path) -> tuple[Path, dict[str, str]]:
    """A base image's files under root, its standard library where this Python has it."""
    paths = sysconfig.get_paths()
    lib = root / Path(paths["stdlib"]).relative_to("/")
    include = Path(paths["include"]).relative_to("/").as_posix()
    stdlib = lib.relative_to(root).as_posix()
    kept = {
        f"{stdlib}/os.py": "", f"{stdlib}/pydoc.py": "", f"{stdlib}/json/__init__.py": "",
        f"{stdlib}/unittest/__init__.py": "",
        f"{stdlib}/lib-dynload/_json.cpython-311-x86_64-linux-gnu.so": "ext",
        f"{stdlib}/lib-dynload/_xxsubinterpreters.cpython-311-x86_64-linux-gnu.so": "ext",
        "var/lib/dpkg/status": "Package: python3", "var/lib/dpkg/info/python3.list": "/",
        "var/cache/debconf/templates.dat": "t", "var/log/btmp": "", "usr/bin/python3": "",
        "usr/share/doc/python3/copyright": "c",
    }
    dropped = {
        f"{stdlib}/__pycache__/os.cpython-311.pyc": "pyc",
        f"{stdlib}/json/__pycache__/__init__.cpython-311.pyc": "pyc",
        f"{stdlib}/test/__init__.py": "", f"{stdlib}/test/support/__init__.py": "",
        f"{stdlib}/lib-dynload/_testcapi.cpython-311-x86_64-linux-gnu.so": "test",
        f"{stdlib}/lib-dynload/_ctypes_test.cpython-311-x86_64-linux-gnu.so": "test",
        f"{stdlib}/lib-dynload/xxlimited_35.cpython-311-x86_64-linux-gnu.so": "example",
        f"{stdlib}/lib2to3/__init__.py": "", f"{stdlib}/pydoc_data/topics.py": "topics",
        f"{stdlib}/ensurepip/_bundled/pip-23.0.1-py3-none-any.whl": "wheel",
        f"{stdlib}/turtle.py": "", f"{stdlib}/tkinter/__init__.py": "",
        "usr/share/python-wheels/setuptools-66.1.1-py3-none-any.whl": "wheel",
        f"{include}/Python.h": "header",
        "var/lib/dpkg/status-old": "old", "var/cache/debconf/templates.dat-old": "old",
        "var/log/dpkg.log": "log", "var/log/apt/history.log": "log",
        "var/cache/apt/pkgcache.bin": "cache", "var/lib/apt/lists/deb.debian.org_Release": "x",
    }
    for rel, text in {**kept, **dropped}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return lib, kept


def test_slim_base_keeps_what_runs_and_drops_the_rest(tmp_path):
    lib, kept = _base_tree(tmp_path)
    done = subprocess.run([sys.executable, str(SLIM_BASE), str(tmp_path)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    left = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")
                  if p.is_file())
    assert left == sorted(kept)
    assert not list(lib.rglob("__pycache__"))
    for step in ("standard library parts no server runs", "bytecode of the standard library",
                 "backups, logs and package caches of the base's build"):
        assert step in done.stdout


def test_slim_base_refuses_a_root_without_a_standard_library(tmp_path):
    done = subprocess.run([sys.executable, str(SLIM_BASE), str(tmp_path)],
                          capture_output=True, text=True)
    assert done.returncode != 0
    assert "no standard library" in done.stderr
    assert not list(tmp_path.iterdir())  # nothing removed, nothing made


def test_smoke_check_passes_on_this_checkout(tmp_path):
    # from an empty folder, like the image build: the checkout's hps is on PYTHONPATH
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": str(tmp_path),
           "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    done = subprocess.run([sys.executable, str(SMOKE)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    for line in ("compiled tier + RocksDB: 16,000 vectors checked, 0 mismatches",
                 "HTTP server: ready, 64 vectors looked up over JSON, equal to the files",
                 "smoke check passed"):
        assert line in done.stdout
