"""Labels that cannot go stale: every file, folder and module that a docstring, a docs page, the
README or SECURITY.md names must exist, and every name a dotted reference takes from a module of
diag must be defined there; the strict type-check list is the list of pure modules.

The dated notebooks (BENCHMARKS.md, RELIABILITY.md) are left out: they say what was measured
then, with the names of then.
"""

from __future__ import annotations

import ast
import re
import subprocess
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import layers
import pytest
from importgraph import REPO

PAGES = ("README.md", "SECURITY.md", "docs")
SOURCES = ("diag", "tests", "bench", "docsite", "scripts", "deploy")
TOP = ("diag", "tests", "bench", "deploy", "docs", "scripts", "docsite")
PATH = re.compile(r"(?<![\w./<{$*-])((?:" + "|".join(TOP) + r")/[\w./-]*[\w/])")
# Not a format's name (`diag.stack/1`, `diag.job-verdict/1`) nor the taint key's domain
# (`diag.dev/unhealthy`): those are followed by a slash or a hyphen.
DOTTED = re.compile(r"(?<![\w./-])(diag(?:\.[A-Za-z_]\w*)+)(?![\w/-])")
# Files of other projects that the docs name (DeepSpeed's conversion scripts, torch's module).
ELSEWHERE = frozenset({"zero_to_fp32.py", "zero_to_torch.py", "distributed_c10d.py"})
BARE = re.compile(r"(?<![\w./<{$*-])([a-z_][a-z0-9_]*\.py)\b")


@dataclass(frozen=True)
class Label:
    where: str  # file:line
    text: str


@cache
def tracked() -> frozenset[str]:
    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True)
    return frozenset(out.stdout.split())


@cache
def tracked_dirs() -> frozenset[str]:
    return frozenset(str(p) for f in tracked() for p in Path(f).parents if str(p) != ".")


@cache
def basenames() -> frozenset[str]:
    return frozenset(Path(f).name for f in tracked())


def _docstrings(path: Path) -> Iterator[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=False)
            if doc and node.body and isinstance(node.body[0], ast.Expr):
                yield node.body[0].lineno, doc


def labelled_texts() -> Iterator[tuple[str, int, str]]:
    """(file, first line, text) of every docstring of the sources and every docs page."""
    for f in sorted(tracked()):
        if f.endswith(".py") and f.split("/", 1)[0] in SOURCES and "_pb2" not in f:
            for line, doc in _docstrings(REPO / f):
                yield f, line, doc
        elif f.endswith(".md") and (f in PAGES or f.split("/", 1)[0] in PAGES):
            yield f, 1, (REPO / f).read_text()


def _line(text: str, start: int, first: int) -> int:
    return first + text.count("\n", 0, start)


@cache
def module_names(dotted: str) -> frozenset[str] | None:
    """The names a module of diag defines at its top level (None: no such module)."""
    parts = dotted.split(".")
    base = REPO.joinpath(*parts)
    path = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
    if not path.is_file():
        return None
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    if base.is_dir():
        names.update(p.stem for p in base.glob("*.py"))
        names.update(p.name for p in base.iterdir() if (p / "__init__.py").exists())
    return frozenset(names)


def dotted_problem(name: str) -> str | None:
    """Why a dotted name (a module of diag, then names in it) names nothing (None: it does)."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        names = module_names(".".join(parts[:cut]))
        if names is None:
            continue
        rest = parts[cut:]
        if not rest or rest[0] in names:
            return None  # attributes of attributes are not followed
        return f"{'.'.join(parts[:cut])} defines no {rest[0]}"
    return "no such module"


def stale_labels() -> list[str]:
    problems = []
    for f, first, text in labelled_texts():
        for m in PATH.finditer(text):
            p = m.group(1).rstrip("./")
            if p not in tracked() and p not in tracked_dirs() and not (REPO / p).exists():
                problems.append(f"{f}:{_line(text, m.start(), first)}: {p} does not exist")
        for m in DOTTED.finditer(text):
            why = dotted_problem(m.group(1).rstrip("."))
            if why:
                problems.append(f"{f}:{_line(text, m.start(), first)}: {m.group(1)}: {why}")
        for m in BARE.finditer(text):
            if m.group(1) not in basenames() and m.group(1) not in ELSEWHERE:
                problems.append(f"{f}:{_line(text, m.start(), first)}: no file {m.group(1)}")
    return problems


def test_every_file_and_module_a_label_names_exists() -> None:
    problems = stale_labels()
    assert not problems, "labels naming what does not exist:\n" + "\n".join(problems)


def test_the_strict_type_check_list_is_the_list_of_pure_modules() -> None:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    strict = [
        o["module"]
        for o in config["tool"]["mypy"]["overrides"]
        if o.get("disallow_untyped_defs") and o.get("disallow_any_generics")
    ]
    (modules,) = strict
    assert sorted(modules) == sorted(layers.PURE)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("see `diag/agent/nosuch.py`", "does not exist"),
        ("diag.agent.loop.daemon.NoSuchClass", "defines no NoSuchClass"),
        ("(in nosuchmodule.py)", "no file nosuchmodule.py"),
        ("diag.agent.loop.daemon.Agent.run and diag/agent/loop/daemon.py", None),
    ],
)
def test_a_stale_label_is_caught(text: str, problem: str | None, monkeypatch) -> None:
    monkeypatch.setattr(
        "test_labels.labelled_texts", lambda: iter([("x.md", 1, text)]), raising=True
    )
    found = stale_labels()
    if problem is None:
        assert not found
    else:
        assert len(found) == 1 and problem in found[0], found
