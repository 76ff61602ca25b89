"""A rank serves its flight recorder to the agent while its main thread holds the GIL: a real
single-rank gloo process, stuck in a native call made with the GIL held, answers the agent's
request from torch's C++ server thread; the agent believes only the rank's own PID."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from diag.agent.evidence.frcapture import FlightTarget, collect, take
from diag.formats.frsocket import socket_path

pytestmark = pytest.mark.timeout(60)

JOB = r"""
import ctypes, os, sys, datetime
from pathlib import Path
import torch, torch.distributed as dist
from diag.collector.frserver import FlightRecorderServer, enable_buffer
enable_buffer()
journal = Path(sys.argv[1])
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=0,
                        world_size=1)
server = FlightRecorderServer.start(journal)
t = torch.ones(8)
for _ in range(3):
    dist.all_reduce(t)
(journal.parent / "held").write_text("x")
ctypes.PyDLL(None).sleep(int(sys.argv[3]))  # libc sleep, the GIL held all along
"""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_dump_comes_while_the_main_thread_holds_the_gil(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    journal = run / "job-rank00000.journal"
    proc = subprocess.Popen([sys.executable, "-c", JOB, str(journal), str(_free_port()), "20"])
    try:
        deadline = time.monotonic() + 120  # torch's import alone takes tens of seconds under load
        while not (run / "held").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "job did not start"
            time.sleep(0.1)
        sock = socket_path(journal)
        assert sock.name == "job-rank00000.fr.sock"
        assert oct(os.stat(sock).st_mode & 0o777) == "0o600"
        t0 = time.monotonic()
        files, errors = take(FlightTarget(0, 1, proc.pid, journal), time.monotonic() + 3)
        assert time.monotonic() - t0 < 2.0
        assert list(files) == ["00000-00001.json"], errors
        doc = json.loads(files["00000-00001.json"])
        assert [e["collective_seq_id"] for e in doc["entries"]] == [1, 2, 3]
        # anyone else at the socket (here: a PID that is not the one the journal names) is not
        # believed
        files, errors = take(FlightTarget(0, 1, os.getpid(), journal), time.monotonic() + 3)
        assert not files and "not by the rank" in errors[0]
        inc = tmp_path / "incident"
        inc.mkdir()
        dumps = collect([FlightTarget(0, 1, proc.pid, journal)], inc, timeout=3)
        assert dumps[0].files == ("00000-00001.json",)
        assert (inc / "flight-recorder" / "00000-00001.json").is_file()
    finally:
        proc.kill()
        proc.wait(10)


def test_a_rank_without_socket_is_noted_not_fatal(tmp_path: Path) -> None:
    inc = tmp_path / "incident"
    inc.mkdir()
    dumps = collect([FlightTarget(3, 4, 1, tmp_path / "job-rank00003.journal")], inc, timeout=1)
    assert dumps[0].files == () and "no flight recorder socket" in dumps[0].errors[0]
    errors = json.loads((inc / "flight-recorder" / "errors.json").read_text())
    assert list(errors) == ["3"]


RESETTER = r"""
import socket, struct, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(sys.argv[1])
s.listen(8)
print("ready", flush=True)
while True:
    c, _ = s.accept()
    c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    c.close()  # a reset, as when a rank dies while asked
"""


def test_a_rank_that_resets_the_connection_costs_only_its_own_dump(tmp_path: Path) -> None:
    """A rank dying while asked (the connection reset mid-request) is an error for that rank in
    the incident, not an exception that loses the whole incident (seen: a SIGKILLed rank's
    'Connection reset by peer' ended the evidence of a death)."""
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    journal = run / "job-rank00003.journal"
    proc = subprocess.Popen(
        [sys.executable, "-c", RESETTER, str(socket_path(journal))],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        files, errors = take(FlightTarget(3, 4, proc.pid, journal), time.monotonic() + 5)
        assert files == {} and errors, errors
        incident = tmp_path / "incident"
        incident.mkdir()
        (dump,) = collect([FlightTarget(3, 4, proc.pid, journal)], incident, timeout=5)
        assert dump.files == () and dump.errors
        assert json.loads((incident / "flight-recorder" / "errors.json").read_text())["3"]
    finally:
        proc.kill()
        proc.wait()
