"""Who may write the run directory, and a rank proving who it is: the agent refuses a run
directory others can write, reads journals and metas as what they are (files another process
wrote: regular, owned by a trainer, bounded, validated), and never dumps, signals or names a
process a meta points at unless it is the journal's writer."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from polling import catches_sigterm, wait_for

from diag.agent.observe.observer import Observer
from diag.agent.observe.rankproof import ProcFacts, RankClaim, RankProver, claim_of, file_id, judge
from diag.agent.observe.rundircheck import RunDirStat, TrainerUsers, owners_of, prepare
from diag.agent.observe.rundircheck import judge as judge_dir
from diag.formats.exitcodes import USAGE, UsageError
from diag.formats.journalmeta import (
    GroupInfo,
    JournalMeta,
    journal_path,
    meta_path_for,
    read_meta,
    write_meta,
)
from diag.formats.journalwriter import JournalWriter
from diag.formats.records import DType, OpCode, OpFlag
from diag.formats.untrusted import Owners, UntrustedInput

pytestmark = pytest.mark.timeout(90)

NOBODY = 65534
DIAG = [sys.executable, "-m", "diag.cli.main"]
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")


def _meta(pid: int, start: float, **over: object) -> JournalMeta:
    fields: dict = dict(
        job="job", rank=0, world_size=2, local_rank=0, local_world_size=2, pid=pid,
        pid_start_time=start, node="n", groups=(GroupInfo(0, "default_pg", (0, 1)),),
    )  # fmt: skip
    fields.update(over)
    return JournalMeta(**fields)


def _journal(run_dir: Path, rank: int = 0, *, pending: bool = True) -> JournalWriter:
    w = JournalWriter(journal_path(run_dir, "job", rank), rank=rank, world_size=2, local_rank=rank)
    if pending:  # one collective left unfinished: a hang once its limit passes
        w.append_op(OpCode.ALL_REDUCE, DType.FLOAT32, OpFlag.NONE, 0, -1, 1, 4096, 1)
    return w


def _as_nobody(fn) -> None:  # type: ignore[no-untyped-def]
    """Runs `fn` in a child process as the unprivileged user `nobody`."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        code = 1
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            fn()
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.fixture
def victim() -> Iterator[subprocess.Popen]:
    """An unrelated root process whose stack would say what it runs."""
    p = subprocess.Popen(
        [sys.executable, "-c", "import time\ndef secret_payroll_job():\n    time.sleep(300)\n"
         "secret_payroll_job()\n"],
    )  # fmt: skip
    try:
        yield p
    finally:
        p.kill()
        p.wait(timeout=30)


