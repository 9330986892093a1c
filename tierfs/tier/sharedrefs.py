"""References to a broker group's shared chunks, kept in the bucket itself (upload.dedup_group).

A group's replicas on separate mounts (own hot dir, catalog and store id; one bucket) store their byte-identical
chunks once, as groups/<group>/cas/<xx>/<sha256> (tierfs.tier.layout). No catalog sees the other mounts, so each
mount says in the bucket that it relies on an object: a marker groups/<group>/refs/<sha256>/<store-id>. Locally the
reference authority (tierfs.tier.references) still decides when this mount lets go of a key (no row, hold or
snapshot of its own names it); the janitor then calls `release` here instead of deleting the object.

The protocol (every step one request; Ceph RGW and S3 are strongly read-after-write consistent for PUT, HEAD,
LIST and DELETE, so each request sees every request acknowledged before it was sent):

  uploader U (acquire), before its commit names the key:
    U1 PUT marker(U);  U2 LIST tombs;  if any: U3 wait until all are gone (or expired), then PUT the object;
    else U4 HEAD the object and PUT it only if it is missing; then (the uploader) verify it as its own PUT.
  deleter D (release), once its catalog no longer names the key:
    D1 DELETE marker(D);  D2 LIST markers: any, done (the object stays);  D3 PUT tomb(D) (one per deleter,
    valid `valid_seconds`);
    D4 wait `grace`;  D5 LIST markers: any, keep the object;  none, and no later than `grace + DELETE_SLACK`
    after D3 was sent: D6 DELETE the object;  D7 DELETE the tomb.

Why no acknowledged byte is lost: U relies on the object (its commit names it) only after U1 and its PUT or its
HEAD. If U1 came before D5, D5 lists U's marker and D deletes nothing. Otherwise U1, hence U2, came after D5,
which came after D3: U2 lists D's tomb, unless D7 already ran, and D7 follows D6, so U4's HEAD sees the object
gone and U puts it. When U2 lists a tomb, U waits until it is gone (D7, after D6) before its PUT, so D6 cannot
remove U's bytes. Every deleter has its own tomb, so one deleter's D7 never hides another's decision.
A deleter that died (or stalled) between D3 and D7 leaves a tomb: U waits `valid_seconds` from when it first
saw it (twice D's deadline for D6, counted from before D3, so a live D has sent any D6 by then; a D6 request
that takes longer than that in flight is the one window left), then removes it and puts the object. A second
deleter D' cannot remove the object U relies on: U's marker is there from U1 on, so D' stops at D2 or D5.
Markers stay until this mount releases the key, so a crash leaks at most a marker and an object (fsck reports
this store's stale marker, and an object no mount marks as an orphan); the janitor's queue entry stays until
`release` returns, so the next mount's janitor finishes a release a crash interrupted.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

from tierfs import failpoints
from tierfs.objectstore.base import ObjectStore
from tierfs.tier import layout

log = logging.getLogger("tierfs.tier")

DELETE_SLACK = 60.0  # beyond the grace, the longest a deleter may take from its tomb to its delete
POLL = 0.2  # how often an uploader looks whether a tomb is gone


def check_group(group: str) -> str:
    """`group` if it is a valid group name, else a ValueError naming the key."""
    if not layout.GROUP_NAME.match(group):
        raise ValueError(f"upload.dedup_group: {group!r} is not a group name (1-128 of letters, digits, '.', '_', "
                         "'-')")
    return group


class SharedRefs:
    """One mount's side of a group's shared chunks. Blocking methods: call them off the trio loop."""

    def __init__(self, store: ObjectStore, store_id: str, group: str, grace: float,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.store, self.store_id, self.group = store, store_id, check_group(group)
        self.grace, self._sleep = grace, sleep
        self.valid_seconds = 2 * (grace + DELETE_SLACK)

    def key(self, sha256_hex: str) -> str:
        """The group's object for bytes whose sha256 is `sha256_hex`."""
        return f"{layout.group_cas_prefix(self.group)}{sha256_hex[:2]}/{sha256_hex}"

    def refs_prefix(self, sha: str = "") -> str:
        return f"{layout.group_prefix(self.group)}refs/{sha + '/' if sha else ''}"

    def marker(self, key: str) -> str:
        return f"{self.refs_prefix(layout.cas_sha(key))}{self.store_id}"

    def tomb_prefix(self, key: str) -> str:
        return f"{layout.group_prefix(self.group)}tomb/{layout.cas_sha(key)}/"

    def tomb(self, key: str) -> str:
        """This mount's tomb of `key` (a deleter's own: two deciding at once do not remove each other's)."""
        return f"{self.tomb_prefix(key)}{self.store_id}"

    def owns(self, key: str) -> bool:
        return key.startswith(layout.group_cas_prefix(self.group)) and layout.is_cas(key)

    # ------------------------------------------------------------------ uploader

    def acquire(self, key: str) -> bool:
        """This mount relies on `key` from now on (before a commit names it): True when the object is stored and
        no delete of it can be under way (the caller verifies it, no PUT); False: the caller must PUT it."""
        self.store.put(self.marker(key), self.store_id.encode())  # U1
        if self.tombs(key):  # U2
            self._wait_tombs(key)
            return False
        return self.store.head(key) is not None  # U4

    def tombs(self, key: str) -> list[str]:
        """The tombs of `key` (one per deleter deciding)."""
        return [i.key for i in self.store.list(self.tomb_prefix(key))]

    def _wait_tombs(self, key: str) -> None:
        """U3: until every tomb of `key` is gone (its deleter decided), or expired (its deleter died: removed)."""
        seen: dict[str, float] = {}
        log.info("%s: a delete of this shared object is being decided; waiting for it, then putting it again", key)
        while tombs := self.tombs(key):
            now = time.monotonic()
            for t in tombs:
                if now - seen.setdefault(t, now) > self.valid_seconds:
                    log.warning("%s: tomb %s outlived %.0f s (its deleter died); removing it", key, t,
                                self.valid_seconds)
                    self.store.delete(t)
            self._sleep(POLL)

    # ------------------------------------------------------------------ deleter

    def others(self, key: str) -> list[str]:
        """The markers of `key` (of every mount)."""
        return [i.key for i in self.store.list(self.refs_prefix(layout.cas_sha(key)))]

    def release(self, keys: list[str]) -> list[str]:
        """This mount no longer relies on `keys` (its reference authority let them go): drop its markers and
        delete each object no other mount marks (the protocol above). Returns the objects deleted."""
        self.store.delete_many([self.marker(k) for k in keys])  # D1
        last = [k for k in keys if not self.others(k)]  # D2
        if not last:
            return []
        start = time.monotonic()
        body = json.dumps({"store": self.store_id, "time": time.time(), "valid_seconds": self.valid_seconds})
        try:
            for k in last:
                self.store.put(self.tomb(k), body.encode())  # D3
            failpoints.hit("sharedrefs.tombstoned")
            self._sleep(self.grace)  # D4
            keep = [k for k in last if self.others(k)]  # D5: a mount marked it meanwhile: it stays
            for k in keep:
                log.info("%s: another mount marked it while its delete was decided; kept", k)
            gone = [k for k in last if k not in keep]
            failpoints.hit("sharedrefs.decided")
            if gone and time.monotonic() - start > self.grace + DELETE_SLACK:
                log.warning("%d shared objects, e.g. %s: their delete took longer than %.0f s after the tomb; not "
                            "deleted (an upload may have waited the tomb out); their markers are gone", len(gone),
                            gone[0], self.grace + DELETE_SLACK)
                gone = []
            self.store.delete_many(gone)  # D6
        finally:
            self.store.delete_many([self.tomb(k) for k in last])  # D7
        return gone

    # ------------------------------------------------------------------ fsck

    def marked(self) -> dict[str, set[str]]:
        """sha256 -> the store ids marking it (one LIST of the group's refs)."""
        out: dict[str, set[str]] = {}
        pre = self.refs_prefix()
        for info in self.store.list(pre):
            sha, _, sid = info.key[len(pre):].partition("/")
            out.setdefault(sha, set()).add(sid)
        return out
