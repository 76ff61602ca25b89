"""Pickles written by hand, as an attacker (or a corruption) would write them into a slot: for the
tests of the trainer's unpickler (tests/trainer/flash/test_trust_pickles.py), importable by the
child processes that measure their memory too."""

from __future__ import annotations


def pickle_of(*ops: bytes) -> bytes:
    return b"\x80\x02" + b"".join(ops) + b"."


def global_(module: str, name: str) -> bytes:
    return f"c{module}\n{name}\n".encode()


def text(s: str) -> bytes:
    return b"X" + len(s).to_bytes(4, "little") + s.encode()


def long1(n: int) -> bytes:
    size = (n.bit_length() + 8) // 8  # a sign bit to spare
    return b"\x8a" + bytes([size]) + n.to_bytes(size, "little")


# The persistent id of storage "0", 4 floats (its tuple left open for its numel).
STORAGE = b"(" + text("storage") + global_("torch", "FloatStorage") + text("0") + text("cpu")

# What each pickle would allocate when loaded, from a few bytes (or one MiB) of slot.
BOMBS = {
    # A14's: 3 GiB of zeros, touched.
    "bytearray-3GiB": pickle_of(global_("builtins", "bytearray"), long1(3 << 30), b"\x85R"),
    # 16 M integers in a list: 640 MiB.
    "list-of-a-range": pickle_of(
        global_("builtins", "list"), global_("builtins", "range"), long1(1 << 24), b"\x85R\x85R"
    ),
    # The memo table made 2^27 entries long, and zeroed: 1 GiB.
    "memo-index": pickle_of(b"Nr", (1 << 26).to_bytes(4, "little")),
    # BINBYTES8 allocates the length it states before reading it: 3 GiB (never touched).
    "binbytes8-3GiB": pickle_of(b"\x8e", (3 << 30).to_bytes(8, "little"), b"xx"),
    # A list of 2^20 Nones copied 100 times by collections.deque, in a 1 MiB pickle: 800 MiB.
    "hundred-copies": pickle_of(
        global_("collections", "deque"),
        b"q\x01",
        b"(",
        b"N" * (1 << 20),
        b"lq\x02",
        b"(",
        b"h\x01h\x02\x85R" * 100,
        b"l",
    ),
    # A tensor of 2^28 floats over a storage of 4: torch grows the storage to 1 GiB.
    "tensor-past-its-storage": pickle_of(
        global_("torch._utils", "_rebuild_tensor_v2"),
        b"(",
        STORAGE,
        b"K\x04tQK\x00",
        long1(1 << 28),
        b"\x85K\x01\x85",
        b"\x89",
        global_("collections", "OrderedDict"),
        b")Rt",
        b"R",
    ),
}
