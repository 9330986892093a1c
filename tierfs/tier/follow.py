"""Following read-only mounts: `tierfs mount --read-only --from URL --follow` refreshes every
`tiering.rpo_seconds` from the bucket's newest consistent point, so a reader node sees new data within the RPO.

Each refresh reads the snapshot pointer; for a new snapshot it applies the difference to the mounted cache, on
the trio thread between awaits (the engine's maps never change under a request):

* active files (append objects): the objects not applied yet are written into the local file (a refresh reads
  only what is new); a file that became a tiered segment since is served from its segment objects (its final
  bytes, which the last tail may predate);
* tiered files (sealed segments, and mutable files as blobs): new paths become new TIERED entries; a path whose
  objects changed (a checkpoint rewritten, a segment rewritten) gets a new entry, its old local blocks punched;
* paths gone from the snapshot (retention deleted them) are unlinked from the cache.

The kernel's cached pages, attributes and names of every changed path are invalidated (pyfuse3 notify calls,
from a worker thread: they write to /dev/fuse). A reader of a file being refreshed may see a mix of the two
points for that one file, as it would on the writer while the broker writes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from typing import TYPE_CHECKING

import crc32c
import pyfuse3
import trio

from tierfs.objectstore.base import ObjectStoreError
from tierfs.tier import appendlog
from tierfs.tier import snapshot as snap
from tierfs.tier.catalog import Entry

if TYPE_CHECKING:
    from tierfs.tier.engine import Engine

log = logging.getLogger("tierfs.follow")


@dataclasses.dataclass
class _Plan:
    """What one refresh changes, computed in a worker thread from the new snapshot."""

    seq: int
    time: float
    files: list[tuple[Entry, int, int, int]]
    tails: list[appendlog.TailRow]
    tree: list[tuple]


class Follower:
    def __init__(self, engine: Engine):
        self.eng = engine
        self.every = float(engine.config["tiering.rpo_seconds"]) or 10.0
        self.seq = int(engine.snapshot_info.get("seq") or 0)
        self.applied: dict[str, set[str]] = {}  # tail path -> append object keys already written locally
        self.local: set[str] = set()  # paths served from complete local bytes (tails, kept after sealing)
        self.refreshes = 0
        self.last_error = ""
        self.last_refresh = 0.0

    def status(self) -> dict:
        return {"follow_every_s": self.every, "seq": self.seq, "refreshes": self.refreshes,
                "last_refresh": self.last_refresh, "last_error": self.last_error}

    async def run(self) -> None:
        await trio.to_thread.run_sync(self._adopt_from_snapshot)
        while True:
            await trio.sleep(self.every)
            try:
                await self.refresh()
                self.last_error = ""
            except (ObjectStoreError, OSError, ValueError) as e:
                self.last_error = f"{time.strftime('%H:%M:%S')}: {e}"
                log.warning("follow refresh failed (%s); serving snapshot %d until the next one", e, self.seq)

    def _adopt_from_snapshot(self) -> None:
        """Which tails (and their objects) the cache was built with: from the snapshot.db prepare_readonly kept."""
        db = self.eng.state_dir / "snapshot.db"
        if not db.exists():
            return
        for t in snap.load_tails(db, self.eng.store_id, self.eng.state_dir.name, set()):
            self.local.add(t.path)
            self.applied[t.path] = {o.key for o in t.objects}

    async def refresh(self) -> bool:
        plan = await trio.to_thread.run_sync(self._plan, limiter=self.eng.limiter)
        if plan is None:
            return False
        changed = await self._apply(plan)
        await trio.to_thread.run_sync(self._invalidate, changed)
        self.seq = plan.seq
        self.eng.snapshot_info.update({"seq": plan.seq, "time": plan.time})
        self.refreshes += 1
        self.last_refresh = time.time()
        log.info("follow: now serving snapshot %d (%d paths changed)", plan.seq, len(changed))
        return True

    def _plan(self) -> _Plan | None:
        """Blocking: the newest snapshot, downloaded and validated, or None when it is the one served."""
        store, sid, state = self.eng.store, self.eng.store_id, self.eng.state_dir
        ptr = snap.read_pointer(store, sid)
        if ptr.seq == self.seq:
            return None
        data = store.get(ptr.key)
        if len(data) != ptr.size or crc32c.crc32c(data) != ptr.crc32c:
            raise ValueError(f"catalog snapshot {ptr.key} is corrupt (size or crc32c differ from its pointer)")
        tmp = state / "follow.db"
        tmp.write_bytes(data)
        try:
            files, tree = snap._load(tmp, sid, state.name)
            tails = snap.load_tails(tmp, sid, state.name, {e.path for e, *_ in files} | {t[0] for t in tree})
        finally:
            tmp.unlink(missing_ok=True)
        # tails: the new append objects are fetched here, written on the loop's turn (no await in between)
        return _Plan(ptr.seq, ptr.time, files, tails, tree)

    async def _apply(self, plan: _Plan) -> list[str]:
        eng = self.eng
        hot = eng.hot
        changed: list[str] = []
        for p, typ, mode, *_ in sorted(plan.tree, key=lambda r: r[0].count("/")):
            if typ == "d" and not (hot / p).is_dir():
                os.makedirs(hot / p, exist_ok=True)
                changed.append(p)
        keep: set[str] = {t[0] for t in plan.tree}
        for t in plan.tails:
            keep.add(t.path)
            new = [o for o in t.objects if o.key not in self.applied.get(t.path, set())]
            if t.path not in self.local:
                await self._drop_entry(t.path)
                await trio.to_thread.run_sync(self._create, t.path, t.size)
                self.local.add(t.path)
            elif not new and (hot / t.path).stat().st_size == t.size:
                continue
            row = dataclasses.replace(t, objects=tuple(new))
            await trio.to_thread.run_sync(self._write_tail, row, limiter=eng.limiter)
            self.applied.setdefault(t.path, set()).update(o.key for o in new)
            changed.append(t.path)
        fresh: list[Entry] = []
        for e, mode, uid, gid in plan.files:
            keep.add(e.path)
            cur = eng.entries.get(e.path)
            if e.path in self.local:
                # sealed since: the segment objects hold its final bytes, which the last tail may predate
                self.local.discard(e.path)
                self.applied.pop(e.path, None)
            elif cur is not None and cur.objects == e.objects and cur.size == e.size:
                continue
            await self._drop_entry(e.path)
            await trio.to_thread.run_sync(self._create, e.path, e.size)
            fresh.append(e)
            changed.append(e.path)
        if fresh:
            await self._add_entries(fresh)
        for rel in [r for r in list(eng.entries) if r not in keep] + [r for r in list(self.local) if r not in keep]:
            await self._drop_entry(rel)
            self.local.discard(rel)
            self.applied.pop(rel, None)
            try:
                os.unlink(hot / rel)
            except FileNotFoundError:
                pass
            changed.append(rel)
        marker = eng.state_dir / snap.MARKER
        try:
            body = json.loads(marker.read_text())
            body.update({"seq": plan.seq, "time": plan.time})
            marker.write_text(json.dumps(body) + "\n")
        except (OSError, ValueError):
            pass
        return changed

    def _create(self, rel: str, size: int) -> None:
        """A sparse local file of `size` (the old one, if any, replaced: a new inode, no stale blocks)."""
        p = self.eng.hot / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f".{p.name}.follow")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
        os.replace(tmp, p)

    def _write_tail(self, row: appendlog.TailRow) -> None:
        fd = os.open(self.eng.hot / row.path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            if os.fstat(fd).st_size != row.size:
                os.ftruncate(fd, row.size)
        finally:
            os.close(fd)
        appendlog.materialise(self.eng.store, self.eng.hot, row)

    async def _drop_entry(self, rel: str) -> None:
        eng = self.eng
        e = eng.entries.pop(rel, None)
        if e is None:
            return
        eng.drop(e)
        await eng.db(eng.catalog.remove, rel, [], 0.0)  # a reader never deletes objects: no keys queued

    async def _add_entries(self, fresh: list[Entry]) -> None:
        eng = self.eng
        first = await eng.db(eng.catalog.allocate, len(fresh))
        now = time.time()
        rows = []
        for i, e in enumerate(fresh):
            st = os.lstat(eng.hot / e.path)
            rows.append(dataclasses.replace(e, resident=bytearray((e.nblocks + 7) // 8), last_access=0.0,
                                            state_since=now, file_id=first + i, ino=st.st_ino))
        await eng.db(eng.catalog.put_many, rows, [], 0.0)
        for e in rows:
            if os.lstat(eng.hot / e.path).st_ino != e.ino:
                continue
            eng.files[e.file_id] = e
            eng.entries[e.path] = e
            eng.tiered[e.ino] = e

    def _invalidate(self, rels: list[str]) -> None:
        """Blocking: drop the kernel's cached names, attributes and pages of changed paths."""
        root = os.lstat(self.eng.hot).st_ino
        for rel in rels:
            parent, _, name = rel.rpartition("/")
            try:
                pst = os.lstat(self.eng.hot / parent) if parent else None
                pino = pyfuse3.ROOT_INODE if pst is None or pst.st_ino == root else pst.st_ino
                pyfuse3.invalidate_entry_async(pino, name.encode("utf-8", "surrogateescape"))
                try:
                    st = os.lstat(self.eng.hot / rel)
                    pyfuse3.invalidate_inode(st.st_ino, attr_only=False)
                except FileNotFoundError:
                    pass
            except OSError as e:
                log.debug("follow: invalidating %s: %s", rel, e)
