"""Option tables: one declaration per option, read as a flag, an environment variable and a key of
a TOML table, in that order of precedence, and parsed once into a typed value.

A table has its prefixes: the agent's options are `--hang-timeout` / `DIAG_HANG_TIMEOUT` /
`hang_timeout` in `[agent]`; the taint options `--taint-job-cap` / `DIAG_TAINT_JOB_CAP` / `job_cap`
in `[taint]`. A value that does not parse, is not finite (nan, inf) or lies outside the
option's declared `Bounds` is a usage error naming the option, where the value came from (flag,
environment or file) and what is allowed.
"""

from __future__ import annotations

import argparse
import math
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from diag.formats.exitcodes import UsageError
from diag.formats.untrusted import MIB, UntrustedInput, printable, read_bounded

CONFIG_MAX_BYTES = 1 * MIB  # a config file is a few hundred bytes; anything huge is a mistake


@dataclass(frozen=True)
class Bounds:
    """The closed (or, with `lo_open`, half-open) range a numeric option's value must lie in."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False  # lo itself is not allowed (intervals, timeouts: > 0)

    def allows(self, value: float) -> bool:
        if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo):
            return False
        return self.hi is None or value <= self.hi

    def describe(self) -> str:
        left = "(" if self.lo_open or self.lo is None else "["
        right = ")" if self.hi is None else "]"
        return f"{left}{_number(self.lo, '-inf')}, {_number(self.hi, 'inf')}{right}"


def _number(value: float | None, none: str) -> str:
    if value is None:
        return none
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


@dataclass(frozen=True)
class Option:
    name: str
    parse: Callable[[str], Any]
    default: Any
    help: str
    choices: tuple[str, ...] | None = None
    agent_only: bool = False  # not offered by the one-shot commands (`diag taint`, `untaint`)
    bounds: Bounds | None = None  # numeric options: the allowed range (see OptionTable.bounds)


@dataclass(frozen=True)
class OptionTable:
    options: tuple[Option, ...]
    prefix: str = ""  # "taint_": flags --taint-NAME, variables DIAG_TAINT_NAME, dest taint_NAME
    toml_table: str = "agent"
    # "PRECHECK_": variables DIAG_PRECHECK_NAME while the flags stay --NAME (a command's own
    # flags, whose plain variables would collide with the agent's)
    env_prefix: str = ""
    # option name -> its allowed range; kept beside the declarations so that ranges are added
    # without touching them (an option's own `bounds` wins)
    bounds: Mapping[str, Bounds] = field(default_factory=dict)

    def with_bounds(self, bounds: Mapping[str, Bounds]) -> OptionTable:
        unknown = set(bounds) - {o.name for o in self.options}
        if unknown:
            raise ValueError(f"bounds for unknown options: {', '.join(sorted(unknown))}")
        return replace(self, bounds={**self.bounds, **bounds})

    def bounds_of(self, opt: Option) -> Bounds | None:
        return opt.bounds or self.bounds.get(opt.name)

    def flag(self, opt: Option) -> str:
        return "--" + (self.prefix + opt.name).replace("_", "-")

    def env(self, opt: Option) -> str:
        return "DIAG_" + self.env_prefix + (self.prefix + opt.name).upper()

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
                bounds = self.bounds_of(opt)
                allowed = f"; range {bounds.describe()}" if bounds is not None else ""
                parser.add_argument(
                    self.flag(opt),
                    dest=self.dest(opt),
                    default=None,
                    choices=opt.choices,
                    help=f"{opt.help} [env {self.env(opt)}; default "
                    f"{show_default(opt.default)}{allowed}]",
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
            flag = self.flag(opt)
            raw, source, origin = getattr(args, self.dest(opt), None), flag, "given as a flag"
            if raw is None and self.env(opt) in env:
                raw, source = env[self.env(opt)], self.env(opt)
                origin = f"environment variable for {flag}"
            if raw is None and opt.name in file_values:
                raw = file_values[opt.name]
                source = f"{file}: [{self.toml_table}] {opt.name}"
                origin = f"config file key for {flag}"
                raw = from_file(opt, raw) if from_file is not None else _joined(raw)
            if raw is None:
                values[opt.name] = opt.default
                continue
            if opt.choices and str(raw) not in opt.choices:
                raise UsageError(f"{source}: {raw!r} is not one of {', '.join(opt.choices)}")
            try:
                value = opt.parse(str(raw))
            except (ValueError, OverflowError) as e:
                raise UsageError(f"{source}: {e} ({origin}{self._allowed(opt)})") from e
            problem = self._problem(opt, value, raw)
            if problem is not None:
                raise UsageError(f"{source}: {problem} ({origin}{self._allowed(opt)})")
            values[opt.name] = value
        return values

    def _allowed(self, opt: Option) -> str:
        bounds = self.bounds_of(opt)
        return f"; allowed: {bounds.describe()}" if bounds is not None else ""

    def _problem(self, opt: Option, value: Any, raw: Any) -> str | None:
        """NaN and infinity are never an option's value; numbers stay within their bounds."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return None
        if isinstance(value, float) and not math.isfinite(value):
            return f"{raw!r} is not a finite number"
        bounds = self.bounds_of(opt)
        if bounds is not None and not bounds.allows(value):
            return f"{raw!r} is out of range"
        return None


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
    raw = read_toml(path)
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


