"""The shared timeline is hostile input: every node's agent and the trainers write it, so what
is there may be a link, a FIFO, garbage or a fake. The agent's start-up write probe, the job's
taint ledger and incident retention go through descriptors, read capped into our types, and
count only what this node wrote.

Real files, links and FIFOs throughout; what could hang or eat memory on a regression runs in a
forked child with a deadline and a capped address space, so a failure is a failed test, not a
stuck or swapping suite.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from children import terminate
from polling import catches_sigterm, wait_for

from diag.agent.retention.policy import Entry, Retention, to_remove
from diag.agent.retention.prune import prune_incidents
from diag.agent.taint.ledger import HISTORY, LedgerBusy, TaintLedger
from diag.agent.taint.model import Action, JobBudget, Reason, TaintPlan, TaintRecord
from diag.formats.incidentdir import probe_timeline

pytestmark = pytest.mark.timeout(60)

DIAG = [sys.executable, "-m", "diag.cli.main"]
NOBODY = 65534
DAY = 86400.0
Y2030 = 1_893_456_000.0  # 2030-01-01 UTC
LEDGER_LOG = "diag.agent.taint.ledger"


def in_child(fn: Callable[[], object], timeout: float = 15.0) -> tuple[str, object]:
    """fn() in a forked child whose address space may grow by 256 MiB at most: ("ok", its
    value), ("error", "Type: message") or ("hang", None) when it was still running at
    `timeout` (then killed)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        try:
            os.close(r)
            with open("/proc/self/statm") as f:
                size = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
            limit = size + (256 << 20)
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
            try:
                out: tuple[str, object] = ("ok", fn())
            except BaseException as e:
                out = ("error", f"{type(e).__name__}: {e}")
            os.write(w, pickle.dumps(out))
        finally:
            os._exit(0)
    os.close(w)
    try:
        if not wait_for(lambda: os.waitpid(pid, os.WNOHANG) != (0, 0), timeout=timeout):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "hang", None
        data = b""
        while chunk := os.read(r, 1 << 16):
            data += chunk
    finally:
        os.close(r)
    return pickle.loads(data) if data else ("error", "the child died without a word")


