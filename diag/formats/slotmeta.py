"""A snapshot's description (SnapshotMeta), read from a slot file another process wrote.

The description decides where the agent writes (every file entry becomes a file under the save
directory) and which bytes of the slot it copies, so every field is validated into our types
before anything uses it: paths are relative with no `..` and stay out of the agent's own files
in the save directory, spans lie inside the slot's data area, counts and lengths are bounded.
File modes in the description are not read: the agent chooses modes itself.
"""

from __future__ import annotations

from pathlib import PurePosixPath

from diag.formats.snapshot import (
    HEADER_SIZE,
    LATEST_FILE,
    META_FORMAT,
    TRACKER_FILE,
    FileEntry,
    SnapshotMeta,
    Span,
    StorageEntry,
)
from diag.formats.untrusted import MIB, UntrustedInput, bounded_int, parse_json, relative_parts

# Measured on real ZeRO 1/2/3 snapshots (fp32, bf16): 43 bytes per storage (ZeRO-3 keeps one per
# parameter tensor, ZeRO 1/2 a handful per group) and about 170 per file. 8 MiB holds 190,000
# parameter tensors, about four times a 671B MoE model's whole count. Parsing takes at most
# about 15 times the bytes parsed (one object of short unique keys: 120 MB at the cap; unique
# strings or numbers 8-9 times), once per change of a slot (slotcache.py).
MAX_META_BYTES = 8 * MIB
MAX_FILES = 65536
MAX_STORAGES = 1 << 18  # in all the files of one snapshot (37 bytes at least each)
# A real description spends 29 bytes or more on each JSON object or list (a storage entry 37,
# a file entry 80 on its three); `[{},{},...]` spends 3 and costs 24 times its size to parse.
MIN_BYTES_PER_CONTAINER = 16
MAX_WORLD = 1 << 20
MAX_TEXT = 1024  # job, node, tag, run, device
MAX_PATH = 4096
MAX_COMPONENT = 255
MAX_STEP = (1 << 63) - 1
# The agent's own files at the top of the save directory: a slot never writes them.
RESERVED_TOP = frozenset({".diag", LATEST_FILE, TRACKER_FILE})


def description_from_json(data: bytes, *, source: str = "snapshot description") -> SnapshotMeta:
    """A description alone (not read from a slot: no span is checked against the slot's end);
    UntrustedInput if bad."""
    return parse_meta(data, source=source, data_end=len(data) + (1 << 62))


def parse_meta(data: bytes, *, source: str, data_end: int) -> SnapshotMeta:
    """The description in `data`, read from slot `source` whose data area ends at `data_end`;
    anything out of shape is an UntrustedInput naming the slot."""
    if len(data) > MAX_META_BYTES:
        raise UntrustedInput(
            source, f"snapshot description of {len(data)} bytes, over {MAX_META_BYTES}"
        )
    containers = data.count(b"{") + data.count(b"[")
    if containers > len(data) // MIN_BYTES_PER_CONTAINER + 16:
        raise UntrustedInput(
            source, f"{containers} JSON objects and lists in {len(data)} bytes: not a description"
        )
    raw = parse_json(source, data)
    if not isinstance(raw, dict):
        raise UntrustedInput(source, "snapshot description is not a JSON object")
    fmt = raw.get("format")
    if fmt != META_FORMAT:
        raise UntrustedInput(source, f"unsupported snapshot description format {_short(fmt)}")
    world = _int(raw, "world_size", 1, MAX_WORLD, source)
    files = raw.get("files")
    if not isinstance(files, list):
        raise UntrustedInput(source, "files must be a list")
    if len(files) > MAX_FILES:
        raise UntrustedInput(source, f"{len(files)} files, over the limit of {MAX_FILES}")
    budget = [MAX_STORAGES]
    entries = tuple(_file(f, i, source, data_end, budget) for i, f in enumerate(files))
    paths = [e.path for e in entries]
    if len(set(paths)) != len(paths):
        raise UntrustedInput(source, "the same file is described twice")
    return SnapshotMeta(
        job=_text(raw, "job", source),
        rank=_int(raw, "rank", 0, world - 1, source),
        world_size=world,
        local_rank=_int(raw, "local_rank", 0, MAX_WORLD - 1, source),
        node=_text(raw, "node", source),
        step=_int(raw, "step", 0, MAX_STEP, source),
        tag=_text(raw, "tag", source),
        save_dir=_save_dir(raw.get("save_dir"), source),
        files=entries,
        device=_text(raw, "device", source, default="cpu"),
        run=_text(raw, "run", source, default=""),
        replica_round=_bool(raw, "replica_round", source),
    )


