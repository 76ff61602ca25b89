"""The layers of diag hold: every import obeys tests/architecture/layers.py, the pure cores stay
pure, no rooms import each other in a cycle, and docs/architecture.md draws the rooms as they
are."""

from __future__ import annotations

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


def test_the_allowed_rooms_form_no_cycle() -> None:
    assert importgraph.find_cycles(layers.MAY_IMPORT) == []


def _check_with(modules: list[Module], extra: Module) -> list[str]:
    return [str(v) for v in importgraph.check([*modules, extra])]


def test_a_forbidden_import_is_caught(modules: list[Module]) -> None:
    # Inside a function and under TYPE_CHECKING count as much as one at the top.
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from diag.viewer.merge import main\n"
        "def later():\n"
        "    from ...agent import daemon\n"
    )
    bad = _check_with(modules, Module("diag.trainer.flash.rogue", source))
    assert bad == [
        "diag.trainer.flash.rogue:3 imports diag.viewer.merge: trainer may import collector, "
        "formats, proto (tests/architecture/layers.py)",
        "diag.trainer.flash.rogue:5 imports diag.agent.daemon: trainer may import collector, "
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


def test_a_cycle_between_rooms_is_caught(modules: list[Module]) -> None:
    # formats may import nothing, so this is also a layer violation; the cycle is named apart.
    bad = _check_with(modules, Module("diag.formats.rogue", "import diag.viewer.merge\n"))
    assert any("rooms in a cycle: formats -> viewer -> formats" in v for v in bad), bad
    assert importgraph.find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [
        ["a", "b", "c", "a"]
    ]


def test_the_page_draws_the_rooms_as_they_are() -> None:
    page = diagram.PAGE.read_text()
    assert diagram.block_of(page) == diagram.current(), (
        f"{diagram.PAGE} draws other rooms or arrows than the code has: run "
        "`.venv/bin/python tests/architecture/diagram.py --write` and review the change"
    )
