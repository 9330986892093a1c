"""The writer lease: at most one writable mount per store id writes to the object store (DESIGN §5, §12, §13).

Object layout: one small JSON object per lease *epoch*, `<store-id>/meta/lease/<epoch, 12 digits>`; the lease in
force is the one with the highest epoch. Every write of a lease object is a compare-and-swap
(`ObjectStore.put_if_match`: S3 If-Match / If-None-Match, posix a locked compare and rename), so the store itself
orders the writers of each epoch object:

* a mount takes the lease by first *claiming* the epoch in force N (rewriting it with `superseded_by` N+1, If-Match
  the etag it read) and then creating N+1 (If-None-Match: *). Of several mounts racing for the same lease exactly
  one creates N+1; nothing ever deletes the highest epoch (the new holder deletes only lower ones, a clean unmount
  *releases* its epoch: expires_at 0);
* the holder renews by rewriting its epoch object If-Match the etag of its own last write. A claim changed that
  etag, so a holder that was taken over cannot renew, and a holder that renewed first makes the claim fail (the
  claimant reads again and finds the lease live): renewal and takeover are decided by the store, not by clocks;
* fencing (`fence`, installed on the store as `ObjectStore.fence` once the lease is taken): immediately before
  every object write or delete the store calls it, and it HEADs our epoch object: unchanged since our own last
  write means nobody claimed the next epoch, so nobody else may be writing. Any takeover claims our epoch
  before its own, so this check does not depend on any clock. What is left: the time between that HEAD and the
  arrival of the request it guards (one round trip, or a process paused exactly there), which no S3 interface
  closes for a write to another key (README, "Continuous tiering and takeover").

Clocks decide liveness only: the highest epoch is free to claim when it is released or expired (expires_at < now),
already claimed, ours (this process), or left by the previous daemon of this hot dir's state dir (its holder id,
recorded in STATE_DIR/lease.json; the daemon lock proves that daemon gone); otherwise a writable mount is refused
with a message naming the holder and the expiry, unless a takeover's --force names it. The holder renews every
ttl/3 and, by its own monotonic clock, stops writing at (start of its last successful write) + ttl - ttl/10,
before anybody else may claim the lease, given clocks within ttl/10 of each other.

The holder id is unique to the daemon process: host, pid and a random token, then the hot dir
("host#pid-token:/hot/dir"). A mount of the same host name and hot dir path elsewhere (a pod rescheduled while
its old node is partitioned) is another holder: it is refused while the lease lives, and the old daemon, once
taken over, stays fenced for the rest of its life (it logs FENCED and never takes the lease again).

All methods except `run` block (object store calls): call them from a worker thread inside trio.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import socket
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

import trio

from tierfs.objectstore import ObjectStore
from tierfs.objectstore.base import Fenced, ObjectNotFound, ObjectStoreError

log = logging.getLogger("tierfs.lease")

_EPOCH_RE = re.compile(r"^\d{12}$")
STATE_DIR = ".tierfs"  # the daemon's state dir inside the hot dir (tierfs.fs.operations.STATE_DIR_NAME)
RECORD = "lease.json"  # in the state dir: the holder id and epoch its daemon took last
_token = uuid.uuid4().hex[:12]  # this process's: a forked child draws its own


def _new_token() -> None:
    global _token
    _token = uuid.uuid4().hex[:12]


os.register_at_fork(after_in_child=_new_token)


def lease_prefix(store_id: str) -> str:
    return f"{store_id}/meta/lease/"


def lease_key(store_id: str, epoch: int) -> str:
    return f"{lease_prefix(store_id)}{epoch:012d}"


@dataclass(frozen=True)
class LeaseRecord:
    """The content of one lease epoch object."""

    epoch: int
    holder: str  # holder id: "host#pid-token:hot dir", unique to one daemon process
    host: str
    hot_dir: str
    pid: int
    mountpoint: str
    acquired_at: float
    expires_at: float  # 0: released at a clean unmount
    superseded_by: int = 0  # set by the mount taking the next epoch, before it creates that one

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
                      acquired_at=float(d["acquired_at"]), expires_at=float(d["expires_at"]),
                      superseded_by=int(d.get("superseded_by", 0)))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"lease object {key!r} is not a valid lease ({type(e).__name__}: {e}); if no writable "
                             f"mount of this store id is running anywhere, delete it") from None
        return rec

    def describe(self, now: float) -> str:
        left = self.expires_at - now
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.expires_at))
        return (f"host {self.host}, hot dir {self.hot_dir}, pid {self.pid}, mountpoint {self.mountpoint}; "
                f"the lease expires at {when} (in {left:.1f} s) unless renewed")

    def named_by(self, force: str | None) -> bool:
        """Does a takeover's --force name this holder? Its full id, or "host:hot dir" as an operator knows it."""
        return force is not None and force in (self.holder, f"{self.host}:{self.hot_dir}")


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


