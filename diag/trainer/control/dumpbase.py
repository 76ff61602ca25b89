"""Where an agent's DUMP command may have a rank write its stacks: beneath the rank's run
directory or its timeline (DIAG_TIMELINE; by default the agent's default timeline), nowhere else.
The agent names an absolute directory (its incident directory); what follows the base must be a
plain relative path: no `..`, `.` or empty components.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from diag.formats.untrusted import UntrustedInput, relative_parts

TIMELINE_ENV = "DIAG_TIMELINE"
DEFAULT_TIMELINE = "/root/timeline"  # the agent's default --timeline (diag.agent.config.options)


@dataclass(frozen=True)
class DumpBases:
    """The directories beneath which a DUMP command may have the rank write."""

    bases: tuple[Path, ...]

    @classmethod
    def resolve(cls, run_dir: Path, env: Mapping[str, str] = os.environ) -> DumpBases:
        timeline = env.get(TIMELINE_ENV, "").strip() or DEFAULT_TIMELINE
        found: list[Path] = []
        for p in (Path(os.path.abspath(run_dir)), Path(os.path.abspath(timeline))):
            if p not in found:
                found.append(p)
        return cls(tuple(found))

    def confine(self, directory: str) -> tuple[Path, tuple[str, ...]]:
        """The base `directory` lies beneath and the components below it; refuses anything
        else (relative, `..`, `.`, empty components, outside every base)."""
        for base in self.bases:
            prefix = str(base).rstrip("/") + "/"
            if directory.startswith(prefix):
                rest = directory[len(prefix) :]
                return base, relative_parts(rest, what="the dump directory") if rest else ()
            if directory == str(base):
                return base, ()
        allowed = ", ".join(str(b) for b in self.bases)
        raise UntrustedInput(
            directory,
            f"the dump directory is not beneath the rank's run directory or timeline ({allowed}); "
            f"set {TIMELINE_ENV} in the trainer to the agent's --timeline",
        )
