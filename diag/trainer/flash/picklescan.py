"""One pass over a pickle's opcodes, before anything runs it: only what torch.save's protocol 2 writes.

The C unpickler allocates some things from the numbers a pickle states, before it reads what they
describe: BINBYTES, BINBYTES8 and BYTEARRAY8 allocate the length they state (3 GiB for a claim
in a 1 KB pickle), a memo index makes the memo table that long and zeroes it. Protocol 2, which
the trainer writes (capture.TORCH_PICKLE_PROTOCOL), has none of the first three (bytes are
`_codecs.encode` calls) nor FRAME, STACK_GLOBAL or out-of-band buffers; so every opcode it does
not write is refused, every stated length must lie inside the pickle, and a memo index may not
exceed the position it is stored at (the pickler numbers them from 0, one per object). The
pickle must end at its STOP. What the pickle builds with opcodes alone is then linear in its
length; what calls build is pickleproof.py's.
"""

from __future__ import annotations

import struct

from diag.trainer.flash.refused import RefusedOpcode

# Opcodes of one byte, and those with an argument of fixed size: (opcode, bytes in all).
_NO_ARGUMENT = b"(012N\x88\x89aeb}])dlRstu\x85\x86\x87\x81Q"
_FIXED = {b"J": 5, b"K": 2, b"M": 3, b"G": 9, b"h": 2, b"j": 5, b"q": 2}
_SKIP = [0] * 256  # bytes to the next opcode; 0: handled below, or refused
for _op in _NO_ARGUMENT:
    _SKIP[_op] = 1
for _code, _size in _FIXED.items():
    _SKIP[_code[0]] = _size

_BINUNICODE, _LONG_BINPUT, _LONG1, _LONG4 = 0x58, 0x72, 0x8A, 0x8B
_GLOBAL, _PROTO, _STOP = 0x63, 0x80, 0x2E
_U32 = struct.Struct("<I").unpack_from
_I32 = struct.Struct("<i").unpack_from


def scan(data: bytes) -> None:
    """Raises RefusedOpcode unless `data` is made only of the opcodes protocol 2 writes, each
    argument inside it, and ends with its STOP."""
    skip, u32, i = _SKIP, _U32, 0
    end = len(data) - 1
    try:
        while True:
            # Most opcodes take no argument or a fixed one: stepped over in this inner loop.
            k = skip[data[i]]
            while k:
                i += k
                k = skip[data[i]]
            op = data[i]
            if op == _BINUNICODE:
                i += 5 + u32(data, i + 1)[0]
            elif op == _LONG_BINPUT:
                if u32(data, i + 1)[0] > i:
                    raise RefusedOpcode(f"memo index {u32(data, i + 1)[0]} stored at byte {i}")
                i += 5
            elif op == _LONG1:
                i += 2 + data[i + 1]
            elif op == _GLOBAL:
                i = data.index(b"\n", data.index(b"\n", i + 1) + 1) + 1
            elif op == _LONG4:
                n = _I32(data, i + 1)[0]
                if n < 0:
                    raise RefusedOpcode(f"LONG4 of length {n} at byte {i}")
                i += 5 + n
            elif op == _PROTO:
                if data[i + 1] > 2:
                    raise RefusedOpcode(f"protocol {data[i + 1]}: torch.save writes 2")
                i += 2
            elif op == _STOP:
                if i != end:
                    raise RefusedOpcode(f"{end - i} bytes after the pickle's STOP")
                return
            else:
                raise RefusedOpcode(f"opcode {_name(op)} at byte {i}: protocol 2 never writes it")
    except (IndexError, ValueError, struct.error):  # an argument runs past the end
        raise RefusedOpcode(f"truncated: an opcode's argument runs past byte {end}") from None


def _name(op: int) -> str:
    import pickletools

    code = bytes([op]).decode("latin-1")
    names = {o.code: o.name for o in pickletools.opcodes}
    return names.get(code, f"{op:#04x}")
