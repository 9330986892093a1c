"""Compacted IndexFile sidecar (``.cidx``). Pure: IndexFile bytes in, sidecar bytes out; look-ups over a reader.

A live IndexFile query (format §7.3, :func:`tierfs.store.indexfile.lookup`) follows a ``prev_index`` chain of
20-byte items scattered over a 400 MB file: one random read per item. The sidecar stores, for every hash slot, the
items that chain walk visits as one contiguous run in exactly the walk order (newest first), so a look-up over an
object store is one ranged read of the slot's two table entries and one of the run, and gives the same answer.

Layout (big-endian, like the IndexFile it is derived from)::

    header  56 bytes: magic b"TCIDX\\0\\0\\1", begin_timestamp q, end_timestamp q, begin_phy_offset q,
            end_phy_offset q, hash_slot_count i, index_count i (all six copied raw from the IndexHeader),
            slot_num u32, item_count u32
    table   slot_num+1 u32: run start (item number in the sidecar) of each slot; run length = next start - start
    items   item_count x 16 bytes: key_hash i32, phy_offset i64, time_diff i32 (the IndexFile item minus prev_index)

Runs reproduce the walk's structural rules exactly (slot value <= 0 or > index_count, ``index_count <= 1``,
``prev <= 0``, ``prev > index_count``, ``prev == current``, items past the end of the file, and the ``max_index_num``
step cap). Time filtering and the stop at ``max_n`` hits depend on the query and are applied in :func:`lookup`.
The broker only ever writes chains that go strictly backwards; anything else (possible only in a damaged file)
still gets its exact walk, unless chains share so many items that the sidecar would exceed :func:`build`'s cap.
"""

from __future__ import annotations

import mmap
import struct
import sys
from array import array
from dataclasses import dataclass
from operator import ge
from typing import Callable

from . import indexfile as ix
from .javahash import index_key_hash

__all__ = ["MAGIC", "HEADER_SIZE", "ITEM_SIZE", "CidxError", "CidxHeader", "build", "parse_header",
           "slot_entry_span", "run_span", "lookup"]

MAGIC = b"TCIDX\0\0\1"
_HEADER = struct.Struct(">8sqqqqiiII")
HEADER_SIZE = _HEADER.size  # 56
ITEM_SIZE = 16
_ITEM = struct.Struct(">iqi")
_PAIR = struct.Struct(">II")
_REC = struct.Struct(">16si")  # an IndexFile item: the 16 bytes a sidecar keeps, then prev_index
_U32_MAX = (1 << 32) - 1
_FLUSH = 1 << 16  # item records joined per piece while building (bounds the list of small bytes objects)

if array("I").itemsize != 4 or array("i").itemsize != 4:  # pragma: no cover - every CPython platform we run on
    raise ImportError("tierfs.store.cidx needs 4-byte array('i') and array('I')")


class CidxError(ValueError):
    """The IndexFile cannot be compacted, or a sidecar (or a read of one) is malformed; the message says what."""


@dataclass(frozen=True)
class CidxHeader:
    begin_timestamp: int
    end_timestamp: int
    begin_phy_offset: int
    end_phy_offset: int
    hash_slot_count: int
    index_count: int
    slot_num: int
    item_count: int

    @property
    def items_offset(self) -> int:
        return HEADER_SIZE + 4 * (self.slot_num + 1)

    @property
    def size(self) -> int:
        """Size of the whole sidecar."""
        return self.items_offset + ITEM_SIZE * self.item_count


def _be_array(code: str, data) -> array:
    a = array(code)
    a.frombytes(data)
    if sys.byteorder == "little":
        a.byteswap()
    return a


def build(index_bytes, max_hash_slot_num: int, max_index_num: int) -> bytes:
    """The sidecar of a whole IndexFile (bytes, bytearray, mmap or memoryview) written with these two settings.

    O(items): one pass over the slots following each chain. Raises CidxError when the content is not an IndexFile
    of that geometry (wrong size), or when damaged chains share so many items that the runs would hold more than
    twice the file's items (the walk order itself is reproduced whatever the chains look like).
    """
    S, N = max_hash_slot_num, max_index_num
    if type(S) is not int or type(N) is not int or S <= 0 or N <= 1 or S > _U32_MAX - 1:
        raise ValueError(f"max_hash_slot_num {S!r} and max_index_num {N!r}: need integers, slots in "
                         f"1..{_U32_MAX - 1} and max_index_num > 1")
    expected = ix.index_file_size(S, N)
    if len(index_bytes) != expected:
        raise CidxError(f"IndexFile is {len(index_bytes)} bytes; with max_hash_slot_num={S} and max_index_num={N} "
                        f"it must be {expected} bytes")
    raw = index_bytes if isinstance(index_bytes, (bytes, bytearray, mmap.mmap)) else bytes(index_bytes)
    mv = memoryview(raw).cast("B")
    h = ix.decode_header(mv, raw=True)
    count = h.index_count if h.index_count > 0 else 1  # IndexHeader.load
    # Highest item number a walk can yield: <= index_count, and inside the file. index_count <= 1: no chains.
    top = min(count, N - 1) if count > 1 else 0
    base = ix.HEADER_SIZE + S * ix.SLOT_SIZE
    heads = _be_array("i", mv[ix.HEADER_SIZE:base])
    prev = mv[base:base + ix.ITEM_SIZE * (top + 1)].cast("I")[4::5].tobytes()
    # The broker only links an item to an older one (prev < item). If every reachable item does, a walk simply
    # runs until prev <= 0; any other link (possible only in a damaged file) takes the general walk below.
    backwards_only = not any(map(ge, _be_array("i", prev)[1:], range(1, top + 1)))
    del prev
    cap = max(2 * top, 1 << 16)
    unpack = _REC.unpack_from

    starts = array("I", bytes(4 * (S + 1)))
    pieces: list[bytes] = []
    recs: list[bytes] = []
    app = recs.append
    done = 0  # records already joined into pieces
    for s, v in enumerate(heads):
        starts[s] = done + len(recs)
        if v <= 0 or v > top:
            continue
        if backwards_only:
            i = v
            while i > 0:  # one 20-byte read per item: its first 16 bytes and its prev link
                rec, i = unpack(raw, base + 20 * i)
                app(rec)
        else:
            _walk_general(raw, base, top, N, v, app)
        if len(recs) >= _FLUSH:
            done += len(recs)
            pieces.append(b"".join(recs))
            recs.clear()
            if done > cap:
                _shared(s, done, cap, top)
    total = done + len(recs)
    if total > cap:
        _shared(S - 1, total, cap, top)
    starts[S] = total
    pieces.append(b"".join(recs))
    recs.clear()
    if sys.byteorder == "little":
        starts.byteswap()
    header = _HEADER.pack(MAGIC, h.begin_timestamp, h.end_timestamp, h.begin_phy_offset, h.end_phy_offset,
                          h.hash_slot_count, h.index_count, S, total)
    return b"".join([header, starts.tobytes(), *pieces])


