"""The docs' examples are the ones the end-to-end tests run: the flash-checkpoint example of the
README's quick start is the docs' Flash checkpoints example, and
tests/support/jobs/readme_flash_job.py (which tests/trainer/flash/test_readme_flash.py runs under a
real agent and a SIGKILL) holds its lines (the persist every 10 steps instead of 500)."""

from __future__ import annotations

import re

from repo import ROOT, SUPPORT


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def flash_example(text: str) -> list[str]:
    (block,) = [b for b in python_blocks(text) if "FlashCheckpointer(engine, " in b][:1]
    return [line for line in block.splitlines() if line.strip()]


def test_readme_and_docs_show_the_same_flash_example() -> None:
    readme = flash_example((ROOT / "README.md").read_text())
    docs = flash_example((ROOT / "docs/user/flash.md").read_text())
    assert readme == docs


def test_the_tested_job_runs_the_documented_lines() -> None:
    job = (SUPPORT / "jobs" / "readme_flash_job.py").read_text()
    lines = flash_example((ROOT / "docs/user/flash.md").read_text())
    body = lines[lines.index(next(x for x in lines if x.startswith("ckpt = "))) :]
    for line in body:
        line = line.replace('"/mnt/ckpt/run1"', "args.save_dir").replace("500", "10")
        line = line.replace("writes it to /mnt/ckpt/run1.", "writes it to save_dir.")
        assert line.strip() in job, line


def test_quick_start_agent_command_is_the_tested_one() -> None:
    readme = (ROOT / "README.md").read_text()
    test = (ROOT / "tests/trainer/flash/test_readme_flash.py").read_text()
    (cmd,) = re.findall(r"^diag agent ((?:.*\\\n)*.*)$", readme, flags=re.M)
    for flag, value in re.findall(r"(--[a-z-]+) (\S+)", cmd):
        # The test's own directories, and the user its ranks run as on this machine.
        if flag in ("--run-dir", "--timeline", "--trainer-uid"):
            assert f'"{flag}"' in test, flag
        else:
            assert f'"{flag}", "{value}"' in test, (flag, value)
