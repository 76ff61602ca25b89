"""`diag agent --metrics-port`: a real agent process serving /metrics over HTTP."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from children import terminate
from prometheus_client.parser import text_string_to_metric_families

from diag.formats import exitcodes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agent_cmd(tmp: Path, port: int, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "diag.cli.main", "agent", "--run-dir", str(tmp / "run"),
        "--timeline", str(tmp / "timeline"), "--interval", "0.2", "--metrics-host", "127.0.0.1",
        "--metrics-port", str(port), *extra,
    ]  # fmt: skip


@contextlib.contextmanager
def running(cmd: list[str]) -> Iterator[subprocess.Popen]:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        terminate(proc, timeout=15)
        if proc.stdout:
            proc.stdout.close()


def get(url: str, timeout: float = 20.0) -> tuple[int, str, str]:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                return r.status, r.headers["Content-Type"], r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.headers["Content-Type"], e.read().decode()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


@pytest.mark.timeout(60)
def test_agent_serves_metrics_and_xpu_timer_gauge(tmp_path: Path) -> None:
    port = free_port()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "precheck.prom").write_text(
        'diag_precheck_node_status{job="train",node="n1",status="healthy"} 1\n'
    )
    with running(agent_cmd(tmp_path, port, "--xpu-timer-compat", "true")) as proc:
        status, ctype, body = get(f"http://127.0.0.1:{port}/metrics")
        assert status == 200 and ctype.startswith("text/plain; version=0.0.4")
        fams = {fam.name: fam for fam in text_string_to_metric_families(body)}
        for name in (
            "diag_agent_info",
            "diag_agent_resident_memory_bytes",
            "diag_host_shm_free_bytes",
            "diag_precheck_node_status",
            "XPU_TIMER_COMMON_HANG",
        ):
            assert name in fams, name
        (info,) = fams["diag_agent_info"].samples
        assert info.labels["version"] and info.value == 1
        # No ranks yet: nothing is hung, and DLRover must not read an empty page as "all hung".
        assert [s.value for s in fams["XPU_TIMER_COMMON_HANG"].samples] == [0]
        assert get(f"http://127.0.0.1:{port}/nothing-here")[0] == 404
        assert proc.poll() is None


@pytest.mark.timeout(60)
def test_port_in_use_is_a_usage_error(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with running(agent_cmd(tmp_path, port)) as proc:
            out, _ = proc.communicate(timeout=30)
    assert proc.returncode == exitcodes.USAGE
    text = out.decode()
    assert "cannot serve metrics" in text and "--metrics-port" in text
    assert "Traceback" not in text