def _agent(
    run_dir: Path, timeline: Path, *extra: str, env: dict[str, str] | None = None
) -> subprocess.Popen:
    agent = subprocess.Popen(
        [*DIAG, "agent", "--run-dir", str(run_dir), "--timeline", str(timeline),
         "--interval", "0.1", "--hang-floor", "0.5", "--hang-timeout", "1",
         "--warmup-timeout", "1", "--control", "false", "--drain", "false",
         "--persist-on-incident", "false", "--pyspy-timeout", "5", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    # The tests' clocks start once it runs: on a loaded machine its imports alone take seconds.
    wait_for(lambda: catches_sigterm(agent.pid) or agent.poll() is not None, timeout=60)
    return agent


def _stop(agent: subprocess.Popen, timeout: float = 20) -> str:
    agent.send_signal(signal.SIGTERM)
    out, _ = agent.communicate(timeout=timeout)
    return out


# -- the run directory -------------------------------------------------------------------------


def test_world_writable_run_dir_is_refused_with_exit_2(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    os.chmod(run_dir, 0o777)
    r = subprocess.run(
        [*DIAG, "agent", "--run-dir", str(run_dir), "--timeline", str(tmp_path / "tl")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == USAGE, r.stderr
    assert f"the run directory {run_dir} is writable by every user" in r.stderr
    assert "chmod 0700" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize(
    ("st", "users", "problem"),
    [
        (RunDirStat(True, False, 0, 0, 0o777), TrainerUsers(), "is a symlink"),
        (RunDirStat(False, False, 0, 0, 0o600), TrainerUsers(), "not a directory"),
        (RunDirStat(False, True, 0, 0, 0o1777), TrainerUsers(), "writable by every user"),
        (RunDirStat(False, True, 0, 5, 0o770), TrainerUsers(), "pass --trainer-gid 5"),
        (RunDirStat(False, True, 0, 5, 0o770), TrainerUsers(gid=6), "writable by its group 5"),
        (RunDirStat(False, True, 1234, 0, 0o700), TrainerUsers(uid=1000), "owned by uid 1234"),
        (RunDirStat(False, True, 0, 5, 0o770), TrainerUsers(gid=5), None),
        # A root agent takes no directory from a user it was not told of (finding A4).
        (RunDirStat(False, True, 1000, 0, 0o755), TrainerUsers(), "pass --trainer-uid 1000"),
        (RunDirStat(False, True, 1000, 0, 0o700), TrainerUsers(uid=1000), None),
    ],
)
def test_run_dir_judgement(st: RunDirStat, users: TrainerUsers, problem: str | None) -> None:
    if problem is None:
        owners = judge_dir(Path("/run/diag"), st, users, euid=0)
        assert owners.uids == {0, users.uid if users.uid is not None else st.uid}
        return
    with pytest.raises(UsageError, match=problem):
        judge_dir(Path("/run/diag"), st, users, euid=0)


def test_an_agent_not_started_as_root_takes_the_owner_for_the_trainer() -> None:
    """In a pod the agent and the trainer run as one user, and the trainer made the directory;
    an agent that was root (and dropped to the ranks' user since) does not."""
    st = RunDirStat(False, True, 1000, 0, 0o700)
    assert judge_dir(Path("/run/diag"), st, TrainerUsers(), euid=1000).uids == {0, 1000}
    assert judge_dir(Path("/run/diag"), st, TrainerUsers(), euid=2000).uids == {0, 1000, 2000}
    with pytest.raises(UsageError, match="was not told"):
        judge_dir(Path("/run/diag"), st, TrainerUsers(), euid=2000, started_as_root=True)


@root_only
def test_missing_run_dir_is_created_private_for_the_trainer(tmp_path: Path) -> None:
    run_dir = tmp_path / "a" / "run"
    owners = prepare(run_dir, TrainerUsers(uid=NOBODY, gid=NOBODY))
    st = os.lstat(run_dir)
    assert stat.S_IMODE(st.st_mode) == 0o700 and (st.st_uid, st.st_gid) == (NOBODY, NOBODY)
    assert owners.uids == {0, NOBODY}
    link = tmp_path / "link"
    link.symlink_to(run_dir)
    with pytest.raises(UsageError, match="is a symlink"):
        prepare(link, TrainerUsers())


def test_trainer_side_makes_a_missing_run_dir_private(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        w = JournalWriter(journal_path(tmp_path / "run", "job", 0), rank=0, world_size=1,
                          local_rank=0)  # fmt: skip
        w.close()
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "run").st_mode) == 0o700


# -- finding 16: the journal's temp file ----------------------------------------------------------


def test_planted_symlink_at_the_journal_temp_name_truncates_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    victim_file = tmp_path / "precious"
    victim_file.write_text("keep me")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    path = journal_path(run_dir, "job", 0)
    # The temp name is random; were it guessed, the planted link is still not opened.
    monkeypatch.setattr("secrets.token_hex", lambda n=None: "guessed")
    for name in (f".{path.name}.{os.getpid()}.tmp", f".{path.name}.{os.getpid()}.guessed.tmp"):
        (run_dir / name).symlink_to(victim_file)
    with contextlib.suppress(FileExistsError):
        JournalWriter(path, rank=0, world_size=1, local_rank=0).close()
    assert victim_file.read_bytes() == b"keep me"


def test_meta_writer_follows_no_symlink(tmp_path: Path) -> None:
    victim_file = tmp_path / "precious"
    victim_file.write_text("keep me")
    journal = journal_path(tmp_path, "job", 0)
    meta_path_for(journal).symlink_to(victim_file)
    write_meta(journal, _meta(os.getpid(), 0.0))
    assert victim_file.read_bytes() == b"keep me"
    assert stat.S_ISREG(os.lstat(meta_path_for(journal)).st_mode)


# -- metas are validated -------------------------------------------------------------------------

_GOOD = json.loads(_meta(123, 1.5e9).to_json())


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"pid": "abc"}, "'pid' must be an integer"),
        ({"pid": 0}, "'pid' 0 is out of range"),
        ({"pid": True}, "'pid' must be an integer"),
        ({"rank": 5}, "'rank' 5 is out of range"),
        ({"world_size": 10**9}, "'world_size'"),
        ({"pid_start_time": "x"}, "must be a number"),
        ({"job": 7}, "'job' must be a string"),
        ({"job": "j" * 5000}, "over 1024"),
        ({"groups": [{"index": 0, "name": "g", "ranks": [0, "x"]}]}, "a rank of group"),
        ({"groups": {"a": 1}}, "'groups' must be a list"),
        ({"own_threads": [-1]}, "a thread id"),
        ({"version": 2}, "unsupported journal meta version"),
        ({"pid": None}, "'pid' must be an integer"),
    ],
)
def test_meta_fields_are_checked(tmp_path: Path, change: dict, problem: str) -> None:
    journal = journal_path(tmp_path, "job", 0)
    meta_path_for(journal).write_text(json.dumps({**_GOOD, **change}))
    with pytest.raises(UntrustedInput, match=problem) as e:
        read_meta(journal)
    assert e.value.path == str(meta_path_for(journal))


