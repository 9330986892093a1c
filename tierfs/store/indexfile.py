"""Index file codec, writer and lookup (format doc §7).

Layout: a 40-byte header, ``max_slots`` 4-byte hash slots, then ``max_items`` 20-byte items.
Each slot holds the number of the newest item in its bucket; items chain to older ones through
``prev_index``. Item 0 is never used and ``index_count`` (the next free item) starts at 1.
:class:`IndexWriter` reproduces ``IndexFile.putKey`` on any writable buffer (a ``bytearray`` or an
``mmap``); :func:`lookup` reproduces ``IndexFile.selectPhyOffset`` and :func:`query_offsets`
reproduces ``IndexService.queryOffset`` over several files.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Iterator, NamedTuple, Sequence

from .commitlog import (
    KEY_SEPARATOR,
    PROPERTY_KEYS,
    PROPERTY_UNIQ_KEY,
    TRANSACTION_MASK,
    TRANSACTION_ROLLBACK_TYPE,
)
from .javahash import index_key_hash

__all__ = [
    "HEADER_SIZE",
    "SLOT_SIZE",
    "ITEM_SIZE",
    "MAX_HASH_SLOT_NUM",
    "MAX_INDEX_NUM",
    "MAX_MSGS_NUM_BATCH",
    "INVALID_INDEX",
    "IndexHeader",
    "IndexItem",
    "index_file_size",
    "slot_position",
    "item_position",
    "decode_header",
    "decode_item",
    "IndexWriter",
    "iter_chain",
    "lookup",
    "is_time_matched",
    "query_offsets",
    "build_key",
    "index_keys_for_message",
]

HEADER_SIZE = 40
SLOT_SIZE = 4
ITEM_SIZE = 20
MAX_HASH_SLOT_NUM = 5_000_000
MAX_INDEX_NUM = 20_000_000
MAX_MSGS_NUM_BATCH = 64  # maxMsgsNumBatch: cap on hits per query
INVALID_INDEX = 0

_HEADER = struct.Struct(">qqqqii")
_ITEM = struct.Struct(">iqii")
_I = struct.Struct(">i")
_QQ = struct.Struct(">qq")
_INT_MAX = (1 << 31) - 1


@dataclass
class IndexHeader:
    """The 40-byte ``IndexHeader``. Offsets: 0, 8, 16, 24, 32, 36."""

    begin_timestamp: int = 0
    end_timestamp: int = 0
    begin_phy_offset: int = 0
    end_phy_offset: int = 0
    hash_slot_count: int = 0
    index_count: int = 1

    def encode(self) -> bytes:
        return _HEADER.pack(
            self.begin_timestamp, self.end_timestamp, self.begin_phy_offset,
            self.end_phy_offset, self.hash_slot_count, self.index_count,
        )


class IndexItem(NamedTuple):
    key_hash: int
    phy_offset: int
    time_diff: int  # seconds since the header's begin_timestamp
    prev_index: int


def index_file_size(max_slots: int = MAX_HASH_SLOT_NUM, max_items: int = MAX_INDEX_NUM) -> int:
    """Mapped size of an index file: 40 + slots*4 + items*20 (420000040 with the defaults)."""
    return HEADER_SIZE + max_slots * SLOT_SIZE + max_items * ITEM_SIZE


def slot_position(key_hash: int, max_slots: int) -> int:
    """Byte position of the slot for a (non-negative) key hash."""
    return HEADER_SIZE + (key_hash % max_slots) * SLOT_SIZE


def item_position(item_no: int, max_slots: int) -> int:
    """Byte position of item number *item_no*."""
    return HEADER_SIZE + max_slots * SLOT_SIZE + item_no * ITEM_SIZE


def decode_header(buf, raw: bool = False) -> IndexHeader:
    """Read the header. Unless *raw*, an ``index_count <= 0`` reads as 1, as ``IndexHeader.load`` does
    (a fresh file's header holds 0 until the first key is put)."""
    h = IndexHeader(*_HEADER.unpack_from(buf, 0))
    if not raw and h.index_count <= 0:
        h.index_count = 1
    return h


def decode_item(buf, item_no: int, max_slots: int) -> IndexItem:
    return IndexItem._make(_ITEM.unpack_from(buf, item_position(item_no, max_slots)))


def build_key(topic: str, key: str) -> str:
    """``IndexService.buildKey``: ``topic#key``."""
    return f"{topic}#{key}"


def index_keys_for_message(topic: str, properties: dict[str, str], sys_flag: int = 0) -> list[str]:
    """Index keys the broker inserts for a message, in insertion order (``IndexService.buildIndex``).

    ``topic#UNIQ_KEY`` first (when present), then ``topic#k`` per non-empty space-separated ``KEYS`` token.
    Rollback messages are not indexed.
    """
    if sys_flag & TRANSACTION_MASK == TRANSACTION_ROLLBACK_TYPE:
        return []
    out = []
    uniq = properties.get(PROPERTY_UNIQ_KEY)
    if uniq is not None:
        out.append(build_key(topic, uniq))
    keys = properties.get(PROPERTY_KEYS)
    if keys:
        out.extend(build_key(topic, k) for k in keys.split(KEY_SEPARATOR) if k)
    return out


def _hash(key: str | int) -> int:
    return key if type(key) is int else index_key_hash(key)


class IndexWriter:
    """``IndexFile`` write side over a writable buffer of ``index_file_size(max_slots, max_items)`` bytes.

    Like the broker it keeps the header in memory and writes it into the buffer on every change, so the
    mapping always holds a current header. Every store into the buffer is one slice assignment of final bytes,
    never ``Struct.pack_into``: that zeroes its target before it packs the fields one by one, so a writer killed
    in between left a shared mapping with ``index_count`` 0 and every key of the file unreachable. A new file may
    be pre-seeded with the previous file's end phy offset / timestamp (``prev_end_phy``, ``prev_end_ts``), written
    immediately as the broker's constructor does.
    ``load=True`` adopts the header already in *buf* (an existing file).
    """

    __slots__ = ("buf", "max_slots", "max_items", "_items_base",
                 "_begin_ts", "_end_ts", "_begin_phy", "_end_phy", "_slot_count", "_count")

    def __init__(
        self,
        buf,
        max_slots: int = MAX_HASH_SLOT_NUM,
        max_items: int = MAX_INDEX_NUM,
        prev_end_phy: int = 0,
        prev_end_ts: int = 0,
        *,
        load: bool = False,
    ) -> None:
        if max_slots <= 0 or max_items <= 1:
            raise ValueError("need max_slots > 0 and max_items > 1")
        if len(buf) < index_file_size(max_slots, max_items):
            raise ValueError("buffer smaller than the index file size")
        self.buf = buf
        self.max_slots = max_slots
        self.max_items = max_items
        self._items_base = HEADER_SIZE + max_slots * SLOT_SIZE
        if load:
            h = decode_header(buf)
            self._begin_ts, self._end_ts = h.begin_timestamp, h.end_timestamp
            self._begin_phy, self._end_phy = h.begin_phy_offset, h.end_phy_offset
            self._slot_count, self._count = h.hash_slot_count, h.index_count
            return
        self._begin_ts = self._end_ts = self._begin_phy = self._end_phy = self._slot_count = 0
        self._count = 1
        if prev_end_phy > 0:
            self._begin_phy = self._end_phy = prev_end_phy
            buf[16:32] = _QQ.pack(prev_end_phy, prev_end_phy)
        if prev_end_ts > 0:
            self._begin_ts = self._end_ts = prev_end_ts
            buf[0:16] = _QQ.pack(prev_end_ts, prev_end_ts)

    @property
    def header(self) -> IndexHeader:
        """Snapshot of the in-memory header."""
        return IndexHeader(self._begin_ts, self._end_ts, self._begin_phy, self._end_phy,
                           self._slot_count, self._count)

    @property
    def is_full(self) -> bool:
        """``isWriteFull``: ``index_count >= max_items`` (so at most max_items-1 items per file)."""
        return self._count >= self.max_items

    def put_key(self, key: str | int, phy_offset: int, store_timestamp: int) -> bool:
        """Insert one key (a ``topic#key`` string or its :func:`index_key_hash`). False when the file is full."""
        count = self._count
        if count >= self.max_items:
            return False
        key_hash = key if type(key) is int else index_key_hash(key)
        buf = self.buf
        slot_pos = HEADER_SIZE + (key_hash % self.max_slots) * SLOT_SIZE
        slot_value = _I.unpack_from(buf, slot_pos)[0]
        if slot_value <= INVALID_INDEX or slot_value > count:
            slot_value = INVALID_INDEX
        begin_ts = self._begin_ts
        if begin_ts <= 0:
            time_diff = 0
        else:
            # Java truncates toward zero, then clamps to [0, Integer.MAX_VALUE]: negatives all end up 0.
            diff = store_timestamp - begin_ts
            time_diff = min(diff // 1000, _INT_MAX) if diff > 0 else 0
        item_pos = self._items_base + count * ITEM_SIZE
        buf[item_pos:item_pos + ITEM_SIZE] = _ITEM.pack(key_hash, phy_offset, time_diff, slot_value)
        buf[slot_pos:slot_pos + SLOT_SIZE] = _I.pack(count)
        if count <= 1:
            self._begin_phy = phy_offset
            self._begin_ts = begin_ts = store_timestamp
        if slot_value == INVALID_INDEX:
            self._slot_count += 1
        self._count = count + 1
        self._end_phy = phy_offset
        self._end_ts = store_timestamp
        buf[0:HEADER_SIZE] = _HEADER.pack(begin_ts, store_timestamp, self._begin_phy, phy_offset,
                                          self._slot_count, count + 1)
        return True

    def flush_header(self) -> None:
        """``IndexHeader.updateByteBuffer``: rewrite all 40 header bytes from memory (done before each index msync)."""
        self.buf[0:HEADER_SIZE] = self.header.encode()


def _chain_head(buf, key_hash: int, max_slots: int) -> tuple[int, int, int] | None:
    """``(begin_timestamp, index_count, newest item number)`` for the key's slot, or None if it has no chain."""
    try:
        begin_ts, _, _, _, _, count = _HEADER.unpack_from(buf, 0)
        slot_value = _I.unpack_from(buf, HEADER_SIZE + (key_hash % max_slots) * SLOT_SIZE)[0]
    except (struct.error, ValueError, TypeError):
        return None
    if count <= 0:
        count = 1  # IndexHeader.load
    if slot_value <= INVALID_INDEX or slot_value > count or count <= 1:
        return None
    return begin_ts, count, slot_value


def _chain(buf, item_no: int, count: int, max_slots: int, max_items: int) -> Iterator[tuple[int, int, int, int, int]]:
    """Raw ``(item_no, key_hash, phy_offset, time_diff, prev_index)`` along a chain, newest to oldest.

    Structural stops of ``selectPhyOffset``: ``prev <= 0``, ``prev > index_count``, ``prev == current``.
    Also stops at an item outside *buf* and after *max_items* steps, so corrupt chains (cycles) end.
    """
    base = HEADER_SIZE + max_slots * SLOT_SIZE
    limit = len(buf) - ITEM_SIZE
    unpack = _ITEM.unpack_from
    for _ in range(max_items):
        pos = base + item_no * ITEM_SIZE
        if pos > limit:
            return
        h, phy, time_diff, prev = unpack(buf, pos)
        yield item_no, h, phy, time_diff, prev
        if prev <= INVALID_INDEX or prev > count or prev == item_no:
            return
        item_no = prev


def iter_chain(buf, key: str | int, max_slots: int, max_items: int) -> Iterator[tuple[int, IndexItem]]:
    """Follow the slot chain of *key* newest to oldest, yielding ``(item_no, item)``.

    Yields nothing for an empty/out-of-range slot or ``index_count <= 1``. Never raises on a corrupt buffer.
    """
    head = _chain_head(buf, _hash(key), max_slots)
    if head is None:
        return
    _, count, first = head
    for item_no, h, phy, time_diff, prev in _chain(buf, first, count, max_slots, max_items):
        yield item_no, IndexItem(h, phy, time_diff, prev)


def lookup(
    buf,
    key: str | int,
    begin_ms: int,
    end_ms: int,
    max_num: int = MAX_MSGS_NUM_BATCH,
    max_slots: int = MAX_HASH_SLOT_NUM,
    max_items: int = MAX_INDEX_NUM,
) -> list[int]:
    """Commitlog offsets for *key* in one index file, newest first, as ``IndexFile.selectPhyOffset``.

    A hit needs an equal key hash and ``begin_ms <= time <= end_ms``; the walk stops at ``max_num`` hits,
    a negative time diff, the first item older than *begin_ms*, or the structural ends of :func:`iter_chain`.
    Equal hashes of different keys are returned too: the caller must read the record and compare keys.
    Never raises on a corrupt buffer (it returns what it found before the damage).
    """
    out: list[int] = []
    key_hash = _hash(key)
    head = _chain_head(buf, key_hash, max_slots) if max_num > 0 else None
    if head is None:
        return out
    begin_ts, count, first = head
    for _, h, phy, time_diff, _ in _chain(buf, first, count, max_slots, max_items):
        if time_diff < 0:
            break
        t = begin_ts + time_diff * 1000
        if h == key_hash and begin_ms <= t <= end_ms:
            out.append(phy)
            if len(out) >= max_num:
                break
        if t < begin_ms:
            break
    return out


def is_time_matched(header: IndexHeader, begin_ms: int, end_ms: int) -> bool:
    """``IndexFile.isTimeMatched``: does ``[begin, end]`` overlap the file's header time range?"""
    b, e = header.begin_timestamp, header.end_timestamp
    return (begin_ms < b and end_ms > e) or (b <= begin_ms <= e) or (b <= end_ms <= e)


def query_offsets(
    files: Sequence,
    key: str | int,
    begin_ms: int,
    end_ms: int,
    max_num: int = MAX_MSGS_NUM_BATCH,
    max_slots: int = MAX_HASH_SLOT_NUM,
    max_items: int = MAX_INDEX_NUM,
    headers: Sequence[IndexHeader] | None = None,
) -> list[int]:
    """``IndexService.queryOffset`` over index file buffers given **oldest first** (sorted by name).

    Walks newest to oldest, searches files whose time range overlaps, and stops after a file that
    begins before *begin_ms* or once *max_num* (capped at 64) hits are collected. *headers* may carry
    the decoded headers of *files* (the broker keeps them in memory) to skip re-reading them.
    """
    max_num = min(max_num, MAX_MSGS_NUM_BATCH)
    out: list[int] = []
    key_hash = _hash(key)
    for i in range(len(files) - 1, -1, -1):
        buf = files[i]
        header = headers[i] if headers is not None else decode_header(buf)
        if is_time_matched(header, begin_ms, end_ms):
            out.extend(lookup(buf, key_hash, begin_ms, end_ms, max_num - len(out), max_slots, max_items))
        if header.begin_timestamp < begin_ms or len(out) >= max_num:
            break
    return out
