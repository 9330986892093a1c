"""The tiering engine: the one owner of file state, and the supervisor of the parts that act on it (DESIGN §4-§12).

The hot dir stays the single local home of every file: a tiered segment keeps its hot file at its true size,
and eviction punches holes in it, so `open` always has a real fd and mmap, stat and unlink behave as before.

State: `files` holds every catalog entry by its file id (from the catalog's one sequence: never reused, survives
rename, stamped on the hot inode: tierfs.tier.identity); `by_ino` (by hot-dir st_ino: what the FUSE front knows a
file by, whatever name it was opened by), `entries` (by current name: a derived index the namespace keeps),
`tiered` (TIERED entries by st_ino, the FUSE fast path) and `orphans` (unlinked while open) are indexes into it.
Every name change goes through tierfs.tier.namespace.

Every state change is one catalog transaction on a detached copy of
the row (`Entry.copy`), applied to the live entry and the indexes by the engine's state-change methods (`apply`,
`set_resident`, `add`/`stage`/`rename`/`unname`/`orphan`/`drop`) only after the commit, and re-checked after every
await: a file may have been written, renamed or unlinked meanwhile. The parts never assign an index, the cache
budget or a committed field of a live entry themselves (readers keep only `pins` and `last_access`).

The parts, each in its own module, all working on this state:
  sealer.Sealer          finds finished segments and seals them
  uploader.Uploader      uploads, verifies and commits them TIERED; sweeps stale multipart uploads
  blockcache.BlockCache  serves reads of tiered segments (fetch, verify, read-ahead); writes turn them HOT
  evictor.Evictor        keeps local copies under the cache budget; persists residency after fdatasync
  janitor.run_janitor    deletes objects after their grace period
  compaction.Compactor, snapshot.Snapshotter, lease.WriterLease: jobs, catalog snapshots, the writer lease
  appendlog.AppendLog    continuous tiering of active files every tiering.rpo_seconds
  takeover / follow.Follower  a writable takeover of a lost writer's store; a read-only mount that follows it
Every background loop runs under `supervise`: a failure is logged, counted and restarted, never fatal.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import stat
import time
import uuid
from pathlib import Path
from typing import Callable

import trio

from tierfs.config import Config
from tierfs.objectstore import ObjectStore, open_store
from tierfs.objectstore.base import ObjectStoreError
from tierfs.tier import snapshot
from tierfs.tier import storeconfig
from tierfs.tier.appendlog import AppendLog
from tierfs.tier.blockcache import BlockCache
from tierfs.tier.catalog import Catalog, Entry, State
from tierfs.tier.compaction import Compactor
from tierfs.tier.evictor import Evictor
from tierfs.tier.flusher import Flusher
from tierfs.tier.follow import Follower
from tierfs.tier.janitor import run_janitor
from tierfs.tier import identity
from tierfs.tier.lease import WriterLease
from tierfs.tier.namespace import Namespace, storable
from tierfs.tier.primer import Primer
from tierfs.tier.references import UPLOAD, References
from tierfs.tier.sealer import Sealer
from tierfs.tier.sharedrefs import SharedRefs
from tierfs.tier.spacereserve import SpaceReserve
from tierfs.tier.state import EngineStats, ReadFailed, TieredIndex, WorkerStats
from tierfs.tier.takeover import TakeoverSpec, prepare_takeover
from tierfs.tier.uploader import Uploader

log = logging.getLogger("tierfs.tier")

ENGINE_FDS = 1024  # open fds of tiered hot files the engine keeps (least recently used closed first)


class Engine:
    def __init__(self, hot_dir: Path, state_dir: Path, config: Config, read_only: bool = False,
                 takeover: TakeoverSpec | None = None, follow: bool = False):
        self.hot = hot_dir
        self.state_dir = state_dir
        self.config = config
        self.enabled = bool(config["tiering.enabled"])
        self.block = int(config["cache.block_bytes"])
        self.chunk = int(config["objectstore.chunk_bytes"])
        self.unit = int(config["cache.verify_bytes"])  # 0: no finer verification table
        if self.unit and (self.block % self.unit or self.unit < 512):
            from tierfs.config import ConfigError

            raise ConfigError(f"config key 'cache.verify_bytes': {self.unit} does not divide cache.block_bytes "
                              f"({self.block}); allowed: 0 (no tables, whole blocks only), or a power of two from 512 "
                              f"up to cache.block_bytes that divides it")
        if self.chunk % self.block:
            from tierfs.config import ConfigError

            raise ConfigError(f"config key 'objectstore.chunk_bytes': {self.chunk} is not a multiple of "
                              f"cache.block_bytes ({self.block}); allowed: a multiple of cache.block_bytes")
        self.store: ObjectStore = open_store(self.store_url(), **self.store_options())
        self.store_id = config["store.id"] or self._persistent_store_id()
        self.shared = self._shared_refs()  # upload.dedup_group: a group's chunks shared with other mounts
        # read-only (tierfs.tier.snapshot): every file is a TIERED row of the bucket's newest catalog snapshot,
        # built into the state dir before the catalog opens; nothing is sealed, uploaded, deleted or snapshotted
        self.read_only = read_only
        self.snapshot_info = snapshot.prepare_readonly(self.store, self.store_id, hot_dir, state_dir) \
            if read_only else {}
        # --takeover (tierfs.tier.takeover): the lease, then the hot dir and catalog from the newest point
        self.takeover_info = prepare_takeover(self.store, self.store_id, hot_dir, state_dir, takeover,
                                              float(config["lease.ttl_seconds"]),
                                              float(config["delete.grace_seconds"])) if takeover else {}
        reserve = None if read_only else SpaceReserve(state_dir / "catalog.reserve",
                                                      int(config["mount.catalog_reserve_bytes"]))
        self.catalog = Catalog(state_dir / "catalog.db", reserve)
        self.lease: WriterLease | None = None  # writable mounts: set by take_lease() before serving
        if not read_only:  # a read-only cache is no hot dir for `tierfs fsck` to check (or repair) the store by
            storeconfig.save(state_dir, self.store_url(), self.store_options(), self.store_id,
                             config["upload.dedup_group"])  # for `tierfs fsck`
        self.files: dict[int, Entry] = {}  # every entry, by file id: the one owner
        self.by_ino: dict[int, Entry] = {}  # live entries by hot-dir st_ino (named, or held open after unlink)
        self.entries: dict[str, Entry] = {}  # entries that have a name, by their current path (derived)
        self.tiered = TieredIndex()  # TIERED entries by hot-dir st_ino: the FUSE fast path
        self.orphans: dict[int, Entry] = {}  # unlinked while open: served through open fds until the last close
        # engine-owned O_RDWR fds of tiered hot files, by file id: named files in a bounded LRU (a store has
        # tens of thousands of tiered files, the fd limit is far lower), reopened by path when needed again;
        # held files (unlinked while open) apart, since nothing could reopen them
        self._fds: collections.OrderedDict[int, int] = collections.OrderedDict()
        self._held_fds: dict[int, int] = {}
        self.mountpoint: Path | None = None  # the sealer flushes quiet segments through the mount (mount.py sets it)
        self.flusher_pids: set[int] = set()  # our own flusher process (tierfs.tier.flusher) while it runs
        self.workers = WorkerStats()
        self.flusher = Flusher(self.flusher_pids, self.workers)  # fsyncs through the mount, from one child process
        # reads ahead of writers of preallocated files through the mount, from another child (the FUSE front asks)
        self.primer = Primer(self.workers, int(config["mount.write_prime_kb"]) << 10)
        # what the FUSE front saw, by hot-dir st_ino: a write voids a seal or upload in flight (write_seq moves)
        self.last_write: dict[int, float] = {}
        self.last_fsync: dict[int, float] = {}
        self.write_seq: dict[int, int] = {}
        self._writes = 0
        self.store_roots: list[str] = [""]  # the store roots the sealer's last scan found (tierfs.tier.storeroots)
        self.cache_bytes = 0  # resident bytes of tiered segments (the evictor's budget)
        self.limiter = trio.CapacityLimiter(int(config["objectstore.max_concurrency"]))
        self.db_limiter = trio.CapacityLimiter(1)
        self.stats = EngineStats()
        # metrics hook (tierfs.metrics): observe(event, seconds, bytes) for "upload" and "download"
        self.observe: Callable[[str, float, int], None] = lambda event, seconds, nbytes: None
        self.store_down_since: float | None = None
        self._nursery: trio.Nursery | None = None
        self.sealer = Sealer(self)
        self.namespace = Namespace(self)
        self.uploader = Uploader(self)
        self.cache = BlockCache(self)
        self.evictor = Evictor(self)
        self.compactor = Compactor(self)
        # no snapshots into the embedded default store: it lives in the hot dir, where no reader can reach it
        self.references = References(self.catalog, snapshots=not read_only and bool(config["objectstore.url"]))
        self.snapshotter = snapshot.Snapshotter(self) if not read_only and config["objectstore.url"] else None
        # continuous tiering of active files (tierfs.tier.appendlog): needs the snapshots that name them
        self.appendlog = AppendLog(self) if self.snapshotter is not None and self.enabled \
            and float(config["tiering.rpo_seconds"]) > 0 else None
        # --read-only --follow (tierfs.tier.follow): the newest consistent point, every rpo_seconds
        self.follower = Follower(self) if read_only and follow else None

    # ------------------------------------------------------------------ set-up

    def take_lease(self, mountpoint: Path) -> None:
        """A writable mount holds the store id's writer lease (tierfs.tier.lease): raises LeaseHeld when another
        mount holds it. A store that cannot be reached now does not stop the mount: uploads wait for the lease."""
        self.lease = WriterLease(self.store, self.store_id, self.hot, mountpoint,
                                 float(self.config["lease.ttl_seconds"]))
        try:
            self.lease.acquire()
        except ObjectStoreError as err:
            self.lease.last_error = f"lease not taken at mount: {err}"
            log.error("could not take the writer lease (%s); uploads, deletes and snapshots wait until it is held",
                      err)

    def store_writable(self) -> bool:
        """May this daemon write to the object store now (uploads, deletes, snapshots)? Only under the lease."""
        return not self.read_only and (self.lease is None or self.lease.held())

    def _shared_refs(self) -> SharedRefs | None:
        group = self.config["upload.dedup_group"]
        if not group:
            return None
        try:
            return SharedRefs(self.store, self.store_id, group, float(self.config["upload.dedup_group_grace_seconds"]))
        except ValueError:
            from tierfs.config import ConfigError

            raise ConfigError(f"config key 'upload.dedup_group': {group!r} is not a group name; allowed: 1 to 128 "
                              "letters, digits, '.', '_' or '-'") from None

    def store_url(self) -> str:
        return self.config["objectstore.url"] or f"file://{self.state_dir / 'objects'}"

    def store_options(self) -> dict:
        c = self.config
        if not self.store_url().startswith("s3://"):
            return {"endpoint_url": c["objectstore.endpoint_url"] or None}
        return {k: v for k, v in {
            "endpoint_url": c["objectstore.endpoint_url"] or None,
            "region": c["objectstore.region"] or None,
            "addressing": c["objectstore.addressing"],
            "payload_signing": c["objectstore.payload_signing"],
            "access_key": c["objectstore.access_key_id"] or None,
            "secret_key": c["objectstore.secret_access_key"] or None,
            "max_attempts": c["objectstore.max_attempts"],
            "max_pool_connections": max(c["objectstore.max_concurrency"], 10),
            "read_timeout": max(min(c["objectstore.read_timeout_seconds"], 30.0), 1.0),
        }.items()}

    def _persistent_store_id(self) -> str:
        f = self.state_dir / "store-id"
        try:
            return f.read_text().strip()
        except FileNotFoundError:
            sid = uuid.uuid4().hex[:16]
            f.write_text(sid + "\n")
            return sid

    async def db(self, fn: Callable, *args):
        """Run a catalog call in the one catalog thread: transactions run in the order they were queued."""
        return await trio.to_thread.run_sync(fn, *args, limiter=self.db_limiter)

    async def io(self, fn: Callable, *args):
        """Run a blocking object-store call in a worker thread, within objectstore.max_concurrency."""
        return await trio.to_thread.run_sync(fn, *args, limiter=self.limiter)

    def reconcile(self) -> None:
        """On mount: load the catalog and find each row's hot file *by identity* (its inode and the file id
        stamped on it; tierfs.tier.identity), wherever it is now: a rename the catalog did not see (a crash
        between the hot-dir rename and its commit, a directory renamed while unmounted) moves the row's path, it
        never loses the file. A row whose file is gone, or changed behind the daemon's back (other size, or a
        sealed file written since), no longer describes it: the row goes, and a file that is still there is HOT
        again for the sealer to look at afresh. Then resume what was in flight."""
        now = time.time()
        grace = float(self.config["delete.grace_seconds"])
        if not self.read_only:
            held = self.catalog.release_held_deletes(now + grace)
            if held:
                log.info("%d object deletes held for files open at the last unmount fall due in %.0f s", held, grace)
            # uploads the last daemon did not finish (tierfs.tier.uploader): what they put goes unless a row names it
            put = self.references.release_all(UPLOAD, now + grace)
            if put:
                log.info("%d objects of uploads the last daemon did not finish are queued for deletion", put)
        trusted = self.catalog.get_meta("identity") == "stamped"
        rows = self.catalog.load_all()
        found: dict[int, tuple[str, os.stat_result, int | None]] = {}  # file id -> (path, lstat, stamp)
        lost: list[Entry] = []
        for e in rows:
            hit = self._identify(e, e.path, trusted)
            if hit is not None:
                found[e.file_id] = hit
            else:
                lost.append(e)
        if lost:  # renamed behind the catalog's back: one walk of the hot dir, by inode number
            inos = {e.ino for e in lost if e.ino}
            paths = identity.paths_of(self.hot, self.state_dir, inos) if inos else {}
            still: list[Entry] = []
            for e in lost:
                hit = next((h for p in paths.get(e.ino, ()) if (h := self._identify(e, p, trusted)) is not None),
                           None)
                if hit is None:
                    still.append(e)
                else:
                    log.warning("%s was renamed to %s while the catalog did not know: the row follows the file",
                                e.path, hit[0])
                    found[e.file_id] = hit
            lost = still
        moves: list[tuple[int, str]] = []
        unstamped: list[tuple[str, int, int]] = []
        for e in rows:
            if e.file_id not in found:
                continue
            path, st, stamp = found[e.file_id]
            if path != e.path:
                if storable(path):  # (a name that is not UTF-8 is found again at each mount)
                    moves.append((e.file_id, path))
                e.path = path
            changed = self._changed_while_unmounted(e, st)
            if changed and not self.read_only:
                log.warning("%s changed behind the daemon's back (%s): its catalog row (%s, gen %d) is dropped "
                            "and the file is sealed again from its local bytes", e.path, changed, e.state.value,
                            e.generation)
                self.catalog.remove(e, e.all_objects(), now + grace, artifacts=("cidx",))
                continue
            if stamp != e.file_id and not self.read_only:
                unstamped.append((str(self.hot / e.path), st.st_ino, e.file_id))
            e.ino = st.st_ino
            self.add(e)
            if e.state in (State.SEALED, State.UPLOADING):
                self.uploader.enqueue(e)
            elif e.state is State.TIERED:
                if len(e.resident) != (e.nblocks + 7) // 8:
                    e.resident = bytearray((e.nblocks + 7) // 8)
                self._serve(e)
        for e in lost:
            if self.read_only:  # the objects belong to the writer; never queue their deletion from here
                log.error("read-only cache: %s is missing from the local tree; not served", e.path)
                continue
            if os.path.lexists(self.hot / e.path):
                log.warning("%s changed behind the daemon's back (another file has its name, file id %d's is "
                            "gone): its catalog row is dropped, its objects deleted, and the file there is sealed "
                            "from its own bytes", e.path, e.file_id)
            else:
                log.warning("catalog row %s (file id %d) has no hot file (deleted while unmounted); deleting its "
                            "objects", e.path, e.file_id)
            self.catalog.remove(e, e.all_objects(), now + grace, artifacts=("cidx",))
        if unstamped:  # rows of an earlier version or a takeover: stamped before they count
            for path, file_id in identity.stamp_all(unstamped):
                log.warning("could not stamp the identity of %s (file id %d)", path, file_id)
        if (moves or not trusted) and not self.read_only:  # paths found anew; once, the mark: every file stamped
            self.catalog.apply_namespace(moves, [], [])
            self.catalog.set_meta("identity", "stamped")
        log.info("catalog: %d rows, %d tiered, %d to upload, %d deletes pending%s", len(self.files),
                 len(self.tiered), len(self.uploader.queue), self.catalog.pending_delete_count(),
                 f", {len(moves)} found under new names" if moves else "")

    def _identify(self, e: Entry, path: str, trusted: bool) -> tuple[str, os.stat_result, int | None] | None:
        """Blocking: is the hot file at `path` the file of row `e`? (path, lstat, its stamp) if so. A row with
        no inode yet (a takeover's or a read-only cache's, built from a snapshot) is bound by its path once."""
        try:
            st = os.lstat(self.hot / path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        if not stat.S_ISREG(st.st_mode):
            return None
        if self.read_only:  # a read-only cache's tree is the daemon's own, built from the snapshot's paths
            return path, st, None
        stamp = identity.read(str(self.hot / path))
        if not trusted:  # a catalog from before stamps (or one a takeover built): stamps here are not its own
            return (path, st, stamp) if (st.st_ino == e.ino if e.ino else True) else None
        if not e.ino and stamp is None:  # built from a snapshot and its stamp failed (no xattrs): by its path
            return path, st, stamp
        return (path, st, stamp) if identity.matches(st.st_ino, stamp, e.ino, e.file_id) else None

    @staticmethod
    def _changed_while_unmounted(e: Entry, st: os.stat_result) -> str:
        """Why a row no longer matches its (identified) hot file, or ''. A TIERED file's local bytes are holes and
        pinned pages, so only its size can be checked; a SEALED one must still be exactly what sealed."""
        if e.state is State.HOT:
            return ""
        if st.st_size != e.size:
            return f"size {st.st_size}, was {e.size}"
        if e.state is not State.TIERED and st.st_mtime_ns != e.mtime_ns:
            return "written since it was sealed"
        return ""

    # ------------------------------------------------------------------ the one state-change path
    # Every change of a live entry and of the indexes goes through these methods, after its commit (or, for
    # residency, after the bytes are in the hot file): the parts never assign them, so the indexes, the cache
    # budget and the entries cannot disagree.

    def add(self, e: Entry) -> None:
        """Index a live entry (committed already) by its id, its hot inode and its current name."""
        self.files[e.file_id] = e
        if e.ino:
            self.by_ino[e.ino] = e
        self.entries[e.path] = e

    def stage(self, e: Entry) -> None:
        """Index a committed TIERED entry by id and inode but by no name yet: its hot file is staged and nobody
        reaches it before the rename that names it (`add` then)."""
        self.files[e.file_id] = e
        self.by_ino[e.ino] = e
        self._serve(e)

    def apply(self, e: Entry, row: Entry, serve: bool = False) -> None:
        """A committed row reaches the live entry `e`. Leaving TIERED, `e` leaves the tiered index and the cache
        budget; TIERED to TIERED (a compaction swap), its residency stays the memory's (the hot file's bytes are
        unchanged; the row's bits are only what is durable); `serve`: the row is TIERED and the hot file matches it,
        so reads go through the tiered path from now on."""
        served = self.tiered.get(e.ino) is e
        if served and row.state is not State.TIERED:
            del self.tiered[e.ino]
            self.cache_bytes -= e.resident_bytes()
            served = False
        resident = e.resident
        self._become(e, row)
        if served:
            e.resident = resident
        elif serve and row.state is State.TIERED and self.is_live(e):
            self._serve(e)

    def _serve(self, e: Entry) -> None:
        self.tiered[e.ino] = e
        self.cache_bytes += e.resident_bytes()

    def set_resident(self, e: Entry, block: int, yes: bool) -> int:
        """Block `block` of tiered `e` is now in its hot file (its bytes written) or not (about to be punched):
        the bit and the cache budget together. Returns the bytes it changed the budget by."""
        if e.is_resident(block) == yes:
            return 0
        e.set_resident(block, yes)
        delta = e.block_len(block) if yes else -e.block_len(block)
        if self.tiered.get(e.ino) is e:
            self.cache_bytes += delta
        return delta

    def rename(self, moves: list[tuple[Entry, str]]) -> None:
        """Entries take new names (already in the hot dir), all at once: an exchange swaps two."""
        for e, _ in moves:
            if self.entries.get(e.path) is e:
                del self.entries[e.path]
        for e, path in moves:
            e.path = path
            self.entries[path] = e

    def unname(self, e: Entry, rel: str) -> None:
        """`rel` is no longer `e`'s name (unlinked, or given to another file)."""
        if self.entries.get(rel) is e:
            del self.entries[rel]

    def orphan(self, e: Entry) -> None:
        """`e` lost its last name while open: served through its open fds until the last close."""
        self.orphans[e.ino] = e

    def is_live(self, e: Entry) -> bool:
        """Is `e` still the engine's entry for its file (not unlinked and closed, not replaced)?"""
        return self.files.get(e.file_id) is e

    def remote_bytes(self) -> int:
        """Bytes of tiered segments that are only in the object store (statfs adds them to the used space)."""
        return max(self.tiered.total_bytes - self.cache_bytes, 0)  # both kept as they change: O(1)

    # ------------------------------------------------------------------ the workers

    async def run(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        if self.read_only:
            nursery.start_soon(self.supervise, "evictor", self.evictor.run)  # fetch, read-ahead and evict
            if self.follower is not None:
                nursery.start_soon(self.supervise, "follow", self.follower.run)
            return
        if not self.enabled:
            return
        if self.lease is not None:
            nursery.start_soon(self.supervise, "lease", self.lease.run, self.limiter)
        if self.snapshotter is not None:
            nursery.start_soon(self.supervise, "snapshotter", self.snapshotter.run)
        if self.appendlog is not None:
            nursery.start_soon(self.supervise, "appendlog", self.appendlog.run)
        nursery.start_soon(self.supervise, "sealer", self.sealer.run)
        if self.primer.window and self.mountpoint is not None:
            nursery.start_soon(self.supervise, "primer", self.primer.run, self.mountpoint)
        self.uploader.start(nursery)
        nursery.start_soon(self.supervise, "evictor", self.evictor.run)
        nursery.start_soon(self.supervise, "janitor", run_janitor, self)
        nursery.start_soon(self.supervise, "compaction", self.compactor.run)

    def start_soon(self, fn: Callable, *args) -> None:
        """A short task in the engine's nursery (a fetch, a flush): it outlives the request that started it."""
        assert self._nursery is not None
        self._nursery.start_soon(fn, *args)

    async def supervise(self, name: str, fn: Callable, *args) -> None:
        """Run a background worker for the life of the mount: an exception is logged with its context, counted
        and shown in status, and the worker starts again after a backoff. The FUSE session never ends because a
        worker failed (a dead mount under a broker loses the dirty pages it already acknowledged)."""
        backoff = 1.0
        while True:
            started = time.monotonic()
            try:
                await fn(*args)
                return  # a worker that has nothing (more) to do
            except Exception as err:  # noqa: BLE001 - supervised: anything but cancellation restarts it
                w = self.workers
                w.restarts[name] = w.restarts.get(name, 0) + 1
                w.last_error[name] = f"{time.strftime('%H:%M:%S')}: {type(err).__name__}: {err}"
                log.exception("worker %s failed (restart %d in %.0f s)", name, w.restarts[name], backoff)
            if time.monotonic() - started > 60:
                backoff = 1.0  # it ran a while: a new fault, not the same one again
            await trio.sleep(backoff)
            backoff = min(backoff * 2, 60.0)

    async def shutdown(self) -> None:
        await self.flusher.aclose()  # the mount is gone: nothing is left to flush through it
        await self.primer.aclose()
        await self.evictor.persist_residency()
        if self.appendlog is not None:
            await self.appendlog.final()  # append objects, then the snapshot naming them
        elif self.snapshotter is not None and self.enabled:
            await self.snapshotter.final()  # read-only mounts anywhere see the store as of this unmount
        if self.lease is not None:
            with trio.move_on_after(10):  # a store that does not answer must not hold the unmount up
                try:
                    await trio.to_thread.run_sync(self.lease.release, abandon_on_cancel=True)
                except ObjectStoreError as err:
                    log.warning("could not release the writer lease (%s); it expires by itself", err)
        for fd in [*self._fds.values(), *self._held_fds.values()]:
            os.close(fd)
        self._fds.clear()
        self._held_fds.clear()
        self.catalog.close()

    # ------------------------------------------------------------------ events from the FUSE front

    def note_write(self, ino: int) -> None:
        """A write or truncate of the file: it voids a seal or an upload in flight (write_seq moves)."""
        self.last_write[ino] = time.monotonic()
        self._writes += 1  # one counter for all files: a value is never seen twice, even on a reused st_ino
        self.write_seq[ino] = self._writes

    def inode_freed(self, ino: int) -> None:
        """The hot-dir inode `ino` is gone for good (no name, no fd, forgotten by the kernel) and the file system
        may give its st_ino to the next file: nothing kept by st_ino may carry over to that file. (write_seq
        goes too unless a live entry has the inode: its values come from one counter, so a new file on this st_ino
        never repeats one.)"""
        self.last_write.pop(ino, None)
        self.last_fsync.pop(ino, None)
        if ino not in self.by_ino:  # an upload in flight compares its count only while its file is live
            self.write_seq.pop(ino, None)
        if self.appendlog is not None:
            self.appendlog.inode_freed(ino)

    def note_fsync(self, ino: int, rel: str | None) -> None:
        """An fsync of the file (`rel`: a name it has now, None once it has none)."""
        self.last_fsync[ino] = time.monotonic()
        if rel is not None:
            self.sealer.fsynced(rel, ino)

    async def truncate_barrier(self, ino: int) -> None:
        """Called before any truncate: wait while a seal probe reads the file (no SIGBUS in the daemon)."""
        await self.sealer.truncate_barrier(ino)

    async def read(self, e: Entry, ino: int, fh: int, off: int, size: int) -> bytes:
        return await self.cache.read(e, ino, fh, off, size)

    async def before_write(self, e: Entry, ino: int, off: int, data: bytes) -> bool:
        return await self.cache.before_write(e, ino, off, data)

    async def before_truncate(self, e: Entry, ino: int, new_size: int) -> None:
        await self.cache.before_truncate(e, ino, new_size)

    def opened(self, fh: int, e: Entry) -> None:
        self.cache.opened(fh, e)

    def release_stream(self, fh: int) -> None:
        self.cache.release_stream(fh)

    def hold(self, e: Entry, held_fd: int) -> None:
        """Fetches and evictions of `e` go to its own inode, which has no name any more."""
        if e.file_id not in self._held_fds:
            self._held_fds[e.file_id] = os.open(f"/proc/self/fd/{held_fd}", os.O_RDWR)  # the unlinked inode itself
            self._forget_fd(e.file_id, held=False)

    def keep_orphan(self, e: Entry, held_fd: int) -> None:
        """A following mount removed `e`'s name or gave it to a newer file while `e` is open: served through its
        open fds until the last close (its row is already gone or replaced)."""
        self.hold(e, held_fd)
        self.orphan(e)

    async def on_released(self, ino: int) -> None:
        """The last open fd of an inode closed and it has no name: an orphan's objects now go after the grace."""
        e = self.orphans.pop(ino, None)
        if e is None:
            return
        self.drop(e)
        if self.read_only:  # a reader never deletes objects
            return
        grace = float(self.config["delete.grace_seconds"])
        await self.db(self.catalog.schedule_deletes, e.all_objects(), time.time() + grace)
        log.info("%s: last holder closed; %d objects deleted after %.0f s", e.path, len(e.objects), grace)

    def drop(self, e: Entry) -> None:
        """Forget a file that is gone for good (its row is already gone): every index that still points at it."""
        if self.files.get(e.file_id) is e:
            del self.files[e.file_id]
        if self.by_ino.get(e.ino) is e:
            del self.by_ino[e.ino]
        if self.entries.get(e.path) is e:
            del self.entries[e.path]
        if self.orphans.get(e.ino) is e:
            del self.orphans[e.ino]
        if self.tiered.get(e.ino) is e:
            del self.tiered[e.ino]
            self.cache_bytes -= e.resident_bytes()
        self._forget_fd(e.file_id)
        self.uploader.forget(e.file_id)
        self.evictor.forget(e.file_id)
        self.cache.forget(e)

    # ------------------------------------------------------------------ rows: copy, commit, then become

    @staticmethod
    def tiered_copy(e: Entry, res: tuple) -> Entry:
        """The TIERED row of an uploaded segment: every block resident, its objects and crcs."""
        crc, block_crcs, keys, (unit, unit_crcs, unit_ref), now = res
        return e.copy(crc32c=crc, block_crcs=block_crcs, objects=keys, state=State.TIERED, last_access=now,
                      unit_bytes=unit, unit_crcs=unit_crcs, unit_ref=unit_ref,
                      state_since=now, resident=bytearray(b"\xff" * ((e.nblocks + 7) // 8)))

    def hot_copy(self, e: Entry, generation: int) -> Entry:
        """The row of a file that is HOT again, at a new generation (its old objects are being deleted)."""
        return e.copy(state=State.HOT, generation=generation, objects=[], block_crcs=[], crc32c=None,
                      unit_bytes=0, unit_crcs=b"", unit_ref="",
                      resident=bytearray(), format="raw", chunk_bytes=self.chunk, state_since=time.time())

    @staticmethod
    def _become(e: Entry, row: Entry) -> None:
        """Apply a committed row to the live entry (same identity object: indexes need no update)."""
        for f in dataclasses.fields(row):
            if f.name not in ("path", "pins"):  # the path belongs to renames, pins to readers
                setattr(e, f.name, getattr(row, f.name))

    # ------------------------------------------------------------------ the object store and hot files

    def fence(self, key: str) -> None:
        """Every object write or delete of a writable mount checks the lease first: a daemon whose lease lapsed
        (a throttled upload can outlive the ttl) must not write over a new writer's store."""
        if not self.store_writable():
            raise ObjectStoreError(key, f"refused: the writer lease (epoch {self.lease.epoch if self.lease else 0}) "
                                        f"is not held (fenced)")

    def fd(self, e: Entry) -> int:
        """The engine's O_RDWR fd of a tiered file, by file id: opened by its current name and checked to be its
        inode, or the fd held on it after an unlink while open, so a punch or an install always hits this file.
        Use it with no await before the use: the LRU may close it to open another one (a thread gets a dup)."""
        fd = self._held_fds.get(e.file_id)
        if fd is not None:
            return fd
        fd = self._fds.get(e.file_id)
        if fd is not None:
            self._fds.move_to_end(e.file_id)
            return fd
        fd = os.open(self.hot / e.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        if os.fstat(fd).st_ino != e.ino:
            os.close(fd)
            raise ReadFailed(f"{e.path}: the hot file was replaced behind the daemon's back")
        self._fds[e.file_id] = fd
        while len(self._fds) > ENGINE_FDS:
            os.close(self._fds.popitem(last=False)[1])
        return fd

    def _forget_fd(self, file_id: int, held: bool = True) -> None:
        fd = self._fds.pop(file_id, None)
        if fd is not None:
            os.close(fd)
        fd = self._held_fds.pop(file_id, None) if held else None
        if fd is not None:
            os.close(fd)
