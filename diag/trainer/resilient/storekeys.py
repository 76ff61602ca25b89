"""The names in the launcher's store that in-place recovery and `diag launch` share: a launch
attempt's key space, the generations of each `resilient` run under it, the generation being
formed (which a replacement joins) and the ranks that recover in place (which the launcher
replaces instead of restarting every rank). Pure: names and the parsing of what is read back."""

from __future__ import annotations

JOIN_ENV = "DIAG_RESILIENT_JOIN"  # set by diag launch for a rank that takes a dead one's place
_MAX_FIELD = 12  # digits: a generation or a run counter, read from a store anyone may write


def attempt_key(attempt: int, name: str) -> str:
    return f"diag/resilient/{attempt}/{name}"


def generation_key(attempt: int, call: int, generation: int, name: str = "") -> str:
    return attempt_key(attempt, f"{call}/{generation}/{name}")


def forming_key(attempt: int) -> str:
    """Holds "<call> <generation>": the generation the ranks began forming last."""
    return attempt_key(attempt, "forming")


def member_key(attempt: int, rank: int) -> str:
    """Set once `rank` runs under `resilient`: it recovers in place, and may be replaced alone."""
    return attempt_key(attempt, f"member/{rank}")


def joined_name(rank: int) -> str:
    """Under a generation's keys: `rank` was a member of that generation once it formed."""
    return f"joined/{rank}"


def forming_text(call: int, generation: int) -> str:
    return f"{call} {generation}"


def parse_forming(raw: bytes) -> tuple[int, int] | None:
    """(call, generation) from a forming key's value, or None when it is not two small
    non-negative numbers."""
    parts = raw[: 2 * _MAX_FIELD + 1].decode("ascii", errors="replace").split(" ")
    if len(parts) != 2 or not all(p.isdigit() and len(p) <= _MAX_FIELD for p in parts):
        return None
    return int(parts[0]), int(parts[1])
