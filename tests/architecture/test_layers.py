"""The layers of diag hold: every import obeys tests/architecture/layers.py, the pure cores stay
pure, no rooms (nor sub-rooms of a room) import each other in a cycle, the sub-packages'
docstrings say what the rules say, and docs/architecture.md draws the rooms as they are."""

from __future__ import annotations

import ast
import re

import diagram
import importgraph
import layers
import pytest
from importgraph import Module


@pytest.fixture(scope="module")
def modules() -> list[Module]:
    return importgraph.repo_modules()


def test_every_import_obeys_the_layers(modules: list[Module]) -> None:
    assert len(modules) > 150  # the whole tree was read, not an empty folder
    bad = importgraph.check(modules)
    assert not bad, "imports against tests/architecture/layers.py:\n" + "\n".join(map(str, bad))


def test_the_rules_name_real_modules(modules: list[Module]) -> None:
    names = {m.name for m in modules}
    for pattern in layers.PURE:
        assert any(importgraph.is_pure(n, (pattern,)) for n in names), f"PURE: {pattern}"
    for importer, target in layers.EXCEPTIONS:
        assert importer in names and target in names, (importer, target)
    assert set(layers.MAY_IMPORT) == set(layers.ROOMS)
    assert set(layers.SUB_ROOMS) == set(layers.SUB_MAY_IMPORT) <= set(layers.ROOMS)
    for room, subs in layers.SUB_ROOMS.items():
        assert set(layers.SUB_MAY_IMPORT[room]) == set(subs), room
        for sub, allowed in layers.SUB_MAY_IMPORT[room].items():
            assert allowed <= set(subs) - {sub}, (room, sub, allowed - set(subs))
        for sub, patterns in subs.items():
            for pattern in patterns:
                assert any(importgraph.is_pure(n, (pattern,)) for n in names), (sub, pattern)


def test_every_module_of_a_divided_room_lies_in_one_sub_room(modules: list[Module]) -> None:
    # A new module (or sub-package) needs its place in SUB_ROOMS, or its imports go unchecked.
    divided = [m.name for m in modules if importgraph.room_of(m.name) in layers.SUB_ROOMS]
    assert len(divided) > 100
    placed = {name: importgraph.sub_rooms_of(name) for name in divided}
    assert {name: subs for name, subs in placed.items() if len(subs) != 1} == {}


def test_the_allowed_rooms_form_no_cycle() -> None:
    assert importgraph.find_cycles(layers.MAY_IMPORT) == []
    for room, allowed in layers.SUB_MAY_IMPORT.items():
        assert importgraph.find_cycles(allowed) == [], room


def _may_import_line(docstring: str) -> set[str]:
    """The names of a docstring's "May import: a, b (why), c." sentence."""
    text = " ".join(docstring.split())
    found = re.search(r"May import: (.*?)\.(?:\s|$)", text)
    assert found, f"no 'May import:' line in {docstring!r}"
    return {n.strip() for n in re.sub(r"\([^)]*\)", "", found.group(1)).split(",")}


def test_the_sub_packages_say_what_they_may_import(modules: list[Module]) -> None:
    by_name = {m.name: m for m in modules}
    checked = 0
    for room, subs in layers.SUB_ROOMS.items():
        for sub, patterns in subs.items():
            if patterns != (f"diag.{room}.{sub}.*",):
                continue  # a group of top-level modules: no docstring of its own
            init = by_name[f"diag.{room}.{sub}"]
            said = _may_import_line(ast.get_docstring(ast.parse(init.source)) or "")
            rooms = {n for n in said if "." not in n}
            assert rooms <= layers.MAY_IMPORT[room], (init.path, rooms - layers.MAY_IMPORT[room])
            rules = {f"{room}.{s}" for s in layers.SUB_MAY_IMPORT[room][sub]}
            assert said - rooms == rules, f"{init.path} says {sorted(said - rooms)}, {rules=}"
            checked += 1
    assert checked >= 10


def _check_with(modules: list[Module], extra: Module) -> list[str]:
    return [str(v) for v in importgraph.check([*modules, extra])]


