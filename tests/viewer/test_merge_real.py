"""`diag merge` on real incidents: real Python processes stuck in real places, dumped with the
real `py-spy dump --json --native`, written as the agent writes them, then merged. Six "ranks"
wait in a barrier, one odd rank is stuck loading a checkpoint; every rank also has a helper
thread. The merge must name the odd rank and mark its frames in the SVGs."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from mergekit import Stacktrace, verdict, write_incident

from diag.formats.stackdump import RankDump, parse_pyspy_json
from diag.viewer.flame import FOLDED_TIP
from diag.viewer.merge import merge_incident

WORLD = 7
ODD = 4
SVG = "{http://www.w3.org/2000/svg}"
PROGRAM = """
import sys, threading, time

def heartbeat(stop):
    stop.wait()

def collective_barrier():
    threading.Event().wait()

def load_checkpoint():
    time.sleep(3600)

def train_step(odd):
    if odd:
        load_checkpoint()
    else:
        collective_barrier()

def main():
    threading.Thread(target=heartbeat, args=(threading.Event(),), name="heartbeat", daemon=True).start()
    print("ready", flush=True)
    train_step(sys.argv[1] == "odd")

main()
"""


def pyspy() -> str:
    found = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(found).exists():
        pytest.skip("py-spy is not installed (scripts/bootstrap.sh installs it)")
    return found


def proc_state(pid: int) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("State:"):
            return line.split(":", 1)[1].strip()
    return ""


@pytest.fixture(scope="module")
def stuck_ranks(tmp_path_factory):
    """WORLD processes parked in their places; rank ODD elsewhere. Killed by PID at the end."""
    prog = tmp_path_factory.mktemp("prog") / "rank.py"
    prog.write_text(PROGRAM)
    procs = []
    try:
        for r in range(WORLD):
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(prog), "odd" if r == ODD else "even"],
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
        for p in procs:
            assert p.stdout.readline().strip() == "ready"
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)


@pytest.fixture(scope="module")
def pyspy_outputs(stuck_ranks) -> list[tuple[int, str, str]]:
    """(pid, process state, `py-spy dump --json --native` output) per rank, dumped at once."""
    exe = pyspy()
    outputs = []
    for _ in range(20):  # until every rank sits in its blocking call
        runs = [
            subprocess.Popen(
                [exe, "dump", "--json", "--native", "--pid", str(p.pid)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for p in stuck_ranks
        ]
        outputs = []
        for p, run in zip(stuck_ranks, runs, strict=True):
            out, err = run.communicate(timeout=60)
            assert run.returncode == 0, err
            outputs.append((p.pid, proc_state(p.pid), out))
        if all(("collective_barrier" in o or "load_checkpoint" in o) for _, _, o in outputs):
            break
    return outputs


def our_dump(rank: int, pid: int, state: str, out: str) -> RankDump:
    return RankDump(
        rank=rank,
        world_size=WORLD,
        pid=pid,
        node="node-a",
        local_rank=rank,
        process_state=state,
        native=True,
        threads=parse_pyspy_json(out),
    )


def suspect_titles(svg: Path) -> list[str]:
    """Labels of the red cells; a folded cell's frames each count, as its tooltip lists them."""
    root = ET.parse(svg).getroot()
    out = []
    for g in root.iter(f"{SVG}g"):
        if not re.search(r"\bs\b", g.get("class", "")):
            continue
        lines = g.find(f"{SVG}title").text.split("\n")
        if "fold" in g.get("class", "").split():
            at = lines.index(FOLDED_TIP)
            out.extend(line.strip() for line in lines[at + 1 :] if line.startswith("  "))
        else:
            out.append(lines[0])
    return out


