"""Who still refers to an object, beyond the catalog's live rows (DESIGN §5: one reference authority).

An object may be deleted only when nothing refers to it. The catalog holds the durable part (a live row names
it, or `pending_deletes` says when it may go); this module holds the in-memory part every delete must also ask:
the objects named by catalog snapshots, published (a read-only mount or a takeover may fetch any of them) and in
flight (being taken: once its pointer is up, the same holds). A snapshot names its objects here in the same
loop turn as it reads the rows that name them, so no delete decided after that can take them; a delete decided
before is visible to the snapshot (`name` refuses a key being deleted: the row it read was stale).

The other referrers the design lists (held files, takeover imports, compaction outputs) are still kept by the
catalog's rows and delete times; they belong here as they move out of it.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager


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
    """Object keys named by published and in-flight catalog snapshots. Thread-safe: the janitor asks on the trio
    thread, the snapshot pruner and the append log's collector from worker threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._published: dict[int, frozenset[str]] = {}  # seq -> keys, for every kept snapshot once _complete
        self._complete = False  # _published covers every kept snapshot (after the first `keep`)
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

    @contextmanager
    def may_delete(self, keys: list[str]) -> Iterator[list[str]]:
        """The subset of `keys` no snapshot names (none until the kept snapshots are known). Those stay reserved
        while the caller deletes them, so a snapshot reading a stale row naming one fails instead of publishing it."""
        with self._lock:
            if not self._complete:
                free: list[str] = []
            else:
                sets = [*self._published.values(), *self._flights.values()]
                free = [k for k in keys if k not in self._deleting and not any(k in s for s in sets)]
            if len(free) < len(keys):
                self.roll_requested = True
            self._deleting.update(free)
        try:
            yield free
        finally:
            with self._lock:
                self._deleting.difference_update(free)