def holder_id(host: str, hot_dir: Path | str, pid: int | None = None) -> str:
    """This process's holder id for `hot_dir`: never the same for two daemons, even of one host name and path."""
    return f"{host}#{pid or os.getpid()}-{_token}:{os.path.abspath(hot_dir)}"


def read_current(store: ObjectStore, store_id: str) -> tuple[LeaseRecord, str | None] | None:
    """The lease in force (highest epoch) and the etag it was read at, or None when no lease was ever taken.
    The etag is read before the content: a compare-and-swap with it fails if the content changed since. Blocking."""
    for _ in range(5):
        epochs = [int(i.key.rsplit("/", 1)[1]) for i in store.list(lease_prefix(store_id))
                  if _EPOCH_RE.match(i.key.rsplit("/", 1)[1])]
        if not epochs:
            return None
        key = lease_key(store_id, max(epochs))
        info = store.head(key)
        try:
            if info is not None:
                return LeaseRecord.decode(key, store.get(key)), info.etag
        except ObjectNotFound:
            pass
        # a new holder deleted it as a lower epoch meanwhile: list again
    raise ObjectStoreError(lease_prefix(store_id), "the lease epochs kept changing while being read")


def last_holder(state_dir: Path, store_id: str) -> dict | None:
    """What the daemon of this state dir recorded when it last took the lease of `store_id` ({"holder", "epoch"}),
    or None."""
    try:
        d = json.loads((Path(state_dir) / RECORD).read_text())
        if d.get("store_id") == store_id:
            return {"holder": str(d["holder"]), "epoch": int(d["epoch"])}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    return None


def is_this_hot_dirs(rec: LeaseRecord, store_id: str, hot_dir: Path, state_dir: Path | None = None) -> bool:
    """Was `rec` taken by a daemon of this hot dir (the last one its state dir recorded, or one of a tierfs
    that named holders by host and hot dir alone)? For a check made while no daemon runs here, or by that daemon."""
    last = last_holder(state_dir or Path(hot_dir) / STATE_DIR, store_id)
    return (last is not None and rec.holder == last["holder"]) or \
        rec.holder == f"{socket.gethostname()}:{os.path.abspath(hot_dir)}"


def job_fence(store: ObjectStore, store_id: str, started: dict | None) -> Callable[[str, Sequence[str]], None]:
    """A fence (ObjectStore.fence) for a job a writable mount started out of process (tierfs.spark): it refuses
    every write or delete once the lease in force is no longer `started`, the one the daemon held when the job
    started (`last_holder` of its state dir, read then; None: the lease in force now). Blocking."""
    last = started
    if last is None:
        got = read_current(store, store_id)
        last = {"holder": got[0].holder, "epoch": got[0].epoch} if got else {"holder": "", "epoch": 0}

    def fence(op: str, keys: Sequence[str]) -> None:
        got = read_current(store, store_id)
        cur = got[0] if got else None
        if cur is None and not last["epoch"] or cur is not None and not cur.superseded_by \
                and (cur.epoch, cur.holder) == (last["epoch"], last["holder"]):
            return
        now = f"epoch {cur.epoch} of {cur.holder}" if cur is not None else "no lease at all"
        raise Fenced(keys[0], f"{op} refused: the writer lease of store id {store_id!r} moved since this job "
                              f"started (epoch {last['epoch']} of {last['holder'] or 'nobody'}, now {now}): the "
                              f"mount that started it no longer owns the store")
    return fence


