"""Takes every local rank's flight recorder into an incident, as `flight-recorder/`.

Each rank serves torch's flight recorder on a unix socket beside its journal
(diag.collector.frserver), answered by a C++ thread: it comes even when the training thread
holds the GIL. The agent asks each rank in parallel, within one deadline, and believes an answer
only from the rank itself (the socket's peer, SO_PEERCRED, is the rank's PID). What it keeps is
JSON (torch's own dump, bytes as sent, once they parse), size-capped, written without following
symlinks; a rank that does not answer gets a line in `flight-recorder/errors.json`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import stat
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from diag.formats.frsocket import HANDLERS, Handler, socket_path
from diag.formats.untrusted import open_dir, write_replace

log = logging.getLogger(__name__)

FR_DIR = "flight-recorder"
ERRORS_FILE = "errors.json"
MAX_DUMP_BYTES = 64 << 20  # a ring of 2000 entries is ~1 MB; a huge one is cut, not kept
DEFAULT_TIMEOUT_S = 5.0
_HEADER_LIMIT = 16 << 10


@dataclass(frozen=True)
class FlightTarget:
    rank: int
    world_size: int
    pid: int
    journal: Path


@dataclass(frozen=True)
class FlightDump:
    rank: int
    world_size: int
    files: tuple[str, ...]  # written under flight-recorder/
    errors: tuple[str, ...]  # why a handler gave nothing (one line each)
    seconds: float


class FlightError(Exception):
    """The rank gave no usable dump; the message says why, in one line."""


def _peer_pid(sock: socket.socket) -> int:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, _uid, _gid = struct.unpack("3i", creds)
    return pid


def _request(path: Path, handler: Handler, pid: int, deadline: float) -> bytes:
    """One HTTP/1.1 POST to the rank's worker server; the body of a 200 answer."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise FlightError(f"no flight recorder socket {path.name} (rank not attached?)") from None
    if not stat.S_ISSOCK(st.st_mode):
        raise FlightError(f"{path.name} is not a socket")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(max(0.05, deadline - time.monotonic()))
        try:
            s.connect(str(path))
        except OSError as e:
            raise FlightError(f"cannot connect to {path.name}: {e.strerror or e}") from None
        peer = _peer_pid(s)
        if peer != pid:
            raise FlightError(f"{path.name} is served by pid {peer}, not by the rank (pid {pid})")
        s.sendall(
            f"POST /handler/{handler.name} HTTP/1.1\r\nHost: localhost\r\n"
            "Content-Length: 0\r\nConnection: close\r\n\r\n".encode()
        )
        data = bytearray()
        limit = MAX_DUMP_BYTES + _HEADER_LIMIT
        while True:
            s.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                chunk = s.recv(1 << 20)
            except TimeoutError:
                raise FlightError(f"no answer from {path.name} in time") from None
            if not chunk:
                break
            data += chunk
            if len(data) > limit:
                raise FlightError(f"answer of {handler.name} over {MAX_DUMP_BYTES} bytes")
    head, sep, body = bytes(data).partition(b"\r\n\r\n")
    if not sep:
        raise FlightError(f"{handler.name}: not an HTTP answer")
    status = head.split(b"\r\n", 1)[0].decode("latin-1")
    parts = status.split(" ", 2)
    if len(parts) < 2 or parts[1] != "200":
        why = body[:200].decode("utf-8", "replace").strip().splitlines()[:1]
        raise FlightError(f"{handler.name}: {status[:80]}" + (f" ({why[0]})" if why else ""))
    return body


def take(target: FlightTarget, deadline: float) -> tuple[dict[str, bytes], list[str]]:
    """The rank's dumps, by file name, and what went wrong."""
    path = socket_path(target.journal)
    got: dict[str, bytes] = {}
    empty: dict[str, bytes] = {}
    errors: list[str] = []
    for h in HANDLERS:
        if time.monotonic() >= deadline:
            errors.append(f"{h.name}: out of time")
            continue
        try:
            body = _request(path, h, target.pid, deadline)
            doc = json.loads(body)
            if not isinstance(doc, dict):
                raise FlightError(f"{h.name}: not a JSON object")
        except FlightError as e:
            errors.append(str(e))
            if "socket" in str(e) or "connect" in str(e) or "pid" in str(e):
                break  # the next handler would meet the same
            continue
        except OSError as e:  # the rank died or closed the connection meanwhile
            errors.append(f"{h.name}: {path.name}: {e.strerror or e}")
            break
        except (ValueError, RecursionError) as e:
            errors.append(f"{h.name}: not JSON ({e})")
            continue
        name = f"{target.rank:05d}-{target.world_size:05d}{h.suffix}"
        (got if doc.get("entries") else empty)[name] = body
    # An empty ring beside a full one (NCCL's on a gloo job) says nothing; alone, it says the
    # rank ran no collective yet.
    return got or empty, errors


def collect(
    targets: list[FlightTarget], incident: Path, *, timeout: float = DEFAULT_TIMEOUT_S
) -> list[FlightDump]:
    """Asks every rank for its flight recorder and writes the dumps under
    `incident/flight-recorder/`. Never raises for a rank that fails; returns what each gave."""
    if not targets:
        return []
    started = time.monotonic()
    deadline = started + timeout
    with ThreadPoolExecutor(max_workers=min(16, len(targets)), thread_name_prefix="diag-fr") as ex:
        results = list(ex.map(lambda t: take(t, deadline), targets))
    base = open_dir(incident)
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir(FR_DIR, 0o755, dir_fd=base)
        d = open_dir(FR_DIR, dir_fd=base)
        try:
            out = []
            errors: dict[str, list[str]] = {}
            for t, (files, errs) in zip(targets, results, strict=True):
                for name, body in files.items():
                    write_replace(d, name, body)
                if errs and not files:
                    errors[str(t.rank)] = errs
                    log.warning("flight recorder of rank %d: %s", t.rank, "; ".join(errs))
                out.append(
                    FlightDump(
                        t.rank, t.world_size, tuple(sorted(files)), tuple(errs),
                        round(time.monotonic() - started, 3),
                    )
                )  # fmt: skip
            if errors:
                write_replace(d, ERRORS_FILE, json.dumps(errors, indent=1).encode())
        finally:
            os.close(d)
    finally:
        os.close(base)
    return out
