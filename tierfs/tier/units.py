"""Finer verification units of raw segments (DESIGN §7): a crc32c for every `unit` bytes (cache.verify_bytes,
4 KiB by default), next to the crc32c of every block.

Why: a block (cache.block_bytes, 1 MiB) is the unit of residency, read-ahead and eviction, and was the only unit
that could be checked, so a random 4 KiB read of an evicted segment fetched a whole MiB. With this table a random
read fetches only the units it touches, in one ranged GET of the raw chunk object, and checks each of them before
any byte is served. Packed little-endian uint32 (4 bytes per unit: 1 MiB per GiB at 4 KiB, 8 MiB at 512 B).

Where the table lives: one object per segment next to its chunks (<generation>.raw/units), written at upload; the
row holds only a reference, "crc32c:size:key"; content-addressed chunks (tierfs.tier.layout) have their table
content-addressed too (its own sha256), since two rows share it. Readers load tables lazily into a bounded LRU
(cache.unit_tables_bytes). The table is untrusted: it is checked against the reference's crc32c, and a unit that
fails it is fetched again as its whole block and checked against the block's own crc32c (the catalog's), so a
wrong table costs a re-fetch, never wrong bytes or a false EIO. Rows written before this keep the table inline
(unit_crcs), which still works.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections import OrderedDict

import crc32c

from tierfs.tier import layout

_U32 = struct.Struct("<I")


def table(data: bytes | memoryview, unit: int) -> bytes:
    """The crc32c of each `unit`-byte piece of `data` (the last may be short), packed."""
    mv = memoryview(data)
    a = array("I", [crc32c.crc32c(mv[u:u + unit]) for u in range(0, len(mv), unit)])
    if sys.byteorder == "big":
        a.byteswap()
    return a.tobytes()


TABLE_NAME = "units"


def table_key(chunk_key: str) -> str:
    """The table object of the segment generation whose (first) chunk object is `chunk_key`: beside it."""
    return f"{chunk_key.rsplit('/', 1)[0]}/{TABLE_NAME}"


def row_table_key(first_chunk: str, ref: str) -> str:
    """The table object a row whose first chunk object is `first_chunk` may name (parse_ref checks the row's
    reference against it): beside the chunk, or for content-addressed chunks a content-addressed object of the
    same store (named by the table's own bytes, so rows cannot point a reader anywhere else)."""
    if not layout.is_cas(first_chunk):
        return table_key(first_chunk)
    key = ref_key(ref)
    if layout.is_cas(key) and layout.cas_store(key) == layout.cas_store(first_chunk):
        return key
    return f"a content-addressed object under {layout.cas_prefix(layout.cas_store(first_chunk))}"


def make_ref(key: str, packed: bytes) -> str:
    """The row's reference to a table object holding `packed`."""
    return f"{crc32c.crc32c(packed):08x}:{len(packed)}:{key}"


def ref_key(ref: str) -> str:
    """The object key a reference names ("" for none)."""
    return ref.split(":", 2)[2] if ref.count(":") >= 2 else ""


def parse_ref(ref: str, size: int, key: str) -> tuple[str, int, int]:
    """(key, size, crc32c) of a reference, checked against the size and key its row implies: ValueError if not."""
    parts = ref.split(":", 2) if isinstance(ref, str) else []
    if len(parts) != 3 or len(parts[0]) != 8 or not parts[1].isdigit():
        raise ValueError(f"verification table reference {ref!r} is not 'crc32c:size:key'")
    try:
        crc = int(parts[0], 16)
    except ValueError:
        raise ValueError(f"verification table reference {ref!r} has no hex crc32c") from None
    if int(parts[1]) != size:
        raise ValueError(f"verification table reference names {parts[1]} bytes; the row needs {size}")
    if parts[2] != key:
        raise ValueError(f"verification table reference names object {parts[2]!r}, not {key!r}")
    return key, size, crc


def check_table(data: bytes, size: int, crc: int) -> str | None:
    """Why a fetched table object does not match its reference, or None when it does."""
    if len(data) != size:
        return f"{len(data)} bytes, its reference says {size}"
    if crc32c.crc32c(data) != crc:
        return "it fails the crc32c of its reference"
    return None


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


class TableLRU:
    """Loaded table objects by (file id, generation), least recently used dropped first beyond `budget` bytes: the
    daemon holds the tables of the segments being read, not one per tiered segment."""

    def __init__(self, budget: int):
        self.budget = budget
        self.bytes = 0
        self._d: OrderedDict[tuple[int, int], bytes] = OrderedDict()

    def get(self, key: tuple[int, int]) -> bytes | None:
        t = self._d.get(key)
        if t is not None:
            self._d.move_to_end(key)
        return t

    def put(self, key: tuple[int, int], table: bytes) -> None:
        self.discard(key)
        self._d[key] = table
        self.bytes += len(table)
        while self.bytes > self.budget and len(self._d) > 1:
            self.bytes -= len(self._d.popitem(last=False)[1])

    def discard(self, key: tuple[int, int]) -> None:
        t = self._d.pop(key, None)
        if t is not None:
            self.bytes -= len(t)

    def __contains__(self, key: tuple[int, int]) -> bool:
        return key in self._d
