"""The one reference authority over objects (DESIGN §5): an object is deleted only when nothing refers to it.

Every deleter of objects (the janitor, which alone deletes what the catalog queued: segment chunks, compacted
objects, sidecars, retired append objects; and the snapshot pruner for its content-addressed blobs) asks here,
and every referrer registers here:

- live rows, artifacts and the append objects of active files name their objects in the catalog itself;
- an unlinked file still open holds its objects (`held:<file id>` in the catalog's `object_refs`, until its last
  close or the next mount: no process holds a file of an earlier daemon);
- an upload holds the object keys it will put (`upload:<file id>`) durably before its first PUT, until the
  commit that names them (or queues them) lands; a failed upload releases them (queued), and the next mount
  releases every one an earlier daemon left (`release_all`): so every object a daemon that died put is named by a
  row or queued for deletion, and a row that names one keeps it (a queued delete of a key a live row names is
  dropped, never done; a content-addressed key, which several rows may name, is kept while any of them does:
  tierfs.tier.layout). A takeover queues the refs of its point like every other (tierfs.tier.takeover);
- a compaction job holds the outputs it may write (`job:<job id>`) from before it starts until its result is
  applied (or it failed): what no row took over is then queued, so a failed or skipped job leaks nothing and a
  running one loses nothing;
- catalog snapshots, published (a read-only mount or a takeover may fetch any object they name) and in flight
  (being taken: once its pointer is up, the same holds), are held here in memory: they name their objects in
  the same loop turn as they read the rows that name them, and a restart reloads the kept ones (`keep`).

`claim` answers "which queued deletes may go now" in one catalog transaction (Catalog.claim_deletes) that also
asks the snapshot sets, under one lock, and reserves the answer until its deleter is done: a snapshot that reads
a stale row naming a reserved key fails (`BeingDeleted`) instead of publishing it, and a holder cannot register
one (`hold` raises the same).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tierfs.tier.catalog import Catalog

UPLOAD = "upload:"  # object_refs holder of an upload in progress, followed by its file id
SNAPSHOT_RETRY_S = 5.0  # a due delete a snapshot still names is asked about again this much later


class BeingDeleted(ValueError):
    """A snapshot named an object a delete already took: the row it read was older than the delete."""


class Flight:
    """The objects one snapshot being taken has named so far."""

    def __init__(self, refs: References, ident: int):
        self._refs, self._id = refs, ident

    def name(self, keys: Iterable[str]) -> None:
        """Hold `keys` from now on (call in the same loop turn as reading the rows that name them)."""
        self._refs._name(self._id, keys)

    def publish(self, seq: int) -> None:
        """The snapshot becomes published snapshot `seq` (call before its pointer can go up): its objects are then
        held until a `keep` without `seq`."""
        self._refs._publish(self._id, seq)


class References:
    """Who refers to which object: the catalog's durable referrers and the snapshots' keys. Thread-safe: the
    snapshotter names keys on the trio thread; the janitor claims, jobs hold, the pruner asks from worker threads
    (the catalog call runs under this lock: lock order References, then Catalog)."""

    def __init__(self, catalog: Catalog, snapshots: bool) -> None:
        """`snapshots`: this mount takes catalog snapshots, whose kept ones are unknown until the first `keep`."""
        self._catalog = catalog
        self._lock = threading.Lock()
        self._published: dict[int, frozenset[str]] = {}  # seq -> keys, for every kept snapshot once _complete
        self._complete = not snapshots  # _published covers every kept snapshot (after the first `keep`)
        self._flights: dict[int, set[str]] = {}
        self._ids = itertools.count()
        self._deleting: set[str] = set()  # released by may_delete, until their deleter is done
        # a due delete waits for a snapshot that names it: the snapshotter then takes a new one even if nothing
        # changed, so old ones roll out of the kept ones and the delete can proceed
        self.roll_requested = False

    @contextmanager
    def in_flight(self) -> Iterator[Flight]:
        """One snapshot being taken: what it names is held until it is published, or until it ends unpublished
        (failed, or skipped as unchanged)."""
        ident = next(self._ids)
        with self._lock:
            self._flights[ident] = set()
        try:
            yield Flight(self, ident)
        finally:
            with self._lock:
                self._flights.pop(ident, None)

    def _name(self, ident: int, keys: Iterable[str]) -> None:
        keys = set(keys)
        with self._lock:
            taken = keys & self._deleting
            if taken:
                raise BeingDeleted(f"{len(taken)} objects the snapshot names are being deleted, e.g. {min(taken)}")
            self._flights[ident] |= keys

    def _publish(self, ident: int, seq: int) -> None:
        with self._lock:
            self._published[seq] = frozenset(self._flights.pop(ident))

    def keep(self, seqs: list[int], load: Callable[[int], set[str]]) -> None:
        """After a prune: the published snapshots are exactly `seqs`. `load` (blocking) reads the keys of one this
        process has not published itself. Until the first call, no delete is allowed."""
        with self._lock:
            missing = [s for s in seqs if s not in self._published]
        loaded = {s: frozenset(load(s)) for s in missing}
        with self._lock:
            self._published = {s: self._published[s] if s in self._published else loaded[s] for s in seqs}
            self._complete = True

    def named(self, prefix: str) -> set[str]:
        """Every key under `prefix` a published or in-flight snapshot names."""
        with self._lock:
            sets = [*self._published.values(), *self._flights.values()]
            return {k for s in sets for k in s if k.startswith(prefix)}

    # ------------------------------------------------------------------ durable referrers (the catalog)

    def hold(self, holder: str, keys: list[str]) -> None:
        """Blocking: `holder` refers to `keys` from now on (register before writing or using them). Raises
        BeingDeleted when a delete already took one: the holder must not rely on it."""
        with self._lock:
            self._refuse_deleting(keys, holder)
            self._catalog.hold_refs(holder, keys)

    def hold_many(self, holds: dict[str, list[str]]) -> None:
        """Blocking: `hold` for several holders in one catalog transaction (all or none of them)."""
        with self._lock:
            self._refuse_deleting([k for keys in holds.values() for k in keys], ", ".join(holds))
            self._catalog.hold_refs_many([(k, h) for h, keys in holds.items() for k in keys])

    def hold_content(self, holder: str, key: str) -> bool:
        """Blocking: `hold` of one content-addressed key; True when a live row already names it (stored and
        verified: the other replica's identical chunk), so the holder need not put it. Raises BeingDeleted as
        `hold` (a delete of the same bytes is running: the holder tries again later)."""
        with self._lock:
            self._refuse_deleting([key], holder)
            return self._catalog.hold_content(holder, key)

    def _refuse_deleting(self, keys: list[str], who: str) -> None:
        """(under the lock) BeingDeleted when a delete already took one of `keys`."""
        taken = set(keys) & self._deleting
        if taken:
            raise BeingDeleted(f"{len(taken)} objects {who} would hold are being deleted, e.g. {min(taken)}")

    def release(self, holder: str, not_before: float) -> int:
        """Blocking: `holder` is done; its objects go after `not_before` unless something else refers to them."""
        return self._catalog.release_refs(holder, not_before)

    def settle(self, settled: list[str], released: list[str], not_before: float) -> None:
        """Blocking, in one transaction: `settled` holders are done and a committed change names or queued their
        objects (nothing to queue); `released` ones as `release`."""
        self._catalog.end_refs(settled, released, not_before)

    def release_all(self, prefix: str, not_before: float) -> int:
        """Blocking: release every holder whose name starts with `prefix` (at mount: an earlier daemon's holders,
        which ended with it)."""
        return sum(self._catalog.release_refs(h, not_before) for h in self._catalog.holders(prefix))

    def claim(self, now: float, limit: int = 1000) -> list[str]:
        """Blocking: the queued deletes due at `now` that nothing refers to, reserved until `done` (call it
        whatever happens). None while the kept snapshots are unknown."""
        with self._lock:
            if not self._complete:
                return []
            free = self._catalog.claim_deletes(now, limit, self._deleting, self._snapshot_named, SNAPSHOT_RETRY_S)
            self._deleting.update(free)
            return free

    def done(self, keys: list[str], deleted: bool) -> None:
        """Blocking: the deleter of claimed `keys` finished; `deleted`: they are gone (their queue entries go)."""
        try:
            if deleted:
                self._catalog.deleted(keys)
        finally:
            with self._lock:
                self._deleting.difference_update(keys)

    def _snapshot_named(self, keys: list[str]) -> set[str]:
        """(under the lock) those of `keys` a published or in-flight snapshot names; asks for a roll if any."""
        sets = [*self._published.values(), *self._flights.values()]
        named = {k for k in keys if any(k in s for s in sets)}
        if named:
            self.roll_requested = True
        return named

    # ------------------------------------------------------------------ snapshot-only objects (blobs)

    @contextmanager
    def may_delete(self, keys: list[str]) -> Iterator[list[str]]:
        """For objects only snapshots refer to (content-addressed blobs, which a later snapshot may name again, so
        they are never queued): the subset of `keys` no snapshot names (none until the kept snapshots are known),
        reserved while the caller deletes them."""
        with self._lock:
            if not self._complete:
                free: list[str] = []
            else:
                named = self._snapshot_named(keys)
                free = [k for k in keys if k not in self._deleting and k not in named]
            if len(free) < len(keys):
                self.roll_requested = True
            self._deleting.update(free)
        try:
            yield free
        finally:
            with self._lock:
                self._deleting.difference_update(free)
