"""`diag demo`: its flags (diag.cli.demosettings, standard library only, so `--help` needs
nothing installed) and the demo itself (diag.cli.demo), imported only when it runs."""

from __future__ import annotations

import argparse

from diag.cli.demosettings import add_arguments, settings

__all__ = ["add_arguments", "run"]


def run(args: argparse.Namespace) -> int:
    from diag.cli import demo

    return demo.main(settings(args))
