"""The tests' helpers sit in folders by concern (tests/support/<concern>/), imported by bare
module name: pytest's `pythonpath`, the benches (`repo.on_sys_path()`) and the processes tests
start (`repo.pythonpath()`) must all see the same folders, and no two helpers may share a name."""

from __future__ import annotations

import tomllib
from collections import Counter

from repo import FOLDERS, ROOT, SUPPORT

# The only modules loose in tests/support: where things are, and the fast tier's guard that
# tests/conftest.py imports before any folder is known.
LOOSE = {"repo.py", "fasttier.py"}


def test_pytest_pythonpath_lists_every_helper_folder() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    listed = config["tool"]["pytest"]["ini_options"]["pythonpath"]
    expected = ["tests/support", *(str(f.relative_to(ROOT)) for f in FOLDERS)]
    assert listed == expected, "pyproject's pytest pythonpath and tests/support's folders differ"


def test_no_two_helpers_share_a_module_name() -> None:
    names = Counter(p.stem for folder in FOLDERS for p in folder.glob("*.py"))
    names.update(p.stem for p in SUPPORT.glob("*.py"))
    assert [n for n, c in names.items() if c > 1] == []


def test_helpers_sit_in_a_folder_of_their_concern() -> None:
    loose = {p.name for p in SUPPORT.glob("*.py")}
    assert loose <= LOOSE, f"move {sorted(loose - LOOSE)} into a folder of tests/support/"
    assert len(FOLDERS) >= 5
    assert all(any(f.glob("*.py")) for f in FOLDERS), "a helper folder without a module"