def test_meta_of_another_user_or_a_fifo_is_refused(tmp_path: Path) -> None:
    journal = journal_path(tmp_path, "job", 0)
    write_meta(journal, _meta(123, 1.5e9))
    assert read_meta(journal, Owners.this_process()).pid == 123
    os.chown(meta_path_for(journal), 4321, 4321)
    with pytest.raises(UntrustedInput, match="owned by uid 4321"):
        read_meta(journal, Owners.this_process())
    os.unlink(meta_path_for(journal))
    os.mkfifo(meta_path_for(journal))
    with pytest.raises(UntrustedInput, match="a FIFO"):
        read_meta(journal)


# -- finding 4: a meta with "pid": "abc" ---------------------------------------------------------


def test_agent_survives_a_meta_with_a_bad_pid(tmp_path: Path) -> None:
    run_dir, timeline = tmp_path / "run", tmp_path / "tl"
    run_dir.mkdir(mode=0o700)
    w = _journal(run_dir)
    meta = json.loads(_meta(os.getpid(), psutil.Process().create_time()).to_json())
    meta_path_for(w.path).write_text(json.dumps({**meta, "pid": "abc"}))
    agent = _agent(run_dir, timeline)
    try:
        time.sleep(2.0)
        assert agent.poll() is None, agent.communicate()[0]
    finally:
        out = _stop(agent)
    assert agent.returncode == 0, out
    assert "Traceback" not in out
    warnings = [line for line in out.splitlines() if str(meta_path_for(w.path)) in line]
    assert len(warnings) == 1 and "'pid' must be an integer" in warnings[0], out


# -- finding 3: a FIFO named *.journal -----------------------------------------------------------

