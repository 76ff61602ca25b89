"""A warm spare: a process started ahead of time on the node, with torch, DeepSpeed and diag's
trainer imported, waiting on its standard input for the rank it is to take. The launcher
writes one line (an `Order`: the rank's environment and the script's argv) and closes the
pipe; the spare then runs the script as `python -u script args` would, in this process. End of
input without an order (the launcher stopped) exits 0.

    python -u -m diag.launch.spare      # started by diag launch, never by hand
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from dataclasses import dataclass

ORDER_MAX = 1 << 20  # bytes: an environment and a command line
READY_FD_ENV = "DIAG_SPARE_READY_FD"  # the pipe a spare writes a byte to once it has imported
# What a rank's first engine imports, in the order it does: torch, DeepSpeed, diag's trainer,
# then what DeepSpeed's first `initialize` imports lazily (measured: dynamo, ~3.5 s, reached from
# torch.optim's first optimizer; ZeRO's optimizer check imports its Muon module, ~2.6 s). A
# name a version lacks is skipped.
PRELOAD = (
    "torch", "torch.distributed", "deepspeed", "diag.trainer", "diag.trainer.resilient",
    "torch._dynamo", "deepspeed.runtime.engine", "deepspeed.runtime.zero.stage_1_and_2",
    "deepspeed.runtime.zero.stage3", "deepspeed.runtime.zero.muon.muon_optimizer",
)  # fmt: skip


class BadOrder(ValueError):
    pass


@dataclass(frozen=True)
class Order:
    env: dict[str, str]  # set over the spare's own environment (the launcher's)
    argv: list[str]  # the script and its arguments

    def encode(self) -> bytes:
        return json.dumps({"env": self.env, "argv": self.argv}).encode() + b"\n"

    @classmethod
    def decode(cls, raw: bytes) -> Order:
        if len(raw) > ORDER_MAX:
            raise BadOrder(f"an order of {len(raw)} bytes (at most {ORDER_MAX})")
        try:
            d = json.loads(raw)
        except ValueError as e:
            raise BadOrder(f"an order that is not JSON ({e})") from None
        env, argv = (d.get("env"), d.get("argv")) if isinstance(d, dict) else (None, None)
        if not isinstance(env, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and k and "=" not in k and "\0" not in k + v
            for k, v in env.items()
        ):
            raise BadOrder("an order whose env is not a map of variable names to strings")
        if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
            raise BadOrder("an order whose argv is not a non-empty list of strings")
        return cls(dict(env), list(argv))


def preload() -> None:
    """What a cold start spends its first seconds on (torch ~1 s, DeepSpeed ~2.4 s, which
    imports torch's dynamo and inductor)."""
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError as e:  # the script may not need it; a cold start would fail alike
            print(f"diag launch: spare: {name} not imported ({e})", file=sys.stderr)


def _say_warm() -> None:
    """Tells the launcher that the imports are done (a byte on the pipe it passed), so that its
    log says whether the spare that takes a rank was warm or still importing."""
    raw = os.environ.pop(READY_FD_ENV, "")
    if not raw.isdigit():
        return
    with contextlib.suppress(OSError):
        os.write(int(raw), b".")
    with contextlib.suppress(OSError):
        os.close(int(raw))


def take(order: Order) -> None:
    """Becomes the rank: its environment, argv and script directory, then runs the script."""
    import runpy

    os.environ.update(order.env)
    script = order.argv[0]
    sys.argv = list(order.argv)
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python script` sets it
    runpy.run_path(script, run_name="__main__")


def main() -> int:
    preload()
    _say_warm()
    raw = sys.stdin.buffer.readline(ORDER_MAX + 1)
    if not raw.strip():
        return 0  # the launcher closed the pipe without an order: not needed
    try:
        order = Order.decode(raw)
    except BadOrder as e:
        print(f"diag launch: spare: {e}; exiting", file=sys.stderr)
        return 2
    sys.stdin.close()
    sys.stdin = open(os.devnull)  # noqa: SIM115  (the script's stdin, as a worker's)
    take(order)
    return 0


if __name__ == "__main__":
    sys.exit(main())
