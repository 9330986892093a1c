"""Space kept back on the hot disk for the catalog, so a full disk never makes the namespace read-only.

A broker whose disk is full frees space by deleting its oldest segments. Each unlink through the mount commits a
catalog transaction (SQLite, in the state dir on the hot disk); with no free block that commit failed
(SQLITE_FULL) and the unlink answered EIO, so the broker could not free the space it needed. A file of
`mount.catalog_reserve_bytes`, allocated while space is free, is given back the first time a commit finds the disk
full; the commit is retried into the space it freed. It is allocated again once the disk has room for it
several times over, so re-arming never takes the last free blocks from the broker.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from pathlib import Path

log = logging.getLogger("tierfs.tier")

REARM_FREE_FACTOR = 4  # re-arm only with this many times the reserve free
REARM_INTERVAL = 10.0  # seconds between re-arm attempts while released


class SpaceReserve:
    """A preallocated file whose blocks a full disk's catalog commit can have (thread-safe)."""

    def __init__(self, path: Path, size: int):
        self.path = path
        self.size = size
        self.releases = 0  # times given back (status, tests)
        self._lock = threading.Lock()
        self._armed = False
        self._next_try = 0.0
        self.arm()

    @property
    def armed(self) -> bool:
        return self._armed

    def arm(self) -> bool:
        """Allocate the reserve if it is not, and the disk has room for it several times over. True if armed."""
        with self._lock:
            if self._armed or self.size <= 0:
                return self._armed
            self._next_try = time.monotonic() + REARM_INTERVAL
            try:
                sv = os.statvfs(self.path.parent)
                if sv.f_bavail * sv.f_frsize < REARM_FREE_FACTOR * self.size:
                    return False
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                try:
                    os.posix_fallocate(fd, 0, self.size)
                    os.fsync(fd)
                finally:
                    os.close(fd)
            except OSError as e:
                if e.errno not in (errno.ENOSPC, errno.EOPNOTSUPP, errno.ENOSYS):
                    log.warning("catalog space reserve %s not allocated: %s", self.path, e)
                self._unlink()
                return False
            self._armed = True
            return True

    def maybe_rearm(self) -> None:
        """Cheap unless released and due: called after catalog commits."""
        if not self._armed and self.size > 0 and time.monotonic() >= self._next_try:
            if self.arm():
                log.info("catalog space reserve %s allocated again (%d MiB)", self.path, self.size >> 20)

    def release(self) -> bool:
        """Give the reserve's blocks back to the disk; True if there were any to give."""
        with self._lock:
            if not self._armed:
                return False
            self._armed = False
            self._next_try = time.monotonic() + REARM_INTERVAL
            self._unlink()
            self.releases += 1
        log.warning("the hot disk is full: gave back the catalog's %d MiB space reserve (%s) so namespace changes "
                    "still commit; it is allocated again once the disk has room", self.size >> 20, self.path)
        return True

    def _unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