@pytest.mark.timeout(120)
def test_real_incident_names_the_odd_rank(tmp_path: Path, pyspy_outputs):
    dumps = [our_dump(r, pid, st, out) for r, (pid, st, out) in enumerate(pyspy_outputs)]
    d = write_incident(
        tmp_path / "timeline" / "20261121-235901-hang-node-a",
        dumps,
        verdict("real-1", WORLD, culprit=None),
    )
    (d / "machine.json").write_text(json.dumps({"hostname": "node-a"}))
    (d / f"{0:05d}-{WORLD:05d}.journal.json").write_text("{}")
    result = merge_incident(tmp_path / "timeline")

    assert result.ranks == f"0-{WORLD - 1}"
    assert result.suspects[0].rank == ODD
    assert {s.rank for s in result.suspects} == {ODD}
    summary = json.loads(result.summary_json.read_text())
    assert summary["suspects"][0]["rank"] == ODD
    classes = summary["views"]["py"]["classes"]
    assert [(c["size"], c["ranks"], c["suspect"]) for c in classes] == [
        (WORLD - 1, "0-3/5-6", False),
        (1, str(ODD), True),
    ]
    # they part inside train_step, at different lines, then go their own ways
    parts = classes[1]["diverges"]
    assert parts["after"].startswith("main@") and parts["thread"] == "Thread@MainThread"
    assert parts["here"].startswith("train_step@") and parts["there"].startswith("train_step@")
    assert parts["here"] != parts["there"]
    assert [f.split("@")[0] for f in classes[1]["stack"][:2]] == ["train_step", "load_checkpoint"]
    text = result.summary_txt.read_text()
    assert re.search(rf"SUSPECTS, best first:\n  rank {ODD}\s+score", text)

    for svg in (result.py_svg, result.cpp_svg):
        marked = suspect_titles(svg)
        # the odd rank's own frames (train_step, load_checkpoint, time.sleep) may be folded into
        # one cell, as every run of frames the same ranks share is
        assert any(
            t.startswith("load_checkpoint@")
            or ("frames folded" in t and "train_step@" in t and "sleep@" in t)
            for t in marked
        ), marked
        assert not any("collective_barrier" in t or "heartbeat" in t for t in marked)
    # the heartbeat threads of all ranks merge into one tower, apart from the main threads
    folded = result.folded[next(iter(result.folded))].read_text()
    assert f"Thread@heartbeat@0-{WORLD - 1}|;" in folded
    # native frames of the real capture are in the native view, not in the Python one
    cpp = (d / "cpp_stack.folded").read_text()
    assert "libc.so" in cpp and "libc.so" not in folded


@pytest.mark.timeout(120)
def test_real_dumps_in_three_formats_merge(tmp_path: Path, pyspy_outputs):
    """The same real captures written as our dumps (ranks 0-1), raw py-spy files (2-3) and
    xpu_timer .stacktrace files (4-6, built as its dump driver builds them)."""
    d = tmp_path / "timeline"
    d.mkdir()
    for r, (pid, st, out) in enumerate(pyspy_outputs):
        if r < 2:
            write_incident(d, [our_dump(r, pid, st, out)])
        elif r < 4:
            (d / f"{r:05d}-{WORLD:05d}.json").write_text(out)
        else:
            msg = Stacktrace(pid=pid, rank=r, process_state=st)
            for t in json.loads(out):
                th = msg.py_stacktrace.add(
                    pid=t["pid"], thread_id=t["thread_id"], thread_name=t["thread_name"] or ""
                )
                for f in t["frames"]:
                    th.frames.add(
                        func_name=f["name"],
                        file_name=f"{f['filename']}:{f['line']}",
                        module=f["module"] or "unknown",
                    )
            (d / f"{r:05d}-{WORLD:05d}.stacktrace").write_bytes(msg.SerializeToString())
    result = merge_incident(d)
    assert result.ranks == f"0-{WORLD - 1}"
    assert result.suspects[0].rank == ODD
    summary = json.loads(result.summary_json.read_text())
    py_classes = summary["views"]["py"]["classes"]
    assert (py_classes[0]["ranks"], py_classes[1]["ranks"]) == ("0-3/5-6", str(ODD))
    assert any(t.startswith("load_checkpoint@") for t in suspect_titles(result.py_svg))
