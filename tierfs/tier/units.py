"""Finer verification units of raw segments (DESIGN §7): a crc32c for every `unit` bytes (cache.verify_bytes,
4 KiB by default), next to the crc32c of every block.

Why: a block (cache.block_bytes, 1 MiB) is the unit of residency, read-ahead and eviction, and was the only unit
that could be checked, so a random 4 KiB read of an evicted segment fetched a whole MiB. With this table a random
read fetches only the units it touches, in one ranged GET of the raw chunk object, and checks each of them before
any byte is served. Packed little-endian uint32 (4 bytes per unit: 1 MiB per GiB at 4 KiB), not a JSON list:
the table lives in every catalog row and snapshot row of a tiered segment.
"""

from __future__ import annotations

import struct
import sys
from array import array

import crc32c

_U32 = struct.Struct("<I")


def table(data: bytes | memoryview, unit: int) -> bytes:
    """The crc32c of each `unit`-byte piece of `data` (the last may be short), packed."""
    mv = memoryview(data)
    a = array("I", [crc32c.crc32c(mv[u:u + unit]) for u in range(0, len(mv), unit)])
    if sys.byteorder == "big":
        a.byteswap()
    return a.tobytes()


def crc_of(packed: bytes, i: int) -> int:
    """The crc32c of unit `i` from a packed table."""
    return _U32.unpack_from(packed, 4 * i)[0]


def first_bad(data: bytes | memoryview, first: int, packed: bytes, unit: int) -> int | None:
    """The first unit of `data` (units first, first+1, ..., each `unit` bytes, the last possibly short) whose
    crc32c differs from the table, or None."""
    mv = memoryview(data)
    for i, pos in enumerate(range(0, len(mv), unit)):
        if crc32c.crc32c(mv[pos:pos + unit]) != crc_of(packed, first + i):
            return first + i
    return None
