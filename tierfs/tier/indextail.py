"""Active IndexFiles in continuous tiering: upload the header and the appended items, not the hash-slot table.

An IndexFile (rocketmq-store-format.md §7) is a 40-byte header, `maxHashSlotNum` 4-byte hash slots, then 20-byte
items appended in order. Every put rewrites a random slot, so the slot table (20 MB by default) is dirty all over
after every round; uploading it each time costs more than the CommitLog itself. It carries no information of its
own: each slot holds the number of the newest item whose `keyHash % maxHashSlotNum` is that slot, so replaying
items 1 .. indexCount-1 in order rebuilds it exactly (the items' own `prevIndex` chains are uploaded as they are).
The writer therefore uploads the header and the items region only (`slot_count` finds where it starts, from
the configured geometry or the broker's default 1:4 ratio, checked against the items); whoever
materialises the tail (takeover, read-only and following mounts) calls `rebuild_slots`.
"""

from __future__ import annotations

import mmap
import os
import struct

import numpy as np

from tierfs.store import indexfile as ix

_RATIO = 4  # the broker's maxIndexNum / maxHashSlotNum (20,000,000 / 5,000,000)
_BATCH = 1 << 20  # items replayed at a time (20 MiB read, ~100 MiB of numpy temporaries)
_ITEM = struct.Struct(">iqii")
_I = struct.Struct(">i")


def items_base(slots: int) -> int:
    """Byte offset of item 0 (never used: the items region the writer uploads starts there)."""
    return ix.HEADER_SIZE + slots * ix.SLOT_SIZE


def _count(fd: int) -> int:
    h = ix.decode_header(os.pread(fd, ix.HEADER_SIZE, 0).ljust(ix.HEADER_SIZE, b"\0"))
    return h.index_count


def _geometries(size: int, configured: tuple[int, int] | None) -> list[int]:
    """Hash-slot counts an IndexFile of `size` bytes may have: the configured geometry (broker.max_hash_slot_num,
    broker.max_index_num) if the size is its size, then the broker's default items = 4 x slots ratio."""
    out = []
    if configured is not None and ix.index_file_size(*configured) == size:
        out.append(configured[0])
    per = ix.SLOT_SIZE + _RATIO * ix.ITEM_SIZE
    if size > ix.HEADER_SIZE and (size - ix.HEADER_SIZE) % per == 0 and (size - ix.HEADER_SIZE) // per not in out:
        out.append((size - ix.HEADER_SIZE) // per)
    return out


def _items(slots: int, size: int) -> int:
    return (size - items_base(slots)) // ix.ITEM_SIZE


def slot_count(fd: int, size: int, configured: tuple[int, int] | None = None) -> tuple[int | None, bool]:
    """(maxHashSlotNum, checked) of an IndexFile of `size` bytes (see _geometries), checked against its contents
    when it holds an item: the newest item heads its slot's chain (or a newer item with the same slot does) and
    chains to an item of the same slot. None when no geometry fits: the caller then uploads the file as it is."""
    candidates = _geometries(size, configured)
    count = _count(fd)
    if count <= 1:  # no item yet: nothing to check, and nothing in the items region to misplace
        return (candidates[0], False) if candidates else (None, False)
    for slots in candidates:
        if count <= _items(slots, size) and _fits(fd, slots, count):
            return slots, True
    return None, False


def _fits(fd: int, slots: int, count: int) -> bool:
    def item(n: int) -> tuple[int, int, int, int] | None:
        raw = os.pread(fd, ix.ITEM_SIZE, items_base(slots) + n * ix.ITEM_SIZE)
        return _ITEM.unpack(raw) if len(raw) == ix.ITEM_SIZE else None

    last = item(count - 1)
    if last is None or last[0] < 0 or not 0 <= last[3] < count - 1:
        return False
    slot = last[0] % slots
    head = _I.unpack(os.pread(fd, 4, ix.HEADER_SIZE + slot * ix.SLOT_SIZE).ljust(4, b"\0"))[0]
    if head != count - 1:
        newer = item(head) if head > count - 1 else None  # put after the header was read
        if newer is None or newer[0] < 0 or newer[0] % slots != slot:
            return False
    if last[3] > 0:
        prev = item(last[3])
        if prev is None or prev[0] < 0 or prev[0] % slots != slot:
            return False
    return True


def local_count(fd: int) -> int:
    """indexCount of the header a local copy holds now (before new objects are written over it)."""
    return _count(fd)


def rebuild_slots(fd: int, slots: int, since: int = 1) -> int:
    """Bring the hash-slot table of an IndexFile up to its header and items, in place: replay items since ..
    indexCount-1 in order over a table that holds items 1 .. since-1 (since <= 1: the whole table from nothing),
    the newest item of each slot winning. A follower replays only what a refresh added; only the slots that change
    are written. Returns the items replayed. Blocking; `fd` open for reading and writing."""
    count = min(_count(fd), _items(slots, os.fstat(fd).st_size))
    since = max(1, since)
    if since > count:
        since = 1  # the header went back (a file rewritten): all again
    mm = mmap.mmap(fd, items_base(slots))
    try:
        table = np.ndarray((slots,), dtype=">i4", buffer=mm, offset=ix.HEADER_SIZE)
        if since == 1:
            step = 1 << 18
            for lo in range(0, slots, step):  # stale slots go; holes (a fresh sparse copy) stay holes
                if table[lo:lo + step].any():
                    table[lo:lo + step] = 0
        n = 0
        for first_no in range(since, count, _BATCH):  # in order, in batches: a later batch overwrites
            want = min(_BATCH, count - first_no)
            raw = os.pread(fd, want * ix.ITEM_SIZE, items_base(slots) + first_no * ix.ITEM_SIZE)
            got = len(raw) // ix.ITEM_SIZE
            n += got
            hashes = np.frombuffer(raw, dtype=">i4", count=got * 5).reshape(got, 5)[:, 0].astype(np.int64)
            numbers = np.arange(first_no, first_no + got, dtype=np.int64)
            ok = hashes >= 0  # Math.abs: a valid item never has a negative hash; a torn one is not replayed
            # the last (newest) item of each slot: unique over the reversed sequence keeps first occurrences
            uniq, first = np.unique((hashes[ok] % slots)[::-1], return_index=True)
            table[uniq] = numbers[ok][::-1][first]
            if got < want:
                break
        del table
    finally:
        mm.close()
    return n
