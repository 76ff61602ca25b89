"""What `diag merge` accepts from an incident directory: size caps per kind of file, the bound on
rank numbers, and text cleaned of control characters.

An incident directory may sit in a timeline that other users (or a compromised job) can write,
so every file in it is outside input: read only as a regular file (no symlink, no FIFO), under
the cap of its kind, and every name in it (frame, thread, file, node) loses its terminal escapes
and control characters once, when it is parsed into our types, so that summary.txt, the folded
files (one line per stack), summary.json and the terminal all get clean text.
"""

from __future__ import annotations

import os

from diag.formats.untrusted import KIB, MIB, UntrustedInput, open_regular, printable

# Caps, far above what production writes (bench/incidentgen: a rank of 75 threads, the training
# thread 199 frames deep, is ~200 KB as diag.stack/1 or .stacktrace, ~50 KB as py-spy JSON). A
# rank with a thousand threads of 200 native frames each stays under 64 MiB.
DUMP_MAX_BYTES = 64 * MIB  # diag.stack/1, py-spy JSON, xpu_timer .stacktrace: one rank's file
# A journal tail is the last 256 records and the meta (~50 KB).
JOURNAL_TAIL_MAX_BYTES = 16 * MIB
# verdict.json: the verdict, its suspects and the evidence of one node's ranks (a few KB).
VERDICT_MAX_BYTES = 16 * MIB

# Rank numbers and world sizes, from file names or file contents, above this are not believed
# (the largest jobs run tens of thousands of ranks).
MAX_WORLD = 1 << 20
# A world size named by files is believed up to this many ranks per dump file found (one node's
# directory of a 16k-rank job holds 8 dumps: 2,048 per file); above it, the world is what the
# files show (the highest rank + 1), so that a name cannot make the merge allocate per rank of
# a world nobody dumped.
MAX_RANKS_PER_FILE = 4096


def clean(text: str) -> str:
    """`text` as one line without terminal escapes or control characters. Names are clean
    almost always: the check is one C call, and the regexes run only on the rest."""
    if text.isprintable():
        return text
    return printable(text, keep_newlines=False)


def clean_lines(text: str) -> str:
    """Like `clean`, keeping newlines (a tool's stderr, kept as the reason a rank has no
    stack)."""
    if text.isprintable():
        return text
    return printable(text)


def read_capped(path: str | os.PathLike[str], max_bytes: int) -> bytes:
    """The content of a regular file of at most `max_bytes` (no symlink followed, no FIFO
    waited on), read by its size: `read_bounded` asks for the whole cap at once, and a buffer
    of the cap allocated and shrunk per file costs a merge of thousands of files a tenth more
    time."""
    fd, st = open_regular(path, max_bytes=max_bytes)
    try:
        parts: list[bytes] = []
        total = 0
        while total <= max_bytes:
            want = min(max(st.st_size + 1 - total, 64 * KIB), max_bytes + 1 - total)
            chunk = os.read(fd, want)
            if not chunk:
                break
            parts.append(chunk)
            total += len(chunk)
    finally:
        os.close(fd)
    if total > max_bytes:
        raise UntrustedInput(path, f"grew past the {max_bytes}-byte limit while being read")
    return parts[0] if len(parts) == 1 else b"".join(parts)
