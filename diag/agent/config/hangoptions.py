"""The agent's options of hang detection and what follows a verdict: its limits (adaptive,
warm-up, phases, the idle rule) and `--on-hang`. Part of the agent's one table (options.py).
"""

from __future__ import annotations

from diag.agent.detect.hang import OnHang
from diag.agent.optiontable.optiontable import Option, non_negative, positive


def parse_phases(text: str) -> dict[str, float]:
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, seconds = part.partition("=")
        if not sep or not name:
            raise ValueError(f"expected NAME=SECONDS, got {part!r}")
        value = positive(seconds)
        if value > 7 * 86400:
            raise ValueError(f"{name.strip()}={seconds}: at most a week (604800 s)")
        out[name.strip()] = value
    return out


HANG_OPTIONS = (
    Option(
        "hang_timeout",
        positive,
        300.0,
        "ceiling of the hang limit in seconds; the limit adapts "
        "below it and stays under torch's collective timeout",
    ),
    Option("hang_floor", positive, 10.0, "floor of the adaptive hang limit in seconds"),
    Option(
        "hang_factor",
        positive,
        5.0,
        "adaptive limit = factor x slowest step/op of this launch since warm-up",
    ),
    Option(
        "idle_factor",
        non_negative,
        2.0,
        "the factor instead, for a wait on a local rank idle outside any collective (next to no "
        "CPU in it or its children, no I/O): stuck, not slow; doubled after each such verdict "
        "within 30 min (0: off)",
    ),
    Option("warmup_steps", int, 2, "steps before the adaptive limit applies"),
    Option("warmup_timeout", positive, 900.0, "hang limit during the warm-up steps"),
    Option(
        "warmup_cadence",
        non_negative,
        30.0,
        "a rank that marks no steps leaves warm-up after its ops completed at a steady pace for "
        "this many seconds (0: it keeps the warm-up limit)",
    ),
    Option("phase_timeout", parse_phases, {}, "per-phase limits, NAME=SECONDS[,NAME=SECONDS]"),
    Option("default_phase_timeout", positive, 1800.0, "limit inside phases not listed"),
    Option(
        "on_hang",
        str,
        "none",
        "what to do after the evidence is on disk",
        choices=tuple(m.value for m in OnHang),
    ),
    Option(
        "stop_grace",
        positive,
        10.0,
        "seconds between SIGTERM and SIGKILL when stopping ranks (with --on-hang recover, "
        "also the most a rank's answer is waited for, itself at most 3 s)",
    ),
)
