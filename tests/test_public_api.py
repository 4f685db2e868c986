from __future__ import annotations

import importlib
import json
import subprocess
import sys

import hps
import hps.inference

#: what `import hps` must not import: each takes from tens of milliseconds to seconds
HEAVY = ("numpy", "numba", "llvmlite", "pydantic", "fastapi", "uvicorn", "starlette",
         "redis", "rocksdict", "cupy", "torch", "grpc", "hps.server", "hps.http",
         "hps.tiers", "hps.config", "hps.api", "hps.inference")


def test_all_lists_exactly_the_public_names() -> None:
    public = {n for n in dir(hps) if not n.startswith("_") or n == "__version__"}
    public.discard("annotations")  # the __future__ import
    modules = {n for n in public if type(getattr(hps, n)).__name__ == "module"}
    assert set(hps.__all__) == public - modules
    assert len(hps.__all__) == len(set(hps.__all__))


def test_every_public_name_is_the_object_of_its_module() -> None:
    home = {"HierarchicalParameterServer": "hps.server", "load_config": "hps.config",
            "PSConfig": "hps.config", "SparseModelReader": "hps.modelfiles.formats.sparse_folder",
            "UnknownConfigKeyWarning": "hps.config", "HPSError": "hps.errors"}
    for name, module in home.items():
        assert getattr(hps, name) is getattr(importlib.import_module(module), name)
    for name in hps.inference.__all__:  # HugeCTR's names, as `from hugectr.inference`
        assert name in hps.__all__
        assert getattr(hps, name) is getattr(hps.inference, name)
    assert hps.__version__ == "0.1.0"


def test_an_unknown_name_is_an_attribute_error() -> None:
    try:
        hps.NoSuchThing  # noqa: B018
    except AttributeError as exc:
        assert "NoSuchThing" in str(exc)
    else:
        raise AssertionError("hps.NoSuchThing resolved")
    assert not hasattr(hps, "no_such_name")


def test_every_error_is_an_hps_error_with_a_kind() -> None:
    errors = [getattr(hps, n) for n in hps.__all__ if n.endswith("Error")]
    assert len(errors) >= 15
    kinds = set()
    for err in errors:
        assert issubclass(err, hps.HPSError) and err.__doc__
        kinds.add(err.kind)
    assert len(kinds) == len(errors)


def _imported_by(code: str) -> set[str]:
    """The modules a fresh interpreter holds after running `code`."""
    out = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport sys, json; print(json.dumps(list(sys.modules)))"],
        capture_output=True, text=True, check=True, timeout=120)
    return set(json.loads(out.stdout.splitlines()[-1]))


def heavy_in(modules: set[str]) -> list[str]:
    """The modules of HEAVY (or beneath one) among `modules`."""
    return sorted(m for m in modules if any(m == h or m.startswith(h + ".") for h in HEAVY))


def test_import_hps_imports_nothing_heavy() -> None:
    assert heavy_in(_imported_by("import hps")) == []
    # catching the package's errors costs no more
    assert heavy_in(_imported_by("from hps import HPSError, TierError")) == []


def test_a_lazy_name_imports_its_module_on_first_use() -> None:
    modules = _imported_by("import hps; hps.load_config")
    assert "hps.config" in modules and "hps.server" not in modules
    assert "hps.server" in _imported_by("from hps import HierarchicalParameterServer")
