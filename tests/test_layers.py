"""The package's layers, read from its imports: every import runs down the table below, never up
and never sideways, and no modules import each other in a circle.

Every import counts, the lazy ones inside functions and those under `TYPE_CHECKING` too: a lazy
import that climbs still ties a lower layer to a higher one's contract (the scale-out work found
parallel/launch.py -> worker.py -> runtime.py -> launch.py). Read statically; nothing is imported.

A folder at the package's root is a room; the root's own modules are plain data (one room) or
entry points. docs/architecture.md draws the same table.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the repository root is the package `cadenza`
NOT_PACKAGE = {"tests", "examples", "build", "docs", ".venv", "static", "benchmarks", "results", ".ci"}

# Top to bottom: a room imports only rooms on floors below its own.
FLOORS: tuple[tuple[str, frozenset[str]], ...] = tuple(
    (name, frozenset(rooms.split()))
    for name, rooms in (
        ("entry points: the package, `python -m cadenza`", "cadenza __main__"),
        ("the command line", "cli"),
        ("benchmarks", "bench"),
        ("front ends: the protocols' servers, the Python API", "api llm"),
        ("engines of engines: replicas, routers, disaggregation, Ray", "cluster"),
        ("the engine", "engine"),
        ("building an engine's parts from its config", "runtime"),
        ("the actors and their messages", "actors"),
        ("the model runner", "runner"),
        ("tensor parallelism and the deployment's shape", "parallel"),
        ("speculative decoding", "speculative"),
        ("sampling", "samplers"),
        ("eviction and context policies, KV connectors and tiers, output parsers", "policies kv_connectors kv_tiers parsers"),
        ("models", "models"),
        ("attention backends", "attention_backends"),
        ("the plugin hooks and their errors", "plugins"),
        ("kernels", "kernels"),
        ("CPU threads", "threads"),
        ("config", "config"),
        ("plain data", "data"),
    )
)
FLOOR_OF = {room: i for i, (_, rooms) in enumerate(FLOORS) for room in rooms}


def room_of(module: str) -> str:
    """`cadenza.actors.scheduler` -> `actors`; a root module is an entry point or plain data."""
    parts = module.split(".")
    if len(parts) == 1:
        return "cadenza"
    top = parts[1]
    if (ROOT / top).is_dir() or top in FLOOR_OF:
        return top
    return "data"


def package_modules() -> dict[str, Path]:
    modules = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).parts
        if parts[0] in NOT_PACKAGE or any(p.startswith(".") or p.endswith(".egg-info") for p in parts):
            continue
        name = ".".join(("cadenza", *path.relative_to(ROOT).with_suffix("").parts)).removesuffix(".__init__")
        modules[name] = path
    return modules


@dataclass(frozen=True)
class Arrow:
    """One import of one of the package's modules by another, where it is written."""

    source: str
    target: str
    path: Path
    line: int

    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def arrows(modules: dict[str, Path]) -> list[Arrow]:
    """Every import of a package module, anywhere in a module's text. `from cadenza import x`
    names the submodule x; an import of the package root itself is left out (it always runs first)."""
    found = []
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: set[str] = set()
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.startswith("cadenza"):
                submodules = {f"{node.module}.{alias.name}" for alias in node.names} & modules.keys()
                # `from cadenza.config import environment` depends on the submodule; a package's
                # `__init__` runs before any of its submodules, whoever imports them.
                if len(submodules) < len(node.names):
                    targets |= {node.module} & modules.keys()
                targets |= submodules
            elif isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names} & modules.keys()
            found += [Arrow(name, t, path, node.lineno) for t in sorted(targets - {name, "cadenza"})]
    return found