def _shared(slot: int, n: int, cap: int, top: int) -> None:
    raise CidxError(f"IndexFile chains share items: by slot {slot} the runs already hold {n} items, more than {cap} "
                    f"(twice the file's {top} items); the file is damaged, no sidecar built")


def _walk_general(raw, base: int, top: int, max_items: int, i: int, app) -> None:
    """The chain walk from item *i* with every rule of the live one, including its step cap (ends cycles)."""
    unpack = _REC.unpack_from
    for _ in range(max_items):
        rec, p = unpack(raw, base + 20 * i)
        app(rec)
        if p <= 0 or p > top or p == i:  # prev > top: past index_count, or outside the file (not yielded)
            return
        i = p


def parse_header(b: bytes | bytearray | memoryview, object_size: int | None = None) -> CidxHeader:
    """Decode the header from the first :data:`HEADER_SIZE` bytes of *b*; with *object_size*, check it too."""
    if len(b) < HEADER_SIZE:
        raise CidxError(f"cidx header: need {HEADER_SIZE} bytes, got {len(b)}")
    magic, *fields = _HEADER.unpack_from(b, 0)
    if magic != MAGIC:
        raise CidxError(f"cidx header: bad magic {magic!r} (expected {MAGIC!r}): not a cidx sidecar")
    h = CidxHeader(*fields)
    if not 0 < h.slot_num < _U32_MAX:
        raise CidxError(f"cidx header: slot_num {h.slot_num} is out of range")
    if object_size is not None and object_size != h.size:
        raise CidxError(f"cidx header: {h.slot_num} slots and {h.item_count} items make {h.size} bytes, but the "
                        f"object is {object_size} bytes")
    return h


def slot_entry_span(h: CidxHeader, slot: int) -> tuple[int, int]:
    """Byte range of the table entries of *slot* and *slot*+1 (the run's start and end)."""
    if not 0 <= slot < h.slot_num:
        raise ValueError(f"cidx: slot {slot} is outside [0, {h.slot_num})")
    return HEADER_SIZE + 4 * slot, 8


def run_span(h: CidxHeader, start: int, count: int) -> tuple[int, int]:
    """Byte range of sidecar items ``[start, start+count)``."""
    if start < 0 or count < 0 or start + count > h.item_count:
        raise CidxError(f"cidx: run [{start}, {start}+{count}) is outside the {h.item_count} items")
    return h.items_offset + ITEM_SIZE * start, ITEM_SIZE * count


def lookup(read: Callable[[int, int], bytes], key: str | int, begin_ms: int, end_ms: int, max_n: int,
           header: CidxHeader | None = None) -> list[int]:
    """Commitlog offsets for *key* (``topic#key`` or its index hash), newest first: exactly what
    :func:`tierfs.store.indexfile.lookup` answers on the source IndexFile for the same arguments.

    ``read(offset, length)`` returns sidecar bytes (a ranged GET). Pass *header* (from :func:`parse_header`) to
    skip reading it; after the header a look-up makes one read for the slot's table entries and, unless the slot
    is empty, one for its run. Equal hashes of other keys are returned too, as by the live query.
    """
    h = header if header is not None else parse_header(read(0, HEADER_SIZE))
    if max_n <= 0:
        return []
    key_hash = key if type(key) is int else index_key_hash(key)
    off, n = slot_entry_span(h, key_hash % h.slot_num)
    entry = read(off, n)
    if len(entry) != n:
        raise CidxError(f"cidx: read of the table entries at {off} returned {len(entry)} bytes, expected {n}")
    start, end = _PAIR.unpack(entry)
    if not start <= end <= h.item_count:
        raise CidxError(f"cidx: slot {key_hash % h.slot_num} has run [{start}, {end}), not inside the "
                        f"{h.item_count} items (corrupt table)")
    if start == end:
        return []
    off, n = run_span(h, start, end - start)
    run = read(off, n)
    if len(run) != n:
        raise CidxError(f"cidx: read of the run at {off} returned {len(run)} bytes, expected {n}")
    out: list[int] = []
    begin_ts = h.begin_timestamp
    for kh, phy, time_diff in _ITEM.iter_unpack(run):
        if time_diff < 0:
            break
        t = begin_ts + time_diff * 1000
        if kh == key_hash and begin_ms <= t <= end_ms:
            out.append(phy)
            if len(out) >= max_n:
                break
        if t < begin_ms:
            break
    return out
