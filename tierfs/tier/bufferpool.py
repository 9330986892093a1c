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

from collections import OrderedDict

Key = tuple[int, int, int]  # (file id, generation, block)


class BufferPool:
    __slots__ = ("budget", "nbytes", "unread_bytes", "_blocks", "_by_file")

    def __init__(self, budget: int):
        self.budget = budget
        self.nbytes = 0
        self.unread_bytes = 0  # of nbytes: prefetched and not read yet
        self._blocks: OrderedDict[Key, list] = OrderedDict()  # key -> [memoryview, unread]
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

    def put(self, key: Key, data: memoryview, unread: bool, reserve: int = 0) -> None:
        """Keep a verified block; the least recently used go while the pool plus `reserve` (bytes still being
        fetched into memory) is over the budget."""
        self.discard(key)
        self._blocks[key] = [data, unread]
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

    def discard_file(self, file_id: int) -> None:
        """Forget every block of a file (it was rewritten or is gone): its buffers describe an old content."""
        for key in list(self._by_file.get(file_id, ())):
            self.discard(key)