def read_toml(path: Path) -> dict[str, Any]:
    """A TOML config file the user named: a regular file (not a FIFO, a directory or a device),
    at most CONFIG_MAX_BYTES, UTF-8 text, valid TOML; anything else is a UsageError."""
    try:
        data = read_bounded(path, max_bytes=CONFIG_MAX_BYTES)
    except UntrustedInput as e:
        problem = "no such file" if e.problem == "does not exist" else e.problem
        raise UsageError(f"--config {path}: {problem}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(
            f"--config {path}: not UTF-8 text (byte {e.start}): give a TOML file"
        ) from None
    if "\x00" in text:
        raise UsageError(f"--config {path}: contains NUL bytes: give a TOML file")
    try:
        return tomllib.loads(text)
    except (tomllib.TOMLDecodeError, RecursionError, ValueError) as e:
        raise UsageError(f"--config {path}: not valid TOML: {printable(str(e))}") from None


# -- value parsers: text in, a typed value out, ValueError with what was expected ----------------


def finite(text: str) -> float:
    """A float that is a number: nan and inf would turn every comparison into a silent no."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"expected a finite number, got {text!r}")
    return value


def positive(text: str) -> float:
    value = finite(text)
    if value <= 0:
        raise ValueError(f"must be > 0, got {text}")
    return value


def non_negative(text: str) -> float:
    value = finite(text)
    if value < 0:
        raise ValueError(f"must be >= 0, got {text}")
    return value


def integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"expected a whole number, got {text!r}") from None


def count(text: str) -> int:
    value = integer(text)
    if value < 0:
        raise ValueError(f"must be >= 0, got {text}")
    return value


def size(text: str) -> int:
    """Bytes from `2GiB`, `500MB` or a plain number."""
    from diag.agent.node.units import parse_size

    try:
        return parse_size(str(text))
    except OverflowError:
        raise ValueError(f"size {text!r} is too large") from None


def bounded_type(
    lo: float, hi: float, parse: Callable[[str], float] = finite, *, lo_open: bool = False
) -> Callable[[str], Any]:
    """An argparse type: a finite number in [lo, hi] (nan, inf and the rest exit 2, naming
    the flag and the range)."""

    bounds = Bounds(lo, hi, lo_open=lo_open)
    allowed = bounds.describe()

    def check(text: str) -> float:
        try:
            value = parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{e}; allowed: {allowed}") from None
        if not bounds.allows(value):
            raise argparse.ArgumentTypeError(f"{text!r} is out of range; allowed: {allowed}")
        return value

    return check


def boolean(text: str) -> bool:
    low = str(text).strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {text!r}")