def test_a_forbidden_import_is_caught(modules: list[Module]) -> None:
    # Inside a function and under TYPE_CHECKING count as much as one at the top.
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from diag.viewer.merge import main\n"
        "def later():\n"
        "    from ...agent.loop import daemon\n"
    )
    bad = _check_with(modules, Module("diag.trainer.flash.rogue", source))
    assert bad == [
        "diag.trainer.flash.rogue:3 imports diag.viewer.merge: trainer may import collector, "
        "formats, proto (tests/architecture/layers.py)",
        "diag.trainer.flash.rogue:5 imports diag.agent.loop.daemon: trainer may import collector, "
        "formats, proto (tests/architecture/layers.py)",
    ]


def test_an_impure_import_in_a_pure_core_is_caught(modules: list[Module]) -> None:
    source = (
        "import time\n"
        "from os import path\n"
        "from os import PathLike\n"  # allowed: a type only
        "from collections.abc import Mapping\n"
        "from diag.agent.detect.hang import Verdict\n"
        "def f():\n"
        "    from diag.formats.journal import Journal\n"
        "    import logging\n"
    )
    bad = _check_with(modules, Module("diag.agent.detect.rogue", source))
    assert [v.split(" imports ")[1].split(":")[0] for v in bad] == [
        "time",
        "os.path",
        "diag.formats.journal",
        "logging",
    ]


def test_a_forbidden_sub_room_import_is_caught(modules: list[Module]) -> None:
    bad = _check_with(
        modules, Module("diag.agent.detect.rogue", "from ..loop.daemon import Agent\n")
    )
    assert (
        "diag.agent.detect.rogue:1 imports diag.agent.loop.daemon: agent.detect may import nothing of "
        "its room (tests/architecture/layers.py)" in bad
    ), bad
    # The loop imports (through others) every sub-room; an import the other way closes a cycle.
    cycles = [v for v in bad if "sub-rooms in a cycle: " in v]
    assert len(cycles) == 1 and "agent.detect -> agent.loop -> " in cycles[0], bad


def test_a_cycle_between_rooms_is_caught(modules: list[Module]) -> None:
    # formats may import nothing, so this is also a layer violation; the cycle is named apart.
    bad = _check_with(modules, Module("diag.formats.rogue", "import diag.viewer.merge\n"))
    assert any("rooms in a cycle: formats -> viewer -> formats" in v for v in bad), bad
    assert importgraph.find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [
        ["a", "b", "c", "a"]
    ]


def test_the_page_draws_the_rooms_as_they_are() -> None:
    page = diagram.PAGE.read_text()
    for drawing, drawn in (
        (diagram.ROOMS, diagram.current()),
        (diagram.SUB_ROOMS, diagram.current_sub_rooms()),
    ):
        assert diagram.block_of(page, drawing) == drawn, (
            f"{diagram.PAGE} draws other rooms or arrows than the code has: run "
            "`.venv/bin/python tests/architecture/diagram.py --write` and review the change"
        )


def test_no_two_modules_share_a_name(modules: list[Module]) -> None:
    """A name says what a module is: two modules named `drain` for different things is what the rooms
    replaced. Generated protobuf stubs aside."""
    seen: dict[str, list[str]] = {}
    for m in modules:
        if not m.is_package and not m.name.endswith(("_pb2", "_pb2_grpc")):
            seen.setdefault(m.name.rsplit(".", 1)[-1], []).append(m.name)
    shared = {leaf: names for leaf, names in seen.items() if len(names) > 1}
    assert not shared, f"modules sharing a name: {shared}"


def test_no_two_modules_import_each_other(modules: list[Module]) -> None:
    """A pair that imports each other (lazily or for types alone too) is one concept split in
    two, or two tangled: either way a reader goes back and forth between them."""
    known = {m.name for m in modules}
    edges = {
        (m.name, i.target)
        for m in modules
        for i in importgraph.imports_of(m, known)
        if i.target in known and i.target != m.name
    }
    pairs = sorted({tuple(sorted(e)) for e in edges if (e[1], e[0]) in edges})
    assert not pairs, f"modules importing each other: {pairs}"
