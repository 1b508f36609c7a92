"""The folders are floors: imports between them run only downwards.

Issue 25: each top-level package is one layer, a module imports only from its
own floor or the ones below, no two modules import each other (directly or
around a circle), and no floor holds more than 35% of the code. Read from the
source with ``ast`` (every import, at module level or inside a function;
migrations and tests not counted), so a new upward import fails here.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Bottom to top.
FLOORS = [
    "batches",  # batch rows: models, intake records, exports
    "jobs",  # job models and the transition layer
    "operator_api",  # API token models and their policy
    "engine",  # policies: intake, progress, sweep, reconcile, retention, webhooks
    "api",  # the worker and operator APIs, their JSON, long-poll, OpenAPI
    "console",  # HTML pages, admin registrations, management commands
    "recall_site",  # settings, URLs, server, health, metrics
]
MAX_SHARE = 0.35


def _modules() -> dict[str, Path]:
    found = {}
    for floor in FLOORS:
        for path in sorted((ROOT / floor).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if "migrations" in parts:
                continue
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules ``name`` imports (a ``from pkg import sub`` counts
    as an import of ``pkg.sub`` when that is a module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [
                f"{module}.{alias.name}"
                if f"{module}.{alias.name}" in known
                else module
                for alias in node.names
            ]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(name, path, known) for name, path in modules.items()}


def _floor(module: str) -> int:
    return FLOORS.index(module.partition(".")[0])


def test_imports_between_folders_run_only_downwards():
    upward = sorted(
        f"{source} imports {target}"
        for source, targets in _graph().items()
        for target in targets
        if _floor(target) > _floor(source)
    )
    assert upward == []


def test_no_import_circles_between_modules():
    graph = _graph()
    # A module that imports its own package's __init__ (or the reverse) is
    # how a package exposes its parts, not a circle between files.
    edges = {
        source: {
            target
            for target in targets
            if not (source.startswith(target + ".") or target.startswith(source + "."))
        }
        for source, targets in graph.items()
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in edges[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    assert circles == []


def test_no_folder_holds_more_than_a_third_of_the_code():
    lines: dict[str, int] = defaultdict(int)
    for name, path in _modules().items():
        lines[name.partition(".")[0]] += len(path.read_text().splitlines())
    total = sum(lines.values())
    too_big = {
        floor: round(count / total, 3)
        for floor, count in lines.items()
        if count > MAX_SHARE * total
    }
    assert too_big == {}
