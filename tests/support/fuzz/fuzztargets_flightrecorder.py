"""Fuzz targets for torch's flight recorder dumps as `diag merge` reads them from an incident."""

from __future__ import annotations

from pathlib import Path

from fuzzkit import FuzzTarget
from repo import EVIDENCE

from diag.formats.untrusted import read_bounded
from diag.viewer import frdumps as flightrec
from diag.viewer import frsummary

DATA = EVIDENCE / "flight_recorder_data"
NAME = "00001-00002.json"


def _seeds(_scratch: Path) -> list[bytes]:
    return [p.read_bytes() for p in sorted(DATA.glob("*.json"))]


def _parse(path: Path) -> object:
    rank, world, backend = flightrec.file_identity(path.name) or (1, 2, "cpu")
    data = read_bounded(path, max_bytes=flightrec.MAX_FILE_BYTES)
    record = flightrec.parse_dump(data, str(path), rank=rank, world_size=world, backend=backend)
    report = flightrec.FlightReport((record,), (), flightrec.lags([record]))
    return frsummary.to_lines(report), frsummary.to_json(report)


TARGETS = [FuzzTarget("flight_recorder", _seeds, _parse, file_name=NAME, json=True)]
