"""Option tables: one declaration per option, read as a flag, an environment variable and a key of
a TOML table, in that order of precedence, and parsed once into a typed value.

A table has its prefixes: the agent's options are `--hang-timeout` / `DIAG_HANG_TIMEOUT` /
`hang_timeout` in `[agent]`; the taint options `--taint-job-cap` / `DIAG_TAINT_JOB_CAP` / `job_cap`
in `[taint]`. A value that does not parse is a usage error naming where it came from.
"""

from __future__ import annotations

import argparse
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diag.agent.exitcodes import UsageError


@dataclass(frozen=True)
class Option:
    name: str
    parse: Callable[[str], Any]
    default: Any
    help: str
    choices: tuple[str, ...] | None = None
    agent_only: bool = False  # not offered by the one-shot commands (`diag taint`, `untaint`)


@dataclass(frozen=True)
class OptionTable:
    options: tuple[Option, ...]
    prefix: str = ""  # "taint_": flags --taint-NAME, variables DIAG_TAINT_NAME, dest taint_NAME
    toml_table: str = "agent"

    def flag(self, opt: Option) -> str:
        return "--" + (self.prefix + opt.name).replace("_", "-")

    def env(self, opt: Option) -> str:
        return "DIAG_" + (self.prefix + opt.name).upper()

    def dest(self, opt: Option) -> str:
        return self.prefix + opt.name

    def add_arguments(
        self,
        parser: argparse.ArgumentParser | Any,  # a parser or an argument group
        *,
        show_default: Callable[[Any], str] = str,
        keep: Callable[[Option], bool] = lambda o: True,
    ) -> None:
        for opt in self.options:
            if keep(opt):
                parser.add_argument(
                    self.flag(opt),
                    dest=self.dest(opt),
                    default=None,
                    choices=opt.choices,
                    help=f"{opt.help} [env {self.env(opt)}; default {show_default(opt.default)}]",
                )

    def resolve(
        self,
        args: argparse.Namespace,
        env: Mapping[str, str],
        file_values: Mapping[str, Any],
        file: Path | None,
        *,
        from_file: Callable[[Option, Any], str] | None = None,
    ) -> dict[str, Any]:
        """Every option's value: its flag, else its variable, else its key in the file, else its
        default. `from_file` turns a TOML value (a list, a table) into the text the parser
        takes (default: lists joined by commas)."""
        values: dict[str, Any] = {}
        for opt in self.options:
            raw, source = getattr(args, self.dest(opt), None), self.flag(opt)
            if raw is None and self.env(opt) in env:
                raw, source = env[self.env(opt)], self.env(opt)
            if raw is None and opt.name in file_values:
                raw = file_values[opt.name]
                source = f"{file}: [{self.toml_table}] {opt.name}"
                raw = from_file(opt, raw) if from_file is not None else _joined(raw)
            if raw is None:
                values[opt.name] = opt.default
                continue
            if opt.choices and str(raw) not in opt.choices:
                raise UsageError(f"{source}: {raw!r} is not one of {', '.join(opt.choices)}")
            try:
                values[opt.name] = opt.parse(str(raw))
            except ValueError as e:
                raise UsageError(f"{source}: {e}") from e
        return values


def _joined(raw: Any) -> Any:
    return ",".join(str(v) for v in raw) if isinstance(raw, list) else raw


def read_toml_table(
    path: Path,
    table: str,
    known: Iterable[str],
    *,
    top_level_default: bool = False,
    other_tables: tuple[str, ...] = (),
) -> dict[str, Any]:
    """The `[table]` of the TOML file `path`, its keys checked against `known` (a dash in a key
    reads as an underscore). With `top_level_default`, a file without `[table]` is read from its
    top level, less the `other_tables` that other readers take."""
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError as e:
        raise UsageError(f"--config {path}: no such file") from e
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"--config {path}: not valid TOML: {e}") from e
    if table in raw or not top_level_default:
        section = raw.get(table, {})
    else:
        section = {k: v for k, v in raw.items() if k not in other_tables}
    if not isinstance(section, dict):
        raise UsageError(f"--config {path}: [{table}] must be a table")
    names = set(known)
    out = {}
    for key, value in section.items():
        name = key.replace("-", "_")
        if name not in names:
            raise UsageError(f"--config {path}: unknown option {key!r} in [{table}]")
        out[name] = value
    return out


# -- value parsers: text in, a typed value out, ValueError with what was expected ----------------


def positive(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise ValueError(f"must be > 0, got {text}")
    return value


def non_negative(text: str) -> float:
    value = float(text)
    if value < 0:
        raise ValueError(f"must be >= 0, got {text}")
    return value


def count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(f"must be >= 0, got {text}")
    return value


def boolean(text: str) -> bool:
    low = str(text).strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {text!r}")
