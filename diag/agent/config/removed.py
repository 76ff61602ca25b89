"""The agent's options of earlier versions, which fail loudly, naming what replaced them: a
setting silently ignored would mislead."""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from diag.formats.exitcodes import UsageError

_BOARD_GONE = (
    "the peer board is gone; a rank on another node is named by the job verdict, from the views "
    "the nodes file with their incident reports"
)
REMOVED = {"peers": _BOARD_GONE, "peers_dir": _BOARD_GONE, "peer_interval": _BOARD_GONE}


def check_removed(args: argparse.Namespace, env: Mapping[str, str], file_keys: set[str]) -> None:
    """Options of earlier versions fail loudly: a silently ignored setting misleads."""
    for name, why in REMOVED.items():
        flag, var = f"--{name.replace('_', '-')}", f"DIAG_{name.upper()}"
        if getattr(args, name, None) is not None:
            where = flag
        elif var in env:
            where = var
        elif name in file_keys:
            where = f"{args.config}: {name}"
        else:
            continue
        raise UsageError(f"{where} was removed: {why}; drop it")
