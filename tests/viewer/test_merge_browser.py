"""The merged flame SVG in a real browser (headless Chromium): it renders, the odd rank's frames
show red in the picture, and the inline script runs: search by rank, search by name, zoom."""

from __future__ import annotations

import shutil
import struct
import subprocess
import xml.etree.ElementTree as ET
import zlib
from pathlib import Path

import pytest
from mergekit import C10D, common, py, rank_dump, thread, verdict, write_incident

from diag.viewer.merge import merge_incident

WORLD = 1024
ODD = 700
SVG = "{http://www.w3.org/2000/svg}"


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    pytest.skip("no chromium: add it with scripts/bootstrap.sh (Debian package `chromium`)")


def run_chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    profile = tmp_path / f"profile-{len(list(tmp_path.iterdir()))}"
    return subprocess.run(
        [
            chromium(),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--hide-scrollbars",
            f"--user-data-dir={profile}",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=90,
    )


def read_png(path: Path) -> tuple[int, int, list[bytes]]:
    """Width, height and rows of RGB(A) pixels of a non-interlaced 8-bit PNG."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat = 8, b""
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + n]
        if kind == b"IHDR":
            w, h, depth, ctype, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert depth == 8 and ctype in (2, 6) and interlace == 0
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    bpp = 4 if ctype == 6 else 3
    raw = zlib.decompress(idat)
    stride = w * bpp
    rows: list[bytes] = []
    prev = bytearray(stride)
    for y in range(h):
        f = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b = prev[i]
            c = prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 0xFF
            elif f == 2:
                line[i] = (line[i] + b) & 0xFF
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 0xFF
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                pred = a if pa <= pb and pa <= pc else b if pb <= pc else c
                line[i] = (line[i] + pred) & 0xFF
        rows.append(bytes(line))
        prev = line
    return w, bpp, rows


def frames_top(svg: Path) -> int:
    """The y of the highest frame: pixels above it are the header and the colour legend."""
    root = ET.parse(svg).getroot()
    frames = next(g for g in root.iter(f"{SVG}g") if g.get("id") == "frames")
    return int(min(float(r.get("y")) for r in frames.iter(f"{SVG}rect")))


def count_pixels(path: Path, test, from_row: int = 0) -> int:
    _, bpp, rows = read_png(path)
    return sum(
        1
        for row in rows[from_row:]
        for i in range(0, len(row), bpp)
        if test(row[i], row[i + 1], row[i + 2])
    )


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    d = tmp_path_factory.mktemp("browser") / "20261121-235901-hang-node-a"
    dumps = []
    for r in range(WORLD):
        inner = (
            [py("load_checkpoint", 12), py("read_shard", 30)]
            if r == ODD
            else [py("barrier", 4811, C10D)]
        )
        dumps.append(rank_dump(r, WORLD, thread(common(*inner))))
    write_incident(d, dumps, verdict("browser", WORLD))
    return merge_incident(d)


def is_suspect_red(r: int, g: int, b: int) -> bool:
    return r >= 200 and 30 <= g <= 100 and 30 <= b <= 90


def is_python_aqua(r: int, g: int, b: int) -> bool:
    return 50 <= r <= 120 and 165 <= g <= 225 and 190 <= b <= 240


@pytest.mark.timeout(180)
def test_svg_renders_with_the_odd_rank_in_red(tmp_path: Path, merged):
    shot = tmp_path / "py_stack.png"
    done = run_chromium(
        tmp_path, f"--screenshot={shot}", "--window-size=1200,400", merged.py_svg.as_uri()
    )
    assert shot.exists(), done.stderr[-2000:]
    # 1 rank of 1,024 is 1.2 px at full scale; drawn at least 8 px wide: two frames and a cap
    top = frames_top(merged.py_svg)
    red = count_pixels(shot, is_suspect_red, top)
    assert red >= 3 * 6 * 12, red
    assert count_pixels(shot, is_python_aqua, top) > 20_000
    # a graph without suspects shows no red at all
    plain = merged.out_dir.parent / "plain"
    write_incident(plain, [rank_dump(r, 4, thread(common(py("barrier", 1)))) for r in range(4)])
    calm = merge_incident(plain)
    shot2 = tmp_path / "calm.png"
    run_chromium(tmp_path, f"--screenshot={shot2}", "--window-size=1200,400", calm.py_svg.as_uri())
    assert count_pixels(shot2, is_suspect_red, frames_top(calm.py_svg)) == 0
    assert count_pixels(shot2, is_suspect_red) > 0  # the legend still shows the colour


def dom(tmp_path: Path, url: str) -> str:
    done = run_chromium(tmp_path, "--dump-dom", url)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.mark.timeout(180)
def test_script_searches_by_rank_and_name_and_zooms(tmp_path: Path, merged):
    url = merged.py_svg.as_uri()
    page = dom(tmp_path, url)
    assert 'data-ready="1"' in page  # the inline script ran to its end
    assert not [seg for seg in page.split("<g ") if "match" in seg.split(">")[0]]

    by_rank = dom(tmp_path, f"{url}?s=rank:{ODD}")
    matched = [seg for seg in by_rank.split("<g ") if "match" in seg.split(">")[0]]
    names = sorted(seg.split("<title>")[1].split("@")[0] for seg in matched)
    assert names == sorted(
        [
            "Role",
            "Thread",
            "&lt;module&gt;",
            "main",
            "train_step",
            "load_checkpoint",
            "read_shard",
            "State",
        ]
    )
    assert f"rank {ODD}: 8 frames" in by_rank  # role, thread, 5 frames, state

    by_name = dom(tmp_path, f"{url}?s=barrier")
    matched = [seg for seg in by_name.split("<g ") if "match" in seg.split(">")[0]]
    assert len(matched) == 1 and "Matched: " in by_name

    zoomed = dom(tmp_path, f"{url}?z=load_checkpoint")
    assert "zoomed" in zoomed.split("<svg")[1].split(">")[0]
    hidden = [seg for seg in zoomed.split("<g ") if " hide" in seg.split(">")[0]]
    assert any("barrier@" in seg for seg in hidden)
    # the zoomed frame now spans the width
    seg = next(s for s in zoomed.split("<g ") if "<title>load_checkpoint@" in s)
    assert 'width="1180.00"' in seg
