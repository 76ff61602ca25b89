"""deploy/image/Dockerfile read as its stages, for the tests that check the image build without a
container engine (tests/deploy/test_image_lint.py, tests/deploy/test_wheel.py)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from repo import ROOT

DOCKERFILE = ROOT / "deploy" / "image" / "Dockerfile"


@dataclass
class Stage:
    name: str  # '' for an unnamed stage
    image: str  # what it is FROM
    instructions: list[tuple[str, str]] = field(default_factory=list)  # (WORD, the rest)

    def runs(self) -> list[str]:
        return [rest for word, rest in self.instructions if word == "RUN"]

    def env(self) -> dict[str, str]:
        """The stage's ENV settings (the `ENV A=1 B=2` form)."""
        out: dict[str, str] = {}
        for word, rest in self.instructions:
            if word == "ENV":
                out.update(pair.split("=", 1) for pair in rest.split())
        return out

    def copies(self) -> list[tuple[str, list[str], str]]:
        """(--from stage or '', sources, destination) of each COPY."""
        out = []
        for word, rest in self.instructions:
            if word == "COPY":
                parts = rest.split()
                source = parts[0].removeprefix("--from=") if parts[0].startswith("--from=") else ""
                paths = parts[1:] if source else parts
                out.append((source, paths[:-1], paths[-1]))
        return out


def instructions(text: str | None = None) -> list[tuple[str, str]]:
    """Every instruction, continuation lines joined (a comment between them dropped)."""
    text = DOCKERFILE.read_text() if text is None else text
    text = re.sub(r"\\\n", " ", text)
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def stages(text: str | None = None) -> dict[str, Stage]:
    """The stages by name, in order; an unnamed stage is ''."""
    out: dict[str, Stage] = {}
    current: Stage | None = None
    for word, rest in instructions(text):
        if word == "FROM":
            image, _, name = rest.partition(" AS ")
            current = Stage(name.strip(), image.strip())
            out[current.name] = current
        elif current is not None:
            current.instructions.append((word, rest))
    return out
