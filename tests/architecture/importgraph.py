"""diag's import graph, read from the source (ast, nothing imported), and its check against the
rules of `layers.py`."""

from __future__ import annotations

import ast
import fnmatch
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import layers

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Module:
    name: str  # as imported: diag.agent.detect.hang
    source: str
    is_package: bool = False  # an __init__.py: relative imports start from itself
    path: str = ""  # for messages


@dataclass(frozen=True)
class Import:
    importer: str
    target: str  # a module of diag, or for anything else `module` / `module.Name`
    line: int


@dataclass(frozen=True)
class Violation:
    importer: str
    target: str
    line: int
    rule: str

    def __str__(self) -> str:
        return f"{self.importer}:{self.line} imports {self.target}: {self.rule}"


def repo_modules(repo: Path = REPO) -> list[Module]:
    """Every module of every room, named as its path under the repository names it."""
    found = []
    for room in layers.ROOMS:
        for path in sorted((repo / "diag" / room).rglob("*.py")):
            parts = list(path.relative_to(repo).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts.pop()
            found.append(
                Module(
                    name=".".join(parts),
                    source=path.read_text(),
                    is_package=is_package,
                    path=str(path.relative_to(repo)),
                )
            )
    return found


def _absolute(module: Module, level: int, name: str | None) -> str:
    base = module.name.split(".")
    if not module.is_package:
        base.pop()
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, name] if name else base)


