"""Page-cache priming ahead of a writer of a preallocated file, from one child process kept for the life of the
mount (`python -m tierfs.tier.primer MOUNTPOINT`; its life: tierfs.tier.helperproc).

A broker preallocates each ConsumeQueue file (setLength to its full size) and writes 20-byte units into it. With
the writeback cache, the first write into each 4 KiB page inside i_size makes the kernel READ that page from the
daemon first (fuse write_begin: a partial write of a page that is not uptodate), and the writer sleeps for the
round trip: one per 4 KiB, 15 % of the writer's CPU and most of its wall time in bench/hot_path.py workload b
(ext4 maps such a hole without any I/O). The page cache could be filled ahead by the daemon only through
FUSE_NOTIFY_STORE, which overwrites a folio even when it is dirty: unsafe.

So the FUSE front, seeing a writable handle READ small pages one after another, asks this child to
posix_fadvise(WILLNEED) the next window of the file through the mount. The kernel's readahead fills only the
folios that are not in the page cache (never a dirty one) with one READ per max_pages, the daemon answers those
from holes without the disk (tierfs.fs.localread), and the writer's next pages are uptodate: no round trip.
The same page-by-page reading of a file that already holds data (a read-modify-write writer) is primed the same
way; what the kernel reads is always the file's true bytes.

Best effort by design: the requests go through a bounded queue, a full queue drops a request (the writer then
just pays its READs), the child never answers, and a child that died is counted and replaced at the next request.
Protocol: records `path<TAB>offset<TAB>length<NUL>`, path relative to the mountpoint. The child opens the path,
advises, and closes it again (an fd held open would make a plain `umount` of an idle mount fail with EBUSY).
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

import trio

from tierfs.tier.helperproc import HelperProcess, encode, records

if TYPE_CHECKING:
    from tierfs.tier.state import WorkerStats

QUEUE = 256  # requests waiting for the child; more are dropped (the writer pays its READs, nothing else)


class Primer:
    """The daemon's side. `want` is called from the FUSE READ handler (no await); `run` is a supervised worker
    that hands the requests to the child."""

    def __init__(self, workers: WorkerStats, window: int):
        self.window = window  # bytes primed per request; 0 turns priming off
        self.helper = HelperProcess("primer", "tierfs.tier.primer", workers)
        self._send, self._recv = trio.open_memory_channel[tuple[str, int]](QUEUE)
        self.requests = 0
        self.dropped = 0

    def want(self, rel: str, off: int) -> None:
        """Prime `window` bytes of `rel` from `off`, soon."""
        try:
            self._send.send_nowait((rel, off))
            self.requests += 1
        except trio.WouldBlock:
            self.dropped += 1

    def status(self) -> dict:
        return {"window_bytes": self.window, "requests": self.requests, "dropped": self.dropped}

    async def run(self, mountpoint: os.PathLike | str) -> None:
        async for rel, off in self._recv:
            batch = [(rel, off)]
            while True:  # whatever queued meanwhile goes in the same write
                try:
                    batch.append(self._recv.receive_nowait())
                except trio.WouldBlock:
                    break
            data = b"".join(encode(f"{r}\t{o}\t{self.window}") + b"\0" for r, o in batch)
            proc = await self.helper.child(str(mountpoint))
            assert proc.stdin is not None
            try:
                await proc.stdin.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as err:
                self.helper.died(f"died ({err})")  # these requests are lost: a writer pays its READs
                with trio.CancelScope(shield=True):
                    await self.helper.stop(kill=True)

    async def aclose(self) -> None:
        """At unmount: end the child (shielded, so an unmount being cancelled still reaps it)."""
        with trio.CancelScope(shield=True):
            await self.helper.stop(kill=False)


def prime(mountpoint: str, rel: str, off: int, length: int) -> None:
    try:
        fd = os.open(os.path.join(mountpoint, rel), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return  # gone, renamed, or the mount is going away: nothing to prime
    try:
        os.posix_fadvise(fd, off, length, os.POSIX_FADV_WILLNEED)
    except OSError:
        pass
    finally:
        os.close(fd)


def main() -> None:
    """The child: requests from stdin until it closes."""
    mountpoint = sys.argv[1]
    for rec in records(sys.stdin.buffer):
        try:
            rel, off, length = rec.decode("utf-8", "surrogateescape").rsplit("\t", 2)
            prime(mountpoint, rel, int(off), int(length))
        except ValueError:
            print(f"tierfs primer: bad request {rec[:200]!r}", file=sys.stderr)


if __name__ == "__main__":
    main()
