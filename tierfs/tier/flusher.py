"""fsync files through a tierfs mount, from one child process kept for the life of the mount
(`python -m tierfs.tier.flusher MOUNTPOINT`).

The sealer uses this to make the kernel write back every page still dirty for a quiet segment (a broker under
ASYNC_FLUSH may never fsync its last pages), and continuous tiering before each round. It must not run inside the
daemon: a daemon thread blocked in a request to its own mount keeps a SIGKILLed daemon from ever exiting (its
/dev/fuse fd stays open, so the kernel never aborts the connection that would wake the thread). A separate process
just gets ENOTCONN then.

One process serves every flush: starting a Python interpreter per flush cost ~0.15 CPU-seconds, a seal scan or a
round may flush every second, and on a 2-core machine under a SYNC_FLUSH broker that CPU came straight out of the
broker's produce rate. The child dies with the daemon (its stdin closes) and is started again after any failure.

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

import logging
import os
import subprocess
import sys
import time
from typing import TYPE_CHECKING

import trio

if TYPE_CHECKING:  # the child imports this module too: it stays light
    from tierfs.tier.state import WorkerStats

log = logging.getLogger(__name__)


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


def _encode(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")


class Flusher:
    """The daemon's side: one child at a time, one batch at a time, started on first use and again after it died
    or a batch was cancelled (a child killed mid-batch is the only safe way to abandon its answer)."""

    def __init__(self, pids: set[int], workers: WorkerStats, batch_timeout: float = 300.0):
        self.pids = pids  # the FUSE front's view: pids whose fsync needs no fsync of the hot file
        # a batch that hangs (a mount that stopped answering) must not hold every later flush behind it
        self.batch_timeout = batch_timeout
        self.workers = workers  # a child that died is counted as a restart of worker "flusher" (status, metrics)
        self._proc: trio.Process | None = None
        self._mountpoint = ""
        self._pending = b""  # bytes read past the last answer (none, in a well-behaved child)
        self._lock = trio.Lock()

    async def flush(self, mountpoint: os.PathLike | str, rels: list[str]) -> list[str]:
        """fsync `rels` through the mount: the `path<TAB>error` lines of those that failed. OSError when the
        child cannot start, dies mid-batch or does not answer in batch_timeout (the caller retries later).
        Cancelling kills the child."""
        if not rels:
            return []
        async with self._lock:
            proc = await self._child(str(mountpoint))
            done = False
            try:
                assert proc.stdin is not None
                with trio.fail_after(self.batch_timeout):
                    await proc.stdin.send_all(b"".join(_encode(r) + b"\0" for r in rels) + b"\0")
                    failed = await self._answer(proc)
                done = True
                return failed
            except trio.TooSlowError:
                self._died(f"did not answer in {self.batch_timeout:.0f} s (killed)")
                raise OSError(f"the flusher process did not answer in {self.batch_timeout:.0f} s") from None
            except (trio.BrokenResourceError, trio.ClosedResourceError) as err:
                self._died(f"died mid-batch ({err})")
                raise OSError(f"the flusher process died mid-batch ({err})") from None
            except OSError as err:
                self._died(str(err))
                raise OSError(f"the flusher process {err}") from None
            finally:
                if not done:
                    with trio.CancelScope(shield=True):
                        await self._stop(kill=True)

    async def _child(self, mountpoint: str) -> trio.Process:
        if self._proc is not None and self._proc.returncode is not None:
            self._died(f"exited with code {self._proc.returncode} between batches")
            await self._stop(kill=True)
        if self._proc is not None and self._mountpoint != mountpoint:
            await self._stop(kill=True)
        if self._proc is None:
            self._proc = await trio.lowlevel.open_process(
                [sys.executable, "-P", "-m", "tierfs.tier.flusher", mountpoint],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None)  # stderr: the daemon's log
            self._mountpoint, self._pending = mountpoint, b""
            self.pids.add(self._proc.pid)
        return self._proc

    def _died(self, why: str) -> None:
        w = self.workers
        w.restarts["flusher"] = w.restarts.get("flusher", 0) + 1
        w.last_error["flusher"] = f"{time.strftime('%H:%M:%S')}: the flusher process {why}"
        log.warning("the flusher process %s; a new one starts at the next flush", why)

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

    async def _stop(self, kill: bool) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        # out of the set before the first await: once reaped, its pid may go to another process, whose fsyncs
        # must not be taken for ours
        self.pids.discard(proc.pid)
        if kill:
            proc.kill()
        elif proc.stdin is not None:
            await proc.stdin.aclose()  # end of input: the child exits by itself
        with trio.move_on_after(10):
            await proc.wait()
        if proc.returncode is None:
            log.warning("the flusher process %d did not exit; killing it", proc.pid)
            proc.kill()
            await proc.wait()

    async def aclose(self) -> None:
        """At unmount: end the child (shielded, so an unmount being cancelled still reaps it)."""
        with trio.CancelScope(shield=True):
            async with self._lock:
                await self._stop(kill=False)


def main() -> None:
    """The child: batches from stdin until it closes."""
    mountpoint = sys.argv[1]
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    batch: list[str] = []
    pending = b""
    while True:
        data = inp.read1(65536)
        if not data:
            return  # the daemon closed our stdin (unmount) or died
        pending += data
        *records, pending = pending.split(b"\0")
        for rec in records:
            if rec:
                batch.append(rec.decode("utf-8", "surrogateescape"))
                continue
            failed = flush(mountpoint, batch)
            batch = []
            out.write(b"".join(_encode(f"{rel}\t{err}") + b"\0" for rel, err in failed) + b"\0")
            out.flush()


if __name__ == "__main__":
    main()
