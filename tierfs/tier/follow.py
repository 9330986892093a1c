"""Following read-only mounts: `tierfs mount --read-only --from URL --follow` refreshes every
`tiering.rpo_seconds` from the bucket's newest consistent point, so a reader node sees new data within the RPO.

Each refresh reads the snapshot pointer; for a new snapshot it applies the difference to the mounted cache, on
the trio thread between awaits (the engine's maps never change under a request):

* active files (append objects): the objects not applied yet are written into the local file in place, in
  offset order (a reader sees a longer prefix, as on the writer while the broker writes);
* files served from objects (sealed segments, and mutable files as blobs), and tails not local yet: a new local
  file is staged beside the old one (written whole, or sparse with its entry committed and registered first)
  and renamed over it, so every reader gets the old file or the new one, never a half-made one. The old inode
  keeps serving whoever holds it open (as after a rename over it on the writer); a segment that sealed is then
  served from its segment objects (its final bytes, which the last tail may predate);
* files are applied in the broker's own order (CommitLog, then ConsumeQueues and IndexFiles, then the rest);
* paths gone from the snapshot (retention deleted them) are unlinked from the cache.

The kernel's cached pages, attributes and names of every changed path are invalidated (pyfuse3 notify calls,
from a worker thread: they write to /dev/fuse).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import crc32c
import pyfuse3
import trio

from tierfs import failpoints
from tierfs.objectstore.base import ObjectStoreError
from tierfs.store.paths import Kind, classify
from tierfs.tier import appendlog
from tierfs.tier import snapshot as snap
from tierfs.tier.catalog import Entry, State

if TYPE_CHECKING:
    from tierfs.tier.engine import Engine

log = logging.getLogger("tierfs.follow")


_ORDER = {Kind.COMMITLOG: 0, Kind.DLEDGER_DATA: 0, Kind.DLEDGER_INDEX: 0, Kind.CONSUMEQUEUE: 1,
          Kind.BATCHCONSUMEQUEUE: 1, Kind.CONSUMEQUEUE_EXT: 1, Kind.INDEX: 2}


def apply_order(rel: str) -> tuple[int, str]:
    """The order a refresh applies files in, the broker's own: CommitLog (by offset), then the ConsumeQueues and
    IndexFiles built from it, then the rest (checkpoint, config). A reader never finds a later file's bytes
    without the earlier ones that were in the same point."""
    return _ORDER.get(classify(rel), 3), rel


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
        self.staging = engine.state_dir / "follow-staging"
        self.staged = 0
        # set by the FUSE layer (its HotDir), blocking, paths relative to the hot dir: rename a file over a name
        # and remove a name, each keeping the file that loses its last name pinned (fs/inodes.py); both return
        # the stat of the file the name had, or None
        self.replace_name: Callable[[str, str], os.stat_result | None] | None = None
        self.remove_name: Callable[[str], os.stat_result | None] | None = None
        # set by the FUSE layer: a name the daemon removed or gave to another file (the stat of the file that had
        # it); returns an fd held open on that file, or None
        self.name_gone: Callable[[str, os.stat_result], int | None] | None = None

    def status(self) -> dict:
        return {"follow_every_s": self.every, "seq": self.seq, "refreshes": self.refreshes,
                "last_refresh": self.last_refresh, "last_error": self.last_error}

    async def run(self) -> None:
        await trio.to_thread.run_sync(self._clear_staging)
        await trio.to_thread.run_sync(self._adopt_from_snapshot)
        while True:
            await trio.sleep(self.every)
            try:
                await self.refresh()
                self.last_error = ""
            except (ObjectStoreError, OSError, ValueError) as e:
                self.last_error = f"{time.strftime('%H:%M:%S')}: {e}"
                log.warning("follow refresh failed (%s); serving snapshot %d until the next one", e, self.seq)

    def _clear_staging(self) -> None:
        """Copies a refresh staged and never renamed (the daemon died in between) go."""
        self.staging.mkdir(mode=0o700, exist_ok=True)
        for p in self.staging.iterdir():
            p.unlink()

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
            files, tree = snap.load_snapshot(tmp, sid, state.name)
            tails = snap.load_tails(tmp, sid, state.name, {e.path for e, *_ in files} | {t[0] for t in tree})
        finally:
            tmp.unlink(missing_ok=True)
        # tails: the new append objects are fetched here, written on the loop's turn (no await in between)
        return _Plan(ptr.seq, ptr.time, files, tails, tree)

    async def _apply(self, plan: _Plan) -> list[str]:
        eng = self.eng
        changed: list[str] = []
        for p, typ, mode, *_ in sorted(plan.tree, key=lambda r: r[0].count("/")):
            if typ == "d" and not (eng.hot / p).is_dir():
                os.makedirs(eng.hot / p, exist_ok=True)
                changed.append(p)
        keep: set[str] = {t[0] for t in plan.tree}
        work: list[tuple[str, appendlog.TailRow | Entry]] = [(t.path, t) for t in plan.tails]
        work += [(e.path, e) for e, *_ in plan.files]
        for rel, item in sorted(work, key=lambda w: apply_order(w[0])):
            keep.add(rel)
            if await (self._apply_tail(item) if isinstance(item, appendlog.TailRow) else self._apply_file(item)):
                changed.append(rel)
        for rel in [r for r in list(eng.entries) if r not in keep] + [r for r in list(self.local) if r not in keep]:
            await self._remove(rel)
            changed.append(rel)
        marker = eng.state_dir / snap.MARKER
        try:
            body = json.loads(marker.read_text())
            body.update({"seq": plan.seq, "time": plan.time})
            marker.write_text(json.dumps(body) + "\n")
        except (OSError, ValueError):
            pass
        return changed

    async def _apply_tail(self, t: appendlog.TailRow) -> bool:
        """An active file: new append objects are written in place, in offset order (a reader sees a longer
        prefix, as on the writer); a file that was not local yet is written whole, then swapped in."""
        eng = self.eng
        if t.path in self.local:
            new = tuple(o for o in t.objects if o.key not in self.applied.get(t.path, set()))
            if not new and (eng.hot / t.path).stat().st_size == t.size:
                return False
            await trio.to_thread.run_sync(self._write_tail, dataclasses.replace(t, objects=new), limiter=eng.limiter)
            self.applied.setdefault(t.path, set()).update(o.key for o in new)
            return True
        tmp, _ = await trio.to_thread.run_sync(self._stage, t.path, t.size)
        try:
            await trio.to_thread.run_sync(appendlog.materialise, eng.store, eng.hot, t, tmp, limiter=eng.limiter)
            cur = eng.entries.get(t.path)
            if cur is not None:  # was served from objects: its row goes first, memory at the swap
                await eng.db(eng.catalog.remove, cur, [], 0.0)  # a reader never deletes objects: none queued
            await self._swap(t.path, tmp, None)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        self.local.add(t.path)
        self.applied[t.path] = {o.key for o in t.objects}
        return True

    async def _apply_file(self, e: Entry) -> bool:
        """A file served from its objects (a sealed segment, a mutable file's blob): new or changed, it gets a
        new entry on a new sparse local file, registered before the file takes the name."""
        eng = self.eng
        cur = eng.entries.get(e.path)
        if e.path not in self.local and cur is not None and cur.objects == e.objects and cur.size == e.size:
            return False
        tmp, ino = await trio.to_thread.run_sync(self._stage, e.path, e.size)
        try:
            first = await eng.db(eng.catalog.allocate, 1)
            row = dataclasses.replace(e, resident=bytearray((e.nblocks + 7) // 8), last_access=0.0,
                                      state_since=time.time(), file_id=first, ino=ino)
            # replaces the path's old row, if any, in the same transaction
            await eng.db(eng.catalog.put_many, [row], [], 0.0, (), (cur.file_id,) if cur is not None else ())
            eng.stage(row)  # the staged inode: nobody reaches it before the swap
            await self._swap(e.path, tmp, row)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        # sealed since it was a tail: the segment objects hold its final bytes, which the last tail may predate
        self.local.discard(e.path)
        self.applied.pop(e.path, None)
        return True

    async def _swap(self, rel: str, tmp: Path, new: Entry | None) -> None:
        """Give `rel` to the staged file in one rename, then (no await) point the maps at it. The inode that had
        the name keeps serving whoever holds it open: its entry lives on as an orphan until the last close."""
        eng = self.eng
        old = eng.entries.get(rel)
        await failpoints.pause("follow.swap")
        try:
            assert self.replace_name is not None
            old_st = await trio.to_thread.run_sync(self.replace_name, str(tmp.relative_to(eng.hot)), rel)
        except BaseException:
            if new is not None:
                eng.drop(new)
            raise
        if new is not None:
            eng.add(new)
        elif old is not None:
            eng.unname(old, rel)
        self._name_gone(rel, old, old_st)

    async def _remove(self, rel: str) -> None:
        """Gone from the writer's point (retention deleted it): the name goes, its row first; whoever holds the
        file open keeps reading it, as after an unlink on the writer."""
        eng = self.eng
        old = eng.entries.get(rel)
        if old is not None:
            await eng.db(eng.catalog.remove, old, [], 0.0)  # a reader never deletes objects: no keys queued
        assert self.remove_name is not None
        old_st = await trio.to_thread.run_sync(self.remove_name, rel)
        if old is not None:
            eng.unname(old, rel)
        self.local.discard(rel)
        self.applied.pop(rel, None)
        self._name_gone(rel, old, old_st)

    def _name_gone(self, rel: str, old: Entry | None, old_st: os.stat_result | None) -> None:
        """The file that had `rel` lost it: the FUSE layer forgets the name; its entry lives on as an orphan
        while the file is open (served through its open fds until the last close), else it goes."""
        held = self.name_gone(rel, old_st) if old_st is not None and self.name_gone is not None else None
        if old is None or self.eng.entries.get(rel) is old:
            return
        if held is not None and old.state is State.TIERED and self.eng.tiered.get(old.ino) is old:
            self.eng.keep_orphan(old, held)
        else:
            self.eng.drop(old)

    def _stage(self, rel: str, size: int) -> tuple[Path, int]:
        """Blocking: a new sparse file of `size` that will take `rel`'s name, in the state dir (the same file
        system, never listed through the mount). Returns it and its st_ino."""
        (self.eng.hot / rel).parent.mkdir(parents=True, exist_ok=True)
        self.staged += 1
        tmp = self.staging / f"{self.staged}"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, size)
            return tmp, os.fstat(fd).st_ino
        finally:
            os.close(fd)

    def _write_tail(self, row: appendlog.TailRow) -> None:
        fd = os.open(self.eng.hot / row.path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            if os.fstat(fd).st_size != row.size:
                os.ftruncate(fd, row.size)
        finally:
            os.close(fd)
        appendlog.materialise(self.eng.store, self.eng.hot, row)

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
