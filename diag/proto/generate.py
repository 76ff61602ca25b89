"""Generates the Python modules of the `.proto` files in this folder (grpcio-tools, a dev extra).

    python -m diag.proto.generate            # rewrite the committed stubs
    python -m diag.proto.generate --out DIR  # write them elsewhere (the staleness test does)

protoc runs on a copy of each `.proto` placed at `diag/proto/<name>.proto`, so the generated
gRPC module imports its messages as `from diag.proto import <name>_pb2` and the descriptors are
registered under a name no other package uses.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PACKAGE_PATH = Path("diag") / "proto"


def proto_files(src: Path = HERE) -> list[Path]:
    return sorted(src.glob("*.proto"))


_SERVICE = re.compile(r"^\s*service\s+\w+", re.MULTILINE)


def has_service(proto: Path) -> bool:
    return _SERVICE.search(proto.read_text()) is not None


def generated_names(proto: Path) -> list[str]:
    """The messages module and its type stubs; the gRPC module only for a file that declares a
    service (a messages-only file, such as xpu_timer's stack traces, needs none)."""
    stem = proto.stem
    names = [f"{stem}_pb2.py", f"{stem}_pb2.pyi"]
    return [*names, f"{stem}_pb2_grpc.py"] if has_service(proto) else names


def generate(out: Path, src: Path = HERE) -> list[Path]:
    """Writes the stubs of every `.proto` in `src` into `out`; returns the files written."""
    import grpc_tools
    from grpc_tools import protoc  # dev-only dependency

    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    with tempfile.TemporaryDirectory(prefix="diag-proto-") as tmp:
        root, gen = Path(tmp) / "src", Path(tmp) / "gen"
        (root / PACKAGE_PATH).mkdir(parents=True)
        (gen / PACKAGE_PATH).mkdir(parents=True)
        protos = proto_files(src)
        for p in protos:
            shutil.copy(p, root / PACKAGE_PATH / p.name)
        include = Path(grpc_tools.__file__).parent / "_proto"
        args = [
            "grpc_tools.protoc",
            f"-I{root}",
            f"-I{include}",
            f"--python_out={gen}",
            f"--pyi_out={gen}",
            f"--grpc_python_out={gen}",
            *(str(PACKAGE_PATH / p.name) for p in protos),
        ]
        rc = protoc.main(args)
        if rc != 0:
            raise RuntimeError(f"protoc failed with exit code {rc}")
        for p in protos:
            for name in generated_names(p):
                target = out / name
                shutil.copy(gen / PACKAGE_PATH / name, target)
                written.append(target)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m diag.proto.generate", description=__doc__)
    parser.add_argument("--out", type=Path, default=HERE, help="where to write the stubs")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
