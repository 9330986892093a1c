"""Large reads of local (never tiered) files for the FUSE front: holes answered without the disk, and a worker
thread only for what would block.

A fresh CommitLog segment is preallocated with ftruncate and filled through mmap: the page faults ahead of the
writer make the kernel READ megabytes that are holes. Reading them costs a zero-fill of page-cache pages in the
backing file; SEEK_DATA says where the data starts, so those bytes are answered as zeros from memory.
Only for files whose holes are real: a tiered file's evicted blocks are holes too, and go through the engine
(the caller decides that with no await before calling here, so an eviction cannot slip in between).

The rest is read with preadv2(RWF_NOWAIT) inline: a page-cache hit costs no thread hop. Only what is not cached
(EAGAIN, or a short read) goes to a worker thread, so one slow disk read never stalls the trio loop, and small
requests never queue behind large ones.
"""

from __future__ import annotations

import errno
import os

import trio

LARGE = 64 << 10  # smaller reads are one plain pread inline: a probe would cost more than it saves
_NOWAIT = getattr(os, "RWF_NOWAIT", 0)


def hole_prefix(fd: int, off: int, size: int) -> int:
    """How many bytes from `off` (at most `size`) are a hole (SEEK_DATA finds no data there); 0 when the file
    system cannot tell."""
    try:
        data = os.lseek(fd, off, os.SEEK_DATA)
    except OSError as err:
        if err.errno != errno.ENXIO:
            return 0  # EINVAL etc.: no SEEK_DATA here, read it
        return max(0, min(size, os.fstat(fd).st_size - off))  # no data at or after `off`: a hole to the end
    return max(0, min(size, data - off))


class LocalReader:
    """Counts what it answered without the disk (status.json `bytes_read_from_holes`) and without a thread."""

    __slots__ = ("bytes_from_holes", "reads_threaded")

    def __init__(self) -> None:
        self.bytes_from_holes = 0
        self.reads_threaded = 0

    async def pread(self, fd: int, size: int, off: int) -> bytes | memoryview:
        if size < LARGE or not _NOWAIT:
            return os.pread(fd, size, off)
        hole = hole_prefix(fd, off, size)
        if hole:
            self.bytes_from_holes += hole
            if hole == size:
                return bytes(size)
        buf = bytearray(size)  # zeros: the hole prefix is already answered
        mv = memoryview(buf)
        got = hole
        try:
            got += os.preadv(fd, [mv[hole:]], off + hole, _NOWAIT)
        except BlockingIOError:
            pass
        if got < size:  # not (all) in the page cache, or the end of the file
            st_size = os.fstat(fd).st_size
            if off + got < st_size:
                self.reads_threaded += 1
                got += await trio.to_thread.run_sync(os.preadv, fd, [mv[got:]], off + got)
            else:
                return mv[:max(0, min(size, st_size - off))]
        return mv[:got]
