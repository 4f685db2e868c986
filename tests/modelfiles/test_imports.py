"""The model-source modules import each other without a circle.

Read from the source text, not from `sys.modules`: `import hps` loads the whole package,
so only the import statements themselves show who depends on whom. Imports inside
functions count too: a deferred import back up is still a circle in the design.
"""

from __future__ import annotations

import ast
from pathlib import Path

import hps.modelfiles

IO_DIR = Path(hps.modelfiles.__file__).parent


def io_imports() -> dict[str, set[str]]:
    """hps.modelfiles module → the hps.modelfiles modules it imports, anywhere in its text."""
    graph: dict[str, set[str]] = {}
    for path in IO_DIR.rglob("*.py"):
        parts = path.relative_to(IO_DIR).with_suffix("").parts
        module = ".".join(("hps", "modelfiles", *parts)).removesuffix(".__init__")
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            deps.update(n for n in names if n.startswith("hps.modelfiles.") and n != module)
        graph[module] = deps
    return graph


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a path that ends where it starts, or None."""
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> list[str] | None:
        if module in path:
            return path[path.index(module) :] + [module]
        if module in done:
            return None
        for dep in sorted(graph.get(module, ())):
            circle = visit(dep, path + [module])
            if circle:
                return circle
        done.add(module)
        return None

    for module in sorted(graph):
        circle = visit(module, [])
        if circle:
            return circle
    return None


def test_io_has_no_import_circle() -> None:
    assert find_circle(io_imports()) is None


def test_remote_sources_import_only_the_base_types() -> None:
    graph = io_imports()
    # s3_requests is the S3 reader's own request budget, importing no other model module
    assert graph["hps.modelfiles.s3"] == {"hps.modelfiles.source", "hps.modelfiles.s3_requests"}
    assert graph["hps.modelfiles.s3_requests"] == set()
    assert graph["hps.modelfiles.hdfs"] == {"hps.modelfiles.source"}
    assert graph["hps.modelfiles.source"] == set()


def test_circle_finder_sees_a_circle() -> None:
    # the checker itself must be able to fail: a circle between the URI and a backend
    graph = {"hps.modelfiles.uri": {"hps.modelfiles.s3"}, "hps.modelfiles.s3": {"hps.modelfiles.uri"}}
    assert find_circle(graph) == ["hps.modelfiles.s3", "hps.modelfiles.uri", "hps.modelfiles.s3"]