def imports_of(module: Module, known: Iterable[str]) -> list[Import]:
    """Every import anywhere in the module (top level, functions, TYPE_CHECKING blocks).
    `from package import name` names the submodule when `name` is one of `known`."""
    known = set(known)
    found = []
    for node in ast.walk(ast.parse(module.source, filename=module.path or module.name)):
        if isinstance(node, ast.Import):
            found += [Import(module.name, a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, node.level, node.module) if node.level else node.module
            assert base is not None
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                own = base == "diag" or base.startswith("diag.")
                if own and sub not in known and base in known:
                    found.append(Import(module.name, base, node.lineno))
                else:
                    # A submodule of diag, or `module.Name` of anything else (PURE_STDLIB
                    # allows single names such as os.PathLike).
                    found.append(Import(module.name, sub, node.lineno))
    return found


def room_of(name: str) -> str | None:
    parts = name.split(".")
    if parts[0] != "diag" or len(parts) < 2:
        return None
    return parts[1]


def is_pure(name: str, pure: Iterable[str] = layers.PURE) -> bool:
    return any(_matches(name, p) for p in pure)


def _matches(name: str, pattern: str) -> bool:
    # `package.*` stands for the package and every module under it.
    return (
        name == pattern
        or fnmatch.fnmatchcase(name, pattern)
        or (pattern.endswith(".*") and name == pattern[:-2])
    )


def sub_rooms_of(
    name: str, sub_rooms: Mapping[str, Mapping[str, tuple[str, ...]]] = layers.SUB_ROOMS
) -> list[str]:
    """The sub-rooms a module of diag lies in, as `room.sub` (one, where the rules are right;
    none for a room without sub-rooms)."""
    room = room_of(name)
    if room is None:
        return []
    return [
        f"{room}.{sub}"
        for sub, patterns in sub_rooms.get(room, {}).items()
        if any(_matches(name, p) for p in patterns)
    ]


def sub_room_of(
    name: str, sub_rooms: Mapping[str, Mapping[str, tuple[str, ...]]] = layers.SUB_ROOMS
) -> str | None:
    found = sub_rooms_of(name, sub_rooms)
    return found[0] if len(found) == 1 else None


def _stdlib_allowed(target: str, allowed: frozenset[str]) -> bool:
    # `from a.b import c` gives a.b.c: allowed when a.b.c is listed (a module or a single name)
    # or a.b is (a module, all of it); `import a.b` gives a.b.
    return target in allowed or target.rpartition(".")[0] in allowed


def check(
    modules: Iterable[Module],
    may_import: Mapping[str, frozenset[str]] = layers.MAY_IMPORT,
    exceptions: Mapping[tuple[str, str], str] = layers.EXCEPTIONS,
    pure: Iterable[str] = layers.PURE,
    pure_stdlib: frozenset[str] = layers.PURE_STDLIB,
    sub_rooms: Mapping[str, Mapping[str, tuple[str, ...]]] = layers.SUB_ROOMS,
    sub_may_import: Mapping[str, Mapping[str, frozenset[str]]] = layers.SUB_MAY_IMPORT,
) -> list[Violation]:
    """The imports that break a rule, and the cycles between rooms and between the sub-rooms of
    a room."""
    modules = list(modules)
    known = {m.name for m in modules}
    pure = tuple(pure)
    bad = []
    edges: dict[tuple[str, str], Import] = {}
    sub_edges: dict[tuple[str, str], Import] = {}
    for m in modules:
        here = room_of(m.name)
        here_sub = sub_room_of(m.name, sub_rooms)
        for imp in imports_of(m, known):
            there = room_of(imp.target)
            there_sub = sub_room_of(imp.target, sub_rooms)
            if here_sub and there_sub and here_sub != there_sub and here == there:
                sub_edges.setdefault((here_sub, there_sub), imp)
                assert here is not None
                allowed_subs = sub_may_import.get(here, {}).get(here_sub.split(".", 1)[1], ())
                if there_sub.split(".", 1)[1] not in allowed_subs and (
                    (imp.importer, imp.target) not in exceptions
                ):
                    names = ", ".join(f"{here}.{s}" for s in sorted(allowed_subs)) or "nothing"
                    bad.append(
                        Violation(
                            imp.importer,
                            imp.target,
                            imp.line,
                            f"{here_sub} may import {names} of its room "
                            "(tests/architecture/layers.py)",
                        )
                    )
            if there is not None and there != here and here is not None:
                edges.setdefault((here, there), imp)
                if there not in may_import.get(here, frozenset()) and (
                    (imp.importer, imp.target) not in exceptions
                ):
                    allowed = ", ".join(sorted(may_import.get(here, ()))) or "nothing"
                    bad.append(
                        Violation(
                            imp.importer,
                            imp.target,
                            imp.line,
                            f"{here} may import {allowed} (tests/architecture/layers.py)",
                        )
                    )
            if is_pure(m.name, pure):
                if there is not None:
                    ok = is_pure(imp.target, pure)
                else:
                    ok = _stdlib_allowed(imp.target, pure_stdlib)
                if not ok:
                    bad.append(
                        Violation(
                            imp.importer,
                            imp.target,
                            imp.line,
                            "a pure core imports only pure modules and PURE_STDLIB",
                        )
                    )
    for found, what in ((edges, "rooms"), (sub_edges, "sub-rooms")):
        for cycle in find_cycles({a: {b for (x, b) in found if x == a} for (a, _) in found}):
            first = found[(cycle[0], cycle[1])]
            bad.append(
                Violation(
                    first.importer,
                    first.target,
                    first.line,
                    f"{what} in a cycle: " + " -> ".join(cycle),
                )
            )
    return list(dict.fromkeys(bad))  # one line per import, however many names it brings


def room_edges(modules: Iterable[Module]) -> dict[tuple[str, str], int]:
    """Between rooms: how many imports go from one to another."""
    modules = list(modules)
    known = {m.name for m in modules}
    count: dict[tuple[str, str], int] = {}
    for m in modules:
        for imp in imports_of(m, known):
            a, b = room_of(imp.importer), room_of(imp.target)
            if a is not None and b is not None and a != b:
                count[(a, b)] = count.get((a, b), 0) + 1
    return count


def sub_room_edges(
    modules: Iterable[Module],
    sub_rooms: Mapping[str, Mapping[str, tuple[str, ...]]] = layers.SUB_ROOMS,
) -> dict[tuple[str, str], int]:
    """Between the sub-rooms of one room: how many imports go from one to another."""
    modules = list(modules)
    known = {m.name for m in modules}
    count: dict[tuple[str, str], int] = {}
    for m in modules:
        a = sub_room_of(m.name, sub_rooms)
        for imp in imports_of(m, known):
            b = sub_room_of(imp.target, sub_rooms)
            if a and b and a != b and room_of(m.name) == room_of(imp.target):
                count[(a, b)] = count.get((a, b), 0) + 1
    return count


def find_cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """One cycle per strongly connected group of nodes, as a path that ends where it starts."""
    cycles = []
    done: set[str] = set()
    for start in sorted(graph):
        # Depth-first from each node for a path back to it; small graphs, so plain search.
        stack = [(start, [start])]
        seen = set()
        while stack:
            node, path = stack.pop()
            for nxt in sorted(graph.get(node, ())):
                if nxt == start and start not in done:
                    cycles.append([*path, start])
                    done.update(path)
                    stack.clear()
                    break
                if nxt not in seen and nxt not in done:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
    return cycles
