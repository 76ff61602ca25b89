"""What we refuse of another process's input, as values: the `UntrustedInput` error, the size
units of the caps, and the checks on a value once read (printable text, bounded ints). Pure: the
parsers and the pure cores use it without the file access of `untrusted`, which re-exports it.
"""

from __future__ import annotations

import re
from os import PathLike

KIB = 1024
MIB = 1024 * KIB


class UntrustedInput(ValueError):
    """A file or value from another process that we refuse, with the reason."""

    def __init__(self, path: str | PathLike[str], problem: str) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


# C0 controls but tab and newline, DEL, C1 controls; ESC starts the sequences that move a
# terminal's cursor or rewrite its title, so whole CSI/OSC sequences go, not only the ESC.
_ANSI = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)?|[@-Z\\-_])")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str, *, keep_newlines: bool = True) -> str:
    """`text` with terminal escape sequences and control characters removed."""
    text = _CONTROL.sub("", _ANSI.sub("", text))
    return text if keep_newlines else text.replace("\n", " ").replace("\t", " ")


def bounded_int(value: object, *, lo: int, hi: int, what: str, source: str) -> int:
    """An int from parsed input, within [lo, hi]; bools and floats are not ints here."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise UntrustedInput(source, f"{what} must be an integer, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise UntrustedInput(source, f"{what} {value} is out of range [{lo}, {hi}]")
    return value