_RANK = """
import os, sys, time, psutil
from pathlib import Path
from diag.formats.journalwriter import JournalWriter
from diag.formats.journalmeta import JournalMeta, journal_path, write_meta
path = journal_path(Path(sys.argv[1]), "job", 1)
w = JournalWriter(path, rank=1, world_size=2, local_rank=1)
write_meta(path, JournalMeta(job="job", rank=1, world_size=2, local_rank=1, local_world_size=2,
    pid=os.getpid(), pid_start_time=psutil.Process().create_time(), node="n"))
w.mark("hello")
print("ready", flush=True)
time.sleep(60)
"""


def test_fifo_journal_blocks_nothing_and_a_death_is_still_seen(tmp_path: Path) -> None:
    run_dir, timeline = tmp_path / "run", tmp_path / "tl"
    run_dir.mkdir(mode=0o700)
    fifo = journal_path(run_dir, "job", 0)
    os.mkfifo(fifo)
    rank = subprocess.Popen(
        [sys.executable, "-c", _RANK, str(run_dir)], stdout=subprocess.PIPE, text=True
    )
    agent = None
    try:
        assert rank.stdout is not None and rank.stdout.readline().strip() == "ready"
        agent = _agent(
            run_dir,
            timeline,
            "--until",
            "incident",
            "--hang-timeout",
            "60",
            "--warmup-timeout",
            "60",
        )
        time.sleep(1.5)
        rank.kill()
        rank.wait(timeout=30)
        try:
            out, _ = agent.communicate(timeout=20)  # the death is an incident: it exits
        except subprocess.TimeoutExpired:
            out = _stop(agent)
            pytest.fail(f"the agent did not report the rank's death:\n{out}")
    finally:
        if rank.poll() is None:
            rank.kill()
            rank.wait(timeout=30)
        if agent is not None and agent.poll() is None:
            agent.kill()
            agent.wait(timeout=30)
    assert "rank 1" in out and "died" in out.lower(), out
    assert sum(str(fifo) in line for line in out.splitlines()) == 1, out
    assert "a FIFO" in out and "Traceback" not in out


def test_fifo_journal_leaves_sigterm_working(tmp_path: Path) -> None:
    run_dir, timeline = tmp_path / "run", tmp_path / "tl"
    run_dir.mkdir(mode=0o700)
    os.mkfifo(journal_path(run_dir, "job", 0))
    os.mkfifo(meta_path_for(journal_path(run_dir, "job", 1)))
    _journal(run_dir, 1)
    agent = _agent(run_dir, timeline)
    time.sleep(1.5)
    t0 = time.monotonic()
    out = _stop(agent, timeout=15)
    assert agent.returncode == 0 and time.monotonic() - t0 < 10, out


# -- ownership -----------------------------------------------------------------------------------


def test_files_of_another_user_are_ignored_with_one_warning(tmp_path: Path, caplog) -> None:
    w = _journal(tmp_path)
    write_meta(w.path, _meta(os.getpid(), psutil.Process().create_time()))
    os.chown(w.path, 4321, 4321)
    obs = Observer(tmp_path, owners=Owners.of(os.geteuid()), agent_pids=frozenset())
    try:
        with caplog.at_level(logging.WARNING):
            for _ in range(5):
                assert obs.observe(time.monotonic()).ranks == ()
        warned = [r.getMessage() for r in caplog.records if str(w.path) in r.getMessage()]
        assert len(warned) == 1 and "owned by uid 4321" in warned[0]
        os.chown(w.path, 0, 0)  # a trusted owner: watched from now on
        assert [r.rank for r in obs.observe(time.monotonic()).ranks] == [0]
    finally:
        obs.close()


# -- rank proof ----------------------------------------------------------------------------------

_FACTS = ProcFacts(True, 100.0, (1000, 1000), 7, frozenset({(1, 2)}))
_CLAIM = RankClaim(42, 100.0, frozenset({(1, 2)}))