def _bool(raw: dict, key: str, source: str) -> bool:
    value = raw.get(key, False)
    if not isinstance(value, bool):
        raise UntrustedInput(source, f"{key} must be true or false")
    return value


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _int(raw: dict, key: str, lo: int, hi: int, source: str, what: str = "") -> int:
    return bounded_int(raw.get(key), lo=lo, hi=hi, what=what or key, source=source)


def _text(raw: dict, key: str, source: str, default: str | None = None) -> str:
    value = raw.get(key, default)
    if not isinstance(value, str):
        raise UntrustedInput(source, f"{key} must be a string, got {type(value).__name__}")
    if len(value) > MAX_TEXT or "\x00" in value:
        raise UntrustedInput(source, f"{key} is over {MAX_TEXT} characters or holds a NUL")
    return value


def _save_dir(value: object, source: str) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_PATH or "\x00" in value:
        raise UntrustedInput(source, "save_dir must be a non-empty path without NUL bytes")
    p = PurePosixPath(value)
    if not p.is_absolute() or ".." in p.parts:
        raise UntrustedInput(source, f"save_dir {_short(value)} must be absolute, without '..'")
    return value


def _span(value: object, what: str, source: str, data_end: int) -> Span | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise UntrustedInput(source, f"{what} must be an object with offset and length")
    offset = _int(value, "offset", HEADER_SIZE, data_end, source, f"{what} offset")
    length = _int(value, "length", 0, data_end - offset, source, f"{what} length")
    return Span(offset, length)


def _path(value: object, what: str, source: str) -> str:
    if not isinstance(value, str) or len(value) > MAX_PATH:
        raise UntrustedInput(source, f"{what} path must be a string of at most {MAX_PATH}")
    try:
        parts = relative_parts(value, what=f"{what} path")
    except UntrustedInput as e:
        raise UntrustedInput(source, f"{e.problem} ({_short(value)})") from None
    if parts[0] in RESERVED_TOP:
        raise UntrustedInput(source, f"{what} path {_short(value)} names one of diag's own files")
    if any(len(p.encode(errors="surrogatepass")) > MAX_COMPONENT for p in parts):
        raise UntrustedInput(source, f"{what} path has a component over {MAX_COMPONENT} bytes")
    return "/".join(parts)


def _file(raw: object, i: int, source: str, data_end: int, budget: list[int]) -> FileEntry:
    what = f"file {i}"
    if not isinstance(raw, dict):
        raise UntrustedInput(source, f"{what} must be an object, got {_short(raw)}")
    path = _path(raw.get("path"), what, source)
    kind = raw.get("kind")
    persist = raw.get("persist", True)
    if not isinstance(persist, bool):
        raise UntrustedInput(source, f"{what}: persist must be true or false")
    if kind == "raw":
        data = _span(raw.get("data"), f"{what} data", source, data_end)
        return FileEntry(path, "raw", persist, data=data)
    if kind != "torch":
        raise UntrustedInput(source, f"{what}: kind must be 'torch' or 'raw', not {_short(kind)}")
    pickle = _span(raw.get("pickle"), f"{what} pickle", source, data_end)
    if pickle is None:
        raise UntrustedInput(source, f"{what}: a torch file needs its pickled structure")
    storages = raw.get("storages", [])
    if not isinstance(storages, list):
        raise UntrustedInput(source, f"{what}: storages must be a list")
    budget[0] -= len(storages)
    if budget[0] < 0:
        raise UntrustedInput(source, f"over {MAX_STORAGES} storages in all")
    out = []
    keys = set()
    for s in storages:
        if not isinstance(s, dict):
            raise UntrustedInput(source, f"{what}: a storage must be an object")
        key = s.get("key")
        # torch.save numbers its storages; the key becomes a record name in the written file
        if not isinstance(key, str) or not key.isascii() or not key.isdigit() or len(key) > 20:
            raise UntrustedInput(source, f"{what}: storage key {_short(key)} is not a number")
        if key in keys:
            raise UntrustedInput(source, f"{what}: storage {key} is described twice")
        keys.add(key)
        offset = _int(s, "offset", HEADER_SIZE, data_end, source, f"{what} storage offset")
        nbytes = _int(s, "nbytes", 0, data_end - offset, source, f"{what} storage nbytes")
        out.append(StorageEntry(key, offset, nbytes))
    return FileEntry(path, "torch", persist, pickle=pickle, storages=tuple(out))
