"""What the set-up steps a page shows would do here (tests/test_docs_commands.py): a
`pip install` checked to be a no-op in this environment rather than run, the virtual
environment's steps checked to be this one's, and what a page's installs so far let its
Python import."""

from __future__ import annotations

import functools
import re
import shlex
import sys
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
#: a distribution the pages name, and the one the test environment holds in its place
#: (the `test` extra's own choice: TensorFlow's CPU build, the same modules)
IN_PLACE_OF = {"tensorflow": "tensorflow-cpu"}


def _distribution(name: str) -> str:
    """`name`, or what the test environment holds in its place where it lacks `name`."""
    try:
        metadata.version(name)
    except metadata.PackageNotFoundError:
        return IN_PLACE_OF.get(canonicalize_name(name), name)
    return name


def _installed(requirement: Requirement, constraints: dict[str, str]) -> str | None:
    """Why `requirement` is not met by the installed distributions (None: it is)."""
    if requirement.marker is not None and not requirement.marker.evaluate():
        return None
    try:
        version = metadata.version(_distribution(requirement.name))
    except metadata.PackageNotFoundError:
        return f"{requirement.name} is not installed"
    if not requirement.specifier.contains(version, prereleases=True):
        return f"{requirement.name} {version} does not meet {requirement.specifier}"
    pinned = constraints.get(requirement.name.lower().replace("_", "-"))
    if pinned is not None and pinned != version:
        return f"{requirement.name} {version} is not the pinned {pinned} (constraints.txt)"
    return None


def _extras() -> dict[str, list[str]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return dict(project["optional-dependencies"])


def check_pip_install(words: list[str], work: Path) -> None:
    """`pip install ...` would change nothing here: each extra of `.[...]` exists and its
    requirements are installed, and so is each package named (at its pin with -c)."""
    args = words[2:]
    constraints: dict[str, str] = {}
    targets: list[str] = []
    index_url = None
    i = 0
    while i < len(args):
        arg = args[i]
        if arg in ("-c", "--constraint"):
            for line in (work / args[i + 1]).read_text().splitlines():
                name, sep, version = line.partition("==")
                if sep:
                    constraints[name.strip().lower().replace("_", "-")] = version.strip()
            i += 2
        elif arg in ("--index-url", "--extra-index-url"):
            index_url = args[i + 1]
            i += 2
        elif arg.startswith("-"):
            raise AssertionError(f"`{shlex.join(words)}`: option {arg} is not known here")
        else:
            targets.append(arg)
            i += 1
    assert targets, f"`{shlex.join(words)}` installs nothing"
    extras = _extras()
    problems = []
    for target in targets:
        if target.startswith("."):
            wanted = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", target)
            assert wanted, f"`{target}`: not a `.[extra,...]` form"
            for extra in (wanted.group(1) or "").split(",") if wanted.group(1) else []:
                assert extra in extras, f"`{target}`: no extra {extra!r} in pyproject.toml"
                problems += [p for r in extras[extra]
                             if (p := _installed(Requirement(r), constraints))]
        else:
            problems += [p for p in [_installed(Requirement(target), constraints)] if p]
    if index_url is not None and "download.pytorch.org/whl/cpu" in index_url:
        # the CPU build's version carries +cpu; a CUDA build would bring NVIDIA wheels
        assert "torch" in targets and metadata.version("torch").endswith("+cpu"), \
            f"`{shlex.join(words)}`: the installed torch is {metadata.version('torch')}"
    assert not problems, f"`{shlex.join(words)}` would not be a no-op here: {problems}"


#: extras that bring this repository's own tools (tests, docs, the compose check), not
#: what a page's code may use
TOOL_EXTRAS = {"test", "dev", "compose"}


def _modules_of(requirements: list[str]) -> set[str]:
    """The top-level modules the installed distributions of `requirements` provide."""
    names = {canonicalize_name(_distribution(Requirement(r).name)) for r in requirements}
    return {module for module, dists in metadata.packages_distributions().items()
            if any(canonicalize_name(d) in names for d in dists)}


def _with_dependencies(requirements: list[str]) -> list[str]:
    """`requirements` and every installed distribution they need, however deep (their
    own extras left out): what installing them brings."""
    found: dict[str, str] = {}
    todo = [Requirement(r) for r in requirements]
    while todo:
        requirement = todo.pop()
        name = canonicalize_name(_distribution(requirement.name))
        if name in found or (requirement.marker is not None
                             and not requirement.marker.evaluate({"extra": ""})):
            continue
        try:
            needs = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue  # not installed here: brings nothing here
        found[name] = name
        todo += [Requirement(r) for r in needs]
    return list(found)


@functools.lru_cache(maxsize=None)  # walks every installed distribution's metadata: seconds
def not_installed(shown: frozenset[str]) -> list[str]:
    """The modules a page's Python cannot import after the installs it showed: `shown`
    holds ".[extra]" for each extra and the name of each package installed by name. Those
    of the extras not shown, less those that the base dependencies and what was shown bring
    (with their own dependencies: TensorFlow brings protobuf, the `grpc` extra's too)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = {k: v for k, v in _extras().items() if k not in TOOL_EXTRAS}
    present = [*project["dependencies"], *(r for k, v in extras.items() if f".[{k}]" in shown
                                           for r in v),
               *(s for s in shown if not s.startswith("."))]
    absent = [r for k, v in extras.items() if f".[{k}]" not in shown for r in v]
    return sorted(_modules_of(absent) - _modules_of(_with_dependencies(present)))


def installs_of(words: list[str]) -> set[str]:
    """What `pip install ...` installs, as `not_installed` takes it."""
    shown: set[str] = set()
    args = iter(words[2:])
    for arg in args:
        if arg in ("-c", "--constraint", "--index-url", "--extra-index-url"):
            next(args)  # the option's value
        elif arg.startswith("."):
            extras = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", arg)
            assert extras, f"`{arg}`: not a `.[extra,...]` form"
            shown |= {f".[{e}]" for e in (extras.group(1) or "").split(",") if e}
        elif not arg.startswith("-"):
            shown.add(Requirement(arg).name)
    return shown


def check_venv(words: list[str], work: Path) -> None:
    """Making or activating `.venv`: the tests run in the project's own, on PATH."""
    assert (VENV_BIN / "python").exists()


#: the set-up commands checked rather than run (the module doc says why)
STAND_INS: list[tuple[Callable[[list[str]], bool], Callable[[list[str], Path], None]]] = [
    (lambda w: w[:2] == ["pip", "install"], check_pip_install),
    (lambda w: w[1:3] == ["-m", "venv"] and w[0].startswith("python"), check_venv),
    (lambda w: w[0] in (".", "source") and w[1:2] == [".venv/bin/activate"], check_venv),
]