class WriterLease:
    def __init__(self, store: ObjectStore, store_id: str, hot_dir: Path, mountpoint: Path, ttl: float,
                 host: str | None = None, pid: int | None = None, state_dir: Path | None = None):
        self.store = store
        self.store_id = store_id
        self.ttl = float(ttl)
        self.margin = self.ttl / 10
        self.host = host or socket.gethostname()
        self.hot_dir = str(Path(hot_dir).resolve())
        self.state_dir = Path(state_dir) if state_dir is not None else Path(self.hot_dir) / STATE_DIR
        self.mountpoint = str(mountpoint)
        self.pid = pid or os.getpid()
        self.id = holder_id(self.host, self.hot_dir, self.pid)
        self.epoch = 0  # the epoch we hold (or held last); 0: never held
        self._etag: str | None = None  # etag of our epoch object as our own last write left it
        self._valid_until = 0.0  # time.monotonic() until which we may write to the store
        self.acquired_at = 0.0
        self.expires_at = 0.0
        self.last_error = ""
        self.renew_failures = 0  # renewals the store did not answer (metrics: errors of type lease_renewal)
        self.failing_since: float | None = None  # time.time() of the first of the renewals failing now, if any
        self.other: LeaseRecord | None = None  # the other holder that refused us, if any
        # set once another mount took the lease over from us: our view of the store is stale from then on, so
        # this daemon never takes the lease again (not even once the other one's lapses)
        self.fenced = False

    # ------------------------------------------------------------------ state

    def held(self) -> bool:
        return not self.fenced and time.monotonic() < self._valid_until

    def status(self) -> dict:
        d = {"held": self.held(), "holder": self.id, "epoch": self.epoch, "ttl_s": self.ttl,
             "expires_at": round(self.expires_at, 3), "last_error": self.last_error, "fenced": self.fenced}
        if self.other is not None and not self.held():
            d["held_by"] = f"{self.other.host}:{self.other.hot_dir} (pid {self.other.pid})"
        return d

    def _key(self) -> str:
        return lease_key(self.store_id, self.epoch)

    def _record(self, epoch: int, acquired_at: float, expires_at: float) -> LeaseRecord:
        return LeaseRecord(epoch=epoch, holder=self.id, host=self.host, hot_dir=self.hot_dir, pid=self.pid,
                           mountpoint=self.mountpoint, acquired_at=acquired_at, expires_at=expires_at)

    def current(self) -> LeaseRecord | None:
        """The lease in force (highest epoch), or None when no lease was ever taken. Blocking."""
        got = read_current(self.store, self.store_id)
        return got[0] if got else None

    def _how_free(self, cur: LeaseRecord, now: float, force: str | None) -> str:
        """Why we may claim the epoch in force (for the log), or LeaseHeld when another live holder has it."""
        if cur.expires_at == 0:
            return "released"
        if cur.superseded_by:
            return "claimed by a mount that did not finish taking it"
        if not cur.live(now):
            return "expired"
        if cur.holder == self.id:
            return "this daemon's own"
        last = last_holder(self.state_dir, self.store_id)
        if last is not None and cur.holder == last["holder"]:
            return "left by this state dir's previous daemon (a crash)"  # which the daemon lock shows is gone
        if not cur.named_by(force):
            self.other = cur
            raise LeaseHeld(self.store.url, self.store_id, cur, now, force)
        log.warning("writer lease epoch %d of %s (pid %d, expires in %.1f s) overridden by --force",
                    cur.epoch, cur.holder, cur.pid, cur.expires_at - now)
        return "overridden by --force"

    # ------------------------------------------------------------------ acquire, renew, release

    def acquire(self, force: str | None = None) -> None:
        """Take the lease or raise LeaseHeld. `force` (a takeover's --force) names the live holder to override:
        it must be the holder in force, so a takeover never overrides a writer its operator did not name.
        ObjectStoreError when the store cannot be reached. Blocking."""
        if self.fenced:  # never again in this daemon's life
            if self.other is not None:
                raise LeaseHeld(self.store.url, self.store_id, self.other, time.time())
            raise Fenced(self._key(), f"refused: {self.last_error}; remount to write again")
        for _ in range(5):
            got = read_current(self.store, self.store_id)
            cur, etag = got if got is not None else (None, None)
            now = time.time()
            if self.epoch and (cur is None or cur.epoch > self.epoch or cur.holder != self.id or cur.superseded_by):
                self._fence_off(cur)  # someone else wrote the store after us: what this daemon knows is stale
                if cur is not None and cur.holder != self.id:
                    raise LeaseHeld(self.store.url, self.store_id, cur, now)
                raise Fenced(self._key(), f"refused: {self.last_error}")
            how = self._how_free(cur, now, force) if cur is not None else ""
            if cur is not None and not cur.superseded_by:  # claim it: its holder's renewals fail from now on
                claimed = dataclasses.replace(cur, superseded_by=cur.epoch + 1)
                if self.store.put_if_match(lease_key(self.store_id, cur.epoch), claimed.encode(), etag) is None:
                    continue  # renewed, released or claimed meanwhile: decide again
            epoch = (cur.epoch if cur is not None else 0) + 1
            started = time.monotonic()
            rec = self._record(epoch, now, now + self.ttl)
            new = self.store.put_if_match(lease_key(self.store_id, epoch), rec.encode(), None)
            if new is None:
                continue  # another mount created it first
            self.epoch = epoch
            self._took(rec, started, new)
            self._remember()
            self.store.fence = self.fence
            if cur is not None:
                log.info("writer lease epoch %d taken over from epoch %d (%s; holder was %s pid %d)",
                         epoch, cur.epoch, how, cur.holder, cur.pid)
            else:
                log.info("writer lease epoch %d taken", epoch)
            self._drop_lower(epoch)
            return
        raise ObjectStoreError(lease_prefix(self.store_id), "lost the race for the writer lease 5 times in a row")

    def _took(self, rec: LeaseRecord, started: float, etag: str) -> None:
        self._etag = etag
        self.acquired_at = rec.acquired_at
        self.expires_at = rec.expires_at
        self._valid_until = started + self.ttl - self.margin
        self.other = None
        self.last_error = ""

    def _remember(self) -> None:
        """Record our holder id in the state dir: the next daemon here after a crash may take our lease at once."""
        if not self.state_dir.is_dir():
            return
        tmp = self.state_dir / f"{RECORD}.tmp"
        try:
            tmp.write_text(json.dumps({"store_id": self.store_id, "holder": self.id, "epoch": self.epoch}) + "\n")
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.state_dir / RECORD)
        except OSError as e:
            log.warning("could not record the writer lease holder in %s (%s): a restart after a crash waits for "
                        "the lease to expire", self.state_dir, e)

    def _drop_lower(self, epoch: int) -> None:
        """Delete epochs below ours (best effort; they are dead once ours exists)."""
        try:
            old = [i.key for i in self.store.list(lease_prefix(self.store_id))
                   if _EPOCH_RE.match(i.key.rsplit("/", 1)[1]) and int(i.key.rsplit("/", 1)[1]) < epoch]
            self.store.delete_many(old)
        except ObjectStoreError as e:
            log.info("could not delete old lease epochs (%s); harmless", e)

    def _ours(self) -> str | None:
        """The etag of our epoch object if the store says it is still ours (our holder and epoch, not claimed),
        else None. Usually one HEAD; when the etag is not the one we know (a renewal of ours in flight in another
        thread, or one whose answer was lost) the content decides, which only a claim or a delete changes."""
        key = self._key()
        info = self.store.head(key)
        if info is None:
            return None
        if info.etag == self._etag:
            return info.etag
        try:
            rec = LeaseRecord.decode(key, self.store.get(key))
        except ObjectNotFound:
            return None
        return info.etag if (rec.holder, rec.epoch, rec.superseded_by) == (self.id, self.epoch, 0) else None

    def _fence_off(self, cur: LeaseRecord | None) -> None:
        """We were taken over: stop for good, and say so once."""
        self._valid_until = 0.0
        if cur is not None and cur.holder != self.id:
            self.other = cur
        if self.fenced:
            return
        self.fenced = True
        who = f"epoch {cur.epoch} of {cur.holder} (pid {cur.pid})" if cur is not None else "nobody (deleted)"
        self.last_error = f"fenced: the writer lease was taken over, it is now {who}"
        log.error("FENCED: writer lease epoch %d of store id %s was taken over (now %s); this mount's object "
                  "puts, deletes and snapshots are refused, and it never takes the lease again: remount it",
                  self.epoch, self.store_id, who)

    def _lost(self) -> None:
        """Our epoch object is no longer ours: fence off, naming who has the lease now."""
        try:
            cur = self.current()
        except (ObjectStoreError, ValueError):
            cur = None
        self._fence_off(cur)

    def renew(self) -> None:
        """Extend our lease by rewriting our epoch object If-Match our last write, valid or lapsed (a lapsed lease
        nobody claimed is still ours: any claim changes that etag). LeaseHeld (or Fenced) once someone else took
        it: this daemon never holds it again. Blocking."""
        if self.fenced or not self.epoch:
            self.acquire()
            return
        lapsed = not self.held()
        started = time.monotonic()
        now = time.time()
        rec = self._record(self.epoch, self.acquired_at, now + self.ttl)
        new = self.store.put_if_match(self._key(), rec.encode(), self._etag)
        if new is None:
            ours = self._ours()  # an answer lost after the write: our own earlier renewal holds the key
            new = self.store.put_if_match(self._key(), rec.encode(), ours) if ours is not None else None
        if new is None:
            self._lost()
            if self.other is not None:
                raise LeaseHeld(self.store.url, self.store_id, self.other, time.time())
            raise Fenced(self._key(), f"refused: {self.last_error}")
        self._took(rec, started, new)
        if lapsed:
            log.info("writer lease epoch %d renewed: it lapsed while it could not be renewed, and nobody claimed it "
                     "meanwhile", self.epoch)

    def verify(self, key: str | None = None, op: str = "write") -> None:
        """Fencing on the store's word: raise Fenced (naming `key`, the object about to be written or deleted)
        unless our lease is valid by our clock and our epoch object is still ours in the store (nobody claimed the
        next epoch). Blocking: one HEAD."""
        if not self.held():
            why = self.last_error if self.fenced else "the writer lease is not held (not renewed in time)"
            raise Fenced(key or self._key(), f"{op} refused: {why} (epoch {self.epoch})")
        if self._ours() is None:
            self._lost()
            raise Fenced(key or self._key(), f"{op} refused: {self.last_error}")

    def fence(self, op: str, keys: Sequence[str]) -> None:
        """ObjectStore.fence: every object write or delete but our own lease objects' waits for `verify`."""
        prefix = lease_prefix(self.store_id)
        if not all(k.startswith(prefix) for k in keys):
            self.verify(keys[0], op)

    def release(self) -> None:
        """At a clean unmount: mark our epoch released so the next writer need not wait for the ttl. Blocking."""
        if not self.epoch or self.fenced:
            return
        self._valid_until = 0.0
        rec = self._record(self.epoch, self.acquired_at, 0.0)
        ours = self._etag
        new = self.store.put_if_match(self._key(), rec.encode(), ours)
        if new is None and (ours := self._ours()) is not None:
            new = self.store.put_if_match(self._key(), rec.encode(), ours)
        if new is None:
            return  # someone else holds it now: nothing of ours to release
        self._etag = new
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
                self.failing_since = None
                if not was_held:
                    log.warning("writer lease epoch %d held: uploads, deletes and snapshots run", self.epoch)
                    lost_logged_at = 0.0
                next_at = time.monotonic() + period
                continue
            except (LeaseHeld, Fenced) as e:  # taken over: said once, by _fence_off and the line below
                self.last_error = str(e)
            except (ObjectStoreError, ValueError, OSError) as e:
                self.renew_failures += 1
                self.failing_since = self.failing_since or time.time()
                self.last_error = f"lease renewal failed: {e}"
                log.warning("%s", self.last_error)
            if not self.held() and time.monotonic() - lost_logged_at >= self.ttl:
                lost_logged_at = time.monotonic()
                until = "for good (this mount was taken over: remount it)" if self.fenced else \
                    "until it is held again"
                log.error("WRITER LEASE NOT HELD for store id %s: uploads, object deletes and catalog snapshots "
                          "are stopped %s (the broker's writes carry on locally). %s", self.store_id, until,
                          self.last_error)
            next_at = time.monotonic() + retry
