"""The tiering engine: seal, upload, verify, evict, and serve evicted bytes (DESIGN §4, §7, §10, §12).

The hot dir stays the single local home of every file: a tiered segment keeps its hot file at its true size,
and eviction punches holes in it (FALLOC_FL_PUNCH_HOLE | KEEP_SIZE), so `open` always has a real fd and mmap,
stat and unlink behave as before. The catalog's resident bitmap says which blocks are real; a read of a
non-resident block fetches it (ranged GET), verifies its crc32c, writes it back into the hole and serves it.

Concurrency rule: everything that checks residency and then touches hot-file bytes (pread, pwrite of a fetched
block, punch) does so with no `await` in between, so trio's cooperative scheduling makes it atomic. Network and
SQLite work runs in worker threads.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import heapq
import logging
import mmap
import os
import random
import sqlite3
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import crc32c
import trio

from tierfs import failpoints
from tierfs.config import Config
from tierfs.objectstore import ObjectStore, open_store
from tierfs.objectstore.base import ObjectNotFound, ObjectStoreError
from tierfs.store.paths import Kind, classify
from tierfs.tier.storeroots import segment_dirs
from tierfs.store.seal import SealParams, is_sealed
from tierfs.tier import layout
from tierfs.tier import lz4c
from tierfs.tier.catalog import NEVER, Catalog, Entry, State
from tierfs.tier.compaction import Compactor
from tierfs.tier import snapshot
from tierfs.tier import storeconfig
from tierfs.tier.lease import WriterLease
from tierfs.tier.appendlog import AppendLog
from tierfs.tier.follow import Follower
from tierfs.tier.takeover import TakeoverSpec, prepare_takeover
from tierfs.tier.ratelimit import BandwidthLimiterClosed, TokenBucket
from tierfs.tier.readahead import ReadAhead

log = logging.getLogger("tierfs.tier")

PAGE = 4096
PREFETCH_GROUP_BYTES = 4 << 20  # one read-ahead GET: large enough that per-request costs stop mattering
_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
_SEAL_BATCH = 512  # candidates probed per worker-thread hop, and sealed per catalog transaction
_UPLOAD_BATCH = 64  # small segments (one block or less) uploaded together and committed in one transaction
_EVICT_BATCH = 256  # segments whose residency is made durable in one transaction before their punches


class TieredIndex(dict):
    """TIERED entries by hot-dir st_ino, keeping the sum of their sizes: statfs asks for the store's remote-only
    bytes on every call, and a sum over 100,000 entries per call would make `df` (and the broker's disk check)
    cost O(files). A tiered entry's size never changes while it is in here (a write or truncate takes it out)."""

    def __init__(self) -> None:
        super().__init__()
        self.total_bytes = 0

    def __setitem__(self, ino: int, e: Entry) -> None:
        old = super().get(ino)
        if old is not None:
            self.total_bytes -= old.size
        super().__setitem__(ino, e)
        self.total_bytes += e.size

    def __delitem__(self, ino: int) -> None:
        self.total_bytes -= super().__getitem__(ino).size
        super().__delitem__(ino)

    _MISSING = object()

    def pop(self, ino: int, default=_MISSING):  # type: ignore[override]
        e = super().pop(ino, None) if default is not TieredIndex._MISSING else super().pop(ino)
        if e is None:
            return None if default is TieredIndex._MISSING else default
        self.total_bytes -= e.size
        return e

    def clear(self) -> None:
        super().clear()
        self.total_bytes = 0


class UploadQueue:
    """Sealed segments waiting for upload, oldest (mtime, path) first. A heap: taking the next one costs
    O(log n), where a min() over the whole backlog per upload made tiering 100,000 small files quadratic."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, str]] = []
        self._queued: set[str] = set()

    def __len__(self) -> int:
        return len(self._queued)

    def __contains__(self, rel: str) -> bool:
        return rel in self._queued

    def push(self, rel: str, mtime_ns: int) -> None:
        if rel not in self._queued:
            self._queued.add(rel)
            heapq.heappush(self._heap, (mtime_ns, rel))

    def pop(self) -> tuple[int, str] | None:
        if not self._heap:
            return None
        item = heapq.heappop(self._heap)
        self._queued.discard(item[1])
        return item


def punch_hole(fd: int, off: int, length: int) -> None:
    if length <= 0:
        return
    if _libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, off, length) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def read_lz4c_footer(store: ObjectStore, key: str) -> "lz4c.Footer":
    """Blocking: HEAD, the fixed-size trailer, then the footer it points at."""
    info = store.head(key)
    if info is None:
        raise ObjectNotFound(key, "lz4c object is missing")
    if info.size < lz4c.TRAILER_SIZE:
        raise lz4c.Lz4cError(f"{info.size} bytes is shorter than the lz4c trailer")
    trailer = lz4c.parse_trailer(store.get_range(key, info.size - lz4c.TRAILER_SIZE, lz4c.TRAILER_SIZE))
    return lz4c.parse_footer(trailer, store.get_range(key, trailer.footer_offset, trailer.footer_length))


class Fetch:
    """One ranged GET in flight for a run of blocks. Its outcome travels with it: a reader gets the error of the
    fetch it waited for, never one left over from an earlier fetch of the same blocks."""

    __slots__ = ("done", "error", "gave_up")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.error: str | None = None
        self.gave_up = False  # a reader already waited the whole bound on it


@dataclass
class WorkerStats:
    """Restarts of supervised background workers, for `tierfs status` and tierfs_worker_restarts_total."""

    restarts: dict = field(default_factory=dict)  # worker name -> count
    last_error: dict = field(default_factory=dict)  # worker name -> "when: what"


class ShortRead(OSError):
    """The hot file no longer holds what was sealed (it shrank, or was replaced): not an upload failure to
    retry forever, but a changed file to seal again."""

    def __init__(self, keys: list[str], msg: str):
        super().__init__(errno.EIO, msg)
        self.keys = keys


class ReadFailed(OSError):
    """A read of evicted bytes that cannot be served (object store down past the bound, corrupt object)."""

    def __init__(self, msg: str):
        super().__init__(errno.EIO, msg)


@dataclass
class EngineStats:
    uploads: int = 0
    upload_bytes: int = 0
    upload_failures: int = 0
    fetches: int = 0
    fetch_bytes: int = 0
    fetch_errors: int = 0
    corrupt_objects: int = 0
    evicted_bytes: int = 0
    evicted_blocks: int = 0
    reads_local: int = 0
    reads_waited: int = 0
    prefetch_bytes: int = 0
    rewrites: int = 0
    identical_rewrites: int = 0
    last_error: str = ""


class Engine:
    def __init__(self, hot_dir: Path, state_dir: Path, config: Config, read_only: bool = False,
                 takeover: TakeoverSpec | None = None, follow: bool = False):
        self.hot = hot_dir
        self.state_dir = state_dir
        self.config = config
        self.enabled = bool(config["tiering.enabled"])
        self.block = int(config["cache.block_bytes"])
        self.chunk = int(config["objectstore.chunk_bytes"])
        if self.chunk % self.block:
            from tierfs.config import ConfigError

            raise ConfigError(f"config key 'objectstore.chunk_bytes': {self.chunk} is not a multiple of "
                              f"cache.block_bytes ({self.block}); allowed: a multiple of cache.block_bytes")
        self.seal_params = SealParams(int(config["broker.max_index_num"]), int(config["broker.max_hash_slot_num"]))
        self.store: ObjectStore = open_store(self._store_url(), **self._store_options())
        self.store_id = config["store.id"] or self._persistent_store_id()
        # read-only (tierfs.tier.snapshot): every file is a TIERED row of the bucket's newest catalog snapshot,
        # built into the state dir before the catalog opens; nothing is sealed, uploaded, deleted or snapshotted
        self.read_only = read_only
        self.snapshot_info = snapshot.prepare_readonly(self.store, self.store_id, hot_dir, state_dir) \
            if read_only else {}
        # --takeover (tierfs.tier.takeover): the lease, then the hot dir and catalog from the newest point
        self.takeover_info = prepare_takeover(self.store, self.store_id, hot_dir, state_dir, takeover,
                                              float(config["lease.ttl_seconds"]),
                                              float(config["delete.grace_seconds"])) if takeover else {}
        self.catalog = Catalog(state_dir / "catalog.db")
        self.lease: WriterLease | None = None  # writable mounts: set by take_lease() before serving
        if not read_only:  # a read-only cache is no hot dir for `tierfs fsck` to check (or repair) the store by
            storeconfig.save(state_dir, self._store_url(), self._store_options(), self.store_id)  # for `tierfs fsck`
        # One owner of file state: `files` holds every entry by its file id (never reused, survives rename);
        # `entries` (path) and `tiered` (hot-dir st_ino, the FUSE fast path) are indexes into it.
        self.files: dict[int, Entry] = {}
        self.entries: dict[str, Entry] = {}  # entries that have a name, by path
        self.tiered = TieredIndex()  # TIERED entries by hot-dir st_ino: the FUSE fast path
        self.orphans: dict[int, Entry] = {}  # unlinked while open: served through open fds until the last close
        self._fds: dict[int, int] = {}  # engine-owned O_RDWR fds of tiered hot files, by file id
        self.mountpoint: Path | None = None  # the sealer flushes quiet segments through the mount (mount.py sets it)
        self.workers = WorkerStats()
        self.last_write: dict[int, float] = {}
        self.last_fsync: dict[int, float] = {}
        self.write_seq: dict[int, int] = {}
        self._inflight: dict[tuple[int, int, int], Fetch] = {}  # (file id, generation, block) -> its fetch
        self._untierable: set[str] = set()  # segments whose object keys the store refuses: kept local
        self._refused: dict[str, str] = {}  # path -> the corrupt-content reason last logged for it
        self._dirty_residency: set[int] = set()  # file ids
        self._seal_candidates: dict[str, int] = {}  # path -> st_ino when it became a candidate (0: unknown)
        self._probing: dict[int, int] = {}  # st_ino -> probes reading it now: a truncate waits (no SIGBUS)
        self._probe_done = trio.Event()
        self._flushed: dict[int, tuple[int, int]] = {}  # st_ino -> (write seq, mtime) when the sealer flushed it
        # (size, mtime, ctime, write seq) of segments whose content was found incomplete: a scan skips them
        # until one of those changes, so a periodic scan re-reads only what may have changed
        self._unsealed: dict[str, tuple[int, int, int, int]] = {}
        self._ns_changes = 0  # unlinks and renames seen: a seal batch re-checks its paths when this moved
        self._sealed_at_seq: dict[int, int] = {}  # file id -> write_seq when sealed: a later write voids the upload
        self._upload_queue = UploadQueue()
        self._upload_wakeup = trio.Event()
        self._uploading: set[str] = set()  # paths
        self.started_at = time.time()  # multipart uploads initiated before this are a crashed daemon's
        self._sweep_done = trio.Event()  # uploaders start after the first stale-upload sweep
        bw = int(config["upload.bandwidth_bytes_per_second"])
        self.upload_limit: TokenBucket | None = TokenBucket(bw) if bw else None
        self.hot_segments: dict[str, tuple[str, int, int]] = {}  # rel -> (kind, size, local bytes): last scan
        self.streams: dict[int, ReadAhead] = {}
        self._footers: dict[str, lz4c.Footer] = {}  # lz4c block tables by object key
        self.prefetch_inflight = 0
        self.cache_bytes = 0
        self.limiter = trio.CapacityLimiter(int(config["objectstore.max_concurrency"]))
        # threads of a batch of small uploads: half the store's request slots, the rest stay with readers
        self._small_limiter = trio.CapacityLimiter(max(1, int(config["objectstore.max_concurrency"]) // 2))
        self.db_limiter = trio.CapacityLimiter(1)
        self.stats = EngineStats()
        # metrics hook (tierfs.metrics): observe(event, seconds, bytes) for "upload" and "download"
        self.observe: Callable[[str, float, int], None] = lambda event, seconds, nbytes: None
        self.store_down_since: float | None = None
        self._nursery: trio.Nursery | None = None
        self.compactor = Compactor(self)
        # no snapshots into the embedded default store: it lives in the hot dir, where no reader can reach it
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

    def _store_url(self) -> str:
        return self.config["objectstore.url"] or f"file://{self.state_dir / 'objects'}"

    def _store_options(self) -> dict:
        c = self.config
        if not self._store_url().startswith("s3://"):
            return {"endpoint_url": c["objectstore.endpoint_url"] or None}
        return {k: v for k, v in {
            "endpoint_url": c["objectstore.endpoint_url"] or None,
            "region": c["objectstore.region"] or None,
            "addressing": c["objectstore.addressing"],
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

    async def _db(self, fn: Callable, *args):
        return await trio.to_thread.run_sync(fn, *args, limiter=self.db_limiter)

    async def _io(self, fn: Callable, *args):
        return await trio.to_thread.run_sync(fn, *args, limiter=self.limiter)

    def reconcile(self) -> None:
        """On mount: load the catalog, match each row against its hot file, resume what was in flight. A row whose
        file changed behind the daemon's back (other inode, other size, or a sealed file written since) no longer
        describes it: the row goes, the file is HOT again and the sealer looks at it afresh."""
        now = time.time()
        grace = float(self.config["delete.grace_seconds"])
        if not self.read_only:
            held = self.catalog.release_held_deletes(now + grace)
            if held:
                log.info("%d object deletes held for files open at the last unmount fall due in %.0f s", held, grace)
        unnumbered: list[Entry] = []  # a read-only cache's rows come from snapshot files: ids are assigned here
        for e in self.catalog.load_all():
            try:
                st = os.lstat(self.hot / e.path)
            except FileNotFoundError:
                if self.read_only:  # the objects belong to the writer; never queue their deletion from here
                    log.error("read-only cache: %s is missing from the local tree; not served", e.path)
                    continue
                log.warning("catalog row %s has no hot file (deleted while unmounted); deleting its objects", e.path)
                self.catalog.remove(e.path, e.objects, now + grace, artifacts=("cidx",))
                continue
            changed = self._changed_while_unmounted(e, st)
            if changed and not self.read_only:
                log.warning("%s changed behind the daemon's back (%s): its catalog row (%s, gen %d) is dropped "
                            "and the file is sealed again from its local bytes", e.path, changed, e.state.value,
                            e.generation)
                self.catalog.remove(e.path, e.objects, now + grace, artifacts=("cidx",))
                continue
            e.ino = st.st_ino
            self.entries[e.path] = e
            if not e.file_id or e.file_id in self.files:
                unnumbered.append(e)
            else:
                self.files[e.file_id] = e
            if e.state in (State.SEALED, State.UPLOADING):
                self._upload_queue.push(e.path, e.mtime_ns)
            elif e.state is State.TIERED:
                if len(e.resident) != (e.nblocks + 7) // 8:
                    e.resident = bytearray((e.nblocks + 7) // 8)
                self.tiered[st.st_ino] = e
                self.cache_bytes += e.resident_bytes()
        if unnumbered:  # one allocation and one transaction, not a synchronous commit per row
            first = self.catalog.allocate(len(unnumbered))
            for i, e in enumerate(unnumbered):
                e.file_id = first + i
                self.files[e.file_id] = e
            self.catalog.put_many(unnumbered, [], 0.0)
        log.info("catalog: %d rows, %d tiered, %d to upload, %d deletes pending", len(self.entries),
                 len(self.tiered), len(self._upload_queue), self.catalog.pending_delete_count())

    @staticmethod
    def _changed_while_unmounted(e: Entry, st: os.stat_result) -> str:
        """Why a row no longer matches its hot file, or ''. A TIERED file's local bytes are holes and pinned
        pages, so only its identity and size can be checked; a SEALED one must still be exactly what sealed."""
        if e.ino and st.st_ino != e.ino:
            return f"inode {st.st_ino}, was {e.ino}"
        if e.state is State.HOT:
            return ""
        if st.st_size != e.size:
            return f"size {st.st_size}, was {e.size}"
        if e.state is not State.TIERED and st.st_mtime_ns != e.mtime_ns:
            return "written since it was sealed"
        return ""

    def is_live(self, e: Entry) -> bool:
        """Is `e` still the engine's entry for its file (not unlinked and closed, not replaced)?"""
        return self.files.get(e.file_id) is e

    async def run(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        if self.read_only:
            nursery.start_soon(self._supervise, "evictor", self._evictor_loop)  # fetch, read-ahead and evict
            if self.follower is not None:
                nursery.start_soon(self._supervise, "follow", self.follower.run)
            return
        if not self.enabled:
            return
        if self.lease is not None:
            nursery.start_soon(self._supervise, "lease", self.lease.run, self.limiter)
        if self.snapshotter is not None:
            nursery.start_soon(self._supervise, "snapshotter", self.snapshotter.run)
        if self.appendlog is not None:
            nursery.start_soon(self._supervise, "appendlog", self.appendlog.run)
        nursery.start_soon(self._supervise, "sealer", self._sealer_loop)
        nursery.start_soon(self._supervise, "upload-sweep", self._sweep_stale_uploads)
        if self.upload_limit is not None:
            nursery.start_soon(self._close_limiter_on_cancel)
        for i in range(int(self.config["upload.concurrency"])):
            nursery.start_soon(self._supervise, "uploader", self._uploader_loop)
        nursery.start_soon(self._supervise, "evictor", self._evictor_loop)
        nursery.start_soon(self._supervise, "janitor", self._janitor_loop)
        nursery.start_soon(self._supervise, "compaction", self.compactor.run)

    async def _supervise(self, name: str, fn: Callable, *args) -> None:
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

    async def _sweep_stale_uploads(self) -> None:
        """Abort the multipart uploads a crashed daemon left under <store-id>/ (DESIGN §5), retrying until one
        pass succeeds. Uploaders wait for the first pass; anything this daemon (or a job it started) puts while
        a retry runs was initiated after it started, and is spared."""
        backoff = 1.0
        try:
            while True:
                if not self.store_writable():
                    await trio.sleep(1.0)  # only the lease holder may abort uploads: they may be the writer's
                    continue
                try:
                    busy = tuple(f"{self.store_id}/seg/{p}/" for p in self._uploading)
                    aborted, spared = await self._io(self._abort_stale_uploads, busy)
                except ObjectStoreError as err:
                    log.warning("listing stale multipart uploads under %s/ failed (%s); retrying in %.0f s",
                                self.store_id, err, backoff)
                else:
                    log.info("aborted %d stale multipart uploads under %s/ (initiated before this daemon "
                             "started)%s", aborted, self.store_id, f"; {spared} newer kept" if spared else "")
                    return
                self._sweep_done.set()
                await trio.sleep(backoff)
                backoff = min(backoff * 2, float(self.config["upload.retry_max_seconds"]))
        finally:
            self._sweep_done.set()

    def _abort_stale_uploads(self, busy: tuple[str, ...]) -> tuple[int, int]:
        """Blocking: abort uploads under <store-id>/ initiated before this daemon started. Spared: newer ones
        (another process, e.g. a compaction job) and those under `busy` (segments being uploaded right now)."""
        aborted = spared = 0
        for up in list(self.store.list_multipart_uploads(f"{self.store_id}/")):
            if up.initiated is None or up.initiated >= self.started_at or up.key.startswith(busy):
                spared += 1
                continue
            self.store.abort_multipart(up.key, up.upload_id)
            log.info("aborted stale multipart upload of %s (upload id %s, initiated %s)", up.key, up.upload_id,
                     time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(up.initiated)))
            aborted += 1
        return aborted, spared

    async def _close_limiter_on_cancel(self) -> None:
        """At shutdown, wake uploaders waiting for bandwidth so an unmount never waits out a reservation."""
        try:
            await trio.sleep_forever()
        finally:
            assert self.upload_limit is not None
            self.upload_limit.close()

    async def shutdown(self) -> None:
        await self._persist_residency()
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
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self.catalog.close()

    # ------------------------------------------------------------------ events from the FUSE front

    def note_write(self, ino: int) -> None:
        """A write or truncate of the file: it voids a seal or an upload in flight (write_seq moves)."""
        self.last_write[ino] = time.monotonic()
        self.write_seq[ino] = self.write_seq.get(ino, 0) + 1

    def note_fsync(self, ino: int, rel: str) -> None:
        self.last_fsync[ino] = time.monotonic()
        if classify(rel).is_segment:
            self._seal_candidates[rel] = ino

    async def truncate_barrier(self, ino: int) -> None:
        """Called before any truncate: wait while a seal probe reads the file, so the probe never maps pages
        that a truncate is removing (a SIGBUS in the daemon)."""
        while ino in self._probing:
            await self._probe_done.wait()

    async def on_unlink(self, rel: str, ino: int, held_fd: int | None) -> None:
        """The name is gone (unlink, or replaced by a rename). A tiered file still open through `held_fd` keeps
        its entry and its objects until the last close; the row goes now, in one transaction with the deletes."""
        self._ns_changes += 1
        self._untierable.discard(rel)
        self._refused.pop(rel, None)
        self._unsealed.pop(rel, None)
        self._seal_candidates.pop(rel, None)
        self._flushed.pop(ino, None)
        e = self.entries.get(rel)
        if e is None or (e.ino and e.ino != ino):
            return
        grace = float(self.config["delete.grace_seconds"])
        keep = e.state is State.TIERED and held_fd is not None and self.tiered.get(ino) is e
        if keep and e.file_id not in self._fds:
            self._fds[e.file_id] = os.open(f"/proc/self/fd/{held_fd}", os.O_RDWR)  # the unlinked inode itself
        await self._db(self.catalog.remove, rel, e.objects, NEVER if keep else time.time() + grace, ("cidx",))
        failpoints.hit("tier.unlinked")
        if self.entries.get(rel) is e:
            del self.entries[rel]
        if keep:
            self.orphans[ino] = e
            log.info("%s deleted while open: served through its open fds; %d objects go %.0f s after the last "
                     "close", rel, len(e.objects), grace)
            return
        self._drop(e)
        log.info("%s deleted: %d objects deleted after %.0f s", rel, len(e.objects), grace)

    async def on_released(self, ino: int) -> None:
        """The last open fd of an inode closed and it has no name: an orphan's objects now go after the grace."""
        e = self.orphans.pop(ino, None)
        if e is None:
            return
        self._drop(e)
        grace = float(self.config["delete.grace_seconds"])
        await self._db(self.catalog.schedule_deletes, e.objects, time.time() + grace)
        log.info("%s: last holder closed; %d objects deleted after %.0f s", e.path, len(e.objects), grace)

    def _drop(self, e: Entry) -> None:
        """Forget a file that is gone for good (its row is already gone)."""
        if self.files.get(e.file_id) is e:
            del self.files[e.file_id]
        if self.tiered.get(e.ino) is e:
            del self.tiered[e.ino]
            self.cache_bytes -= e.resident_bytes()
        self._forget_fd(e.file_id)
        self._sealed_at_seq.pop(e.file_id, None)
        self._dirty_residency.discard(e.file_id)

    async def on_rename(self, old: str, new: str) -> None:
        """Memory first, then the row: the one catalog thread runs transactions in order (trio's limiter is
        FIFO) and every row written after this reads the new path, so the catalog ends as memory says."""
        self._ns_changes += 1
        self._unsealed.pop(old, None)
        self._unsealed.pop(new, None)
        ino = self._seal_candidates.pop(old, None)
        e = self.entries.pop(old, None)
        if e is None:
            if ino is not None:
                self._seal_candidates[new] = ino
            return
        e.path = new
        self.entries[new] = e
        if e.state is State.HOT:
            self._seal_candidates[new] = e.ino
        await self._db(self.catalog.rename, old, new)

    # ------------------------------------------------------------------ sealing

    async def _sealer_loop(self) -> None:
        interval = float(self.config["seal.scan_interval_seconds"])
        next_scan = 0.0
        while True:
            if time.monotonic() >= next_scan:
                found, self.hot_segments = await trio.to_thread.run_sync(self._scan_segments)
                for rel, ino in found:
                    self._seal_candidates.setdefault(rel, ino)
                next_scan = time.monotonic() + interval
            todo = list(self._seal_candidates.items())
            for i in range(0, len(todo), _SEAL_BATCH):
                await self._seal_batch(dict(todo[i:i + _SEAL_BATCH]))
            await trio.sleep(min(1.0, interval))

    def _scan_segments(self) -> tuple[list[tuple[str, int]], dict[str, tuple[str, int, int, str]]]:
        """Blocking: one walk of the segment dirs, for the sealer and for `tierfs status`. Returns the seal
        candidates (path, st_ino), and (kind, size, local bytes, why not sealed) of every segment with no catalog
        row or a HOT one. A segment past HOT costs a directory entry and no stat (the catalog has its numbers),
        but one whose inode is not the row's was replaced behind the daemon's back: a candidate again. One whose
        content was found incomplete is a candidate again only once its size, mtime, ctime or write count moved."""
        found: list[tuple[str, int]] = []
        usage: dict[str, tuple[str, int, int, str]] = {}
        entries, unsealed, write_seq = self.entries, self._unsealed, self.write_seq
        hot = str(self.hot)
        stack = segment_dirs(hot, self.config["store.roots"])  # every store root below the mount's too
        while stack:
            d = stack.pop()
            try:
                it = os.scandir(f"{hot}/{d}")
            except (FileNotFoundError, NotADirectoryError, PermissionError):
                continue
            with it:
                for de in it:
                    rel = f"{d}/{de.name}"
                    try:
                        if de.is_dir(follow_symlinks=False):
                            stack.append(rel)
                            continue
                        e = entries.get(rel)
                        if e is not None and e.state is not State.HOT and e.ino == de.inode():
                            continue
                        if not de.is_file(follow_symlinks=False):
                            continue
                        kind = classify(rel)
                        if not kind.is_segment:
                            continue
                        st = de.stat(follow_symlinks=False)
                    except OSError:
                        continue  # gone, or unreadable: the next scan looks again
                    why = unsealed.get(rel, (0, 0, 0, 0, "not checked yet"))
                    usage[rel] = (kind.value, st.st_size, min(st.st_size, st.st_blocks * 512), why[4])
                    if why[:4] != (st.st_size, st.st_mtime_ns, st.st_ctime_ns, write_seq.get(st.st_ino, 0)):
                        found.append((rel, st.st_ino))
        return found, usage

    async def _seal_batch(self, cands: dict[str, int]) -> None:
        """Probe candidates in one worker-thread hop (stat, the quiet rule, the content rule), then seal those
        that pass in one catalog transaction: sealing is bookkeeping, and 100,000 small segments must not cost
        100,000 synchronous commits. A quiet segment with writes the daemon has not seen flushed is flushed by
        the daemon itself, through the mount, first: a broker under ASYNC_FLUSH may never fsync its last pages."""
        ns0 = self._ns_changes
        inos = [ino for ino in cands.values() if ino]
        for ino in inos:
            self._probing[ino] = self._probing.get(ino, 0) + 1
        try:
            probes = await trio.to_thread.run_sync(self._probe, cands)
        finally:
            for ino in inos:
                n = self._probing.pop(ino) - 1
                if n:
                    self._probing[ino] = n
            self._probe_done.set()
            self._probe_done = trio.Event()
        sealed: list[tuple[Entry, Entry | None, int, str]] = []  # entry, the one it replaces, seq, why
        flush: list[tuple[str, int, tuple[int, int]]] = []
        for rel, verdict in probes:
            what = verdict[0]
            if what == "wait":
                continue
            if what == "flush":
                flush.append((rel, verdict[1], verdict[2]))
                continue
            if self._seal_candidates.get(rel) == cands[rel]:
                del self._seal_candidates[rel]
            if what == "retry":  # e.g. the hot dir (and the catalog) full: try again
                self._seal_candidates[rel] = cands[rel]
                log.warning("sealing %s failed (%s); will retry", rel, verdict[1])
                continue
            if what == "bad":
                log.error("sealing %s failed (%s); it stays hot", rel, verdict[1])
                continue
            if what == "drop":
                continue
            _, st, seq, kind, ok, why = verdict
            if not ok:
                self._unsealed[rel] = (st.st_size, st.st_mtime_ns, st.st_ctime_ns, seq, why)
                if why.startswith("corrupt") and self._refused.get(rel) != why:
                    self._refused[rel] = why
                    log.warning("%s not sealed: %s; it stays hot", rel, why)
                else:
                    log.debug("%s not sealed: %s", rel, why)
                continue
            self._refused.pop(rel, None)
            e = self.entries.get(rel)
            if self.write_seq.get(st.st_ino, 0) != seq:
                self._seal_candidates[rel] = st.st_ino
                continue
            if (e is not None and (e.state is not State.HOT or e.ino != st.st_ino)) or rel in self._untierable:
                continue
            if self._ns_changes != ns0:  # unlinks or renames since the probe: seal only what is still there
                try:
                    if os.lstat(self.hot / rel).st_ino != st.st_ino:
                        self._seal_candidates[rel] = 0
                        continue
                except FileNotFoundError:
                    continue
            entry = Entry(path=rel, kind=kind.value, size=st.st_size, mtime_ns=st.st_mtime_ns, state=State.SEALED,
                          generation=e.generation if e is not None else 0, chunk_bytes=self.chunk,
                          block_bytes=self.block, state_since=time.time(),
                          file_id=e.file_id if e is not None else 0, ino=st.st_ino)
            sealed.append((entry, e, seq, why))
        if flush:
            self._nursery_start(self._flush_through_mount, flush)
        if sealed:
            await self._commit_sealed(sealed)

    def _nursery_start(self, fn: Callable, *args) -> None:
        assert self._nursery is not None
        self._nursery.start_soon(fn, *args)

    async def _flush_through_mount(self, todo: list[tuple[str, int, tuple[int, int]]]) -> None:
        """fsync quiet segments through the mount, so the kernel writes back every page still dirty for them (as
        WRITEs to this daemon) before they are judged complete; our own fsync handler then records the flush and
        makes them candidates again. In a child process (tierfs.tier.flusher): never a daemon thread blocked on
        its own mount."""
        if self.mountpoint is None:
            return
        for rel, ino, mark in todo:
            self._flushed[ino] = mark
        paths = b"\0".join(rel.encode("utf-8", "surrogateescape") for rel, _, _ in todo)
        try:
            done = await trio.run_process([sys.executable, "-P", "-m", "tierfs.tier.flusher", str(self.mountpoint)],
                                          stdin=paths, capture_stdout=True, capture_stderr=True, check=False)
        except OSError as err:
            log.warning("could not start the segment flusher (%s); will retry", err)
            for _, ino, _ in todo:
                self._flushed.pop(ino, None)
            return
        for line in done.stdout.decode("utf-8", "replace").splitlines():
            log.warning("flushing quiet segment %s through the mount failed; will retry", line.replace("\t", ": "))
        if done.returncode:
            log.warning("the segment flusher exited %d: %s", done.returncode, done.stderr.decode(errors="replace")[-500:])
        for rel, ino, _ in todo:
            self._seal_candidates.setdefault(rel, ino)

    async def _commit_sealed(self, sealed: list[tuple[Entry, Entry | None, int, str]]) -> None:
        """One transaction for the batch, then memory. New files take a file id (and first generation) from the
        catalog sequence first, so no two files ever share an object key."""
        fresh = [s[0] for s in sealed if not s[0].file_id]
        try:
            if fresh:
                first = await self._db(self.catalog.allocate, len(fresh))
                for i, entry in enumerate(fresh):
                    entry.file_id = entry.generation = first + i
            await self._db(self.catalog.put_many, [s[0] for s in sealed], [], 0.0)
        except (ValueError, UnicodeError) as err:
            if len(sealed) > 1:  # find the one row SQLite refuses; the others seal
                for one in sealed:
                    await self._commit_sealed([one])
                return
            log.error("sealing %s failed (%s); it stays hot", sealed[0][0].path, err)
            return
        except (OSError, sqlite3.Error) as err:  # e.g. the hot dir (and the catalog) full
            log.warning("sealing %d segments failed (%s); will retry", len(sealed), err)
            for entry, *_ in sealed:
                self._seal_candidates[entry.path] = entry.ino
            return
        failpoints.hit("tier.sealed")
        stale: list[Entry] = []
        for entry, prev, seq, why in sealed:
            # re-checked after the commit's await: unlinked, renamed, replaced or written meanwhile?
            if (self.entries.get(entry.path) is not prev or self.write_seq.get(entry.ino, 0) != seq
                    or not self._same_inode(entry)):
                stale.append(entry)
                continue
            self.files[entry.file_id] = entry
            self.entries[entry.path] = entry
            self._sealed_at_seq[entry.file_id] = seq
            self._unsealed.pop(entry.path, None)
            self._upload_queue.push(entry.path, entry.mtime_ns)
            log.log(logging.INFO if len(sealed) == 1 else logging.DEBUG, "sealed %s (%s, %d bytes, gen %d)",
                    entry.path, why, entry.size, entry.generation)
        if stale:
            await self._unseal_stale(stale)
        if len(sealed) > 1:
            log.info("sealed %d segments (%d bytes), %s .. %s", len(sealed), sum(s[0].size for s in sealed),
                     sealed[0][0].path, sealed[-1][0].path)
        self._upload_wakeup.set()

    def _same_inode(self, e: Entry) -> bool:
        try:
            return os.lstat(self.hot / e.path).st_ino == e.ino
        except OSError:
            return False

    async def _unseal_stale(self, stale: list[Entry]) -> None:
        """Rows committed for files that changed while the commit ran: the row goes again (no objects exist
        yet), and the path is looked at afresh by the sealer."""
        for e in stale:
            cur = self.entries.get(e.path)
            if cur is not None and cur is not e:
                continue  # the path's row is someone else's now (a rename over it committed after ours)
            await self._db(self.catalog.remove, e.path, [], 0.0)
            self._seal_candidates[e.path] = 0
            log.info("%s changed while its seal was committed; it stays hot", e.path)

    def _probe(self, cands: dict[str, int]) -> list[tuple[str, tuple]]:
        """Blocking: each candidate's verdict. ('wait',): not quiet yet; ('flush', ino, mark): quiet, but
        written since the last flush the daemon saw; ('drop',): gone, past HOT, or kept local;
        ('retry', err) / ('bad', err): unreadable now / for good;
        ('checked', lstat, write seq before the read, kind, sealed?, why)."""
        quiet = float(self.config["seal.quiet_seconds"])
        out: list[tuple[str, tuple]] = []
        for rel, ino in cands.items():
            try:
                out.append((rel, self._probe_one(rel, ino, quiet)))
            except FileNotFoundError:
                out.append((rel, ("drop",)))
            except (ValueError, UnicodeError) as err:
                out.append((rel, ("bad", err)))
            except OSError as err:
                out.append((rel, ("retry", err)))
        return out

    def _probe_one(self, rel: str, ino: int, quiet: float) -> tuple:
        if rel in self._untierable:
            return ("drop",)
        e = self.entries.get(rel)
        if e is not None and e.state is not State.HOT:
            return ("drop",)
        rel.encode()  # a name SQLite cannot store (not UTF-8) fails here, on its own, not in a batch commit
        st = os.lstat(self.hot / rel)
        if st.st_ino != ino:
            return ("wait",)  # not the inode the truncate barrier protects: look again with the right one
        lw = self.last_write.get(ino)
        if time.time() - st.st_mtime < quiet or (lw is not None and time.monotonic() - lw < quiet):
            return ("wait",)
        seq = self.write_seq.get(ino, 0)
        mark = (seq, st.st_mtime_ns)
        flushed = lw is None or self.last_fsync.get(ino, 0.0) >= lw
        if not flushed and self._flushed.get(ino) != mark:
            return ("flush", ino, mark)  # pages of it may still be dirty in the kernel: flush, then judge
        kind = classify(rel)
        ok, why = self._check_content(rel, ino, kind, st.st_size)
        if not ok and not why.startswith("corrupt") and self._flushed.get(ino) != mark:
            return ("flush", ino, mark)  # incomplete here; maybe complete in the kernel's dirty pages
        return ("checked", st, seq, kind, ok, why)

    def _check_content(self, rel: str, ino: int, kind: Kind, size: int) -> tuple[bool, str]:
        """Map the file and apply the seal rule. Truncates of this inode wait for the probe (truncate_barrier),
        so the mapping cannot lose pages under us."""
        if size == 0:
            return False, "empty"
        fd = os.open(self.hot / rel, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            st = os.fstat(fd)
            if st.st_ino != ino:
                return False, "replaced while being checked"
            size = min(size, st.st_size)
            if size == 0:
                return False, "empty"
            with mmap.mmap(fd, size, prot=mmap.PROT_READ) as m:
                return is_sealed(kind, m, size, self.seal_params)
        finally:
            os.close(fd)

    # ------------------------------------------------------------------ upload

    async def _uploader_loop(self) -> None:
        backoff = 1.0
        await self._sweep_done.wait()
        while True:
            if not self.store_writable():
                await trio.sleep(1.0)  # never two writers uploading: wait for the lease
                continue
            rels = self._next_uploads()
            if not rels:
                self._upload_wakeup = trio.Event()
                with trio.move_on_after(1.0):
                    await self._upload_wakeup.wait()
                continue
            self._uploading.update(rels)
            try:
                try:
                    failed = await self._upload(rels)
                except (ObjectStoreError, OSError, sqlite3.Error) as err:  # the batch's commit failed
                    failed = [(rel, err) for rel in rels]
                retry = False
                for rel, err in failed:
                    if isinstance(err, BandwidthLimiterClosed):
                        return  # shutting down; the catalog says SEALED, so the next mount resumes it
                    self.stats.upload_failures += 1
                    self.stats.last_error = f"upload {rel}: {err}"
                    if isinstance(err, ValueError):  # the store refuses this segment's object key: never tiered
                        log.error("%s cannot be tiered (%s); it stays local", rel, err)
                        await self._keep_local(rel)
                        continue
                    log.warning("upload of %s failed (%s); retrying in %.1f s", rel, err, backoff)
                    e = self.entries.get(rel)
                    if e is not None and e.state is not State.HOT:
                        self._upload_queue.push(rel, e.mtime_ns)
                    retry = True
                if retry:
                    await trio.sleep(backoff * (0.5 + random.random()))
                    backoff = min(backoff * 2, float(self.config["upload.retry_max_seconds"]))
                else:
                    backoff = 1.0
            finally:
                self._uploading.difference_update(rels)

    async def _keep_local(self, rel: str) -> None:
        self._untierable.add(rel)
        e = self.entries.get(rel)
        if e is not None:
            try:
                await self._db(self.catalog.remove, rel, [], time.time())
            except sqlite3.Error as err:
                log.warning("could not drop the catalog row of %s (%s)", rel, err)
                return
            if self.entries.get(rel) is e:
                del self.entries[rel]
                self._drop(e)

    def _next_uploads(self) -> list[str]:
        """Oldest first (lowest mtime): the next segment waiting for upload and, while the oldest ones are small
        (one block or less, where per-object requests and commits cost more than the bytes), up to
        _UPLOAD_BATCH of them, uploaded together and committed in one transaction."""
        out: list[str] = []
        busy: list[tuple[int, str]] = []  # a failed upload backing off is still in _uploading: it stays queued
        while len(out) < _UPLOAD_BATCH:
            item = self._upload_queue.pop()
            if item is None:
                break
            mtime_ns, rel = item
            e = self.entries.get(rel)
            if e is None or e.state not in (State.SEALED, State.UPLOADING):
                continue
            if rel in self._uploading:
                busy.append(item)
                continue
            if e.mtime_ns != mtime_ns:  # sealed again since it was queued: its place follows its new mtime
                self._upload_queue.push(rel, e.mtime_ns)
                continue
            small = e.size <= self.block
            if out and not small:
                self._upload_queue.push(rel, mtime_ns)  # a big one goes alone, next
                break
            out.append(rel)
            if not small:
                break
        for mtime_ns, rel in busy:
            self._upload_queue.push(rel, mtime_ns)
        return out

    async def _upload(self, rels: list[str]) -> list[tuple[str, Exception]]:
        """Upload one segment, or a batch of small ones with their requests overlapping, then commit every one
        still unchanged as TIERED in one transaction: durable before any local byte may be dropped. Returns the
        segments whose upload failed, with the error; raises if the commit fails (nothing is tiered then).

        SEALED -> UPLOADING is kept in memory only: a crash resumes both the same way (upload again, same keys),
        and writing it would cost one more synchronous commit per segment."""
        t0 = time.monotonic()
        batch: list[tuple[Entry, int, int]] = []  # entry, ino, write seq when sealed
        for rel in rels:
            e = self.entries[rel]
            batch.append((e, e.ino, self._sealed_at_seq.get(e.file_id, self.write_seq.get(e.ino, 0))))
            if e.state is State.SEALED:
                e.state = State.UPLOADING
        results: list[tuple[int, list[int], list[str]] | ShortRead | None] = [None] * len(batch)
        failed: list[tuple[str, Exception]] = []

        async def put(i: int, e: Entry) -> None:
            try:  # one big segment: its own thread, as ever; small ones: bounded, so readers keep store slots
                results[i] = await trio.to_thread.run_sync(
                    self._upload_blocking, e, limiter=self._small_limiter if len(batch) > 1 else None)
            except ShortRead as err:
                results[i] = err  # the file shrank since it was sealed: void this generation, seal it again
            except (ObjectStoreError, OSError, ValueError) as err:
                failed.append((e.path, err))

        async with trio.open_nursery() as nursery:
            for i, (e, _, _) in enumerate(batch):
                nursery.start_soon(put, i, e)
        failpoints.hit("tier.after_put")
        now = time.time()
        done: list[tuple[tuple[Entry, int, int], tuple]] = []
        voided: list[Entry] = []
        void_keys: list[str] = []
        for (e, ino, seq), res in zip(batch, results):
            if res is None:
                continue
            shrank = isinstance(res, ShortRead)
            crc, block_crcs, keys = (0, [], res.keys) if isinstance(res, ShortRead) else res
            if (shrank or self.write_seq.get(ino, 0) != seq or self.entries.get(e.path) is not e
                    or e.state is not State.UPLOADING):
                log.info("%s changed during upload%s; discarding gen %d objects", e.path,
                         f" ({res})" if shrank else "", e.generation)
                void_keys += keys
                if self.entries.get(e.path) is e and self.is_live(e):
                    voided.append(e)
                continue
            done.append(((e, ino, seq), (crc, block_crcs, keys, now)))
        if not done and not void_keys:
            return failed
        gen0 = await self._db(self.catalog.allocate, len(voided)) if voided else 0
        # rows to commit are copies, made with no await before the commit is queued (so they carry the current
        # paths; a rename queues its own transaction after ours): memory changes only once it is durable
        rows = [self._tiered_copy(e, res) for (e, _, _), res in done]
        void_rows = [self._hot_copy(e, gen0 + i) for i, e in enumerate(voided)]
        await self._db(self.catalog.put_many, rows + void_rows, void_keys, now)
        failpoints.hit("tier.after_commit")
        for e, row in zip(voided, void_rows):
            if self.is_live(e):
                self._become(e, row)
        late: list[Entry] = []
        for ((e, ino, seq), _), row in zip(done, rows):
            if self.entries.get(e.path) is not e or not self.is_live(e):
                continue  # unlinked while the commit ran: its row and objects are gone already
            self._become(e, row)
            if self.write_seq.get(ino, 0) != seq:
                late.append(e)  # written while the commit ran: the objects hold the old content
                continue
            self.tiered[ino] = e
            self._sealed_at_seq.pop(e.file_id, None)  # a later seal (after a rewrite) records its own
            self.cache_bytes += e.resident_bytes()
            self.stats.uploads += 1
            self.stats.upload_bytes += e.size
            self.observe("upload", time.monotonic() - t0, e.size)
            log.log(logging.INFO if len(batch) == 1 else logging.DEBUG, "tiered %s: %d bytes in %d objects, "
                    "crc32c %08x, %.2f s", e.path, e.size, len(e.objects), e.crc32c, time.monotonic() - t0)
        self.store_down_since = None
        if len(batch) > 1 and done:
            log.info("tiered %d small segments (%d bytes), %s .. %s, in %.2f s", len(done),
                     sum(d[0][0].size for d in done), done[0][0][0].path, done[-1][0][0].path, time.monotonic() - t0)
        if late:
            await self._void_late(late)
        return failed

    async def _void_late(self, late: list[Entry]) -> None:
        """Segments written while their TIERED commit ran: not in `tiered` yet, so nothing was evicted and the
        hot file is whole. They turn HOT at a new generation (to be sealed again) and their objects go."""
        keys = [k for e in late for k in e.objects]
        for e in late:
            log.info("%s written while its upload was committed; discarding gen %d objects", e.path, e.generation)
        gen0 = await self._db(self.catalog.allocate, len(late))
        rows = [self._hot_copy(e, gen0 + i) for i, e in enumerate(late)]
        await self._db(self.catalog.put_many, rows, keys, time.time())
        for e, row in zip(late, rows):
            if self.is_live(e) and self.tiered.get(e.ino) is not e:
                self._become(e, row)

    @staticmethod
    def _tiered_copy(e: Entry, res: tuple) -> Entry:
        crc, block_crcs, keys, now = res
        row = dataclasses.replace(e, crc32c=crc, block_crcs=block_crcs, objects=keys, state=State.TIERED,
                                  last_access=now, state_since=now, pins=0)
        row.resident = bytearray(b"\xff" * ((row.nblocks + 7) // 8))
        return row

    def _hot_copy(self, e: Entry, generation: int) -> Entry:
        """The row of a file that is HOT again, at a new generation (its old objects are being deleted)."""
        return dataclasses.replace(e, state=State.HOT, generation=generation, objects=[], block_crcs=[], crc32c=None,
                                   resident=bytearray(), format="raw", chunk_bytes=self.chunk, state_since=time.time(),
                                   pins=0)

    @staticmethod
    def _become(e: Entry, row: Entry) -> None:
        """Apply a committed row to the live entry (same identity object: indexes need no update)."""
        for f in dataclasses.fields(row):
            if f.name not in ("path", "pins"):  # the path belongs to renames, pins to readers
                setattr(e, f.name, getattr(row, f.name))

    def _upload_blocking(self, e: Entry) -> tuple[int, list[int], list[str]]:
        """Read the hot file chunk by chunk, PUT each chunk, verify, and return (crc, block crcs, keys)."""
        keys = layout.chunk_keys(self.store_id, e.path, e.generation, "raw", e.size, e.chunk_bytes)
        crc = 0
        block_crcs: list[int] = []
        verify_full = self.config["upload.verify"] == "full"
        fd = os.open(self.hot / e.path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            if e.ino and os.fstat(fd).st_ino != e.ino:
                raise ShortRead(keys, f"{e.path} was replaced since it was sealed")
            # TIERED says every block is resident: the bytes must be durable before that commit
            os.fdatasync(fd)
            for i, key in enumerate(keys):
                off = i * e.chunk_bytes
                data = os.pread(fd, min(e.chunk_bytes, e.size - off), off)
                if len(data) != min(e.chunk_bytes, e.size - off):
                    raise ShortRead(keys, f"short read of {e.path} at {off}: it shrank since it was sealed")
                self._fence(key)
                chunk_crc = crc32c.crc32c(data)
                crc = crc32c.crc32c(data, crc)
                mv = memoryview(data)
                block_crcs += [crc32c.crc32c(mv[b:b + e.block_bytes]) for b in range(0, len(data), e.block_bytes)]
                if self.upload_limit is not None:
                    self.upload_limit.acquire(len(data))  # shared by every uploader thread
                self.store.put(key, data, metadata={"crc32c": f"{chunk_crc:08x}"})
                failpoints.hit("tier.chunk_put")
                if verify_full:
                    back = self.store.get(key)
                    if len(back) != len(data) or crc32c.crc32c(back) != chunk_crc:
                        raise ObjectStoreError(key, "verification failed: the object differs from what was put")
                else:
                    info = self.store.head(key)
                    if info is None or info.size != len(data):
                        raise ObjectStoreError(key, "verification failed: size mismatch")
        finally:
            os.close(fd)
        return crc, block_crcs, keys

    # ------------------------------------------------------------------ reads of tiered segments

    def _fence(self, key: str) -> None:
        """Every object write or delete of a writable mount checks the lease first: a daemon whose lease lapsed
        (a throttled upload can outlive the ttl) must not write over a new writer's store."""
        if not self.store_writable():
            raise ObjectStoreError(key, f"refused: the writer lease (epoch {self.lease.epoch if self.lease else 0}) "
                                        f"is not held (fenced)")

    def _fd(self, e: Entry) -> int:
        """The engine's O_RDWR fd of a tiered file, by file id: opened while the file has its name, kept across
        renames and after an unlink while open, so a punch or an install always hits this file's inode."""
        fd = self._fds.get(e.file_id)
        if fd is None:
            fd = os.open(self.hot / e.path, os.O_RDWR | os.O_NOFOLLOW)
            if os.fstat(fd).st_ino != e.ino:
                os.close(fd)
                raise ReadFailed(f"{e.path}: the hot file was replaced behind the daemon's back")
            self._fds[e.file_id] = fd
        return fd

    def _forget_fd(self, file_id: int) -> None:
        fd = self._fds.pop(file_id, None)
        if fd is not None:
            os.close(fd)

    @staticmethod
    def _pinned(e: Entry) -> list[tuple[int, int]]:
        """Byte ranges that never leave the hot file: the first page of every segment (startup recovery),
        and the last page of every ConsumeQueue segment (cleaning reads its last unit)."""
        out = [(0, min(PAGE, e.size))]
        if e.kind in (Kind.CONSUMEQUEUE.value, Kind.BATCHCONSUMEQUEUE.value):
            out.append(((e.size - 1) // PAGE * PAGE, e.size))
        return out

    def _needs_fetch(self, e: Entry, off: int, end: int) -> list[int]:
        # read-only: the sparse local files hold no pinned pages; never serve a hole as zeros
        if not self.read_only and any(p0 <= off and end <= p1 for p0, p1 in self._pinned(e)):
            return []
        return [b for b in range(off // e.block_bytes, (end - 1) // e.block_bytes + 1) if not e.is_resident(b)]

    async def read(self, e: Entry, ino: int, fh: int, off: int, size: int) -> bytes:
        end = min(off + size, e.size)
        if off >= end:
            return b""
        e.last_access = time.time()
        stream = self.streams.get(fh)
        if stream is None:
            c = self.config
            stream = self.streams[fh] = ReadAhead(int(c["readahead.initial_blocks"]), int(c["readahead.batch_blocks"]),
                                                  int(c["readahead.max_blocks"]), tolerance=e.block_bytes)
        window = stream.on_read(off, end)
        waited = False
        deadline = trio.current_time() + float(self.config["objectstore.read_timeout_seconds"])
        for _ in range(8):
            if self.tiered.get(ino) is not e:
                return os.pread(fh, end - off, off)  # rewritten meanwhile: now fully local
            missing = self._needs_fetch(e, off, end)
            if not missing:
                for b in range(off // e.block_bytes, (end - 1) // e.block_bytes + 1):
                    stream.consumed(b)
                if window:
                    self._prefetch(e, stream, (end - 1) // e.block_bytes + 1, window)
                if waited:
                    self.stats.reads_waited += 1
                else:
                    self.stats.reads_local += 1
                return os.pread(self._fd(e), end - off, off)  # no await since the residency check
            waited = True
            if window:
                self._prefetch(e, stream, missing[-1] + 1, window)
            await self._ensure(e, missing, deadline)
        raise ReadFailed(f"{e.path}: blocks kept being evicted while reading {off}+{size}")

    def _runs(self, e: Entry, blocks: list[int], max_blocks: int) -> list[tuple[int, int]]:
        """Group blocks into (first, count) runs that stay inside one chunk object."""
        per_chunk = e.chunk_bytes // e.block_bytes
        runs: list[tuple[int, int]] = []
        for b in sorted(set(blocks)):
            if runs:
                first, n = runs[-1]
                if b == first + n and n < max_blocks and b // per_chunk == first // per_chunk:
                    runs[-1] = (first, n + 1)
                    continue
            runs.append((b, 1))
        return runs

    async def _ensure(self, e: Entry, blocks: list[int], deadline: float) -> None:
        """Make `blocks` resident (fetching what no one is fetching yet), bounded by the read deadline. The
        error a reader gets is the one of the fetch it waited for."""
        fetches: dict[int, Fetch] = {}
        todo = []
        for b in blocks:
            f = self._inflight.get((e.file_id, e.generation, b))
            if f is not None:
                fetches[id(f)] = f
            else:
                todo.append(b)
        for first, n in self._runs(e, todo, 8):
            f = self._start_fetch(e, first, n, prefetch=False)
            fetches[id(f)] = f
        if any(f.gave_up for f in fetches.values()):
            # a read of these blocks already waited the whole bound and the fetch is still stuck: the kernel's
            # retry of a failed read-ahead lands here, and must not double the bound the caller sees
            raise ReadFailed(f"{e.path}: object store did not answer within "
                             f"{self.config['objectstore.read_timeout_seconds']} s (fetch still in flight)")
        with trio.move_on_at(deadline) as scope:
            for f in fetches.values():
                await f.done.wait()
        if scope.cancelled_caught:
            for f in fetches.values():
                f.gave_up = not f.done.is_set()
            raise ReadFailed(f"{e.path}: object store did not answer within "
                             f"{self.config['objectstore.read_timeout_seconds']} s")
        for f in fetches.values():
            if f.error:
                raise ReadFailed(f.error)

    def _start_fetch(self, e: Entry, first: int, n: int, prefetch: bool) -> Fetch:
        f = Fetch()
        for b in range(first, first + n):
            self._inflight[(e.file_id, e.generation, b)] = f
        self._nursery_start(self._fetch, e, first, n, f, prefetch)
        return f

    def _prefetch(self, e: Entry, stream: ReadAhead, start: int, window: int) -> None:
        budget = int(self.config["readahead.budget_bytes"])
        # The window slides by the one block each read uncovers; extend it to the end of its aligned group, so
        # each GET brings a whole group (PREFETCH_GROUP_BYTES) instead of one block per read.
        group = max(1, PREFETCH_GROUP_BYTES // e.block_bytes)
        hi = min(-(-min(start + window, e.nblocks) // group) * group, e.nblocks)
        want = [b for b in range(start, hi)
                if not e.is_resident(b) and (e.file_id, e.generation, b) not in self._inflight]
        for first, n in self._runs(e, want, group):
            nbytes = n * e.block_bytes
            if self.prefetch_inflight + nbytes > budget:
                return
            self.prefetch_inflight += nbytes
            stream.prefetched.update(range(first, first + n))
            self._start_fetch(e, first, n, prefetch=True)

    def _object_of(self, e: Entry, first: int) -> str:
        return e.objects[0] if e.format == "lz4c" else e.objects[first // (e.chunk_bytes // e.block_bytes)]

    async def _read_blocks(self, e: Entry, first: int, n: int) -> bytes:
        """The content of blocks [first, first+n) from the object store: one ranged GET of a raw chunk object,
        or of the covering lz4 blocks of an lz4c object (decompressed and checked off the trio loop)."""
        key = self._object_of(e, first)
        if e.format == "lz4c":
            footer = await self._footer(key)
            off, length = lz4c.block_span(footer, first, n)
            packed = await self._io(self.store.get_range, key, off, length)
            return await trio.to_thread.run_sync(lz4c.decode_blocks, footer, first, n, packed)
        per_chunk = e.chunk_bytes // e.block_bytes
        start = (first - first // per_chunk * per_chunk) * e.block_bytes
        length = sum(e.block_len(b) for b in range(first, first + n))
        return await self._io(self.store.get_range, key, start, length)

    async def _footer(self, key: str) -> "lz4c.Footer":
        """An lz4c object's block table, fetched once (trailer, then footer) and kept in memory."""
        footer = self._footers.get(key)
        if footer is None:
            footer = await self._io(read_lz4c_footer, self.store, key)
            self._footers[key] = footer
        return footer

    async def _fetch(self, e: Entry, first: int, n: int, fetch: Fetch, prefetch: bool) -> None:
        gen = e.generation
        key = self._object_of(e, first)
        error = None
        t0 = time.monotonic()
        e.pins += 1  # the evictor leaves a file alone while a fetch for it is in flight
        try:
            for attempt in (1, 2):
                try:
                    data = await self._read_blocks(e, first, n)
                except lz4c.Lz4cError as err:
                    self.stats.corrupt_objects += 1
                    error = f"object {key} of {e.path} is corrupt: {err}"
                    log.error("%s (attempt %d)", error, attempt)
                    self._footers.pop(key, None)
                    continue
                except ObjectNotFound:
                    error = f"object {key} of {e.path} is missing"
                    break
                except ObjectStoreError as err:
                    error = f"object {key} of {e.path}: {err}"
                    self.store_down_since = self.store_down_since or time.time()
                    break
                bad = self._verify_blocks(e, first, n, data)
                if bad is None:
                    self._install_blocks(e, gen, first, n, data)
                    self.stats.fetches += 1
                    self.stats.fetch_bytes += len(data)
                    self.observe("download", time.monotonic() - t0, len(data))
                    if prefetch:
                        self.stats.prefetch_bytes += len(data)
                    error = None
                    break
                self.stats.corrupt_objects += 1
                error = f"object {key} of {e.path} is corrupt: block {bad} fails its crc32c"
                log.error("%s (attempt %d)", error, attempt)
        except Exception as err:  # never let a fetch task take the nursery down
            error = f"object {key} of {e.path}: {type(err).__name__}: {err}"
            log.exception("fetch failed")
        finally:
            e.pins -= 1
            if prefetch:
                self.prefetch_inflight -= n * e.block_bytes
            if error:
                self.stats.fetch_errors += 1
                self.stats.last_error = error
                log.error("read of %s failed: %s", e.path, error)
            for b in range(first, first + n):
                k = (e.file_id, gen, b)
                if self._inflight.get(k) is fetch:
                    del self._inflight[k]
            fetch.error = None if prefetch else error
            fetch.done.set()

    def _verify_blocks(self, e: Entry, first: int, n: int, data: bytes) -> int | None:
        mv = memoryview(data)
        pos = 0
        for b in range(first, first + n):
            ln = e.block_len(b)
            if len(data) < pos + ln or crc32c.crc32c(mv[pos:pos + ln]) != e.block_crcs[b]:
                return b
            pos += ln
        return None

    def _install_blocks(self, e: Entry, gen: int, first: int, n: int, data: bytes) -> None:
        """Write fetched blocks into the holes, unless the file changed meanwhile. No await in here."""
        if e.state is not State.TIERED or e.generation != gen or not self.is_live(e) or self.tiered.get(e.ino) is not e:
            return
        fd = self._fd(e)
        pos = 0
        mv = memoryview(data)
        for b in range(first, first + n):
            ln = e.block_len(b)
            if not e.is_resident(b):
                os.pwrite(fd, mv[pos:pos + ln], b * e.block_bytes)
                e.set_resident(b, True)
                self.cache_bytes += ln
            pos += ln
        self._dirty_residency.add(e.file_id)

    # ------------------------------------------------------------------ writes into tiered segments

    async def before_write(self, e: Entry, ino: int, off: int, data: bytes) -> bool:
        """Called before a write lands in a tiered segment. Returns False for an identical rewrite (a no-op:
        index header at shutdown, BLANK after a crash); otherwise re-materialises the file as HOT."""
        end = min(off + len(data), e.size)
        deadline = trio.current_time() + float(self.config["objectstore.read_timeout_seconds"])
        e.pins += 1
        try:
            if off < end and await self._make_resident(e, off, end, deadline):
                if self.tiered.get(ino) is e and off + len(data) <= e.size:
                    if os.pread(self._fd(e), len(data), off) == bytes(data):
                        self.stats.identical_rewrites += 1
                        return False
            if self.tiered.get(ino) is not e:
                return True
            await self._rematerialise(e, ino, e.size, f"write at {off}+{len(data)}", deadline)
            return True
        finally:
            e.pins -= 1

    async def before_truncate(self, e: Entry, ino: int, new_size: int) -> None:
        """Called before a tiered segment is truncated (setattr, or an open with O_TRUNC): the file becomes HOT
        with only the bytes the truncate keeps fetched first. Without this the hot file would shrink and regrow
        under a TIERED row, and the old generation's blocks would be fetched into the new content."""
        if self.tiered.get(ino) is not e or new_size == e.size:
            return
        deadline = trio.current_time() + float(self.config["objectstore.read_timeout_seconds"])
        e.pins += 1
        try:
            await self._rematerialise(e, ino, min(new_size, e.size), f"truncate to {new_size}", deadline)
        finally:
            e.pins -= 1

    async def _rematerialise(self, e: Entry, ino: int, keep: int, why: str, deadline: float) -> None:
        """Make [0, keep) resident and durable, then turn the tiered row HOT at a new generation and queue the
        old objects' deletion, in one transaction. The caller pins `e`: the evictor cannot punch what was just
        fetched while this waits for the disk or the catalog."""
        log.info("%s of tiered %s: re-materialising (gen %d -> new)", why, e.path, e.generation)
        if keep and not await self._make_resident(e, 0, keep, deadline + 600):
            raise ReadFailed(f"{e.path}: could not re-materialise for a {why}")
        if self.tiered.get(ino) is not e:
            return  # another writer re-materialised it meanwhile
        fd = self._fd(e)
        await trio.to_thread.run_sync(os.fdatasync, fd)
        failpoints.hit("tier.rewrite")
        await failpoints.pause("tier.rematerialise_synced")  # tests: the evictor runs while this waits
        if self.orphans.get(ino) is e:  # unlinked while open: no row to rewrite, the objects may simply go
            del self.orphans[ino]
            self._drop(e)
            await self._db(self.catalog.schedule_deletes, e.objects,
                           time.time() + float(self.config["delete.grace_seconds"]))
            return
        gen = await self._db(self.catalog.allocate, 1)
        if self.tiered.get(ino) is not e:
            return
        row = self._hot_copy(e, gen)
        old_keys = e.objects
        not_before = time.time() + float(self.config["delete.grace_seconds"])
        await self._db(self.catalog.replace, row, old_keys, not_before, ("cidx",))
        failpoints.hit("tier.rewritten")
        # committed: from here the hot file is the only copy, so the entry leaves `tiered` whatever else changed
        if self.tiered.get(ino) is e:
            del self.tiered[ino]
            self.cache_bytes -= e.resident_bytes()
        self._become(e, row)
        self._dirty_residency.discard(e.file_id)
        for k in old_keys:
            self._footers.pop(k, None)
        self.stats.rewrites += 1

    async def _make_resident(self, e: Entry, off: int, end: int, deadline: float) -> bool:
        """Fetch until [off, end) is resident; evictions can race a fetch, so retry a few times. True once
        nothing is missing, or once a concurrent rewrite made the file HOT (then it is all local anyway)."""
        for _ in range(8):
            if self.tiered.get(e.ino) is not e:
                return True
            missing = self._needs_fetch(e, off, end)
            if not missing:
                return True
            await self._ensure(e, missing, deadline)
        return self.tiered.get(e.ino) is not e or not self._needs_fetch(e, off, end)

    # ------------------------------------------------------------------ eviction

    async def _evictor_loop(self) -> None:
        while True:
            await trio.sleep(0.5)
            try:
                await self._evict_once()
                await self._persist_residency()
            except (OSError, sqlite3.Error) as err:
                log.warning("eviction pass failed: %s", err)

    def _evictable(self, e: Entry) -> bool:
        return (e.pins == 0 and e.state is State.TIERED and self.is_live(e) and self.tiered.get(e.ino) is e
                and e.ino not in self.orphans)

    async def _evict_once(self) -> None:
        cap = int(self.config["cache.max_bytes"])
        if self.cache_bytes <= cap * float(self.config["cache.high_watermark"]):
            return
        target = cap * float(self.config["cache.low_watermark"])
        now = time.time()
        # least recently used first: a heap (O(n) to build, O(log n) per victim taken), not a sort of every entry
        victims = [(e.last_access, n, e) for n, e in enumerate(self.tiered.values()) if now - e.last_access > 1.0]
        heapq.heapify(victims)
        while self.cache_bytes > target and victims:
            # up to _EVICT_BATCH segments per transaction: many small segments must not cost a commit each
            picked: list[tuple[Entry, int, list[int]]] = []
            expect = self.cache_bytes
            while victims and expect > target and len(picked) < _EVICT_BATCH:
                e = heapq.heappop(victims)[2]
                if not self._evictable(e):
                    continue  # rewritten, unlinked or pinned while an earlier batch committed
                blocks = [b for b in range(e.nblocks) if e.is_resident(b)]
                if not blocks:
                    continue
                expect -= sum(e.block_len(b) for b in blocks)
                picked.append((e, e.generation, blocks))
            if not picked:
                break
            # the bitmaps without these blocks, durable before any punch: a crash now can only cost a re-fetch.
            # Memory drops the bits first (a reader meanwhile re-fetches; a block fetched again is not punched).
            for e, _, blocks in picked:
                for b in blocks:
                    if e.is_resident(b):
                        e.set_resident(b, False)
                        self.cache_bytes -= e.block_len(b)
            rows = [dataclasses.replace(e, resident=bytearray(e.resident), pins=0) for e, _, _ in picked]
            await self._db(self.catalog.save_residency, rows)
            failpoints.hit("tier.evict")
            await failpoints.pause("tier.evict_saved")  # tests: names change between the commit and the punches
            for e, gen, blocks in picked:
                if e.generation == gen and self.is_live(e) and self.tiered.get(e.ino) is e:
                    try:
                        self._punch(e, blocks)
                    except OSError as err:  # one file's failure must not leave the others half-done
                        log.warning("evicting %s failed (%s); its blocks are fetched again when read", e.path, err)

    def _punch(self, e: Entry, blocks: list[int]) -> None:
        """Punch the given non-resident blocks out of the hot file through the file's own fd, keeping pinned
        pages. A block fetched again (or being fetched) meanwhile is left alone. No await in here."""
        fd = self._fd(e)
        pins = self._pinned(e) if not self.read_only else []
        freed = 0
        for first, n in self._runs(e, blocks, 1 << 30):
            for b in range(first, first + n):
                if e.is_resident(b) or (e.file_id, e.generation, b) in self._inflight:
                    continue
                lo, hi = b * e.block_bytes, b * e.block_bytes + e.block_len(b)
                cuts = [(lo, hi)]
                for p0, p1 in pins:
                    cuts = [c for c0, c1 in cuts for c in ((c0, min(c1, p0)), (max(c0, p1), c1)) if c[1] > c[0]]
                for c0, c1 in cuts:
                    punch_hole(fd, c0, c1 - c0)
                freed += hi - lo
                self.stats.evicted_blocks += 1
                for s in self.streams.values():
                    s.expired_unread(b)
        self.stats.evicted_bytes += freed

    def residency_changed(self, e: Entry) -> None:
        """Someone rewrote e's row without its live bits: persist them again (after an fdatasync)."""
        self._dirty_residency.add(e.file_id)

    async def _persist_residency(self) -> None:
        """Copy the bitmaps, make the hot files' data durable, then persist the copies: a bit can only reach the
        catalog after the bytes it stands for are on disk."""
        if not self._dirty_residency:
            return
        dirty = [self.files[i] for i in self._dirty_residency if i in self.files]
        self._dirty_residency.clear()
        dirty = [e for e in dirty if self.tiered.get(e.ino) is e and e.file_id in self._fds]
        before = [bytes(e.resident) for e in dirty]
        fds = [self._fds[e.file_id] for e in dirty]
        try:
            await trio.to_thread.run_sync(lambda: [os.fdatasync(fd) for fd in fds])
            # a bit goes to the catalog only if it was set before the fdatasync (its bytes are durable) and is
            # still set now (not given up by an eviction meanwhile); no await between this and queueing the save
            rows = []
            for e, old in zip(dirty, before):
                bits = bytearray(a & b for a, b in zip(old, e.resident))
                rows.append(dataclasses.replace(e, resident=bits, pins=0))
                if bits != e.resident:
                    self._dirty_residency.add(e.file_id)  # set since: persisted by a later pass
            await self._db(self.catalog.save_residency, rows)
        except BaseException:
            self._dirty_residency.update(e.file_id for e in dirty)
            raise

    # ------------------------------------------------------------------ deferred deletes

    async def _janitor_loop(self) -> None:
        while True:
            await trio.sleep(2.0)
            if not self.store_writable():
                continue
            try:
                keys = await self._db(self.catalog.due_deletes, time.time())
                if self.snapshotter is not None:
                    keys = self.snapshotter.unreferenced(keys)  # a read-only mount may still read these
                if not keys:
                    continue
                self._fence(keys[0])
                await self._io(self._fenced_delete, keys)
                await self._db(self.catalog.deleted, keys)
                log.info("deleted %d objects", len(keys))
            except (ObjectStoreError, sqlite3.Error) as err:
                log.warning("object deletes failed (%s); will retry", err)

    def _fenced_delete(self, keys: list[str]) -> None:
        """Blocking: delete objects only while the store itself says the lease epoch is ours (a writer taken
        over meanwhile must not delete what the new one serves)."""
        if self.lease is not None:
            self.lease.verify()
        self.store.delete_many(keys)

    def release_stream(self, fh: int) -> None:
        self.streams.pop(fh, None)
