"""The janitor: deletes objects whose deletion the catalog scheduled, once their grace period is over (DESIGN §5).

Deletes are queued in the same transaction as the state change that orphans the objects (unlink, rewrite,
compaction swap) with a not-before time `delete.grace_seconds` ahead, so a reader that still holds the old row
(a read-only mount, a job) keeps working for that long. Objects a catalog snapshot still names, kept or being
taken, wait longer (tierfs.tier.references): the snapshotter is asked to roll, so the wait ends with the next
snapshots.
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import time
from typing import TYPE_CHECKING, ContextManager

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


def _may_delete(eng: Engine, keys: list[str]) -> ContextManager[list[str]]:
    """The due keys nothing else refers to, reserved while they are deleted (a store without snapshots has no
    referrers beyond the catalog)."""
    if eng.snapshotter is None:
        return contextlib.nullcontext(keys)
    return eng.snapshotter.references.may_delete(keys)


async def run_janitor(eng: Engine) -> None:
    while True:
        await trio.sleep(2.0)
        if not eng.store_writable():
            continue
        try:
            due = await eng.db(eng.catalog.due_deletes, time.time())
            with _may_delete(eng, due) as keys:  # a read-only mount or a takeover may still read the others
                if not keys:
                    continue
                eng.fence(keys[0])
                await eng.io(_fenced_delete, eng, keys)
                await eng.db(eng.catalog.deleted, keys)
            log.info("deleted %d objects", len(keys))
        except (ObjectStoreError, sqlite3.Error) as err:
            log.warning("object deletes failed (%s); will retry", err)
