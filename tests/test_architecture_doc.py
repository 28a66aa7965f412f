"""docs/architecture.md draws the package's layers; this keeps the drawing true.

The picture is the fenced block under "## The layers", one floor a line, top to bottom: the floor's
rooms separated by single spaces, then two spaces or more, then a description. A room is written
as its folder (`actors/`) or, at the package's root, as its module (`cli.py`); `__init__.py` is the
room `cadenza` and every root module the table does not place by name (`outputs.py`, `step.py`,
...) is the room `data`, as `room_of` in tests/test_layers.py reads them.
"""

from __future__ import annotations

import re

from test_layers import FLOOR_OF, FLOORS, ROOT

DOC = ROOT / "docs" / "architecture.md"
HEADING = "## The layers"


def picture(text: str) -> list[str]:
    """The lines of the first fenced block after the layers heading."""
    after = text.split(HEADING, 1)[1]
    match = re.search(r"^```[^\n]*\n(.*?)^```", after, re.M | re.S)
    assert match, f"no fenced block under {HEADING!r} in docs/architecture.md"
    return [line for line in match.group(1).splitlines() if line.strip()]


def room(token: str) -> str:
    """A token of the picture to its room's name in FLOORS."""
    if token.endswith("/"):
        return token.removesuffix("/")
    name = token.removesuffix(".py")
    if name == "__init__":
        return "cadenza"
    return name if name in FLOOR_OF else "data"


def floors_in(text: str) -> list[tuple[list[str], frozenset[str]]]:
    """Each floor of the picture: the tokens written, and the rooms they name."""
    floors = []
    for line in picture(text):
        parts = re.split(r" {2,}", line.strip(), maxsplit=1)
        assert len(parts) == 2 and parts[1].strip(), f"{line!r}: rooms, two spaces or more, then a description"
        tokens = parts[0].split()
        floors.append((tokens, frozenset(room(t) for t in tokens)))
    return floors


def mismatches(text: str) -> list[str]:
    """How the picture differs from FLOORS, floor by floor; empty when they agree."""
    drawn = [rooms for _, rooms in floors_in(text)]
    table = [rooms for _, rooms in FLOORS]
    problems = []
    for i in range(max(len(drawn), len(table))):
        want = sorted(table[i]) if i < len(table) else None
        got = sorted(drawn[i]) if i < len(drawn) else None
        if want != got:
            problems.append(f"floor {i + 1} from the top: tests/test_layers.py has {want}, the picture {got}")
    return problems


def test_picture_matches_the_floors():
    problems = mismatches(DOC.read_text())
    assert not problems, "docs/architecture.md's layer picture is not FLOORS:\n" + "\n".join(problems)


def test_picture_names_what_exists():
    """Every token is a folder or a root module of the package, and every root module is drawn."""
    written = set()
    for tokens, _ in floors_in(DOC.read_text()):
        for token in tokens:
            path = ROOT / token
            assert path.is_dir() if token.endswith("/") else path.is_file(), f"{token} does not exist at the root"
            written.add(token)
    root_modules = {p.name for p in ROOT.glob("*.py")}
    assert root_modules <= written, f"root modules missing from the picture: {sorted(root_modules - written)}"


def test_cited_paths_exist():
    """Every path in backticks (a `/` in it, not a URL) and every relative link resolves."""
    text = DOC.read_text()
    missing = []
    for span in re.findall(r"`([^`\n]+)`", text):
        if "/" in span and " " not in span and not span.startswith("/"):
            if not (ROOT / span).exists():
                missing.append(span)
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" not in target and not (DOC.parent / target).exists():
            missing.append(target)
    assert not missing, f"docs/architecture.md cites paths that do not exist: {missing}"


def test_a_wrong_picture_fails():
    """The check above bites: a swapped, a missing or a moved floor is a mismatch."""
    text = DOC.read_text()
    lines = picture(text)
    assert len(lines) == len(FLOORS)

    def redrawn(new_lines: list[str]) -> str:
        return text.replace("\n".join(lines), "\n".join(new_lines), 1)

    swapped = [*lines]
    swapped[5], swapped[6] = swapped[6], swapped[5]
    assert mismatches(redrawn(swapped))
    assert mismatches(redrawn(lines[:-1]))  # the bottom floor missing
    assert mismatches(redrawn([lines[0], *lines[2:]]))  # a floor near the top missing
    # A room moved up a floor: kv_connectors/ beside samplers/.
    moved = [line.replace("policies/ kv_connectors/", "policies/              ") for line in lines]
    moved = [
        line.replace("samplers/ ", "samplers/ kv_connectors/ ", 1) if line.startswith("samplers/") else line
        for line in moved
    ]
    assert moved != lines and mismatches(redrawn(moved))
    assert not mismatches(text)