def logged(logger: str, fn: Callable[[], object]) -> Callable[[], tuple[object, list[str]]]:
    """fn, returning what it returned and the warnings `logger` gave meanwhile."""

    def run() -> tuple[object, list[str]]:
        lines: list[str] = []

        class Keep(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                lines.append(record.getMessage())

        handler = Keep(logging.WARNING)
        log = logging.getLogger(logger)
        log.addHandler(handler)
        try:
            return fn(), lines
        finally:
            log.removeHandler(handler)

    return run


def taint_plan(node: str, now: float, until: float | None = None) -> TaintPlan:
    record = TaintRecord(Reason.REPEATED_CULPRIT, "culprit", since=now, until=until)
    return TaintPlan(node=node, action=Action.TAINT, why="test", record=record)


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A file the agent must never write, chmod or truncate (root's, in a real attack)."""
    p = tmp_path / "outside" / "victim"
    p.parent.mkdir()
    p.write_bytes(b"root's data\n")
    p.chmod(0o644)
    return p


# -- A3: the start-up write probe ---------------------------------------------------------------


@pytest.mark.timeout(90)
def test_write_probe_truncates_nothing_a_timeline_writer_planted(
    tmp_path: Path, victim: Path
) -> None:
    real = tmp_path / "volume"
    real.mkdir()
    planted = real / ".diag-write-test"
    planted.symlink_to(victim)
    timeline = tmp_path / "timeline"
    timeline.symlink_to(real)  # the operator's mount point: the root may be a symlink
    agent = subprocess.Popen(
        [*DIAG, "agent", "--run-dir", str(tmp_path / "run"), "--timeline", str(timeline),
         "--node", "n1", "--control", "false", "--drain", "false"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        # It installs its SIGTERM handler after the probe: then the probe is done.
        wait_for(lambda: catches_sigterm(agent.pid) or agent.poll() is not None, timeout=60)
        assert agent.poll() is None, agent.communicate(timeout=10)[0]
    finally:
        terminate(agent, timeout=20)
    out = agent.stdout.read() if agent.stdout else ""
    assert victim.read_bytes() == b"root's data\n", out
    assert victim.stat().st_mode & 0o777 == 0o644
    assert planted.is_symlink()  # not the probe's to remove
    assert sorted(p.name for p in real.iterdir()) == [".diag-write-test"], out


def test_write_probe_follows_the_root_only(tmp_path: Path, victim: Path) -> None:
    (tmp_path / "volume").mkdir()
    (tmp_path / "volume" / ".diag-write-test").symlink_to(victim)
    (tmp_path / "timeline").symlink_to(tmp_path / "volume")
    probe_timeline(tmp_path / "timeline")
    probe_timeline(tmp_path / "new" / "timeline")  # made when missing
    assert victim.read_bytes() == b"root's data\n"
    assert [p.name for p in (tmp_path / "volume").iterdir()] == [".diag-write-test"]
    assert list((tmp_path / "new" / "timeline").iterdir()) == []
    (tmp_path / "file").write_text("")
    with pytest.raises(OSError):
        probe_timeline(tmp_path / "file")


# -- A10: the taint ledger ----------------------------------------------------------------------


def ledger_dir(timeline: Path, job: str = "job") -> Path:
    d = timeline / ".taints" / job
    d.mkdir(parents=True, exist_ok=True)
    return d


@pytest.mark.parametrize("where", ["lock", "job", "taints"])
def test_links_planted_in_the_ledger_create_nothing_through_them(
    tmp_path: Path, where: str
) -> None:
    timeline = tmp_path / "timeline"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    if where == "lock":
        (ledger_dir(timeline) / ".lock").symlink_to(elsewhere / "created")
    elif where == "job":
        (timeline / ".taints").mkdir(parents=True)
        (timeline / ".taints" / "job").symlink_to(elsewhere)
    else:
        timeline.mkdir()
        (timeline / ".taints").symlink_to(elsewhere)
    ledger = TaintLedger(timeline, "job", timeout=1.0)
    with pytest.raises(LedgerBusy, match="not used"), ledger.locked():
        ledger.record(taint_plan("n1", 1e9), 1e9)
    assert list(elsewhere.iterdir()) == []


def test_claim_is_never_written_through_a_planted_temp_name(tmp_path: Path, victim: Path) -> None:
    d = ledger_dir(tmp_path)
    for name in (f"n1.tmp{os.getpid()}", "n1.json"):  # the old temp name, and the claim's own
        (d / name).symlink_to(victim)
    ledger = TaintLedger(tmp_path, "job")
    with ledger.locked():
        ledger.record(taint_plan("n1", 1e9), 1e9)
    assert victim.read_bytes() == b"root's data\n"
    assert victim.stat().st_mode & 0o777 == 0o644
    claim = d / "n1.json"
    assert not claim.is_symlink() and claim.stat().st_mode & 0o777 == 0o600
    assert json.loads(claim.read_text())["node"] == "n1"
    assert ledger.budget(1e9).tainted_nodes == ("n1",)


def sparse_gib(p: Path) -> None:
    with p.open("wb") as f:
        f.truncate(1 << 30)  # a GiB that takes no disk


PLANTED_CLAIMS = {
    # what is planted at x.json: a FIFO hung the taint thread with the job's lock held, a
    # link to /dev/zero ran out of memory, `[]` raised AttributeError, the rest ValueError.
    "fifo": lambda p: os.mkfifo(p),
    "dev-zero": lambda p: p.symlink_to("/dev/zero"),
    "huge": sparse_gib,
    "list": lambda p: p.write_text("[]"),
    "bad-until": lambda p: p.write_text('{"node": "x", "until": "soon"}'),
    "not-json": lambda p: p.write_bytes(b"\xff\x00{"),
}


@pytest.mark.parametrize("kind", sorted(PLANTED_CLAIMS))
def test_planted_claims_neither_hang_nor_crash_the_budget(tmp_path: Path, kind: str) -> None:
    d = ledger_dir(tmp_path)
    now = 1e9
    ledger = TaintLedger(tmp_path, "job", timeout=2.0)
    with ledger.locked():
        ledger.record(taint_plan("n1", now, until=now + DAY), now)
        ledger.record(taint_plan("gone", now - 2 * DAY, until=now - DAY), now)  # expired
    PLANTED_CLAIMS[kind](d / "x.json")

    def under_the_lock() -> JobBudget:
        with ledger.locked():
            return ledger.budget(now)

    outcome, value = in_child(logged(LEDGER_LOG, under_the_lock))
    assert outcome == "ok", (outcome, value)
    budget, warnings = value
    # A claim that cannot be read counts as held under its file's name: the cap errs low.
    assert budget.tainted_nodes == ("n1", "x")
    assert len(warnings) == 1 and "x.json" in warnings[0], warnings
    # The lock was given back: the next agent of the job takes it at once.
    with TaintLedger(tmp_path, "job", timeout=0.5).locked():
        pass


def test_a_fifo_at_the_history_blocks_no_taint(tmp_path: Path) -> None:
    d = ledger_dir(tmp_path)
    os.mkfifo(d / HISTORY)
    ledger = TaintLedger(tmp_path, "job")

    def take() -> tuple[float, ...]:
        with ledger.locked():
            ledger.record(taint_plan("n1", 1e9), 1e9)
            return ledger.budget(1e9).recent_taints

    assert in_child(take) == ("ok", (1e9,))
    assert (d / HISTORY).is_file()  # the FIFO was replaced, not written through


def test_history_lines_that_are_not_taints_are_dropped_with_one_warning(tmp_path: Path) -> None:
    d = ledger_dir(tmp_path)
    lines = ['{"node": "a", "at": 5.0}', "[]", '{"at": NaN}', '{"at": "x"}', "{", '"at"']
    (d / HISTORY).write_text("\n".join(lines) + "\n")
    ledger = TaintLedger(tmp_path, "job")
    outcome, value = in_child(logged(LEDGER_LOG, lambda: ledger.budget(10.0).recent_taints))
    assert outcome == "ok", value
    times, warnings = value
    assert times == (5.0,)
    assert len(warnings) == 1 and HISTORY in warnings[0], warnings


# -- A11: retention counts only what this node wrote --------------------------------------------

NOW = 1_800_000_000.0  # 2027-01-15


def e(name: str, at: float, size: int = 1) -> Entry:
    return Entry(name, at, size)


FUTURE_TABLE = [
    # (entries, retention, removed): the allowance is 300 s; future entries rank below every
    # real one and go first, the farthest in the future before the nearer
    (
        [e("real", NOW - DAY), *(e(f"fake{i}", Y2030 + i) for i in range(3))],
        Retention(count=1),
        ["fake2", "fake1", "fake0"],
    ),
    ([e("old", NOW - 9 * DAY), e("fake", Y2030)], Retention(count=1), ["fake"]),
    ([e("real", NOW - DAY), e("skewed", NOW + 200)], Retention(count=1), ["real"]),  # allowed
    ([e("real", NOW - DAY), e("ahead", NOW + 400)], Retention(count=1), ["ahead"]),
    ([e("a", NOW - 2 * DAY), e("b", NOW - DAY), e("f", Y2030)], Retention(count=3), []),
    ([e("a", NOW - 2 * DAY, 5), e("f", Y2030, 1)], Retention(max_bytes=5), ["f"]),
    ([e("f", Y2030, 1), e("g", Y2030 + 1, 1)], Retention(count=1), ["g"]),
    # age: a future entry is never "old"; real ones still go by age
    (
        [e("a", NOW - 20 * DAY), e("b", NOW - DAY), e("f", Y2030)],
        Retention(max_age=14 * DAY),
        ["a"],
    ),
]


@pytest.mark.parametrize(("entries", "keep", "removed"), FUTURE_TABLE)
def test_future_dated_entries_never_displace_real_ones(
    entries: list[Entry], keep: Retention, removed: list[str]
) -> None:
    assert to_remove(entries, keep, NOW) == removed
    assert to_remove(list(reversed(entries)), keep, NOW) == removed


def incident(
    timeline: Path, when: str, node: str, *, at: float, written_by: str | None = None
) -> Path:
    """An incident directory named as `node`'s agent names one, its verdict naming
    `written_by` (default: `node`), dated `at`."""
    d = timeline / f"{when}-hang-{node}@job-{when}"
    d.mkdir(parents=True)
    doc = {"incident_id": f"job-{when}", "node": written_by or node, "kind": "hang"}
    (d / "verdict.json").write_text(json.dumps(doc))
    os.utime(d, (at, at))
    return d


def test_retention_counts_and_removes_only_this_nodes_incidents(tmp_path: Path) -> None:
    tl = tmp_path / "timeline"
    now = time.time()
    ours = [incident(tl, f"2026010{i}-000000", "n1", at=now - (9 - i) * DAY) for i in range(5)]
    others = [
        incident(tl, "20250101-000000", "n2", at=now - 99 * DAY),
        # ends in "-n1" as n1's do; its verdict says which node wrote it
        incident(tl, "20250102-000000", "b-n1", at=now - 98 * DAY),
        # named as n1's, but its verdict names another node
        incident(tl, "20250103-000000", "n1", at=now - 97 * DAY, written_by="n3"),
        # named as n1's, but made by another user
        incident(tl, "20250104-000000", "n1", at=now - 96 * DAY),
    ]
    os.chown(others[-1], NOBODY, NOBODY)
    garbage = incident(tl, "20250105-000000", "n1", at=now - 95 * DAY)
    (garbage / "verdict.json").write_text("[]")

    removed = prune_incidents(tl, Retention(count=2), now, node="n1")

    assert sorted(removed) == sorted(d.name for d in ours[:3])
    assert all(d.is_dir() for d in [*ours[3:], *others, garbage])
    # As n2's agent: only its one incident counts, and it is its newest, so it stays.
    assert prune_incidents(tl, Retention(count=1), now, node="n2") == []


def test_fakes_dated_2030_never_displace_this_nodes_incidents(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tl = tmp_path / "timeline"
    now = time.time()
    real = [incident(tl, f"2026010{i}-000000", "n1", at=now - (9 - i) * DAY) for i in range(3)]
    # Forged as n1's own (a name, a verdict and a date of 2030), and as other nodes'.
    fakes = [incident(tl, f"2030010{i}-000000", "n1", at=Y2030 + i) for i in range(1, 6)]
    foreign = [incident(tl, f"2030010{i}-000000", f"x{i}", at=Y2030) for i in range(1, 6)]

    with caplog.at_level(logging.WARNING, logger="diag.agent.retention.prune"):
        removed = prune_incidents(tl, Retention(count=5), now, node="n1")
        again = prune_incidents(tl, Retention(count=5), now, node="n1")

    # Five kept: the three real ones, then the two fakes nearest in time.
    assert sorted(removed) == sorted(d.name for d in fakes[2:]) and again == []
    assert all(d.is_dir() for d in [*real, *fakes[:2], *foreign])
    future = [r for r in caplog.records if "in the future" in r.getMessage()]
    assert sorted(r.getMessage().split()[0] for r in future) == sorted(str(d) for d in fakes)
