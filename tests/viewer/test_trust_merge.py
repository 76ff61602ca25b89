"""`diag merge` on a timeline someone else could write: planted symlinks (an output directory,
an output file, a temp name, an incident directory, a dump), names claiming huge worlds, huge
files, FIFOs and terminal escapes in frame names. Nothing is written outside the timeline,
nothing read through a symlink, no name or size makes it allocate without bound, nothing hangs,
and no escape sequence reaches the summary, the folded files or the terminal."""

from __future__ import annotations

import json
import logging
import os
import resource
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from mergekit import common, native, odd_one_out, py, rank_dump, thread, verdict, write_incident

from diag.viewer.incidents import IncidentError, find_incidents
from diag.viewer.merge import merge_incident

OUTPUTS = (
    "py_stack.svg",
    "cpp_stack.svg",
    "py_stack.folded",
    "cpp_stack.folded",
    "summary.txt",
    "summary.json",
)
MIB = 1 << 20


def pyspy_doc(func: str = "barrier") -> bytes:
    frames = [
        {"name": func, "filename": "/srv/app/train.py", "line": 4},
        {"name": "<module>", "filename": "/srv/app/train.py", "line": 90},
    ]
    return json.dumps(
        [{"pid": 7, "thread_id": 1, "thread_name": "MainThread", "frames": frames}]
    ).encode()


def run_limited(code: str, *, address_space_mib: int, timeout: float = 60) -> tuple[str, float]:
    """Runs `code` in a child Python whose address space is capped; returns its output and
    wall time. A merge that allocates by what a name or a size says dies there (MemoryError);
    one that blocks runs into the timeout."""

    def cap() -> None:
        limit = address_space_mib * MIB
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    t0 = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=cap,
    )
    took = time.monotonic() - t0
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout, took


# ---- outputs never follow a symlink ----------------------------------------------------------


def two_nodes(root: Path, world: int = 8) -> None:
    dumps = odd_one_out(world, 6)
    write_incident(root / "20261121-235901-hang-node-a", dumps[:4], verdict("inc-1", world))
    write_incident(
        root / "20261121-235902-hang-node-b", dumps[4:], verdict("inc-1", world, node="node-b")
    )


def test_premade_merged_directory_symlink_is_refused_nothing_written_outside(tmp_path: Path):
    root, outside = tmp_path / "timeline", tmp_path / "outside"
    outside.mkdir()
    two_nodes(root)
    (root / "merged-inc-1").symlink_to(outside)
    with pytest.raises(IncidentError, match=r"merged-inc-1.*symlink"):
        merge_incident(root)
    assert list(outside.iterdir()) == []
    assert (root / "merged-inc-1").is_symlink()  # refused, not removed: not ours to delete
    # the CLI says so in one line and exits 2
    done = subprocess.run(
        [sys.executable, "-m", "diag.cli.main", "merge", "--path", str(root)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "symlink" in done.stderr and "Traceback" not in done.stderr
    assert list(outside.iterdir()) == []


def test_planted_output_and_temp_file_symlinks_are_replaced_not_followed(tmp_path: Path):
    d = write_incident(tmp_path / "inc", odd_one_out(4, 1), verdict("files", 4))
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (d / "summary.txt").symlink_to(victim)
    # the temp names the writer used to take (pid-suffixed: predictable)
    for name in OUTPUTS:
        (d / f".{name}.tmp{os.getpid()}").symlink_to(victim)
    result = merge_incident(d)
    assert victim.read_text() == "precious\n"
    assert (
        not result.summary_txt.is_symlink() and "incident files" in result.summary_txt.read_text()
    )
    assert {p.name for p in d.iterdir() if not p.name.startswith(".")} >= set(OUTPUTS)


def test_out_given_as_a_symlink_is_refused(tmp_path: Path):
    d = write_incident(tmp_path / "inc", odd_one_out(4, 1))
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "out").symlink_to(outside)
    with pytest.raises(IncidentError, match="symlink"):
        merge_incident(d, out_dir=tmp_path / "out")
    assert list(outside.iterdir()) == []


# ---- discovery never follows a symlink -------------------------------------------------------


def test_symlinked_incident_directory_is_not_followed(tmp_path: Path, caplog):
    root, elsewhere = tmp_path / "timeline", tmp_path / "elsewhere"
    write_incident(
        root / "20261121-100000-hang-node-a",
        odd_one_out(4, 1),
        verdict("real", 4, detected_at="2026-11-21T10:00:00Z"),
    )
    # newer, so it would be the one merged, and its outputs written into `elsewhere`
    write_incident(
        elsewhere, odd_one_out(4, 2), verdict("planted", 4, detected_at="2026-11-22T10:00:00Z")
    )
    (root / "20261122-100000-hang-node-b").symlink_to(elsewhere)
    with caplog.at_level(logging.WARNING):
        incidents = find_incidents(root)
    assert [i.incident_id for i in incidents] == ["real"]
    assert "20261122-100000-hang-node-b" in caplog.text and "not followed" in caplog.text
    result = merge_incident(root)
    assert result.incident_id == "real"
    assert not any((elsewhere / name).exists() for name in OUTPUTS)


def test_symlinked_dump_file_is_not_read(tmp_path: Path, caplog):
    d = write_incident(tmp_path / "inc", odd_one_out(4, 1)[:3], verdict("links", 4))
    planted = tmp_path / "planted.json"
    planted.write_text(odd_one_out(4, 3)[3].to_json())
    (d / "00003-00004.stack.json").symlink_to(planted)
    with caplog.at_level(logging.WARNING):
        result = merge_incident(d)
    assert result.ranks == "0-2" and result.absent.missing == 1 << 3
    assert "00003-00004.stack.json" in caplog.text
    assert any("symlinks not followed" in p for p in result.report.problems)


# ---- names and sizes do not decide what is allocated -----------------------------------------


def test_world_size_in_a_name_does_not_blow_memory(tmp_path: Path):
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "00000-2000000000.json").write_bytes(pyspy_doc())
    wide = tmp_path / "wide"  # under the hard bound, but one file cannot speak for 1M ranks
    wide.mkdir()
    (wide / "00000-1000000.json").write_bytes(pyspy_doc())
    out, took = run_limited(
        f"""
        from pathlib import Path
        from diag.viewer.incidents import IncidentError
        from diag.viewer.merge import merge_incident
        try:
            merge_incident(Path({str(alone)!r}))
        except IncidentError as e:
            print("refused:", e)
        r = merge_incident(Path({str(wide)!r}))
        print("world", r.world_size, "missing", bin(r.absent.missing), "ranks", r.ranks)
        print("notes", r.report.problems)
        """,
        address_space_mib=768,
    )
    assert "refused:" in out and "00000-2000000000.json" in out and "out of range" in out
    assert "world 1 missing 0b0 ranks 0" in out and "not believed" in out
    assert took < 30


