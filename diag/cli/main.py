"""`diag`: the one command-line entry point. Each subcommand lives in its own module, imported
only when that subcommand runs, so `diag agent` never pays for (or imports) torch."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import typing
from collections.abc import Sequence
from typing import TextIO

from diag.formats import exitcodes
from diag.formats.untrusted import printable

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class PrintableFormatter(logging.Formatter):
    """Log lines carry names from input (frames, ops, phases, hosts, files): their terminal
    escapes and control characters go, and a newline in them cannot forge another line. A
    traceback keeps its lines."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        return printable(super().formatMessage(record), keep_newlines=False)


def configure_logging(verbose: int, stream: TextIO | None = None) -> None:
    handler = logging.StreamHandler(stream)
    handler.setFormatter(PrintableFormatter(LOG_FORMAT))
    logging.basicConfig(level=logging.WARNING - 10 * min(verbose + 1, 2), handlers=[handler])


# name -> (module, one-line help). A module provides `add_arguments(parser)` and `run(args) -> int`.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "agent": (
        "diag.cli.agentcmd",
        "run the per-node sidecar: watch local ranks, detect hangs, act",
    ),
    "dump": ("diag.cli.dumpcmd", "capture stacks and journals of ranks now, as an incident"),
    "merge": (
        "diag.cli.mergecmd",
        "merge an incident's per-rank stacks into flame SVGs and a summary",
    ),
    "precheck": (
        "diag.cli.precheckcmd",
        "check devices and network before training; name bad nodes",
    ),
    "taint": (
        "diag.cli.taintcmd",
        "taint this node with its evidence (plan, then apply; --dry-run prints the plan)",
    ),
    "untaint": ("diag.cli.untaintcmd", "remove diag's taint and condition from a node"),
    "launch": (
        "diag.cli.launchcmd",
        "torchrun with warm spares: a dead worker is replaced alone when its rank recovers in place",
    ),
    "demo": (
        "diag.cli.democmd",
        "run a local CPU DeepSpeed job with an injected fault under a real agent",
    ),
}


class _Parser(argparse.ArgumentParser):
    """A bad flag is one line, like every other usage error; `--help` has the full usage."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(
            exitcodes.USAGE,
            f"{self.prog}: error: {printable(message, keep_newlines=False)} "
            f"(see {self.prog} --help)\n",
        )


def _top_help() -> str:
    width = max(len(n) for n in SUBCOMMANDS)
    lines = [f"  {n:<{width}}  {h}" for n, (_, h) in SUBCOMMANDS.items()]
    return (
        "usage: diag <command> [options]\n\n"
        "Fault-tolerance and diagnostics agent for distributed PyTorch/DeepSpeed training.\n\n"
        "commands:\n"
        + "\n".join(lines)
        + "\n\nRun `diag <command> --help` for a command's options, `diag --version` for the "
        "version."
    )


def _version() -> str:
    """The installed distribution's version; a source tree run without installing has none."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("diag")
    except PackageNotFoundError:
        return "(not installed: pip install . in the repository gives it a version)"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_top_help())
        return exitcodes.OK if argv else exitcodes.USAGE
    if argv[0] in ("--version", "-V"):
        print(f"diag {_version()}")
        return exitcodes.OK
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"diag: unknown command {name!r}\n\n{_top_help()}", file=sys.stderr)
        return exitcodes.USAGE
    module_name, help_text = SUBCOMMANDS[name]
    module = importlib.import_module(module_name)
    parser = _Parser(prog=f"diag {name}", description=help_text[0].upper() + help_text[1:] + ".")
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="more log output (-vv for debug)"
    )
    module.add_arguments(parser)
    try:
        args = parser.parse_args(rest)
    except SystemExit as e:  # argparse has printed the usage error (2) or the help (0)
        return e.code if isinstance(e.code, int) else exitcodes.USAGE
    configure_logging(args.verbose)
    try:
        return int(module.run(args))
    except exitcodes.UsageError as e:
        print(f"diag {name}: error: {printable(str(e), keep_newlines=False)}", file=sys.stderr)
        return exitcodes.USAGE
    except KeyboardInterrupt:
        return exitcodes.INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
