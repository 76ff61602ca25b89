"""The docs site builds with warnings as errors (a broken link or anchor, a page missing from the
nav fails), and its generated reference pages hold every subcommand, every flag, every agent
option and every metric family of the code. The guide's option tables name only flags that exist,
and the README stays short."""

from __future__ import annotations

import argparse
import importlib.util
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import pytest
from repo import ROOT

from diag.agent.config import options
from diag.agent.metrics import families
from diag.agent.precheck import promfile
from diag.agent.taint import taintconfig
from diag.cli import main
from diag.formats import exitcodes

ARCHITECTURE = ROOT / "docs" / "architecture.md"  # written apart from this site; the nav names it


def reference() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "docsite_reference", ROOT / "docsite/reference.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def site() -> Path:
    out = Path(tempfile.mkdtemp(prefix="diag-test-site-"))
    placeholder = not ARCHITECTURE.exists()
    if placeholder:  # a checkout without the architecture page still builds the rest
        ARCHITECTURE.write_text("# Architecture\n")
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
            env={"PATH": "/usr/bin:/bin", "NO_MKDOCS_2_WARNING": "1"},
        )  # fmt: skip
    finally:
        if placeholder:
            ARCHITECTURE.unlink()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "WARNING" not in proc.stderr, proc.stderr
    yield out
    shutil.rmtree(out)


def page(site: Path, name: str) -> str:
    return (site / name / "index.html").read_text()


def all_flags() -> set[str]:
    flags: set[str] = set()
    ref = reference()
    for name in main.SUBCOMMANDS:
        for action in ref.subcommand_parser(name)._actions:
            if action.help != argparse.SUPPRESS and not isinstance(action, argparse._HelpAction):
                flags.update(s for s in action.option_strings if s.startswith("--"))
    return flags


def test_site_builds_and_the_cli_reference_has_every_subcommand_and_flag(site: Path) -> None:
    html = page(site, "reference/cli")
    for name in main.SUBCOMMANDS:
        assert f"diag {name}" in html, name
    missing = sorted(f for f in all_flags() if f"<code>{f}</code>" not in html)
    assert not missing, missing
    assert (site / "index.html").exists() and (site / "security" / "index.html").exists()


def test_agent_options_page_has_every_option_with_its_variable_and_key(site: Path) -> None:
    html = page(site, "reference/agent-options")
    for table in (options.OPTIONS, taintconfig.OPTIONS):
        for opt in table.options:
            row = f"<code>{table.flag(opt)}</code></td>\n<td><code>{table.env(opt)}</code>"
            assert row in html, opt.name
            bounds = table.bounds_of(opt)
            if bounds is not None:
                assert bounds.describe() in html, opt.name


def test_metrics_page_has_every_family(site: Path) -> None:
    html = page(site, "reference/metrics")
    names = [f.exposed[0] if f.kind == families.Kind.COUNTER else f.name for f in families.FAMILIES]
    names += [families.XPU_TIMER_HANG.name]
    names += [v.name for v in vars(promfile).values() if isinstance(v, promfile.Family)]
    missing = [n for n in names if f"<code>{n}</code>" not in html]
    assert not missing, missing


def test_exit_codes_page_has_every_code(site: Path) -> None:
    html = page(site, "reference/exit-codes")
    codes = {v for k, v in vars(exitcodes).items() if k.isupper() and isinstance(v, int)}
    for code in codes:
        assert f"<td>{code}</td>" in html, code
    assert [c for c, _, text in reference().exit_codes() if not text] == []


def test_guide_tables_name_only_flags_that_exist() -> None:
    """A flag in an option table of the guides (its first cells) is a flag of some subcommand;
    other tools' flags (torchrun's) are named in prose, not in these tables."""
    known = all_flags()
    others = {"--max-restarts"}  # the launchers' table in the graceful exit page
    unknown = []
    for md in sorted((ROOT / "docs").rglob("*.md")):
        for line in md.read_text().splitlines():
            if line.startswith("| `--") or line.startswith("| rendezvous") or "| `--" in line[:40]:
                for flag in re.findall(r"`(--[a-z][a-z0-9-]*[a-z0-9])(?![-\w*])", line):
                    if flag not in known and flag not in others:
                        unknown.append(f"{md.relative_to(ROOT)}: {flag}")
    assert not unknown, unknown


def test_readme_is_short_and_points_at_the_site() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    for text in ("./scripts/demo.sh", "./scripts/test.sh", "--fast", ".venv/bin/mkdocs serve"):
        assert text in readme, text
