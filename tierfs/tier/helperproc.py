"""One helper child process (`python -m MODULE MOUNTPOINT`) that does I/O through the daemon's own mount, kept for
the life of the mount: the flusher (tierfs.tier.flusher) and the write primer (tierfs.tier.primer).

Such I/O must not run inside the daemon: a daemon thread blocked in a request to its own mount keeps a SIGKILLed
daemon from ever exiting (its /dev/fuse fd stays open, so the kernel never aborts the connection that would wake
the thread). A separate process just gets ENOTCONN then. One process serves the whole mount: starting a Python
interpreter costs ~0.15 CPU-seconds, which on a 2-core machine under a broker comes out of its produce rate.

This class owns the process's life: started on first use, counted as a restart of worker `name` (status,
tierfs_worker_restarts_total) when it died, killed when its owner abandons an answer, ended at unmount (its stdin
closes, so it also exits by itself if the daemon is SIGKILLed). Its stderr is the daemon's.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, BinaryIO

import trio

if TYPE_CHECKING:  # the children import their modules too: this stays light
    from tierfs.tier.state import WorkerStats

log = logging.getLogger(__name__)


class HelperProcess:
    def __init__(self, name: str, module: str, workers: WorkerStats, pids: set[int] | None = None):
        self.name = name  # the worker name its deaths are counted under
        self.module = module
        self.workers = workers
        self.pids = pids  # if given, holds the live child's pid (the FUSE front recognises its requests by it)
        self.proc: trio.Process | None = None
        self._mountpoint = ""

    async def child(self, mountpoint: str) -> trio.Process:
        """The live child for `mountpoint`, started if there is none (a dead one is counted, then replaced)."""
        if self.proc is not None and self.proc.returncode is not None:
            self.died(f"exited with code {self.proc.returncode} between uses")
            await self.stop(kill=True)
        if self.proc is not None and self._mountpoint != mountpoint:
            await self.stop(kill=True)
        if self.proc is None:
            self.proc = await trio.lowlevel.open_process(
                [sys.executable, "-P", "-m", self.module, mountpoint],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None)  # stderr: the daemon's log
            self._mountpoint = mountpoint
            if self.pids is not None:
                self.pids.add(self.proc.pid)
        return self.proc

    def died(self, why: str) -> None:
        w = self.workers
        w.restarts[self.name] = w.restarts.get(self.name, 0) + 1
        w.last_error[self.name] = f"{time.strftime('%H:%M:%S')}: the {self.name} process {why}"
        log.warning("the %s process %s; a new one starts at the next use", self.name, why)

    async def stop(self, kill: bool) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        # out of the set before the first await: once reaped, its pid may go to another process, whose requests
        # must not be taken for ours
        if self.pids is not None:
            self.pids.discard(proc.pid)
        if kill:
            proc.kill()
        elif proc.stdin is not None:
            try:
                await proc.stdin.aclose()  # end of input: the child exits by itself
            except trio.BrokenResourceError:
                pass
        with trio.move_on_after(10):
            await proc.wait()
        if proc.returncode is None:
            log.warning("the %s process %d did not exit; killing it", self.name, proc.pid)
            proc.kill()
            await proc.wait()


def encode(text: str) -> bytes:
    """A path as bytes on the pipe, whatever it holds (surrogateescape round-trips undecodable names)."""
    return text.encode("utf-8", "surrogateescape")


def records(stream: BinaryIO) -> Iterator[bytes]:
    """The child's side: the NUL-terminated records the daemon writes to `stream`, until it closes (unmount, or
    the daemon died)."""
    pending = b""
    while True:
        data = stream.read1(65536)  # type: ignore[attr-defined]
        if not data:
            return
        pending += data
        *done, pending = pending.split(b"\0")
        yield from done
