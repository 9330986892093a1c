"""fsync files through a tierfs mount, from one child process kept for the life of the mount
(`python -m tierfs.tier.flusher MOUNTPOINT`; its life: tierfs.tier.helperproc).

The sealer uses this to make the kernel write back every page still dirty for a quiet segment (a broker under
ASYNC_FLUSH may never fsync its last pages), and continuous tiering before each round. One process serves every
flush: an interpreter per flush cost ~0.15 CPU-seconds, a seal scan or a round may flush every second, and on a
2-core machine under a SYNC_FLUSH broker that CPU came straight out of the broker's produce rate.

Protocol, NUL-terminated records both ways: the daemon sends a batch of paths (relative to the mountpoint), then an
empty record; the child fsyncs each, answers `path<TAB>error` for each one that failed, then an empty record. A
path that no longer exists is not a failure.

The FUSE front answers an fsync from the child's pid (`pids`) without an fsync of the hot file. The kernel has
written back (and waited for) every dirty page of the file before it sends the FSYNC, which is all a flush is for:
the sealer makes the hot file durable itself before a segment is committed TIERED, and continuous tiering reads
the hot file's pages. So a round does not put a journal commit per active file on the disk the broker's own
SYNC_FLUSH waits for.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

import trio

from tierfs.tier.helperproc import HelperProcess, encode, records

if TYPE_CHECKING:  # the child imports this module too: it stays light
    from tierfs.tier.state import WorkerStats


def flush(mountpoint: str, rels: list[str]) -> list[tuple[str, str]]:
    failed = []
    for rel in rels:
        try:
            fd = os.open(os.path.join(mountpoint, rel), os.O_RDONLY | os.O_NOFOLLOW)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except FileNotFoundError:
            continue
        except OSError as err:
            failed.append((rel, err.strerror or str(err)))
    return failed


class Flusher:
    """The daemon's side: one batch at a time through one child (tierfs.tier.helperproc), started again after it
    died or a batch was cancelled (a child killed mid-batch is the only safe way to abandon its answer)."""

    def __init__(self, pids: set[int], workers: WorkerStats, batch_timeout: float = 300.0):
        # `pids` is the FUSE front's view: pids whose fsync needs no fsync of the hot file
        self.helper = HelperProcess("flusher", "tierfs.tier.flusher", workers, pids)
        # a batch that hangs (a mount that stopped answering) must not hold every later flush behind it
        self.batch_timeout = batch_timeout
        self._pending = b""  # bytes read past the last answer (none, in a well-behaved child)...
        self._pending_from: trio.Process | None = None  # ...of this child
        self._lock = trio.Lock()

    async def flush(self, mountpoint: os.PathLike | str, rels: list[str]) -> list[str]:
        """fsync `rels` through the mount: the `path<TAB>error` lines of those that failed. OSError when the
        child cannot start, dies mid-batch or does not answer in batch_timeout (the caller retries later).
        Cancelling kills the child."""
        if not rels:
            return []
        async with self._lock:
            h = self.helper
            proc = await h.child(str(mountpoint))
            if proc is not self._pending_from:  # a new child: what the old one left unread is not its answer
                self._pending, self._pending_from = b"", proc
            done = False
            try:
                assert proc.stdin is not None
                with trio.fail_after(self.batch_timeout):
                    await proc.stdin.send_all(b"".join(encode(r) + b"\0" for r in rels) + b"\0")
                    failed = await self._answer(proc)
                done = True
                return failed
            except trio.TooSlowError:
                h.died(f"did not answer in {self.batch_timeout:.0f} s (killed)")
                raise OSError(f"the flusher process did not answer in {self.batch_timeout:.0f} s") from None
            except (trio.BrokenResourceError, trio.ClosedResourceError) as err:
                h.died(f"died mid-batch ({err})")
                raise OSError(f"the flusher process died mid-batch ({err})") from None
            except OSError as err:
                h.died(str(err))
                raise OSError(f"the flusher process {err}") from None
            finally:
                if not done:
                    with trio.CancelScope(shield=True):
                        await h.stop(kill=True)

    async def _answer(self, proc: trio.Process) -> list[str]:
        assert proc.stdout is not None
        failed: list[str] = []
        while True:
            while b"\0" in self._pending:
                rec, self._pending = self._pending.split(b"\0", 1)
                if not rec:
                    return failed
                failed.append(rec.decode("utf-8", "replace"))
            data = await proc.stdout.receive_some(65536)
            if not data:
                raise OSError(f"exited with code {await proc.wait()} mid-batch")
            self._pending += data

    async def aclose(self) -> None:
        """At unmount: end the child (shielded, so an unmount being cancelled still reaps it)."""
        with trio.CancelScope(shield=True):
            async with self._lock:
                await self.helper.stop(kill=False)


def main() -> None:
    """The child: batches from stdin until it closes."""
    mountpoint = sys.argv[1]
    out = sys.stdout.buffer
    batch: list[str] = []
    for rec in records(sys.stdin.buffer):
        if rec:
            batch.append(rec.decode("utf-8", "surrogateescape"))
            continue
        failed = flush(mountpoint, batch)
        batch = []
        out.write(b"".join(encode(f"{rel}\t{err}") + b"\0" for rel, err in failed) + b"\0")
        out.flush()


if __name__ == "__main__":
    main()
