"""The bound on FUSE requests that wait on the object store, so that requests on hot files never wait behind them.

pyfuse3 awaits each handler in the worker task that read its request and reads /dev/fuse only while a worker is
free; the kernel sends at most max_background background requests at once, and the read-ahead READs of evicted
bytes share those with the writeback WRITEs of every hot file (an fsync waits for them). A request that waits on
the store holds a worker and, as a read-ahead, a background slot, for up to objectstore.read_timeout_seconds. So at
most `limit` requests may wait on the store at once (the mount gives pyfuse3 that many workers on top of
mount.max_tasks, and keeps that many below the kernel's max_background); one more fails with EIO at once:
letting it wait is exactly what would take a hot request's worker or writeback slot. The kernel retries a failed
read-ahead as one synchronous page read, so a short burst over the limit on a healthy store costs a retry, not an
error, unless the limit is still full then.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

from tierfs.tier.state import ReadFailed

log = logging.getLogger("tierfs.tier")

KEY = "mount.max_store_waiters"
REFUSAL_LOG_SECONDS = 10.0  # one line per this long while requests are refused, with how many were


class StoreWaiters:
    """Counts the requests waiting on the object store now; refuses one beyond the limit (no await in here)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.waiting = 0
        self.refused = 0  # since the mount
        self._logged_at = -REFUSAL_LOG_SECONDS
        self._unlogged = 0

    @contextlib.contextmanager
    def slot(self, what: str) -> Iterator[None]:
        """Hold one of the `limit` slots while the caller waits on the store for `what` (a path); ReadFailed (EIO)
        at once when all are taken."""
        if self.waiting >= self.limit:
            self._refuse(what)
        self.waiting += 1
        try:
            yield
        finally:
            self.waiting -= 1

    def _refuse(self, what: str) -> None:
        self.refused += 1
        self._unlogged += 1
        now = time.monotonic()
        if now - self._logged_at >= REFUSAL_LOG_SECONDS:
            log.warning("a request on %s that needs the object store failed with EIO at once: %d requests already "
                        "wait on it (%s=%d; %d refused so since the last such line)", what, self.waiting, KEY,
                        self.limit, self._unlogged)
            self._logged_at, self._unlogged = now, 0
        raise ReadFailed(f"{what}: {self.waiting} requests already wait on the object store ({KEY}={self.limit})")

    def clamp(self, most: int, why: str) -> None:
        """Lower the limit to `most` (at least 1) when the kernel leaves hot files fewer background slots than
        the configuration assumed."""
        most = max(1, most)
        if most < self.limit:
            log.warning("%s lowered from %d to %d: %s", KEY, self.limit, most, why)
            self.limit = most
