"""torch.save's file format, written without torch: a stored (uncompressed) ZIP archive of

    <archive>/data.pkl                the pickled structure (tensors refer to storages by key)
    <archive>/.format_version         "1"
    <archive>/.storage_alignment      "64"
    <archive>/byteorder               "little"
    <archive>/data/<key>              each storage's raw bytes, 64-byte aligned in the file
    <archive>/version                 "3"
    <archive>/.data/serialization_id  an identifier of this file

The trainer pickles the structure exactly as torch.save would (diag/trainer/flash/capture.py), so the agent
only moves bytes: from shared memory to the file with os.write, the CRC-32 of each record
computed on a second thread while it is being written. ZIP64 records are used when a record or
an offset passes 4 GiB. torch.load and Python's zipfile read the result.
"""

from __future__ import annotations

import datetime as dt
import os
import secrets
import struct
import sys
import threading
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

ALIGNMENT = 64
FORMAT_VERSION = b"1"
FILE_VERSION = b"3\n"
CHUNK = 64 << 20
_U32 = 0xFFFFFFFF
_PAD_ID = 0x4246  # "FB": the padding extra field torch's writer uses too
_ZIP64_ID = 0x0001
_LOCAL = struct.Struct("<IHHHHHIIIHH")
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_EOCD = struct.Struct("<IHHHHIIH")
_EOCD64 = struct.Struct("<IQHHIIQQQQ")
_LOCATOR64 = struct.Struct("<IIQI")


@dataclass(frozen=True)
class _Entry:
    name: bytes
    offset: int
    size: int
    crc: int


def _dos_time(when: dt.datetime) -> tuple[int, int]:
    t = (when.hour << 11) | (when.minute << 5) | (when.second // 2)
    d = ((when.year - 1980) << 9) | (when.month << 5) | when.day
    return t, d


def _write_all(fd: int, data: memoryview | bytes) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.write(fd, view[:CHUNK])
        view = view[n:]


class _Crc:
    """CRC-32 of a buffer computed on a helper thread (zlib releases the GIL on large buffers)
    while the caller writes the same buffer."""

    def __init__(self, data: memoryview | bytes) -> None:
        self.value = 0
        self._data = data
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        view = memoryview(self._data).cast("B")
        crc = 0
        for i in range(0, len(view), CHUNK):
            crc = zlib.crc32(view[i : i + CHUNK], crc)
        self.value = crc

    def result(self) -> int:
        self._thread.join()
        return self.value


class TorchZipWriter:
    """Writes one torch.save-format file to an open file descriptor, sequentially."""

    def __init__(self, fd: int, archive: str) -> None:
        self.fd = fd
        self.archive = archive
        self.offset = 0
        self.entries: list[_Entry] = []
        self._time = _dos_time(dt.datetime.now())

    def add(self, name: str, data: memoryview | bytes) -> None:
        full = f"{self.archive}/{name}".encode()
        size = len(memoryview(data).cast("B"))
        zip64 = size >= _U32
        extra = struct.pack("<HHQQ", _ZIP64_ID, 16, size, size) if zip64 else b""
        header_len = _LOCAL.size + len(full) + len(extra)
        pad = (-(self.offset + header_len + 4)) % ALIGNMENT
        extra += struct.pack("<HH", _PAD_ID, pad) + b"Z" * pad
        crc = _Crc(data) if size >= (1 << 20) else None
        small_crc = zlib.crc32(data) if crc is None else 0
        header = _LOCAL.pack(
            0x04034B50, 45 if zip64 else 20, 0, 0, self._time[0], self._time[1], 0,
            _U32 if zip64 else size, _U32 if zip64 else size, len(full), len(extra),
        )  # fmt: skip
        start = self.offset
        _write_all(self.fd, header + full + extra)
        _write_all(self.fd, data)
        value = crc.result() if crc is not None else small_crc
        os.pwrite(self.fd, struct.pack("<I", value), start + 14)
        self.offset += len(header) + len(full) + len(extra) + size
        self.entries.append(_Entry(full, start, size, value))

    def finish(self) -> None:
        cd_start = self.offset
        blob = bytearray()
        for e in self.entries:
            fields = []
            if e.size >= _U32:
                fields += [e.size, e.size]
            if e.offset >= _U32:
                fields.append(e.offset)
            extra = (
                struct.pack(f"<HH{len(fields)}Q", _ZIP64_ID, 8 * len(fields), *fields)
                if fields
                else b""
            )
            blob += _CENTRAL.pack(
                0x02014B50, 45, 45 if fields else 20, 0, 0, self._time[0], self._time[1], e.crc,
                min(e.size, _U32), min(e.size, _U32), len(e.name), len(extra), 0, 0, 0, 0,
                min(e.offset, _U32),
            )  # fmt: skip
            blob += e.name + extra
        cd_size = len(blob)
        count = len(self.entries)
        end_offset = cd_start + cd_size
        if cd_start >= _U32 or end_offset >= _U32 or count >= 0xFFFF:
            blob += _EOCD64.pack(0x06064B50, 44, 45, 45, 0, 0, count, count, cd_size, cd_start)
            blob += _LOCATOR64.pack(0x07064B50, 0, end_offset, 1)
        blob += _EOCD.pack(
            0x06054B50, 0, 0, min(count, 0xFFFF), min(count, 0xFFFF), min(cd_size, _U32),
            min(cd_start, _U32), 0,
        )  # fmt: skip
        _write_all(self.fd, bytes(blob))
        self.offset += len(blob)


def archive_name(file_name: str) -> str:
    """The record prefix torch derives from a file name: its base name without the extension."""
    base = os.path.basename(file_name)
    stem, dot, _ = base.rpartition(".")
    return (stem if dot else base) or "archive"


def write_torch_file(
    fd: int,
    file_name: str,
    pickle: memoryview | bytes,
    storages: Sequence[tuple[str, memoryview | bytes]],
) -> int:
    """Writes a complete torch.save file; returns its size."""
    if sys.byteorder != "little":
        raise RuntimeError("only little-endian hosts write snapshots")
    w = TorchZipWriter(fd, archive_name(file_name))
    w.add("data.pkl", pickle)
    w.add(".format_version", FORMAT_VERSION)
    w.add(".storage_alignment", str(ALIGNMENT).encode())
    w.add("byteorder", b"little")
    for key, data in storages:
        w.add(f"data/{key}", data)
    w.add("version", FILE_VERSION)
    w.add(
        ".data/serialization_id", "".join(secrets.choice("0123456789") for _ in range(40)).encode()
    )
    w.finish()
    return w.offset
