"""exit_process: exit handlers run, output is flushed, the exit code is kept."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path


def test_exit_process_runs_handlers_flushes_and_keeps_the_code(tmp_path: Path) -> None:
    marker = tmp_path / "handler-ran"
    script = textwrap.dedent(
        f"""
        import atexit, sys
        from diag.trainer import exit_process

        atexit.register(lambda: open({str(marker)!r}, "w").write("yes"))
        sys.stdout.write("no newline, still flushed")
        exit_process(3)
        """
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert run.returncode == 3, run.stderr
    assert run.stdout == "no newline, still flushed"
    assert marker.read_text() == "yes"
