"""Writable takeover of a lost writer's store: `tierfs mount --takeover --from URL HOT_DIR MOUNTPOINT`.

On a machine with an empty HOT_DIR, before the engine opens its catalog:

1. take the writer lease (tierfs.tier.lease) — once the old one expired, or at once with `--force HOLDER`,
   which must name the holder in force. Taking it first fences the old writer: from the new epoch on, its
   snapshot pointer, uploads and deletes are refused (it checks the epoch in the store before each batch);
2. read the newest consistent point (catalog snapshot pointer, written last by the old writer's round);
3. build the hot dir: directories and symlinks; sealed segments as sparse files whose catalog rows are TIERED
   (fetched on demand, their pinned pages too: nothing is local here, the block cache keeps those pages in the
   hot file from their first read on); mutable files (checkpoint, config/*, IndexFiles) from their
   content-addressed blobs and active segments from their append objects, local and whole, every block checked by
   its crc32c (their upload offsets go into the catalog: the new writer's first round uploads only what changed
   since);
4. build the catalog: the TIERED rows (same file ids and objects), the old writer's queued deletes and the
   objects its referrers held (its open files and running jobs are gone with it), all queued, due after the
   grace period, and pipeline artifacts; and an id sequence moved far above the old writer's (ID_GAP);
5. queue every segment object in the store that the new catalog does not name (`_queue_unnamed`): the old writer's
   uploads and compactions after the point (their rows are not in it, and the new writer never learns of them)
   would otherwise stay in the bucket for good.
Deletion safety is the reference authority's (tierfs.tier.references): an imported delete of an object the new
catalog still names (a row, an active tail, a kept snapshot) is refused like any other.

An unmodified broker then starts on the mount: `abort` is present (the old one never shut down), so it runs its
abnormal recovery on a store that holds every byte that was durable `tiering.rpo_seconds` before the loss.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

import crc32c

from tierfs.objectstore import ObjectStore
from tierfs.objectstore.base import ObjectNotFound, ObjectStoreError
from tierfs.tier import appendlog, layout
from tierfs.tier import snapshot as snap
from tierfs.tier.catalog import Catalog, Entry
from tierfs.tier.lease import WriterLease

log = logging.getLogger("tierfs.takeover")

MARKER = "takeover.json"
# Key naming, not deletion safety: object keys carry the file id / generation (tierfs.tier.layout), and the old
# writer may still allocate ids and put objects between its last point and the moment the lease fences it. The new
# sequence starts this far above the point's, so no key the new writer puts can be one the old writer wrote with
# other content: two writers never give two contents one name. (Whether an object may be deleted is decided by
# the reference authority alone.)
ID_GAP = 1_000_000


@dataclass(frozen=True)
class TakeoverSpec:
    """From the command line: the holder --force overrides (None: wait for the ttl), the mountpoint."""

    force: str | None
    mountpoint: str


class TakeoverError(ValueError):
    """A takeover that cannot go ahead, saying why and what to do."""


def _check_empty(hot: Path, state: Path) -> None:
    others = sorted(p.name for p in os.scandir(hot) if Path(p.path) != state)
    if others:
        raise TakeoverError(f"--takeover needs an empty HOT_DIR; {hot} holds {', '.join(others[:5])}"
                            f"{' ...' if len(others) > 5 else ''} (use a new directory)")


def _write_blob_file(store: ObjectStore, hot: Path, e: Entry) -> int:
    """Download a mutable file's blobs into its sparse local file, every block checked; restore its mtime."""
    fd = os.open(hot / e.path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        off = 0
        for key in e.objects:
            data = store.get(key)
            n = min(e.chunk_bytes, e.size - off)
            if len(data) != n:
                raise TakeoverError(f"blob {key} of {e.path} has {len(data)} bytes, the snapshot says {n}")
            first = off // e.block_bytes
            mv = memoryview(data)
            for i, b in enumerate(range(0, n, e.block_bytes)):
                if crc32c.crc32c(mv[b:b + e.block_bytes]) != e.block_crcs[first + i]:
                    raise TakeoverError(f"blob {key} of {e.path} is corrupt: block {first + i} fails its crc32c")
            if data.strip(b"\0"):  # all-zero chunks stay holes
                os.pwrite(fd, data, off)
            off += n
        os.fsync(fd)
        os.utime(fd, ns=(e.mtime_ns, e.mtime_ns))
    finally:
        os.close(fd)
    return e.size


def _catalog(state: Path, snap_db: Path, tiered: list[Entry], grace: float, tails: list[tuple]) -> int:
    """The new writer's catalog: TIERED rows, the old writer's queued deletes and artifacts, ids moved up, and the
    upload offsets of the active tails (their append objects are the point's: the first round resumes from them)."""
    path = state / "catalog.db"
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    now = time.time()
    cat = Catalog(path)
    seen: set[int] = set()  # a snapshot of an earlier version may repeat an id: such a row is numbered anew

    def own_id(e: Entry) -> int:
        fid = e.file_id if e.file_id not in seen else 0
        seen.add(e.file_id)
        return fid

    try:
        cat.put_many([dataclasses.replace(e, resident=bytearray((e.nblocks + 7) // 8), last_access=0.0,
                                          state_since=now, ino=0, file_id=own_id(e)) for e in tiered], [], 0.0)
        cat.save_tails(tails)
    finally:
        cat.close()
    db = sqlite3.connect(str(path), isolation_level=None)
    try:
        db.execute("ATTACH DATABASE ? AS old", (str(snap_db),))
        have = {r[0] for r in db.execute("SELECT name FROM old.sqlite_master WHERE type='table'")}
        db.execute("BEGIN")
        if "pending_deletes" in have:
            db.execute("INSERT OR IGNORE INTO pending_deletes SELECT key, ? FROM old.pending_deletes", (now + grace,))
        if "object_refs" in have:  # held by the old writer's open files and jobs, which ended with it
            db.execute("INSERT OR IGNORE INTO pending_deletes SELECT DISTINCT key, ? FROM old.object_refs",
                       (now + grace,))
        if "artifacts" in have:
            db.execute("INSERT OR IGNORE INTO artifacts SELECT * FROM old.artifacts")
        old_next = 1
        if "meta" in have:
            r = db.execute("SELECT v FROM old.meta WHERE k='next_id'").fetchone()
            old_next = int(r[0]) if r else 1
        top = db.execute("SELECT coalesce(max(file_id), 0), coalesce(max(generation), 0) FROM files").fetchone()
        nxt = max(old_next, *top) + ID_GAP
        db.execute("INSERT OR REPLACE INTO meta VALUES ('next_id', ?)", (str(nxt),))
        db.execute("COMMIT")
        db.execute("DETACH DATABASE old")
    finally:
        db.close()
    return nxt


def _queue_unnamed(store: ObjectStore, store_id: str, state: Path, not_before: float) -> int:
    """Queue, due at `not_before`, every object under the store's seg/ and cas/ that no row or artifact of the new
    catalog
    names: nothing of this writer exists yet, so each is the lost writer's, put after the point or queued by it
    before (the queue entry is the same). The reference authority still decides: a key a kept snapshot names
    waits for it."""
    cat = Catalog(state / "catalog.db")
    try:
        named = {k for e in cat.load_all() for k in e.all_objects()} | {k for a in cat.artifacts() for k in a.keys}
        unnamed = [i.key for pre in layout.object_prefixes(store_id) for i in store.list(pre)
                   if i.key not in named]
        cat.queue_deletes(unnamed, not_before)
    finally:
        cat.close()
    return len(unnamed)


def prepare_takeover(store: ObjectStore, store_id: str, hot: Path, state: Path, spec: TakeoverSpec,
                     ttl: float, grace: float) -> dict:
    """Take the lease and bring HOT/STATE up from the newest consistent point. Blocking; TakeoverError,
    LeaseHeld or SnapshotError say what stops it."""
    marker = state / MARKER
    if marker.exists():
        info = json.loads(marker.read_text())
        if info.get("done"):
            log.info("hot dir %s was already taken over from snapshot %s; serving it", hot, info.get("seq"))
            return info
        snap.wipe_local(hot, state)  # a takeover that stopped halfway: start again
    _check_empty(hot, state)
    try:
        return _take_over(store, store_id, hot, state, spec, ttl, grace, marker)
    except ObjectStoreError as e:
        raise TakeoverError(f"takeover of store id {store_id!r} at {store.url} failed: {e}") from None


def _take_over(store: ObjectStore, store_id: str, hot: Path, state: Path, spec: TakeoverSpec, ttl: float,
               grace: float, marker: Path) -> dict:
    t0 = time.monotonic()
    lease = WriterLease(store, store_id, hot, Path(spec.mountpoint), ttl)
    cur = lease.current()
    lease.acquire(force=spec.force)  # LeaseHeld names the holder and how to override it
    marker.write_text(json.dumps({"done": False, "epoch": lease.epoch}) + "\n")
    ptr = snap.read_pointer(store, store_id)
    try:
        data = store.get(ptr.key)
    except (ObjectNotFound, ObjectStoreError) as e:
        raise snap.SnapshotError(f"cannot download catalog snapshot {ptr.seq}: {e}") from None
    if len(data) != ptr.size or crc32c.crc32c(data) != ptr.crc32c:
        raise snap.SnapshotError(f"catalog snapshot {store.url}/{ptr.key} is corrupt (size or crc32c differ from "
                                 f"its pointer)")
    snap_db = state / "takeover-snapshot.db"
    snap_db.write_bytes(data)
    files, tree = snap.load_snapshot(snap_db, store_id, state.name)
    tails = snap.load_tails(snap_db, store_id, state.name, {e.path for e, *_ in files} | {t[0] for t in tree})
    # a hard-linked file is one inode here as on the writer: its further names are link(2)s of the name its
    # content comes by, and only that name's row is read (a tiered row, a blob, a tail)
    hard_links = snap.load_links(snap_db, {e.path for e, *_ in files} | {t.path for t in tails})
    snap.build_tree(hot, files + [snap.tail_stub(t) for t in tails], tree, hard_links)
    tails = [t for t in tails if t.path not in hard_links]
    bpre = snap.blob_prefix(store_id)
    tiered: list[Entry] = []
    linked: dict[tuple, Entry] = {}  # a point without snapshot_links: a tiered file's names share its file id
    local_bytes = 0
    try:
        for e, *_ in files:
            if e.path in hard_links:
                continue
            if e.objects and all(k.startswith(bpre) for k in e.objects):
                local_bytes += _write_blob_file(store, hot, e)  # a mutable (or not yet sealed) file: local
            elif e.objects:
                same = linked.get((e.file_id, e.generation, tuple(e.objects)))
                if same is not None and e.file_id:
                    os.unlink(hot / e.path)  # the sparse file build_tree made for this name
                    os.link(hot / same.path, hot / e.path)
                    continue
                linked[(e.file_id, e.generation, tuple(e.objects))] = e
                tiered.append(e)  # a sealed segment: remote, fetched on demand
        for t in tails:
            local_bytes += appendlog.materialise(store, hot, t)
    except (ObjectStoreError, ValueError) as e:
        raise TakeoverError(f"takeover from snapshot {ptr.seq} failed: {e}; the hot dir is rebuilt next time")
    offsets = [(t.path, os.lstat(hot / t.path).st_ino, max((o.end for o in t.objects), default=0), t.slots,
                appendlog.encode_objects(t.objects)) for t in tails]
    nxt = _catalog(state, snap_db, tiered, grace, offsets)
    unnamed = _queue_unnamed(store, store_id, state, time.time() + grace)
    snap_db.unlink(missing_ok=True)
    info = {"done": True, "seq": ptr.seq, "time": ptr.time, "writer": ptr.writer, "epoch": lease.epoch,
            "overrode": cur.holder if cur is not None and cur.live(time.time()) else "",
            "files_local": sum(e.path not in hard_links for e, *_ in files) - len(tiered) + len(tails),
            "files_tiered": len(tiered),
            "bytes_local": local_bytes, "next_id": nxt, "unnamed_objects_queued": unnamed,
            "seconds": round(time.monotonic() - t0, 3), "age_s": round(time.time() - ptr.time, 3)}
    marker.write_text(json.dumps(info) + "\n")
    log.warning("took over store id %s from snapshot %d (taken %.1f s ago by %s): %d files local (%d bytes), "
                "%d tiered, lease epoch %d%s", store_id, ptr.seq, info["age_s"], ptr.writer, info["files_local"],
                local_bytes, len(tiered), lease.epoch, f", overriding {info['overrode']}" if info["overrode"] else "")
    return info
