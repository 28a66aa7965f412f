"""The package's modules import one another without cycles, counting the imports inside functions
too (the lazy ones that keep GPU and optional packages out of `import cadenza`): a cycle hidden
behind a lazy import still ties two modules' contracts together (the scale-out issue found
parallel/launch.py -> worker.py -> runtime/ -> launch.py). Read statically, nothing imported."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the repository root is the package `cadenza`
SKIP = {"tests", "examples", "bench", "build", "docs", ".venv", "static", "benchmarks", "results"}


def package_modules() -> dict[str, Path]:
    modules = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).parts
        if parts[0] in SKIP or any(p.startswith(".") or p.endswith(".egg-info") for p in parts):
            continue
        name = ".".join(("cadenza", *path.relative_to(ROOT).with_suffix("").parts)).removesuffix(".__init__")
        modules[name] = path
    return modules


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package's modules it imports anywhere in its text. An edge to the package
    root itself is left out: `from cadenza import x` names the submodule, and `cadenza/__init__.py`
    always runs first."""
    graph = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.startswith("cadenza"):
                deps |= {node.module} & modules.keys()
                deps |= {f"{node.module}.{alias.name}" for alias in node.names} & modules.keys()
            elif isinstance(node, ast.Import):
                deps |= {alias.name for alias in node.names} & modules.keys()
        graph[name] = deps - {name, "cadenza"}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_lazy_cycle():
    # Not vacuous: a two-module cycle and a three-module one, beside an acyclic edge.
    graph = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c", "a"}, "f": {"a"}}
    assert sorted(cycles(graph)) == [["a", "b"], ["c", "d", "e"]]


def test_the_package_has_no_import_cycles():
    modules = package_modules()
    assert {"cadenza.runtime.build", "cadenza.parallel.launch", "cadenza.runtime.worker"} <= modules.keys()
    graph = import_graph(modules)
    assert "cadenza.runtime.build" in graph["cadenza.runtime.worker"]  # lazy imports count
    assert cycles(graph) == []
