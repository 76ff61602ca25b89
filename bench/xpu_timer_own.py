"""xpu_timer's own stack viewer, run from a DLRover checkout for side-by-side timing.

`bench/merge_bench.py --xpu-timer-src DLROVER_CHECKOUT` times xpu_timer's
`py_xpu_timer/stack_viewer.py` itself next to ours and next to bench/xpu_timer_viewer.py (the
rebuilt logic). Nothing of xpu_timer is kept in this repository: at run time its viewer is copied
from the checkout into a scratch package, and the `hosting_service_pb2` module it imports is
generated from the checkout's `hosting_service.proto` with grpc_tools; `flamegraph.pl` (which it
runs through the shell) is put on its PATH. It fails at the first file that does not parse, so,
like the rebuilt logic with `--skip-bad`, it is timed on a directory of the readable files.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

VIEWER = Path("xpu_timer/py_xpu_timer/py_xpu_timer/stack_viewer.py")
PROTO_DIR = Path("xpu_timer/xpu_timer/protos")


class XpuTimerSourceError(RuntimeError):
    pass


@dataclass(frozen=True)
class XpuTimerOwn:
    package_root: Path  # holds py_xpu_timer/
    bin_dir: Path  # holds flamegraph.pl

    def command(self, dump_dir: Path) -> list[str]:
        path = f"{self.bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"
        return [
            "env", f"PYTHONPATH={self.package_root}", f"PATH={path}",
            sys.executable, "-m", "py_xpu_timer.stack_viewer", "--path", str(dump_dir),
        ]  # fmt: skip


def prepare(src: Path, work: Path, perl: str, flamegraph: Path) -> XpuTimerOwn:
    viewer, proto = src / VIEWER, src / PROTO_DIR / "hosting_service.proto"
    for need in (viewer, proto):
        if not need.is_file():
            raise XpuTimerSourceError(
                f"{need} not found: --xpu-timer-src takes a checkout of "
                "github.com/intelligent-machine-learning/dlrover"
            )
    from grpc_tools import protoc

    pkg = work / "py_xpu_timer"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("")
    shutil.copyfile(viewer, pkg / "stack_viewer.py")
    include = Path(protoc.__file__).parent / "_proto"
    rc = protoc.main(
        ["protoc", f"-I{proto.parent}", f"-I{include}", f"--python_out={pkg}", str(proto)]
    )
    if rc != 0:
        raise XpuTimerSourceError(f"protoc failed on {proto} ({rc})")
    bin_dir = work / "bin"
    bin_dir.mkdir(exist_ok=True)
    wrapper = bin_dir / "flamegraph.pl"
    wrapper.write_text(f'#!/bin/sh\nexec {perl} {flamegraph} "$@"\n')
    wrapper.chmod(0o755)
    return XpuTimerOwn(work, bin_dir)


def readable(dump_dir: Path, out: Path) -> Path:
    """A directory of links to the `.stacktrace` files that parse (xpu_timer's viewer stops at
    the first that does not)."""
    from google.protobuf.message import DecodeError

    from diag.proto import hosting_service_pb2

    out.mkdir(parents=True, exist_ok=True)
    for f in sorted(dump_dir.glob("*.stacktrace")):
        try:
            hosting_service_pb2.Stacktrace().ParseFromString(f.read_bytes())
        except DecodeError:
            continue
        link = out / f.name
        if not link.exists():
            link.symlink_to(f.resolve())
    return out
