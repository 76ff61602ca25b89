"""Prints, one per line, the uv options that stand for pip's configured package sources.

uv does not read pip's configuration files or its PIP_* variables; `pip config list` shows
both (the variables as `:env:.name`), so the bootstrap installs from the same indexes, links
and constraints with either tool.
"""

from __future__ import annotations

import ast
import subprocess
import sys

# pip's option -> uv's; each value may list several, separated by whitespace.
OPTIONS = {
    "index-url": "--index-url",
    "extra-index-url": "--extra-index-url",
    "find-links": "--find-links",
    "constraint": "--constraint",
}


def main() -> int:
    listing = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    seen: set[tuple[str, str]] = set()
    for line in listing.splitlines():
        key, sep, raw = line.partition("=")
        if not sep:
            continue
        option = OPTIONS.get(key.rpartition(".")[2])
        if option is None:
            continue
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            print(f"uv_index_args: cannot read pip's setting {line!r}", file=sys.stderr)
            return 1
        for item in str(value).split():
            if (option, item) not in seen:
                seen.add((option, item))
                print(option)
                print(item)
    return 0


if __name__ == "__main__":
    sys.exit(main())
