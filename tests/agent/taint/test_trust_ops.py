"""The agent's own edges: its options and config file, its metrics port, what it keeps on disk
and the text it prints.

- a number option that is nan, inf or out of its range exits 2 naming the option, where the
  value came from (flag, environment, config file) and the allowed range;
- a config file that is binary, not UTF-8, a FIFO, a directory or huge exits 2;
- idle, half-sent connections to the metrics port cost no thread and do not block a scrape;
- incident directories and the taint history are kept within a count, an age and a size;
- names from input lose their terminal escapes in the agent's log lines.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import io
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from children import terminate

from diag.agent.config import agentconfig as config
from diag.agent.metrics.server import MetricsServer
from diag.agent.retention.policy import Entry, Retention, to_remove
from diag.agent.retention.prune import prune_incidents, prune_job_verdicts
from diag.agent.taint.ledger import HISTORY, TaintLedger
from diag.agent.taint.model import Action, Reason, TaintPlan, TaintRecord
from diag.cli.main import configure_logging
from diag.formats import exitcodes
from diag.formats.exitcodes import UsageError

DAY = 86400.0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    config.add_arguments(p)
    return p


def load(argv: list[str], env: dict[str, str] | None = None) -> config.AgentSettings:
    return config.load(parser().parse_args(argv), env=env or {})


# -- options -----------------------------------------------------------------------------------

BAD_VALUES = [
    # (option, value, allowed range as the message prints it)
    ("hang_factor", "nan", "[1, 1000]"),
    ("hang_factor", "inf", "[1, 1000]"),
    ("hang_factor", "0.5", "[1, 1000]"),
    ("interval", "nan", "(0, 600]"),
    ("interval", "inf", "(0, 600]"),
    ("interval", "-inf", "(0, 600]"),
    ("hang_timeout", "1e400", "(0, 604800]"),
    ("warmup_steps", "10000000", "[0, 1000000]"),
    ("dump_parallel", "100000", "[0, 1024]"),
    ("stop_grace", "NaN", "(0, 3600]"),
    ("keep_incidents", "-1", "[0, 1000000]"),
]


@pytest.mark.parametrize("source", ["flag", "env", "file"])
@pytest.mark.parametrize(("name", "value", "allowed"), BAD_VALUES)
def test_nonfinite_and_out_of_range_options_are_usage_errors(
    tmp_path: Path, source: str, name: str, value: str, allowed: str
) -> None:
    flag = "--" + name.replace("_", "-")
    argv: list[str] = []
    env: dict[str, str] = {}
    if source == "flag":
        argv = [f"{flag}={value}"]
        where = (f"{flag}: ", "(given as a flag; allowed: ")
    elif source == "env":
        env = {"DIAG_" + name.upper(): value}
        where = (f"DIAG_{name.upper()}: ", f"(environment variable for {flag}; allowed: ")
    else:
        cfg = tmp_path / "agent.toml"
        cfg.write_text(f'[agent]\n{name} = "{value}"\n')
        argv = ["--config", str(cfg)]
        where = (f"{cfg}: [agent] {name}: ", f"(config file key for {flag}; allowed: ")
    with pytest.raises(UsageError) as e:
        load(argv, env)
    message = str(e.value)
    assert message.startswith(where[0]) and f"{where[1]}{allowed})" in message, message
    assert "\n" not in message


@pytest.mark.parametrize("toml_value", ["nan", "inf", "-inf", "+inf"])
def test_toml_native_nan_and_inf_are_refused(tmp_path: Path, toml_value: str) -> None:
    cfg = tmp_path / "agent.toml"
    cfg.write_text(f"[agent]\nhang_factor = {toml_value}\n[taint]\nhealth_interval = 5\n")
    with pytest.raises(UsageError, match=r"hang_factor: .*allowed: \[1, 1000\]"):
        load(["--config", str(cfg)])
    cfg.write_text(f"[taint]\nhealth_interval = {toml_value}\n")
    with pytest.raises(UsageError, match=r"health_interval: .*for --taint-health-interval"):
        load(["--config", str(cfg)])


def test_values_inside_the_ranges_still_load(tmp_path: Path) -> None:
    cfg = tmp_path / "agent.toml"
    cfg.write_text('[agent]\nhang_factor = 1\ninterval = 600\nkeep_incident_bytes = "3GiB"\n')
    c = load(["--config", str(cfg), "--keep-incidents", "0"], {"DIAG_KEEP_INCIDENT_DAYS": "2.5"})
    assert c.policy.timeouts.factor == 1 and c.interval == 600
    assert c.retention == Retention(count=0, max_age=2.5 * DAY, max_bytes=3 << 30)


def run_cli(*argv: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "diag.cli.main", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.timeout(60)
def test_interval_nan_exits_2_without_a_traceback(tmp_path: Path) -> None:
    r = run_cli(
        "agent", "--run-dir", str(tmp_path / "run"), "--timeline", str(tmp_path / "tl"),
        "--interval", "nan", "--control", "false",
    )  # fmt: skip
    assert r.returncode == exitcodes.USAGE, r.stderr
    assert "Traceback" not in r.stderr
    assert "--interval: " in r.stderr and "(given as a flag; allowed: (0, 600])" in r.stderr


# -- the config file ---------------------------------------------------------------------------


@contextlib.contextmanager
def fifo(path: Path) -> Iterator[Path]:
    os.mkfifo(path)
    try:
        yield path
    finally:
        path.unlink()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["binary", "latin1", "nul", "fifo", "directory", "huge", "link"])
def test_config_file_that_is_not_a_toml_text_file_is_a_usage_error(
    tmp_path: Path, kind: str
) -> None:
    path = tmp_path / "agent.toml"
    expect = {
        "binary": "not UTF-8",
        "latin1": "not UTF-8",
        "nul": "NUL",
        "fifo": "a FIFO",
        "directory": "a directory",
        "huge": "limit",
        "link": "symlink",
    }[kind]
    with contextlib.ExitStack() as stack:
        if kind == "binary":
            path.write_bytes(bytes(range(256)) * 4)
        elif kind == "latin1":
            path.write_bytes("[agent]\nnode = 'n\xe9ud'\n".encode("latin-1"))
        elif kind == "nul":
            path.write_bytes(b"[agent]\x00\n")
        elif kind == "fifo":
            stack.enter_context(fifo(path))
        elif kind == "directory":
            path.mkdir()
        elif kind == "huge":
            path.write_bytes(b"# " + b"x" * (2 << 20) + b"\n")
        else:
            (tmp_path / "real.toml").write_text("[agent]\n")
            path.symlink_to(tmp_path / "real.toml")
        with pytest.raises(UsageError) as e:
            load(["--config", str(path)])
    assert str(path) in str(e.value) and expect in str(e.value), str(e.value)


@pytest.mark.timeout(60)
def test_binary_config_exits_2_from_the_command_line(tmp_path: Path) -> None:
    path = tmp_path / "agent.toml"
    path.write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)))
    for command in ("agent", "taint"):
        extra = ["--node", "n1", "--dry-run"] if command == "taint" else []
        r = run_cli(command, "--config", str(path), *extra)
        assert r.returncode == exitcodes.USAGE, (command, r.stderr)
        assert "Traceback" not in r.stderr and "not UTF-8" in r.stderr, r.stderr


# -- the metrics server ------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def threads_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads line")


def scrape(port: int, timeout: float = 5.0) -> tuple[int, bytes]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as r:
        return r.status, r.read()


def half_sent(port: int, n: int) -> list[socket.socket]:
    conns = []
    for _ in range(n):
        c = socket.create_connection(("127.0.0.1", port), timeout=5)
        c.sendall(b"GET /metr")
        conns.append(c)
    return conns


@pytest.mark.timeout(90)
def test_idle_half_sent_requests_hold_no_agent_threads(tmp_path: Path) -> None:
    port = free_port()
    cmd = [
        sys.executable, "-m", "diag.cli.main", "agent", "--run-dir", str(tmp_path / "run"),
        "--timeline", str(tmp_path / "tl"), "--metrics-host", "127.0.0.1",
        "--metrics-port", str(port), "--control", "false",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    conns: list[socket.socket] = []
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                assert scrape(port)[0] == 200
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.2)
        before = threads_of(proc.pid)
        conns = half_sent(port, 400)
        time.sleep(1.0)
        during = threads_of(proc.pid)
        t0 = time.monotonic()
        status, body = scrape(port)
        took = time.monotonic() - t0
        assert status == 200 and b"diag_agent_info" in body
        # One waiting thread for all connections and a few reply threads, made once.
        assert during <= before + 4, (before, during)
        assert took < 3.0, took
    finally:
        for c in conns:
            c.close()
        terminate(proc, timeout=15)


@pytest.mark.timeout(30)
def test_half_sent_requests_are_closed_after_the_header_timeout() -> None:
    server = MetricsServer(lambda: b"up 1\n", "127.0.0.1", 0, header_timeout=0.5, workers=2)
    server.start()
    base = threading.active_count()
    conns = half_sent(server.port, 400)
    try:
        assert scrape(server.port)[1] == b"up 1\n"
        assert threading.active_count() <= base + 2
        time.sleep(1.2)
        closed = 0
        for c in conns:
            c.settimeout(2)
            with contextlib.suppress(ConnectionResetError):
                closed += c.recv(16) == b""
                continue
            closed += 1
        assert closed == len(conns)
        # A complete request after the storm still answers.
        assert scrape(server.port) == (200, b"up 1\n")
    finally:
        for c in conns:
            c.close()
        server.close()


# -- retention ---------------------------------------------------------------------------------

NOW = 100 * DAY


def e(name: str, age_days: float, size: int = 1) -> Entry:
    return Entry(name, NOW - age_days * DAY, size)


RETENTION_TABLE = [
    # (entries, retention, protected, removed)
    ([e("a", 3), e("b", 2), e("c", 1)], Retention(), (), []),
    ([e("a", 3), e("b", 2), e("c", 1)], Retention(count=2), (), ["a"]),
    ([e("a", 3), e("b", 2), e("c", 1)], Retention(count=1), (), ["a", "b"]),
    ([e("a", 30), e("b", 20), e("c", 1)], Retention(max_age=14 * DAY), (), ["a", "b"]),
    # the newest stays even when every limit says otherwise
    ([e("a", 30, 10), e("b", 20, 10)], Retention(count=1, max_age=DAY, max_bytes=5), (), ["a"]),
    # bytes: newest first until the budget is full; everything older goes
    ([e("a", 3, 4), e("b", 2, 1), e("c", 1, 5)], Retention(max_bytes=6), (), ["a"]),
    ([e("a", 3, 1), e("b", 2, 2), e("c", 1, 5)], Retention(max_bytes=6), (), ["a", "b"]),
    ([e("a", 3, 1), e("b", 2, 5), e("c", 1, 5)], Retention(max_bytes=10), (), ["a"]),
    # protected ones stay (and take their room)
    ([e("a", 3), e("b", 2), e("c", 1)], Retention(count=1), ("a",), ["b"]),
    ([e("a", 40), e("b", 20)], Retention(max_age=DAY), ("a", "b"), []),
    # equal times: the name breaks the tie, so the outcome does not depend on listing order
    ([e("b", 1), e("a", 1), e("c", 1)], Retention(count=2), (), ["a"]),
    ([], Retention(count=1, max_age=1, max_bytes=1), (), []),
]


@pytest.mark.parametrize(("entries", "keep", "protected", "removed"), RETENTION_TABLE)
def test_retention_policy(
    entries: list[Entry], keep: Retention, protected: tuple[str, ...], removed: list[str]
) -> None:
    assert to_remove(entries, keep, NOW, frozenset(protected)) == removed
    assert to_remove(list(reversed(entries)), keep, NOW, frozenset(protected)) == removed


def test_retention_refuses_negative_limits() -> None:
    with pytest.raises(ValueError):
        Retention(count=-1)


def make_incident(
    timeline: Path, name: str, age_days: float, size: int = 100, node: str = "n1"
) -> Path:
    """A directory as the agent of `node` leaves one: its verdict.json names it (`size` bytes)."""
    d = timeline / name
    d.mkdir(parents=True)
    doc = {"incident_id": name, "node": node, "summary": ""}
    doc["summary"] = "x" * max(0, size - len(json.dumps(doc)))
    (d / "verdict.json").write_text(json.dumps(doc))
    t = time.time() - age_days * DAY
    os.utime(d, (t, t))
    return d


def test_prune_removes_old_incidents_keeps_newest_in_progress_and_foreign(tmp_path: Path) -> None:
    tl = tmp_path / "timeline"
    old = [make_incident(tl, f"2026010{i}-000000-hang-n1@job-{i}", 30 - i) for i in range(5)]
    newest = make_incident(tl, "20260110-000000-death-n1@job-9", 20)  # old, but the newest
    current = make_incident(tl, "20260101-000000-hang-n1@job-cur", 40)  # being written
    in_progress = make_incident(tl, ".tmp-20260101-000000-hang-n1-123", 40)
    foreign = make_incident(tl, "xpu_timer_dump", 40)  # not ours: never touched
    outside = tmp_path / "outside"
    make_incident(outside, "keep", 0)
    link = tl / "20260101-000000-hang-n1@job-link"
    link.symlink_to(outside)
    t = time.time() - 50 * DAY
    os.utime(link, (t, t), follow_symlinks=False)

    removed = prune_incidents(
        tl, Retention(count=3, max_age=14 * DAY), time.time(), node="n1", protected=[current.name]
    )

    assert sorted(removed) == sorted(p.name for p in old)
    assert newest.is_dir() and current.is_dir() and in_progress.is_dir() and foreign.is_dir()
    assert link.is_symlink() and (outside / "keep" / "verdict.json").is_file()
    assert not any(p.exists() for p in old)


def test_prune_job_verdicts_spares_young_ones(tmp_path: Path) -> None:
    jobs = tmp_path / ".jobs" / "train"
    old = [make_incident(jobs, f"c10d-{i}", 20 + i) for i in range(3)]
    young = [make_incident(jobs, f"c10d-young-{i}", 0.001 * i) for i in range(3)]
    removed = prune_job_verdicts(tmp_path, Retention(count=1), time.time())
    assert sorted(removed) == sorted(f"train/{d.name}" for d in old)
    assert all(d.is_dir() for d in young)


def test_prune_by_bytes_keeps_the_newest_that_fit(tmp_path: Path) -> None:
    tl = tmp_path / "timeline"
    dirs = [make_incident(tl, f"2026010{i}-000000-hang-n1", 10 - i, size=1000) for i in range(6)]
    removed = prune_incidents(tl, Retention(max_bytes=2500), time.time(), node="n1")
    assert sorted(removed) == sorted(d.name for d in dirs[:4])
    assert dirs[4].is_dir() and dirs[5].is_dir()


def test_prune_does_not_follow_a_symlinked_timeline(tmp_path: Path) -> None:
    real = tmp_path / "real"
    make_incident(real, "20260101-000000-hang-n1", 40)
    make_incident(real, "20260102-000000-hang-n1", 30)
    (tmp_path / "tl").symlink_to(real)
    assert prune_incidents(tmp_path / "tl", Retention(count=1), time.time(), node="n1") == []
    assert len(list(real.iterdir())) == 2


@pytest.mark.timeout(60)
def test_agent_applies_retention_at_start_up(tmp_path: Path) -> None:
    """Only this node's own incidents count: other nodes' stay whatever their number, and
    fakes dated 2030 (forged as this node's or another's) never push out a real one."""
    tl = tmp_path / "tl"
    dirs = [make_incident(tl, f"2026010{i}-000000-hang-n1@job-{i}", 9 - i) for i in range(5)]
    others = [
        make_incident(tl, f"2026010{i}-000000-hang-n2@job-{i}", 20 - i, node="n2") for i in range(5)
    ]
    future = (dt.datetime(2030, 1, 1, tzinfo=dt.UTC).timestamp() - time.time()) / DAY
    fakes = {
        n: [
            make_incident(tl, f"2030010{i}-000000-hang-{n}@job-x{i}", -future - i, node=n)
            for i in range(1, 4)
        ]
        for n in ("n1", "n9")
    }
    cmd = [
        sys.executable, "-m", "diag.cli.main", "agent", "--run-dir", str(tmp_path / "run"),
        "--timeline", str(tl), "--control", "false", "--keep-incidents", "2", "--node", "n1",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while any(d.exists() for d in [*dirs[:3], *fakes["n1"]]):
            assert proc.poll() is None and time.monotonic() < deadline
            assert dirs[3].is_dir() and dirs[4].is_dir()
            time.sleep(0.2)
        assert dirs[3].is_dir() and dirs[4].is_dir()
        assert all(d.is_dir() for d in [*others, *fakes["n9"]])
    finally:
        terminate(proc, timeout=15)


def taint_plan(node: str, now: float) -> TaintPlan:
    record = TaintRecord(Reason.REPEATED_CULPRIT, "culprit", since=now, until=None)
    return TaintPlan(node=node, action=Action.TAINT, why="test", record=record)


def test_taint_history_is_trimmed_to_its_retention(tmp_path: Path) -> None:
    ledger = TaintLedger(tmp_path, "job", history=Retention(count=5, max_age=10 * DAY))
    now = 1_000_000_000.0
    with ledger.locked():
        for i in range(20):
            ledger.record(taint_plan(f"n{i}", now + i), now + i)
    lines = (ledger.dir / HISTORY).read_text().splitlines()
    assert [json.loads(line)["node"] for line in lines] == [f"n{i}" for i in range(15, 20)]
    # a later taint after a long pause: the old lines go by age, the newest stays
    with ledger.locked():
        ledger.record(taint_plan("late", now + 30 * DAY), now + 30 * DAY)
    lines = (ledger.dir / HISTORY).read_text().splitlines()
    assert [json.loads(line)["node"] for line in lines] == ["late"]
    assert ledger.budget(now + 30 * DAY).recent_taints == (now + 30 * DAY,)


def test_taint_history_keeps_what_the_rate_limit_reads(tmp_path: Path) -> None:
    from diag.agent.taint import taintconfig

    p = argparse.ArgumentParser()
    taintconfig.add_arguments(p)
    args = p.parse_args(["--taint-keep-history", "1", "--taint-history-days", "0.001"])
    settings = taintconfig.load(args, job="j", env={"DIAG_TAINT_RATE_COUNT": "4"})
    assert settings.history.count == 4
    assert settings.history.max_age == settings.policy.rate_window


# -- text the agent prints ---------------------------------------------------------------------


def test_agent_log_lines_lose_terminal_escapes_and_forged_lines() -> None:
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    root.handlers.clear()
    out = io.StringIO()
    try:
        configure_logging(0, out)
        frame = "all_reduce\x1b[2J\x1b]0;owned\x07\x1b[31m (train.py:12)\nFAKE WARNING agent: ok"
        # the daemon's verdict line: "<event kind>: <message>"
        logging.getLogger("diag.agent.loop.daemon").warning(
            "%s: %s", "incident", f"stuck in {frame}"
        )
    finally:
        for h in root.handlers:
            h.close()
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    text = out.getvalue()
    assert "\x1b" not in text and "\x07" not in text
    assert text.count("\n") == 1  # one record, one line
    assert "stuck in all_reduce (train.py:12) FAKE WARNING" in text