@pytest.mark.parametrize(
    ("claim", "facts", "reason"),
    [
        (_CLAIM, _FACTS, None),
        (_CLAIM, ProcFacts(False), "no process"),
        (_CLAIM, ProcFacts(True, 200.0, (1000, 1000), 7, _FACTS.files), "another process"),
        (_CLAIM, ProcFacts(True, 100.0, (1000, 0), 7, _FACTS.files), None),
        (_CLAIM, ProcFacts(True, 100.0, (1000, 4321), 7, _FACTS.files), "runs as uid"),
        (_CLAIM, ProcFacts(True, 100.0, (1000, 1000), 8, _FACTS.files), "agent's PID namespace"),
        (RankClaim(42, 100.0, _CLAIM.files, 9), _FACTS, "the meta names"),
        (_CLAIM, ProcFacts(True, 100.0, (1000, 1000), 7, frozenset({(1, 3)})), "does not map"),
        (RankClaim(5, 100.0, _CLAIM.files), _FACTS, "the agent's own process"),
        (_CLAIM, ProcFacts(True, 100.0, (1000, 1000), 7, _FACTS.files, (9, 5, 1)), "agent's own"),
    ],
)
def test_rank_proof_judgement(claim: RankClaim, facts: ProcFacts, reason: str | None) -> None:
    proof = judge(claim, facts, Owners.of(1000), own_pid_ns=7, agent_pids=frozenset({5}))
    assert proof.ok == (reason is None)
    if reason is not None:
        assert reason in proof.reason


def test_rank_proof_with_real_processes(tmp_path: Path, victim: subprocess.Popen) -> None:
    w = _journal(tmp_path)  # this process maps it
    journal = file_id(w.path)
    me = psutil.Process()
    # The test process plays the rank here: no process of its is the agent's.
    prover = RankProver(Owners.this_process(), agent_pids=frozenset())
    assert prover.check(claim_of(me.pid, me.create_time(), [journal]))
    assert prover.check(claim_of(me.pid, me.create_time(), [journal]))  # cached, still alive
    other = psutil.Process(victim.pid)
    proof = prover.check(claim_of(victim.pid, other.create_time(), [journal]))
    assert not proof and proof.exists and "does not map the journal" in proof.reason
    assert not prover.check(claim_of(me.pid, me.create_time() - 5, [journal]))
    # As the agent would judge it: its own process is never a rank, journal mapped or not.
    own = RankProver(Owners.this_process()).check(claim_of(me.pid, me.create_time(), [journal]))
    assert not own and "the agent's own process" in own.reason


# -- finding 2: a forged meta naming an unrelated root process -----------------------------------


@root_only
def test_forged_meta_naming_a_root_process_is_not_a_rank(
    tmp_path: Path, victim: subprocess.Popen, request: pytest.FixtureRequest
) -> None:
    base = Path(tempfile.mkdtemp(prefix="diag-test-forged-", dir="/dev/shm"))
    os.chmod(base, 0o711)  # the trainer's user reaches its run dir through it
    run_dir, timeline = base / "run", base / "tl"
    for d in (run_dir, timeline):  # the agent becomes the trainer's user: its directories
        d.mkdir(mode=0o700)
        os.chown(d, NOBODY, NOBODY)
    request.addfinalizer(lambda: shutil.rmtree(base, ignore_errors=True))
    start = psutil.Process(victim.pid).create_time()

    def forge() -> None:  # as the trainer's user: a journal with one op pending, a lying meta
        w = _journal(run_dir)
        write_meta(w.path, _meta(victim.pid, start))

    _as_nobody(forge)
    meta = meta_path_for(journal_path(run_dir, "job", 0))
    assert os.stat(meta).st_uid == NOBODY
    env = dict(os.environ, DIAG_TRAINER_UID=str(NOBODY))
    agent = _agent(run_dir, timeline, "--on-hang", "stop", env=env)
    try:
        time.sleep(4.0)  # four times the hang limit
        assert agent.poll() is None, agent.communicate()[0]
    finally:
        out = _stop(agent)
    assert victim.poll() is None, "the unrelated process was signalled"
    assert psutil.Process(victim.pid).status() != psutil.STATUS_STOPPED
    assert "watching rank" not in out and "stopping rank" not in out, out
    warned = [line for line in out.splitlines() if str(meta) in line]
    assert len(warned) == 1 and "not the writer" in warned[0], out
    dumped = [p for p in timeline.rglob("*") if p.is_file()] if timeline.exists() else []
    assert not any("secret_payroll_job" in p.read_text(errors="replace") for p in dumped)
    assert not any(p.name == "verdict.json" for p in dumped), dumped


