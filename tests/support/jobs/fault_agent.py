"""`diag agent` with the persist and commit phases marked for faults.py (the kill suite).

    python tests/support/jobs/fault_agent.py --ctl C --go C/agent-go-3 -- agent --run-dir ... (diag's args)

Imports everything, waits for the go file (so a replacement can be started ahead of a kill), then
runs the real agent's entry point.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ctl", required=True)
    p.add_argument("--go", required=True)
    p.add_argument("rest", nargs=argparse.REMAINDER)
    args = p.parse_args()
    from faults import Injector, install_agent

    from diag.cli import main as cli

    install_agent(Injector(Path(args.ctl), "agent"))
    go, stop = Path(args.go), Path(args.ctl) / "stop"
    while not go.exists():
        if stop.exists():
            return 0
        time.sleep(0.01)
    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    return cli.main(rest)


if __name__ == "__main__":
    sys.exit(main())
