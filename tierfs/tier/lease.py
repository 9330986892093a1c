"""The writer lease: at most one writable mount per store id uploads to the object store (DESIGN §5, §12).

Object layout: one small JSON object per lease *epoch*, `<store-id>/meta/lease/<epoch, 12 digits>`; the lease in
force is the one with the highest epoch. A mount takes the lease by creating epoch N+1 with a conditional PUT
(`put_if_absent`), so of several mounts racing for the same free lease exactly one wins. A single key replaced
by delete + conditional PUT cannot do that: two mounts taking over the same expired lease could both delete and
both create, and the object store interface has no compare-and-swap. With epochs, a takeover is just another
conditional create, and nothing ever deletes the highest epoch: the new holder deletes only lower epochs, and a
clean unmount *releases* its epoch (expires_at 0) instead of deleting it, so no mount can ever see an empty
lease directory while another one holds or is taking the lease.

Rules:
* the highest epoch is free when it is released or expired (expires_at < now), or when it names our own holder
  id (host + hot dir: a restart after a crash on the same hot dir; the daemon lock already keeps a second daemon
  off a hot dir); otherwise a writable mount is refused with a message naming the holder and the expiry;
* the holder renews (overwrites its own epoch with a new expires_at) every ttl/3, but only while its lease is
  still valid by its own monotonic clock; a lease that lapsed is taken again through the conditional create, never
  renewed, so a late renewal cannot revive a lease someone else took over meanwhile;
* the holder considers itself valid until (start of the last successful write) + ttl - ttl/10: it stops before
  anybody else may start, given clocks within ttl/10 of each other (run NTP);
* uploads, deletes and snapshots run only while `held()`; the broker's writes never wait on the lease.

All methods except `run` block (object store calls): call them from a worker thread inside trio.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import trio

from tierfs.objectstore import ObjectStore
from tierfs.objectstore.base import ObjectNotFound, ObjectStoreError

log = logging.getLogger("tierfs.lease")

_EPOCH_RE = re.compile(r"^\d{12}$")


def lease_prefix(store_id: str) -> str:
    return f"{store_id}/meta/lease/"


def lease_key(store_id: str, epoch: int) -> str:
    return f"{lease_prefix(store_id)}{epoch:012d}"


@dataclass(frozen=True)
class LeaseRecord:
    """The content of one lease epoch object."""

    epoch: int
    holder: str  # holder id: host + ":" + hot dir
    host: str
    hot_dir: str
    pid: int
    mountpoint: str
    acquired_at: float
    expires_at: float  # 0: released at a clean unmount

    def live(self, now: float) -> bool:
        return self.expires_at > now

    def encode(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def decode(cls, key: str, data: bytes) -> LeaseRecord:
        """Parse a lease object; ValueError names the key and what is wrong."""
        try:
            d = json.loads(data)
            rec = cls(epoch=int(d["epoch"]), holder=str(d["holder"]), host=str(d["host"]),
                      hot_dir=str(d["hot_dir"]), pid=int(d["pid"]), mountpoint=str(d["mountpoint"]),
                      acquired_at=float(d["acquired_at"]), expires_at=float(d["expires_at"]))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"lease object {key!r} is not a valid lease ({type(e).__name__}: {e}); if no writable "
                             f"mount of this store id is running anywhere, delete it") from None
        return rec

    def describe(self, now: float) -> str:
        left = self.expires_at - now
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.expires_at))
        return (f"host {self.host}, hot dir {self.hot_dir}, pid {self.pid}, mountpoint {self.mountpoint}; "
                f"the lease expires at {when} (in {left:.1f} s) unless renewed")


class LeaseHeld(Exception):
    """Another writable mount holds the lease of this store id."""

    def __init__(self, store_url: str, store_id: str, rec: LeaseRecord, now: float, force: str | None = None):
        self.record = rec
        forced = f"--force {force!r} does not name the holder in force, {rec.holder!r}. " if force else ""
        super().__init__(
            f"{forced}store id {store_id!r} at {store_url} is held by another writable tierfs mount "
            f"({rec.describe(now)}). Unmount it there first; if that writer is gone for good, wait until the lease "
            f"expires (lease.ttl_seconds), take it over now with --takeover --force {rec.holder!r}, or mount "
            f"read-only with --read-only --from")


def holder_id(host: str, hot_dir: Path | str) -> str:
    return f"{host}:{os.path.abspath(hot_dir)}"


class WriterLease:
    def __init__(self, store: ObjectStore, store_id: str, hot_dir: Path, mountpoint: Path, ttl: float,
                 host: str | None = None, pid: int | None = None):
        self.store = store
        self.store_id = store_id
        self.ttl = float(ttl)
        self.margin = self.ttl / 10
        self.host = host or socket.gethostname()
        self.hot_dir = str(Path(hot_dir).resolve())
        self.mountpoint = str(mountpoint)
        self.pid = pid or os.getpid()
        self.id = holder_id(self.host, self.hot_dir)
        self.epoch = 0  # the epoch we hold (or held last); 0: never held
        self._valid_until = 0.0  # time.monotonic() until which we may write to the store
        self.expires_at = 0.0
        self.last_error = ""
        self.other: LeaseRecord | None = None  # the other holder that refused us, if any
        # set once another mount took the lease over from us: our view of the store is stale from then on, so
        # this daemon never takes the lease again (not even once the other one's lapses)
        self.fenced = False

    # ------------------------------------------------------------------ state

    def held(self) -> bool:
        return time.monotonic() < self._valid_until

    def status(self) -> dict:
        d = {"held": self.held(), "holder": self.id, "epoch": self.epoch, "ttl_s": self.ttl,
             "expires_at": round(self.expires_at, 3), "last_error": self.last_error}
        if self.other is not None and not self.held():
            d["held_by"] = f"{self.other.host}:{self.other.hot_dir} (pid {self.other.pid})"
        return d

    def _record(self, epoch: int, now: float, acquired_at: float, expires_at: float) -> LeaseRecord:
        return LeaseRecord(epoch=epoch, holder=self.id, host=self.host, hot_dir=self.hot_dir, pid=self.pid,
                           mountpoint=self.mountpoint, acquired_at=acquired_at, expires_at=expires_at)

    def current(self) -> LeaseRecord | None:
        """The lease in force (highest epoch), or None when no lease was ever taken. Blocking."""
        for _ in range(5):
            epochs = [int(i.key.rsplit("/", 1)[1]) for i in self.store.list(lease_prefix(self.store_id))
                      if _EPOCH_RE.match(i.key.rsplit("/", 1)[1])]
            if not epochs:
                return None
            key = lease_key(self.store_id, max(epochs))
            try:
                return LeaseRecord.decode(key, self.store.get(key))
            except ObjectNotFound:
                continue  # a new holder deleted it as a lower epoch meanwhile: list again
        raise ObjectStoreError(lease_prefix(self.store_id), "the lease epochs kept changing while being read")

    # ------------------------------------------------------------------ acquire, renew, release

    def acquire(self, force: str | None = None) -> None:
        """Take the lease or raise LeaseHeld. `force` (a takeover's --force) names the live holder to override:
        it must be the holder in force, so a takeover never overrides a writer its operator did not name.
        ObjectStoreError when the store cannot be reached. Blocking."""
        if self.fenced:  # never again in this daemon's life
            if self.other is not None:
                raise LeaseHeld(self.store.url, self.store_id, self.other, time.time())
            raise ObjectStoreError(lease_prefix(self.store_id), f"refused: {self.last_error}; remount to write again")
        for _ in range(5):
            cur = self.current()
            now = time.time()
            if self.epoch and cur is not None and cur.epoch > self.epoch and cur.holder != self.id:
                self.fenced = True  # someone else wrote the store after us: what this daemon knows is stale
                self.other = cur
                self.last_error = f"fenced: the writer lease was taken over by {cur.holder} (epoch {cur.epoch})"
                log.error("FENCED: writer lease epoch %d of store id %s was taken over by %s (epoch %d); this "
                          "mount's object puts, deletes and snapshots are refused", self.epoch, self.store_id,
                          cur.holder, cur.epoch)
                raise LeaseHeld(self.store.url, self.store_id, cur, now)
            if cur is not None and cur.live(now) and cur.holder != self.id:
                if force is None or force != cur.holder:
                    self.other = cur
                    raise LeaseHeld(self.store.url, self.store_id, cur, now, force)
                log.warning("writer lease epoch %d of %s (pid %d, expires in %.1f s) overridden by --force",
                            cur.epoch, cur.holder, cur.pid, cur.expires_at - now)
            epoch = (cur.epoch if cur is not None else 0) + 1
            started = time.monotonic()
            rec = self._record(epoch, now, now, now + self.ttl)
            if self.store.put_if_absent(lease_key(self.store_id, epoch), rec.encode()):
                ours_lapsed = cur is not None and (cur.holder, cur.epoch, cur.pid) == (self.id, self.epoch, self.pid)
                self._took(rec, started)
                if cur is not None:
                    how = ("released" if cur.expires_at == 0 else
                           "ours, lapsed while it could not be renewed" if ours_lapsed else
                           "our hot dir's, left by an earlier daemon that did not release it (a crash)"
                           if cur.holder == self.id else "expired")
                    log.info("writer lease epoch %d taken over from epoch %d (%s; holder was %s:%s pid %d)",
                             epoch, cur.epoch, how, cur.host, cur.hot_dir, cur.pid)
                else:
                    log.info("writer lease epoch %d taken", epoch)
                self._drop_lower(epoch)
                return
        raise ObjectStoreError(lease_prefix(self.store_id), "lost the race for the writer lease 5 times in a row")

    def _took(self, rec: LeaseRecord, started: float) -> None:
        self.epoch = rec.epoch
        self.expires_at = rec.expires_at
        self._valid_until = started + self.ttl - self.margin
        self.other = None
        self.last_error = ""

    def _drop_lower(self, epoch: int) -> None:
        """Delete epochs below ours (best effort; they are dead once ours exists)."""
        try:
            old = [i.key for i in self.store.list(lease_prefix(self.store_id))
                   if _EPOCH_RE.match(i.key.rsplit("/", 1)[1]) and int(i.key.rsplit("/", 1)[1]) < epoch]
            self.store.delete_many(old)
        except ObjectStoreError as e:
            log.info("could not delete old lease epochs (%s); harmless", e)

    def renew(self) -> None:
        """Extend a valid lease; re-take a lapsed one (LeaseHeld if someone else has it now). Blocking."""
        if not self.held():
            self.acquire()
            return
        cur = self.current()
        if cur is None or cur.epoch != self.epoch or cur.holder != self.id:
            self._valid_until = 0.0
            if cur is not None:
                self.other = cur
                if cur.epoch > self.epoch:
                    self.fenced = True
                    self.last_error = f"fenced: the writer lease is held by epoch {cur.epoch} by {cur.holder}"
                    log.error("FENCED: writer lease epoch %d of store id %s was taken over by %s (epoch %d); this "
                              "mount's object puts, deletes and snapshots are refused", self.epoch, self.store_id,
                              cur.holder, cur.epoch)
                raise LeaseHeld(self.store.url, self.store_id, cur, time.time())
            raise ObjectStoreError(lease_key(self.store_id, self.epoch), "our lease object disappeared")
        started = time.monotonic()
        now = time.time()
        rec = self._record(self.epoch, now, cur.acquired_at, now + self.ttl)
        self.store.put(lease_key(self.store_id, self.epoch), rec.encode())
        self._took(rec, started)

    def verify(self) -> None:
        """Fencing on the store's word, not only our clock: before a batch of object writes or deletes, check
        that the epoch in force is still ours. A writer that was paused or cut off while another mount took the
        lease over (--force, or after the ttl) stops here, says so, and raises. Blocking."""
        if not self.held():
            raise ObjectStoreError(lease_key(self.store_id, self.epoch),
                                   f"refused: the writer lease (epoch {self.epoch}) is not held (fenced)")
        cur = self.current()
        if cur is not None and cur.epoch == self.epoch and cur.holder == self.id:
            return
        self._valid_until = 0.0
        self.other = cur
        self.fenced = True
        who = f"epoch {cur.epoch} by {cur.holder} (pid {cur.pid})" if cur is not None else "nobody (deleted)"
        self.last_error = f"fenced: the writer lease is held by {who}"
        log.error("FENCED: writer lease epoch %d of store id %s was taken over (now %s); this mount's object "
                  "puts, deletes and snapshots are refused", self.epoch, self.store_id, who)
        raise ObjectStoreError(lease_key(self.store_id, self.epoch), f"refused: {self.last_error}")

    def release(self) -> None:
        """At a clean unmount: mark our epoch released so the next writer need not wait for the ttl. Blocking."""
        if not self.epoch:
            return
        self._valid_until = 0.0
        cur = self.current()
        if cur is None or cur.epoch != self.epoch or cur.holder != self.id:
            return  # someone else holds it now: nothing of ours to release
        rec = self._record(self.epoch, time.time(), cur.acquired_at, 0.0)
        self.store.put(lease_key(self.store_id, self.epoch), rec.encode())
        self.expires_at = 0.0
        log.info("writer lease epoch %d released", self.epoch)

    # ------------------------------------------------------------------ the renewal loop (trio)

    async def run(self, limiter: trio.CapacityLimiter) -> None:
        """Renew every ttl/3 (retry sooner after a failure); log loudly while the lease is not held."""
        period = self.ttl / 3
        retry = min(period, max(self.margin, 1.0))
        lost_logged_at = 0.0
        next_at = time.monotonic() + (period if self.held() else 0.0)
        while True:
            await trio.sleep(max(next_at - time.monotonic(), 0.0))
            was_held = self.held()
            try:
                await trio.to_thread.run_sync(self.renew, limiter=limiter)
                if not was_held:
                    log.warning("writer lease epoch %d held: uploads, deletes and snapshots run", self.epoch)
                    lost_logged_at = 0.0
                next_at = time.monotonic() + period
                continue
            except LeaseHeld as e:
                self.last_error = str(e)
            except (ObjectStoreError, ValueError, OSError) as e:
                self.last_error = f"lease renewal failed: {e}"
                log.warning("%s", self.last_error)
            if not self.held() and time.monotonic() - lost_logged_at >= self.ttl:
                lost_logged_at = time.monotonic()
                log.error("WRITER LEASE NOT HELD for store id %s: uploads, object deletes and catalog snapshots "
                          "are stopped until it is held again (the broker's writes carry on locally). %s",
                          self.store_id, self.last_error)
            next_at = time.monotonic() + retry
