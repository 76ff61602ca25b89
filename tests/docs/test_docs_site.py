"""The docs site builds with warnings as errors (a broken link or anchor, a page missing from the
nav fails), and its generated reference pages hold every subcommand, every flag, every agent
option and every metric family of the code. Every built page, loaded in a real browser (headless
Chromium), shows what its source says: tables with rows, lists as lists, diagrams drawn and
readable, images that load, one title, and nothing fetched from outside the site. The guide's
option tables name only flags that exist, and the README stays short."""

from __future__ import annotations

import argparse
import functools
import hashlib
import http.server
import importlib.util
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
from headless import Browser
from repo import ROOT

from diag.agent.config import options
from diag.agent.metrics import families
from diag.agent.precheck import promfile
from diag.agent.taint import taintconfig
from diag.cli import main
from diag.formats import exitcodes

ARCHITECTURE = ROOT / "docs" / "architecture.md"  # written apart from this site; the nav names it
PAGE_CHECK = Path(__file__).with_name("pagecheck.js")
MIN_DIAGRAM_FONT_PX = 10.0  # the words of a diagram as drawn on a 1280-pixel-wide window
# Before a page's own scripts: shadow roots open, so the check sees the diagrams drawn in them.
OPEN_SHADOW_ROOTS = (
    "{const attach = Element.prototype.attachShadow;"
    " Element.prototype.attachShadow = function (o) {"
    " return attach.call(this, {...o, mode: 'open'}); }; }"
)


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


@pytest.fixture(scope="module")
def served(site: Path) -> Iterator[str]:
    """The built site over HTTP on 127.0.0.1, as `mkdocs serve` shows it: its base URL."""

    class Handler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Handler, directory=str(site))
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


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


def _page_problems(seen: dict, outside: list[str]) -> list[str]:
    problems = [f"{what}: {seen[what]}" for what in (
        "runOnTables", "swallowedLists", "headerOnlyTables", "rawMermaid", "brokenImages",
    ) if seen[what]]  # fmt: skip
    if seen["h1"] != 1:
        problems.append(f"{seen['h1']} titles (h1); one per page")
    if len(seen["diagrams"]) != seen["mermaidBlocks"]:
        problems.append(f"{seen['mermaidBlocks']} diagrams, {len(seen['diagrams'])} drawn")
    problems += [
        f"a diagram's words are drawn {d['fontPx']:.1f} px high (under {MIN_DIAGRAM_FONT_PX:g})"
        for d in seen["diagrams"]
        if not d["fontPx"] >= MIN_DIAGRAM_FONT_PX
    ]
    if outside:
        problems.append(f"fetched from outside the site: {sorted(set(outside))}")
    return problems


@pytest.mark.timeout(240)
def test_every_page_renders_in_a_browser(site: Path, served: str) -> None:
    """One headless Chromium loads every built page from a local server and reads what a person
    would see: a table whose rows fell into a paragraph (a blank line after its `|---|` row,
    which `mkdocs build --strict` lets through), a table of a header alone, a list run into the
    paragraph before it, a mermaid diagram left as source (its script not served with the site)
    or drawn too small to read, an image that does not load, more or less than one title, and
    any request to another host (a CDN, web fonts): readers beside a GPU cluster are often
    offline."""
    check = PAGE_CHECK.read_text()
    pages = sorted(p.parent.relative_to(site).as_posix() for p in site.rglob("index.html"))
    nav = re.findall(r"^\s+- [^:]+: (\S+)\.md$", (ROOT / "mkdocs.yml").read_text(), flags=re.M)
    wanted = {"." if n == "index" else n.removesuffix("/index") for n in nav}
    assert wanted and not wanted - set(pages), sorted(wanted - set(pages))
    problems: dict[str, list[str]] = {}
    seen: dict[str, dict] = {}
    with Browser(width=1280, height=900) as browser:
        browser.start(before_each_page=OPEN_SHADOW_ROOTS)
        for name in pages:
            url = served if name == "." else f"{served}{name}/"
            browser.open(url)
            seen[name] = browser.evaluate(check)
            outside = [u for u in browser.requests if not u.startswith((served, "data:", "blob:"))]
            found = _page_problems(seen[name], outside)
            if found:
                problems[name] = found
    assert not problems, "\n".join(f"{name}: {p}" for name, ps in problems.items() for p in ps)
    # the checks saw what they look for: diagrams drawn, and the flame graphs the guide shows
    assert len(seen["architecture"]["diagrams"]) >= 3
    for name in ("user/merge", "user/demo"):
        flames = [i for i in seen[name]["images"] if "flame" in i["src"]]
        assert flames and all(i["width"] > 300 for i in flames), (name, seen[name]["images"])


def test_python_examples_are_valid_python() -> None:
    """Every ```python block of the README and the guides compiles as it is, so a reader can
    paste it (`...` stands for code of their own only where Python allows it)."""
    broken = []
    for md in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = md.read_text()
        for found in re.finditer(r"^```python\n(.*?)^```", text, flags=re.M | re.S):
            line = text[: found.start()].count("\n") + 2
            try:
                compile(found.group(1), f"{md.relative_to(ROOT)}:{line}", "exec")
            except SyntaxError as e:
                broken.append(f"{md.relative_to(ROOT)}:{line + (e.lineno or 1) - 1}: {e.msg}")
    assert not broken, broken


def test_vendored_mermaid_is_the_recorded_release() -> None:
    """The script the site serves is the npm release docsite/mermaid.py names (refresh both with
    scripts/vendor-mermaid.sh), with its licence beside it."""
    hook = importlib.util.spec_from_file_location("docsite_mermaid", ROOT / "docsite/mermaid.py")
    assert hook is not None and hook.loader is not None
    mermaid = importlib.util.module_from_spec(hook)
    hook.loader.exec_module(mermaid)
    script = ROOT / "docs" / mermaid.MERMAID_JS
    assert hashlib.sha256(script.read_bytes()).hexdigest() == mermaid.MERMAID_SHA256
    assert f'version:"{mermaid.MERMAID_VERSION}"' in script.read_text()
    assert "MIT" in (script.parent / "LICENSE").read_text()
