"""The docs site's reference pages, generated from the code at build time so they cannot drift:
the options of every `diag` subcommand (from their argparse parsers), the agent's option table
(flag, environment variable, config key, default, range), the Prometheus metric families and the
exit codes. Also a few root files as pages: the dated lab notebooks (BENCHMARKS.md,
RELIABILITY.md) as the site's history, and SECURITY.md.

mkdocs loads this module as a hook (`hooks:` in mkdocs.yml); `on_files` adds the pages. The
`*_page()` functions return Markdown and need no mkdocs, so tests call them directly.
"""

from __future__ import annotations

import argparse
import importlib
import io
import tokenize
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

# Files at the repository root that are also pages of the site: site path -> root file.
ROOT_PAGES = {
    "history/benchmarks.md": "BENCHMARKS.md",
    "history/reliability.md": "RELIABILITY.md",
    "security.md": "SECURITY.md",
}


def _cell(text: Any) -> str:
    """Text safe inside a Markdown table cell."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _code(text: Any) -> str:
    text = str(text)
    return f"`{text}`" if text else ""


# -- CLI ------------------------------------------------------------------------------------------


def subcommand_parser(name: str) -> argparse.ArgumentParser:
    """The parser `diag NAME` parses with, built as diag/cli/main.py builds it."""
    from diag.cli import main

    module_name, help_text = main.SUBCOMMANDS[name]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(
        prog=f"diag {name}", description=help_text[0].upper() + help_text[1:] + "."
    )
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="more log output (-vv for debug)"
    )
    module.add_arguments(parser)
    return parser


def _action_rows(
    parser: argparse.ArgumentParser, actions: Iterable[argparse.Action]
) -> Iterator[str]:
    formatter = parser._get_formatter()
    for action in actions:
        if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
            continue
        if action.option_strings:
            names = ", ".join(f"`{s}`" for s in action.option_strings)
        else:
            names = f"`{action.metavar or action.dest}` (positional)"
        if action.choices:
            value = " \\| ".join(f"`{c}`" for c in action.choices)
        elif action.nargs == 0:
            value = ""
        else:
            value = _code(action.metavar or action.dest.upper())
        shown = action.default not in (None, argparse.SUPPRESS, False, [], "")
        default = _code(action.default) if shown else ""
        help_text = formatter._expand_help(action) if action.help else ""
        yield f"| {names} | {value} | {default} | {_cell(help_text)} |"


def cli_page() -> str:
    from diag.cli import main

    out = [
        "# CLI reference",
        "",
        "Generated from the argparse parsers of `diag`'s subcommands (`diag/cli/main.py`'s "
        "`SUBCOMMANDS`, each module's `add_arguments`). `diag <command> --help` prints the same.",
        "",
        "| command | what it does |",
        "|---|---|",
    ]
    out += [f"| [`diag {n}`](#diag-{n}) | {_cell(h)} |" for n, (_, h) in main.SUBCOMMANDS.items()]
    for name in main.SUBCOMMANDS:
        parser = subcommand_parser(name)
        out += ["", f"## diag {name}", "", _cell(parser.description), ""]
        out += ["```text", parser.format_usage().strip(), "```", ""]
        for group in parser._action_groups:
            rows = list(_action_rows(parser, group._group_actions))
            if not rows:
                continue
            title = group.title or "options"
            title = "options" if title in ("optional arguments", "options") else title
            out += [f"**{title}**", "", "| flag | value | default | meaning |", "|---|---|---|---|"]
            out += [*rows, ""]
    return "\n".join(out) + "\n"


# -- the agent's option table ---------------------------------------------------------------------


def _default(value: Any) -> str:
    if value is None or value == () or value == {}:
        return ""
    if isinstance(value, tuple):
        return _code(",".join(str(v) for v in value))
    if isinstance(value, bool):
        return _code(str(value).lower())
    return _code(getattr(value, "value", value))


def _table_rows(table: Any, shown: Any = None) -> Iterator[str]:
    for opt in table.options:
        bounds = table.bounds_of(opt)
        allowed = bounds.describe() if bounds is not None else ""
        if opt.choices:
            allowed = ", ".join(f"`{c}`" for c in opt.choices)
        key = f"`{opt.name}` in `[{table.toml_table}]`"
        note = " (agent only)" if opt.agent_only else ""
        default = _default(opt.default)
        if shown is not None and opt.default is not None:
            default = _code(shown(opt.default))
        yield (
            f"| `{table.flag(opt)}` | `{table.env(opt)}` | {key} | {default} "
            f"| {allowed} | {_cell(opt.help)}{note} |"
        )


def agent_options_page() -> str:
    from diag.agent.config import options, precheckoptions
    from diag.agent.taint import taintconfig

    head = "| flag | environment | config key | default | allowed | meaning |\n|---|---|---|---|---|---|"
    return "\n".join(
        [
            "# Agent options",
            "",
            "Generated from the agent's option tables (`diag/agent/config/options.py`, "
            "`diag/agent/taint/taintconfig.py`, read by `diag/agent/optiontable/optiontable.py`). Each option is a "
            "flag, an environment variable and a key of the `--config` TOML file. Precedence: "
            "the flag, then the environment variable, then the config file, then the default. A "
            "value that does not parse, is not finite (NaN, infinity) or lies outside its range "
            "exits 2, naming the option, where the value came from and the range.",
            "",
            "## `[agent]`",
            "",
            head,
            *_table_rows(options.OPTIONS),
            "",
            "`--config FILE`: a TOML file with an `[agent]` table of the keys above "
            "(`hang_timeout = 120`) and a `[taint]` table of the keys below (`job_cap = 2`).",
            "",
            "## `[taint]`",
            "",
            "`diag taint` and `diag untaint` take these too, except those marked agent only.",
            "",
            head,
            *_table_rows(taintconfig.OPTIONS),
            "",
            "## `[precheck]`",
            "",
            "`diag precheck` takes these (`diag/agent/config/precheckoptions.py`), and its "
            "`--config FILE` reads its `[precheck]` table, which may sit in the agent's file. The "
            "rendezvous (`--master-addr`, `--master-port`, `--nnodes`, `--node-rank`) falls back "
            "to the launcher's own variables, not to `DIAG_` ones (see the CLI page).",
            "",
            *[
                line
                for title, table in (
                    ("What to measure", precheckoptions.MEASURE),
                    ("Thresholds", precheckoptions.THRESHOLDS),
                    ("Timeouts", precheckoptions.TIMEOUTS),
                )
                for line in (
                    f"**{title}**",
                    "",
                    head,
                    *_table_rows(table, precheckoptions.shown),
                    "",
                )
            ],
        ]
    )


# -- metrics --------------------------------------------------------------------------------------


def _families(module: Any) -> list[Any]:
    cls = module.Family
    return [v for v in vars(module).values() if isinstance(v, cls)]


def metrics_page() -> str:
    from diag.agent.metrics import families
    from diag.agent.precheck import promfile

    out = [
        "# Metric families",
        "",
        "Generated from their declarations: `diag/agent/metrics/families.py` (the agent's families) "
        "and `diag/agent/precheck/promfile.py` (the precheck's, which the agent re-exports). "
        "Counters are listed by the name a scrape shows (with `_total`); a histogram shows "
        "`_bucket`, `_sum` and `_count` samples.",
        "",
        "## The agent",
        "",
        "| family | type | labels | meaning |",
        "|---|---|---|---|",
    ]
    for fam in families.FAMILIES:
        out.append(
            f"| `{fam.exposed[0] if fam.kind == families.Kind.COUNTER else fam.name}` "
            f"| {fam.kind.value} | {', '.join(fam.labels)} | {_cell(fam.help)} |"
        )
    out += ["", "Histogram buckets (seconds):", ""]
    for fam in families.FAMILIES:
        if fam.buckets:
            out.append(f"- `{fam.name}`: {', '.join(f'{b:g}' for b in fam.buckets)}")
    xpu = families.XPU_TIMER_HANG
    out += [
        "",
        "## xpu_timer compatibility",
        "",
        "Only with `--xpu-timer-compat true`; its labels are xpu_timer's.",
        "",
        "| family | type | labels | meaning |",
        "|---|---|---|---|",
        f"| `{xpu.name}` | {xpu.kind.value} | {', '.join(xpu.labels)} | {_cell(xpu.help)} |",
        "",
        "## The precheck",
        "",
        "Gauges written by `diag precheck --metrics-file` and re-exported by the agent.",
        "",
        "| family | labels | meaning |",
        "|---|---|---|",
    ]
    for fam in _families(promfile):
        out.append(f"| `{fam.name}` | {', '.join(fam.labels)} | {_cell(fam.help)} |")
    return "\n".join(out) + "\n"


# -- exit codes -----------------------------------------------------------------------------------


def exit_codes() -> list[tuple[int, str, str]]:
    """(code, name, meaning) from diag/formats/exitcodes.py: each constant and its comment (the
    trailing one, else the comment lines just above it)."""
    from diag.formats import exitcodes

    source = Path(exitcodes.__file__).read_text()
    comments: dict[int, str] = {}  # line -> comment text
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    rows = []
    for lineno, line in enumerate(source.splitlines(), start=1):
        name, sep, _ = line.partition(" = ")
        if not sep or not name.isupper() or not isinstance(getattr(exitcodes, name), int):
            continue
        text = comments.get(lineno)
        if text is None:
            above = []
            n = lineno - 1
            while n in comments and source.splitlines()[n - 1].lstrip().startswith("#"):
                above.insert(0, comments[n])
                n -= 1
            text = " ".join(above)
        code = getattr(exitcodes, name)
        rows.append((code, name, text or ("success" if code == 0 else "")))
    return sorted(rows)


def exit_codes_page() -> str:
    out = [
        "# Exit codes",
        "",
        "Generated from `diag/formats/exitcodes.py`. Kubeflow's `restartPolicy: ExitCode` treats "
        "1-127 as permanent and 128-255 as retryable, so codes that ask for a restart sit at 128 "
        "and above.",
        "",
        "| code | name | meaning |",
        "|---|---|---|",
    ]
    out += [f"| {code} | `{name}` | {_cell(text)} |" for code, name, text in exit_codes()]
    return "\n".join(out) + "\n"


def root_page(root_file: str) -> str:
    return (ROOT / root_file).read_text()


PAGES = {
    "reference/cli.md": cli_page,
    "reference/agent-options.md": agent_options_page,
    "reference/metrics.md": metrics_page,
    "reference/exit-codes.md": exit_codes_page,
}


# -- the mkdocs hook ------------------------------------------------------------------------------


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    for path, render in PAGES.items():
        files.append(File.generated(config, path, content=render()))
    for path, root_file in ROOT_PAGES.items():
        files.append(File.generated(config, path, content=root_page(root_file)))
    return files


def on_config(config: Any) -> Any:
    # Root files are pages too: rebuild when they change under `mkdocs serve`.
    config.watch.extend(str(ROOT / f) for f in ROOT_PAGES.values())
    return config