def test_drain_stops_only_processes_shown_to_be_ranks(
    tmp_path: Path, victim: subprocess.Popen
) -> None:
    """A control session (or a slot header) naming a PID is a claim too: the drain's stop
    signals only a process that maps its rank's journal or slot."""
    from diag.agent.checkpoint.manager import CheckpointManager
    from diag.agent.checkpoint.sessions import RankKey
    from diag.agent.drain.executor import Drainer
    from diag.agent.drain.plan import DrainSettings

    w = _journal(tmp_path, 0)  # mapped by this process: rank 0 is us
    manager = CheckpointManager(tmp_path, None)
    try:
        me = psutil.Process()
        manager.sessions.register(RankKey("job", 0), me.pid, start_time=me.create_time())
        other = psutil.Process(victim.pid)
        manager.sessions.register(RankKey("job", 1), victim.pid, start_time=other.create_time())
        # The test process plays rank 0: no process of its is the agent's here.
        prover = RankProver(owners_of(tmp_path), agent_pids=frozenset())
        pids = Drainer(manager, DrainSettings(), prover=prover)._pids("job", (0, 1))
        assert pids == {0: me.pid}, w.path
    finally:
        manager.close(timeout=10)


# -- findings A2 and A4 of the second review ----------------------------------------------------


def test_a_meta_naming_the_agent_itself_is_not_a_rank(tmp_path: Path) -> None:
    """Finding A2: a forged meta naming the agent's own PID and start time, one op pending,
    `--on-hang stop`: the proof passed (the agent maps the journal it reads), and the agent
    dumped its own stack and killed itself. The agent and its children are never ranks."""
    run_dir, timeline = tmp_path / "run", tmp_path / "tl"
    run_dir.mkdir(mode=0o700)
    agent = _agent(run_dir, timeline, "--on-hang", "stop")
    try:
        w = _journal(run_dir)
        write_meta(w.path, _meta(agent.pid, psutil.Process(agent.pid).create_time()))
        time.sleep(4.0)  # four times the hang limit
        assert agent.poll() is None, agent.communicate()[0]
    finally:
        out = _stop(agent)
    assert agent.returncode == 0, out
    assert "the agent's own process or its child" in out, out
    assert not list(timeline.rglob("verdict.json")), out


@root_only
def test_a_run_dir_another_user_made_first_is_refused_by_a_root_agent(tmp_path: Path) -> None:
    """Finding A4: another local user makes the run directory (0700, theirs) before the root
    agent starts; the agent took it and acted on the journals planted there. A root agent takes
    a directory of no user it was not given (--trainer-uid), and says so."""
    base = Path(tempfile.mkdtemp(prefix="diag-test-squat-", dir="/dev/shm"))
    try:
        run_dir = base / "diag"
        run_dir.mkdir(mode=0o700)
        os.chown(run_dir, NOBODY, NOBODY)
        r = subprocess.run(
            [*DIAG, "agent", "--run-dir", str(run_dir), "--timeline", str(tmp_path / "tl"),
             "--control", "false"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    finally:
        shutil.rmtree(base, ignore_errors=True)
    assert r.returncode == USAGE, r.stderr
    assert f"belongs to uid {NOBODY}" in r.stderr and f"--trainer-uid {NOBODY}" in r.stderr
    assert "Traceback" not in r.stderr
