"""The janitor: the one deleter of queued objects, once the reference authority says nothing refers to them.

Deletes are queued in the same transaction as the change that orphans the objects (unlink, rewrite, compaction
swap, a job released, append objects retired) with a not-before time `delete.grace_seconds` ahead, so a reader
that still holds the old row (a read-only mount, a job) keeps working for that long. Each pass asks
tierfs.tier.references which due keys nothing refers to (live rows, held files, running jobs, active tails,
published and in-flight snapshots), in one catalog transaction; keys a snapshot still names wait, and the
snapshotter is asked to roll, so the wait ends with the next snapshots.

A broker group's shared chunk (upload.dedup_group) that this mount lets go is not simply deleted: other mounts may
rely on it, so tierfs.tier.sharedrefs drops this mount's marker and deletes the object only when no other mount's
marker remains (its tombstone protocol). Those keys take a thread of their own (the grace is a wait).
"""

from __future__ import annotations

import logging
import sqlite3
import time
from typing import TYPE_CHECKING

import trio

from tierfs.objectstore.base import ObjectStoreError

if TYPE_CHECKING:
    from tierfs.tier.engine import Engine

log = logging.getLogger("tierfs.tier")


def _fenced_delete(eng: Engine, keys: list[str]) -> None:
    """Blocking: delete only while the store itself says the lease epoch is ours (a writer taken over
    meanwhile must not delete what the new one serves)."""
    if eng.lease is not None:
        eng.lease.verify()
    eng.store.delete_many(keys)


def _fenced_release(eng: Engine, keys: list[str]) -> None:
    """Blocking: as _fenced_delete, for a group's shared chunks (this mount's markers go; the objects too when
    no other mount marks them)."""
    if eng.lease is not None:
        eng.lease.verify()
    gone = eng.shared.release(keys)
    if gone:
        log.info("deleted %d shared objects of group %s no mount marks any more", len(gone), eng.shared.group)


async def sweep(eng: Engine) -> int:
    """One pass: delete what the authority lets go; returns how many objects went."""
    refs = eng.references
    keys = await eng.db(refs.claim, time.time())
    if not keys:
        return 0
    shared = [k for k in keys if eng.shared is not None and eng.shared.owns(k)]
    own = [k for k in keys if k not in set(shared)]
    try:
        eng.fence(keys[0])
        if own:
            await eng.io(_fenced_delete, eng, own)
        if shared:
            await trio.to_thread.run_sync(_fenced_release, eng, shared)
    except BaseException:
        refs.done(keys, deleted=False)  # memory only: released at once, retried next pass
        raise
    await eng.db(refs.done, keys, True)
    if eng.appendlog is not None:
        eng.appendlog.note_deleted(keys)
    return len(keys)


async def run_janitor(eng: Engine) -> None:
    while True:
        await trio.sleep(2.0)
        if not eng.store_writable():
            continue
        try:
            n = await sweep(eng)
            if n:
                log.info("deleted %d objects", n)
        except (ObjectStoreError, sqlite3.Error) as err:
            log.warning("object deletes failed (%s); will retry", err)