def test_a_bad_name_beside_good_ones_is_reported_per_file(tmp_path: Path):
    d = tmp_path / "inc"
    d.mkdir()
    (d / "00000-2000000000.json").write_bytes(pyspy_doc())
    (d / "00001-00002.json").write_bytes(pyspy_doc())
    (d / "00007-00002.json").write_bytes(pyspy_doc())  # a rank not below its world
    result = merge_incident(d)
    assert result.world_size == 2 and result.ranks == "1" and result.absent.missing == 0b01
    notes = " ".join(result.report.problems)
    assert "00000-2000000000.json: not read" in notes and "00007-00002.json: not read" in notes


def test_over_cap_stack_file_is_refused_before_it_is_read(tmp_path: Path):
    d = tmp_path / "inc"
    d.mkdir()
    (d / "00000-00002.json").write_bytes(pyspy_doc())
    huge = d / "00001-00002.json"
    with open(huge, "wb") as f:
        f.truncate(800 * MIB)  # sparse: costs no disk
    out, took = run_limited(
        f"""
        from pathlib import Path
        from diag.viewer.merge import merge_incident
        r = merge_incident(Path({str(d)!r}))
        print("ranks", r.ranks, "errors", r.report.errors)
        """,
        address_space_mib=768,
    )
    assert "ranks 0-1" in out and "over the" in out and "limit" in out
    assert took < 30


def test_fifo_named_like_a_dump_or_a_journal_tail_does_not_hang(tmp_path: Path):
    d = write_incident(tmp_path / "inc", odd_one_out(2, 1)[:1])
    os.mkfifo(d / "00000-00002.journal.json")
    os.mkfifo(d / "00001-00002.json")
    out, _ = run_limited(
        f"""
        from pathlib import Path
        from diag.viewer.merge import merge_incident
        r = merge_incident(Path({str(d)!r}))
        print("ranks", r.ranks, "missing", r.absent.missing)
        """,
        address_space_mib=1024,
        timeout=30,
    )
    assert "ranks 0 missing 2" in out


# ---- no terminal escapes reach the outputs ---------------------------------------------------

EVIL = "load\x1b]0;owned\x07\x1b[2J\x1b[31mcheckpoint\r\nforged 99\x9b"


def test_escape_sequences_in_names_reach_no_output(tmp_path: Path):
    world = 4
    dumps = odd_one_out(world, 2)
    dumps[2] = rank_dump(
        2,
        world,
        thread(common(py(EVIL, 12, "/srv/\x1b[8mapp.py"), native("read\x1b[0m")), name="Main\x07"),
    )
    d = write_incident(tmp_path / "inc", dumps, verdict("esc\x1b[1m", world))
    done = subprocess.run(
        [sys.executable, "-m", "diag.cli.main", "merge", "--path", str(d)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "loadcheckpoint" in done.stdout.replace(" ", "")  # the frame is there, cleaned
    for name, text in [
        ("stdout", done.stdout),
        ("stderr", done.stderr),
        *((n, (d / n).read_text()) for n in ("summary.txt", "summary.json")),
    ]:
        assert not any(c in text for c in "\x1b\x07\x9b\r"), f"{name} holds a control character"
        assert "\\u001b" not in text and "\\u0007" not in text, name
    for view in ("py", "cpp"):
        for line in (d / f"{view}_stack.folded").read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            assert count.isdigit() and stack and "\x1b" not in line, line