def misplaced(found: list[Arrow]) -> list[str]:
    """Each arrow that runs up or sideways between rooms, or into a room the table does not place."""
    problems = []
    for arrow in found:
        src, dst = room_of(arrow.source), room_of(arrow.target)
        if src == dst:
            continue
        if src not in FLOOR_OF or dst not in FLOOR_OF:
            unplaced = src if src not in FLOOR_OF else dst
            problems.append(f"{arrow.where()}: {unplaced!r} has no floor in tests/test_layers.py's table")
        elif FLOOR_OF[dst] <= FLOOR_OF[src]:
            way = "sideways" if FLOOR_OF[dst] == FLOOR_OF[src] else "up"
            problems.append(
                f"{arrow.where()}: {arrow.source} ({FLOORS[FLOOR_OF[src]][0]}) imports {arrow.target} "
                f"({FLOORS[FLOOR_OF[dst]][0]}): an import {way}"
            )
    return problems


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm, iterative)."""
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
                    work.append((child, iter(sorted(graph.get(child, ())))))
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


def cycle_report(found: list[Arrow]) -> list[str]:
    """Each circle of modules, with the file and line of every import that closes it."""
    graph: dict[str, set[str]] = {}
    for arrow in found:
        graph.setdefault(arrow.source, set()).add(arrow.target)
    report = []
    for component in cycles(graph):
        inside = set(component)
        lines = [a.where() + f" -> {a.target}" for a in found if a.source in inside and a.target in inside]
        report.append(f"a circle of {len(component)} modules: " + "; ".join(lines))
    return report


# --- the checker itself can fail ---------------------------------------------------------------


def test_the_cycle_finder_finds_a_lazy_cycle():
    graph = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c", "a"}, "f": {"a"}}
    assert sorted(cycles(graph)) == [["a", "b"], ["c", "d", "e"]]


def test_an_import_up_or_sideways_is_named_with_its_file_and_line():
    here = ROOT / "kernels" / "rows.py"
    found = [
        Arrow("cadenza.kernels.rows", "cadenza.models.llama", here, 7),  # up
        Arrow("cadenza.policies.eviction", "cadenza.kv_connectors.base", ROOT / "policies" / "eviction.py", 3),  # sideways
        Arrow("cadenza.models.llama", "cadenza.kernels.rows", ROOT / "models" / "llama.py", 9),  # down: fine
        Arrow("cadenza.step", "cadenza.outputs", ROOT / "step.py", 5),  # within plain data: fine
    ]
    problems = misplaced(found)
    assert len(problems) == 2
    assert problems[0].startswith("kernels/rows.py:7: cadenza.kernels.rows (kernels) imports cadenza.models.llama")
    assert problems[0].endswith("an import up")
    assert problems[1].startswith("policies/eviction.py:3:") and problems[1].endswith("an import sideways")


def test_every_room_has_a_floor_and_a_docstring_that_says_what_it_owns():
    rooms = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists() and p.name not in NOT_PACKAGE}
    assert rooms - FLOOR_OF.keys() == set(), "a folder of the package that tests/test_layers.py does not place"
    for room in rooms:
        doc = ast.get_docstring(ast.parse((ROOT / room / "__init__.py").read_text()))
        assert doc and "import" in doc, f"{room}/__init__.py: its docstring says what the layer owns and may import"


def test_the_root_holds_only_plain_data_and_entry_points():
    entry = {"__init__", "__main__", "cli", "llm"}
    for path in ROOT.glob("*.py"):
        if path.stem in entry:
            continue
        # Plain data: importing it loads no torch, no actor, no model (only other plain data and config).
        for arrow in arrows(package_modules()):
            if arrow.source == f"cadenza.{path.stem}" and room_of(arrow.target) != "data":
                raise AssertionError(f"{arrow.where()}: a root module imports {arrow.target}")
        text = path.read_text()
        assert "import torch" not in text and "import anyio" not in text, f"{path.name} is not plain data"


# --- the package --------------------------------------------------------------------------------


def test_no_import_runs_up_or_sideways():
    found = arrows(package_modules())
    assert any(a.source == "cadenza.runtime.worker" and a.target == "cadenza.runtime.build" for a in found) or any(
        a.source == "cadenza.runtime.worker" for a in found
    ), "lazy imports count"
    assert misplaced(found) == []


def test_the_package_has_no_import_cycles():
    assert cycle_report(arrows(package_modules())) == []
