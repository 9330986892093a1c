"""Space kept back on the hot disk for the catalog, so a full disk never makes the namespace read-only.

A broker whose disk is full frees space by deleting its oldest segments. Each unlink through the mount commits a
catalog transaction (SQLite, in the state dir on the hot disk); with no free block that commit failed
(SQLITE_FULL) and the unlink answered EIO, so the broker could not free the space it needed. A file of
`mount.catalog_reserve_bytes`, allocated while space is free, is given back when a commit finds the disk full,
and the commit is retried into the space it freed. Half of what is left each time, not all at once: the blocks
given back are anyone's, and a writer still filling the disk (the broker) takes them at once; the first release
then left the catalog with nothing while the broker's unlinks were still to come (a CI run: 40 of 40 unlinks EIO).
Halving keeps some for every later commit that finds the disk full. It is allocated again once the disk has room
for it several times over, so re-arming never takes the last free blocks from the broker.
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
LAST_STEP = 256 << 10  # a reserve this small is given back whole (a few commits' worth of WAL pages)


class SpaceReserve:
    """A preallocated file whose blocks full-disk catalog commits can have, half of what is left at a time
    (thread-safe)."""

    def __init__(self, path: Path, size: int):
        self.path = path
        self.size = size
        self.held = 0  # bytes allocated now
        self.releases = 0  # times some was given back (status, tests)
        self._lock = threading.Lock()
        self._next_try = 0.0
        self.arm()

    @property
    def armed(self) -> bool:
        """Whole: nothing given back since it was last allocated."""
        return self.size > 0 and self.held >= self.size

    def arm(self) -> bool:
        """Allocate the reserve to its full size if it is not, and the disk has room for it several times over.
        True if armed."""
        with self._lock:
            if self.size <= 0 or self.held >= self.size:
                return self.armed
            self._next_try = time.monotonic() + REARM_INTERVAL
            try:
                sv = os.statvfs(self.path.parent)
                if sv.f_bavail * sv.f_frsize < REARM_FREE_FACTOR * self.size:
                    return False
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                try:
                    try:
                        os.posix_fallocate(fd, 0, self.size)
                        os.fsync(fd)
                    except OSError:
                        os.ftruncate(fd, self.held)  # no half-allocated tail: what is held stays what it was
                        raise
                finally:
                    os.close(fd)
            except OSError as e:
                if e.errno not in (errno.ENOSPC, errno.EOPNOTSUPP, errno.ENOSYS):
                    log.warning("catalog space reserve %s not allocated: %s", self.path, e)
                if not self.held:
                    self._unlink()
                return False
            self.held = self.size
            return True

    def maybe_rearm(self) -> None:
        """Cheap unless (partly) released and due: called after catalog commits."""
        if self.size > 0 and self.held < self.size and time.monotonic() >= self._next_try:
            if self.arm():
                log.info("catalog space reserve %s allocated again (%d MiB)", self.path, self.size >> 20)

    def release(self) -> bool:
        """Give half of the reserve's blocks back to the disk (all of them once it is small); True if there were
        any to give."""
        with self._lock:
            if self.held <= 0:
                return False
            keep = self.held // 2 if self.held // 2 >= LAST_STEP else 0
            try:
                if keep:
                    os.truncate(self.path, keep)
                else:
                    self._unlink()
            except OSError as e:  # (the file is ours alone: only a broken disk gets here)
                log.warning("catalog space reserve %s could not be given back: %s", self.path, e)
                return False
            given, self.held = self.held - keep, keep
            self._next_try = time.monotonic() + REARM_INTERVAL
            self.releases += 1
        log.warning("the hot disk is full: gave back %d KiB of the catalog's space reserve (%s; %d KiB kept for "
                    "later commits) so namespace changes still commit; it is allocated again once the disk has "
                    "room", given >> 10, self.path, keep >> 10)
        return True

    def _unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
