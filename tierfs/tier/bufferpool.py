"""Verified blocks of tiered segments held in memory (DESIGN §7): the FUSE replies of cold reads are cut from here.

A fetch lands its checked blocks here first; readers waiting on it and later readers of prefetched blocks are
answered from these buffers, so a cold sequential read never goes through the hot file at all. Writing a block
into the hot file (the local cache) is a separate decision, taken only where the cache budget wants it kept.

The pool is bounded (`readahead.budget_bytes`, shared with the prefetches in flight): least recently used blocks
go first, and a file's buffers go when its last reader closes it (they were there for that reader; the next
open reads the local cache or the store again). Blocks that a prefetch brought and no one has read yet are counted apart (`unread_bytes`), because the
read-ahead must stop asking for more while they pile up. Keys carry the generation, so a block of an older
generation of a file is never served for a newer one.
"""

from __future__ import annotations

import mmap
from collections import OrderedDict

Key = tuple[int, int, int]  # (file id, generation, block; ~unit for a verification unit: tierfs.tier.units)
IDLE_SECONDS = 30.0  # free buffers no fetch needed for this long are given back to the allocator


class Buffer:
    """One reusable block buffer. `refs` counts its holders: the fetch filling it, the pool entry serving it, a
    hot-file install writing it. At zero it goes back to its free list.

    Anonymous mmap, not bytearray: a bytearray is zeroed where it is made, on the trio thread (page faults and a
    memset per MiB on the loop); an mmap's pages are faulted in by the worker thread whose GET first fills them.
    Private, not shared (mmap's default): a shared anonymous page lives in shmem, and a GET filling fresh shmem
    pages cost 0.8 s per GiB of them against 0.5 s for private ones (page faults on a VM). Not in transparent huge
    pages: one fault per 2 MiB, but on a VM a fresh huge page is often guest memory the host never backed, and
    zeroing it cost more than the 4 KiB faults saved (27 % of a cold read's CPU, against 7 %)."""

    __slots__ = ("view", "refs")

    def __init__(self, size: int):
        self.view = memoryview(mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE))
        self.refs = 0


class Buffers:
    """Free lists of block buffers, by size, reused from one ranged GET to the next.

    Why one buffer per block: the pool's count is then the memory held. With one bytes object per GET, a 16 MiB
    GET stayed whole in memory while any one of its blocks was pooled or being installed (8 concurrent cold
    readers: peak RSS 592 MiB, against 372 MiB this way, budget 256 MiB). Why reused: a fresh buffer faults in and
    zeroes fresh pages, which on a VM costs about as much CPU as the receive copy.

    Buffers are taken and released on the trio thread only. That makes reuse safe: a
    FUSE reply cut from a buffer is written before the request's task yields, and a buffer is handed to a worker
    thread only by a fetch task (a later step), so no worker ever fills a buffer a reply still reads. What the
    buffers hold in all is what was in use at once (pool, fetches, installs); free ones idle for IDLE_SECONDS go.
    """

    __slots__ = ("_free", "free_bytes", "_idle_bytes", "_checked")

    def __init__(self) -> None:
        self._free: dict[int, list[Buffer]] = {}
        self.free_bytes = 0
        self._idle_bytes = 0  # the fewest free bytes since the last trim: buffers no one needed all that time
        self._checked = 0.0

    def take(self, size: int) -> Buffer:
        """A buffer of `size` bytes (contents undefined), held once by the caller."""
        free = self._free.get(size)
        if free:
            buf = free.pop()
            self.free_bytes -= size
            self._idle_bytes = min(self._idle_bytes, self.free_bytes)
        else:
            buf = Buffer(size)
        buf.refs = 1
        return buf

    @staticmethod
    def hold(buf: Buffer) -> None:
        buf.refs += 1

    def release(self, buf: Buffer) -> None:
        buf.refs -= 1
        if buf.refs == 0:
            self._free.setdefault(len(buf.view), []).append(buf)
            self.free_bytes += len(buf.view)

    def trim(self, now: float) -> None:
        """Called now and then: give back the free buffers that stayed free since the last look, IDLE_SECONDS
        ago or more (those a steady reader keeps cycling are kept)."""
        if now - self._checked < IDLE_SECONDS:
            return
        self._checked = now
        drop = self._idle_bytes
        for size, free in self._free.items():
            while free and drop > 0:
                free.pop(0)  # the oldest freed first
                self.free_bytes -= size
                drop -= size
        self._idle_bytes = self.free_bytes


class BufferPool:
    __slots__ = ("budget", "nbytes", "unread_bytes", "buffers", "_blocks", "_by_file")

    def __init__(self, budget: int):
        self.budget = budget
        self.nbytes = 0
        self.unread_bytes = 0  # of nbytes: prefetched and not read yet
        self.buffers = Buffers()  # what a pooled block's Buffer goes back to when the block leaves the pool
        self._blocks: OrderedDict[Key, list] = OrderedDict()  # key -> [memoryview, unread, Buffer or None]
        self._by_file: dict[int, set[Key]] = {}  # file id -> its keys

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: Key) -> bool:
        return key in self._blocks

    def get(self, key: Key) -> memoryview | None:
        """The block's bytes (and it becomes the most recently used), or None."""
        slot = self._blocks.get(key)
        if slot is None:
            return None
        self._blocks.move_to_end(key)
        if slot[1]:
            slot[1] = False
            self.unread_bytes -= len(slot[0])
        return slot[0]

    def put(self, key: Key, data: memoryview, unread: bool, reserve: int = 0, buf: Buffer | None = None) -> None:
        """Keep a verified block (`data`, a view of `buf` when it lives in one: the pool holds it until the block
        goes); the least recently used go while the pool plus `reserve` (bytes still being fetched into memory)
        is over the budget."""
        self.discard(key)
        if buf is not None:
            self.buffers.hold(buf)
        self._blocks[key] = [data, unread, buf]
        self._by_file.setdefault(key[0], set()).add(key)
        self.nbytes += len(data)
        if unread:
            self.unread_bytes += len(data)
        while self.nbytes + reserve > self.budget and len(self._blocks) > 1:
            self.discard(next(iter(self._blocks)))

    def discard(self, key: Key) -> None:
        slot = self._blocks.pop(key, None)
        if slot is not None:
            keys = self._by_file[key[0]]
            keys.discard(key)
            if not keys:
                del self._by_file[key[0]]
            self.nbytes -= len(slot[0])
            if slot[1]:
                self.unread_bytes -= len(slot[0])
            if slot[2] is not None:
                self.buffers.release(slot[2])

    def discard_file(self, file_id: int) -> None:
        """Forget every block of a file (it was rewritten or is gone): its buffers describe an old content."""
        for key in list(self._by_file.get(file_id, ())):
            self.discard(key)
