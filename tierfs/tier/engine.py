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
import errno
import heapq
import logging
import mmap
import os
import random
import sqlite3
import time
import uuid
from dataclasses import dataclass
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
from tierfs.tier.catalog import Catalog, Entry, State
from tierfs.tier.compaction import Compactor
from tierfs.tier import snapshot
from tierfs.tier import storeconfig
from tierfs.tier.lease import WriterLease
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
    def __init__(self, hot_dir: Path, state_dir: Path, config: Config, read_only: bool = False):
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
        self.catalog = Catalog(state_dir / "catalog.db")
        self.lease: WriterLease | None = None  # writable mounts: set by take_lease() before serving
        if not read_only:  # a read-only cache is no hot dir for `tierfs fsck` to check (or repair) the store by
            storeconfig.save(state_dir, self._store_url(), self._store_options(), self.store_id)  # for `tierfs fsck`
        self.entries: dict[str, Entry] = {}  # every catalog row, by path
        self.tiered = TieredIndex()  # TIERED entries by hot-dir st_ino: the FUSE fast path
        self._ino_of: dict[str, int] = {}
        self._fds: dict[str, int] = {}  # engine-owned O_RDWR fds of tiered hot files
        self.last_write: dict[int, float] = {}
        self.last_fsync: dict[int, float] = {}
        self.write_seq: dict[int, int] = {}
        self._inflight: dict[tuple[str, int, int], trio.Event] = {}
        self._gave_up: set[trio.Event] = set()  # in-flight fetches a reader already timed out on
        self._untierable: set[str] = set()  # segments whose object keys the store refuses: kept local
        self._refused: dict[str, str] = {}  # path -> the corrupt-content reason last logged for it
        self._fetch_errors: dict[tuple[str, int, int], str] = {}
        self._dirty_residency: set[str] = set()
        self._seal_candidates: set[str] = set()
        # (size, mtime, ctime, write seq) of segments whose content was found incomplete: a scan skips them
        # until one of those changes, so a periodic scan re-reads only what may have changed
        self._unsealed: dict[str, tuple[int, int, int, int]] = {}
        self._ns_changes = 0  # unlinks and renames seen: a seal batch re-checks its paths when this moved
        self._sealed_at_seq: dict[str, int] = {}  # write_seq when sealed: a later write voids the upload
        self._upload_queue = UploadQueue()
        self._upload_wakeup = trio.Event()
        self._uploading: set[str] = set()
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
        """On mount: load the catalog, match it against the hot dir, resume what was in flight."""
        now = time.time()
        grace = float(self.config["delete.grace_seconds"])
        for e in self.catalog.load_all():
            try:
                st = os.lstat(self.hot / e.path)
            except FileNotFoundError:
                if self.read_only:  # the objects belong to the writer; never queue their deletion from here
                    log.error("read-only cache: %s is missing from the local tree; not served", e.path)
                    continue
                log.warning("catalog row %s has no hot file (deleted while unmounted); deleting its objects", e.path)
                self.catalog.remove(e.path, e.objects, now + grace)
                continue
            self.entries[e.path] = e
            self._ino_of[e.path] = st.st_ino
            if e.state in (State.SEALED, State.UPLOADING):
                self._upload_queue.push(e.path, e.mtime_ns)
            elif e.state is State.TIERED:
                if len(e.resident) != (e.nblocks + 7) // 8:
                    e.resident = bytearray((e.nblocks + 7) // 8)
                self.tiered[st.st_ino] = e
                self.cache_bytes += e.resident_bytes()
        log.info("catalog: %d rows, %d tiered, %d to upload, %d deletes pending", len(self.entries),
                 len(self.tiered), len(self._upload_queue), self.catalog.pending_delete_count())

    async def run(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        if self.read_only:
            nursery.start_soon(self._evictor_loop)  # fetch, read-ahead and evict; nothing else
            return
        if not self.enabled:
            return
        if self.lease is not None:
            nursery.start_soon(self.lease.run, self.limiter)
        if self.snapshotter is not None:
            nursery.start_soon(self.snapshotter.run)
        nursery.start_soon(self._sealer_loop)
        nursery.start_soon(self._sweep_stale_uploads)
        if self.upload_limit is not None:
            nursery.start_soon(self._close_limiter_on_cancel)
        for _ in range(int(self.config["upload.concurrency"])):
            nursery.start_soon(self._uploader_loop)
        nursery.start_soon(self._evictor_loop)
        nursery.start_soon(self._janitor_loop)
        nursery.start_soon(self.compactor.run)

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
        if self.snapshotter is not None and self.enabled:
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
        self.last_write[ino] = time.monotonic()
        self.write_seq[ino] = self.write_seq.get(ino, 0) + 1

    def note_fsync(self, ino: int, rel: str) -> None:
        self.last_fsync[ino] = time.monotonic()
        if classify(rel).is_segment:
            self._seal_candidates.add(rel)

    def attrs_override(self, ino: int) -> Entry | None:
        return self.tiered.get(ino)

    async def on_unlink(self, rel: str) -> None:
        self._ns_changes += 1
        self._untierable.discard(rel)
        self._refused.pop(rel, None)
        self._unsealed.pop(rel, None)
        e = self.entries.pop(rel, None)
        ino = self._ino_of.pop(rel, None)
        if e is None:
            return
        # only what is in `tiered` counts in cache_bytes (an entry whose TIERED commit is running is not yet)
        if ino is not None and self.tiered.pop(ino, None) is not None:
            self.cache_bytes -= e.resident_bytes()
        self._forget_fd(rel)
        grace = float(self.config["delete.grace_seconds"])
        await self._db(self.catalog.remove, rel, e.objects, time.time() + grace)
        await self._db(self.catalog.drop_artifacts, rel, ("cidx",), time.time() + grace)
        log.info("%s deleted: %d objects deleted after %.0f s", rel, len(e.objects), grace)

    async def on_rename(self, old: str, new: str) -> None:
        self._ns_changes += 1
        self._unsealed.pop(old, None)
        self._unsealed.pop(new, None)
        e = self.entries.pop(old, None)
        if e is None:
            self.entries.pop(new, None)
            return
        e.path = new
        self.entries[new] = e
        if old in self._ino_of:
            self._ino_of[new] = self._ino_of.pop(old)
        if old in self._fds:
            self._fds[new] = self._fds.pop(old)
        await self._db(self.catalog.rename, old, new)

    # ------------------------------------------------------------------ sealing

    async def _sealer_loop(self) -> None:
        interval = float(self.config["seal.scan_interval_seconds"])
        next_scan = 0.0
        while True:
            if time.monotonic() >= next_scan:
                found, self.hot_segments = await trio.to_thread.run_sync(self._scan_segments)
                self._seal_candidates.update(found)
                next_scan = time.monotonic() + interval
            todo = list(self._seal_candidates)
            for i in range(0, len(todo), _SEAL_BATCH):
                await self._seal_batch(todo[i:i + _SEAL_BATCH])
            await trio.sleep(min(1.0, interval))

    def _scan_segments(self) -> tuple[list[str], dict[str, tuple[str, int, int]]]:
        """Blocking: one walk of the segment dirs, for the sealer and for `tierfs status`. Returns the seal
        candidates, and (kind, size, local bytes) of every segment with no catalog row or a HOT one. A segment
        past HOT costs a directory entry and no stat (the catalog has its numbers); one whose content was found
        incomplete is a candidate again only once its size, mtime, ctime or write count has moved."""
        found: list[str] = []
        usage: dict[str, tuple[str, int, int]] = {}
        entries, unsealed, write_seq = self.entries, self._unsealed, self.write_seq
        hot = str(self.hot)
        stack = segment_dirs(hot, self.config["store.roots"])  # every store root below the mount's too
        while stack:
            d = stack.pop()
            try:
                it = os.scandir(f"{hot}/{d}")
            except (FileNotFoundError, NotADirectoryError):
                continue
            with it:
                for de in it:
                    rel = f"{d}/{de.name}"
                    if de.is_dir(follow_symlinks=False):
                        stack.append(rel)
                        continue
                    e = entries.get(rel)
                    if (e is not None and e.state is not State.HOT) or not de.is_file(follow_symlinks=False):
                        continue
                    kind = classify(rel)
                    if not kind.is_segment:
                        continue
                    try:
                        st = de.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    usage[rel] = (kind.value, st.st_size, min(st.st_size, st.st_blocks * 512))
                    if unsealed.get(rel) != (st.st_size, st.st_mtime_ns, st.st_ctime_ns, write_seq.get(st.st_ino, 0)):
                        found.append(rel)
        return found, usage

    async def _seal_batch(self, rels: list[str]) -> None:
        """Probe candidates in one worker-thread hop (stat, the flush and quiet rules, the content rule), then
        seal those that pass in one catalog transaction: sealing is bookkeeping, and 100,000 small segments
        must not cost 100,000 synchronous commits."""
        ns0 = self._ns_changes
        probes = await trio.to_thread.run_sync(self._probe, rels)
        sealed: list[tuple[Entry, Entry | None, int, int, str]] = []  # entry, the one it replaces, ino, seq, why
        for rel, verdict in probes:
            what = verdict[0]
            if what == "wait":
                continue
            self._seal_candidates.discard(rel)
            if what == "retry":  # e.g. the hot dir (and the catalog) full: try again
                self._seal_candidates.add(rel)
                log.warning("sealing %s failed (%s); will retry", rel, verdict[1])
                continue
            if what == "bad":
                log.error("sealing %s failed (%s); it stays hot", rel, verdict[1])
                continue
            if what == "drop":
                continue
            _, st, seq, kind, ok, why = verdict
            if not ok:
                self._unsealed[rel] = (st.st_size, st.st_mtime_ns, st.st_ctime_ns, seq)
                if why.startswith("corrupt") and self._refused.get(rel) != why:
                    self._refused[rel] = why
                    log.warning("%s not sealed: %s; it stays hot", rel, why)
                else:
                    log.debug("%s not sealed: %s", rel, why)
                continue
            self._refused.pop(rel, None)
            e = self.entries.get(rel)
            if self.write_seq.get(st.st_ino, 0) != seq:
                self._seal_candidates.add(rel)
                continue
            if (e is not None and e.state is not State.HOT) or rel in self._untierable:
                continue
            if self._ns_changes != ns0:  # unlinks or renames since the probe: seal only what is still there
                try:
                    if os.lstat(self.hot / rel).st_ino != st.st_ino:
                        self._seal_candidates.add(rel)
                        continue
                except FileNotFoundError:
                    continue
            gen = e.generation if e is not None else 0
            entry = Entry(path=rel, kind=kind.value, size=st.st_size, mtime_ns=st.st_mtime_ns, state=State.SEALED,
                          generation=gen, chunk_bytes=self.chunk, block_bytes=self.block, state_since=time.time())
            sealed.append((entry, e, st.st_ino, seq, why))
        if sealed:
            await self._commit_sealed(sealed)

    async def _commit_sealed(self, sealed: list[tuple[Entry, Entry | None, int, int, str]]) -> None:
        # the rows go into `entries` before the commit, so an unlink meanwhile finds its row and removes it
        # (after ours: one catalog thread, first come first served) instead of leaving a row without a file
        for entry, _, ino, seq, _ in sealed:
            self.entries[entry.path] = entry
            self._ino_of[entry.path] = ino
            self._sealed_at_seq[entry.path] = seq
            self._unsealed.pop(entry.path, None)
        try:
            await self._db(self.catalog.put_many, [s[0] for s in sealed], [], 0.0)
        except BaseException as err:
            for entry, prev, *_ in sealed:
                if self.entries.get(entry.path) is entry:
                    if prev is None:
                        del self.entries[entry.path]
                    else:
                        self.entries[entry.path] = prev
                    self._seal_candidates.add(entry.path)
            if isinstance(err, (ValueError, UnicodeError)):
                if len(sealed) > 1:  # find the one row SQLite refuses; the others seal
                    for one in sealed:
                        await self._commit_sealed([one])
                    return
                self._seal_candidates.discard(sealed[0][0].path)
                log.error("sealing %s failed (%s); it stays hot", sealed[0][0].path, err)
                return
            if isinstance(err, (OSError, sqlite3.Error)):  # e.g. the hot dir (and the catalog) full
                log.warning("sealing %d segments failed (%s); will retry", len(sealed), err)
                return
            raise
        for entry, _, _, _, why in sealed:
            if self.entries.get(entry.path) is entry:  # not unlinked while the commit ran
                self._upload_queue.push(entry.path, entry.mtime_ns)
            log.log(logging.INFO if len(sealed) == 1 else logging.DEBUG, "sealed %s (%s, %d bytes, gen %d)",
                    entry.path, why, entry.size, entry.generation)
        if len(sealed) > 1:
            log.info("sealed %d segments (%d bytes), %s .. %s", len(sealed), sum(s[0].size for s in sealed),
                     sealed[0][0].path, sealed[-1][0].path)
        self._upload_wakeup.set()

    def _probe(self, rels: list[str]) -> list[tuple[str, tuple]]:
        """Blocking: each candidate's verdict. ('wait',): not flushed after its last write, or not quiet yet;
        ('drop',): gone, past HOT, or kept local; ('retry', err) / ('bad', err): unreadable now / for good;
        ('checked', lstat, write seq before the read, kind, sealed?, why)."""
        quiet = float(self.config["seal.quiet_seconds"])
        out: list[tuple[str, tuple]] = []
        for rel in rels:
            try:
                out.append((rel, self._probe_one(rel, quiet)))
            except FileNotFoundError:
                out.append((rel, ("drop",)))
            except (ValueError, UnicodeError) as err:
                out.append((rel, ("bad", err)))
            except OSError as err:
                out.append((rel, ("retry", err)))
        return out

    def _probe_one(self, rel: str, quiet: float) -> tuple:
        if rel in self._untierable:
            return ("drop",)
        e = self.entries.get(rel)
        if e is not None and e.state is not State.HOT:
            return ("drop",)
        rel.encode()  # a name SQLite cannot store (not UTF-8) fails here, on its own, not in a batch commit
        st = os.lstat(self.hot / rel)
        ino = st.st_ino
        lw = self.last_write.get(ino)
        if lw is not None:
            if self.last_fsync.get(ino, 0.0) < lw or time.monotonic() - lw < quiet:
                return ("wait",)  # not flushed since the last write, or not quiet yet: keep it as a candidate
        elif time.time() - st.st_mtime < quiet:
            return ("wait",)
        seq = self.write_seq.get(ino, 0)
        kind = classify(rel)
        ok, why = self._check_content(rel, kind, st.st_size)
        return ("checked", st, seq, kind, ok, why)

    def _check_content(self, rel: str, kind: Kind, size: int) -> tuple[bool, str]:
        if size == 0:
            return False, "empty"
        with open(self.hot / rel, "rb") as f:
            with mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as m:
                return is_sealed(kind, m, size, self.seal_params)

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
        e = self.entries.pop(rel, None)
        if e is not None:
            try:
                await self._db(self.catalog.remove, rel, [], time.time())
            except sqlite3.Error as err:
                log.warning("could not drop the catalog row of %s (%s)", rel, err)

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

    def upload_backlog(self, kind: str | None = None) -> tuple[int, int, float]:
        """(files, bytes, seconds since the oldest was sealed) waiting for or in upload; of one kind if given."""
        waiting = [e for e in self.entries.values() if e.state in (State.SEALED, State.UPLOADING)
                   and (kind is None or e.kind == kind)]
        if not waiting:
            return 0, 0, 0.0
        return len(waiting), sum(e.size for e in waiting), time.time() - min(e.state_since for e in waiting)

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
            ino = self._ino_of[rel]
            batch.append((e, ino, self._sealed_at_seq.get(rel, self.write_seq.get(ino, 0))))
            if e.state is State.SEALED:
                e.state = State.UPLOADING
        results: list[tuple[int, list[int], list[str]] | None] = [None] * len(batch)
        failed: list[tuple[str, Exception]] = []

        async def put(i: int, e: Entry) -> None:
            try:  # one big segment: its own thread, as ever; small ones: bounded, so readers keep store slots
                results[i] = await trio.to_thread.run_sync(
                    self._upload_blocking, e, limiter=self._small_limiter if len(batch) > 1 else None)
            except (ObjectStoreError, OSError, ValueError) as err:
                failed.append((e.path, err))

        async with trio.open_nursery() as nursery:
            for i, (e, _, _) in enumerate(batch):
                nursery.start_soon(put, i, e)
        failpoints.hit("tier.after_put")
        now = time.time()
        done: list[tuple[Entry, int, int]] = []
        voided: list[Entry] = []
        void_keys: list[str] = []
        for (e, ino, seq), res in zip(batch, results):
            if res is None:
                continue
            crc, block_crcs, keys = res
            if self.write_seq.get(ino, 0) != seq or self.entries.get(e.path) is not e or e.state is not State.UPLOADING:
                log.info("%s changed during upload; discarding gen %d objects", e.path, e.generation)
                void_keys += keys
                if self.entries.get(e.path) is e:
                    e.state = State.HOT
                    e.generation += 1
                    voided.append(e)
                continue
            e.crc32c, e.block_crcs, e.objects = crc, block_crcs, keys
            e.resident = bytearray(b"\xff" * ((e.nblocks + 7) // 8))
            e.state = State.TIERED
            e.last_access = now
            e.state_since = now
            done.append((e, ino, seq))
        if not done and not void_keys:
            return failed
        try:  # durable: from here the objects are authoritative
            await self._db(self.catalog.put_many, [e for e, _, _ in done] + voided, void_keys, now)
        except BaseException:
            for e, _, _ in done:
                e.state = State.UPLOADING  # not durable, so not tiered: the hot file stays authoritative
            raise
        failpoints.hit("tier.after_commit")
        late: list[Entry] = []
        for e, ino, seq in done:
            if self.entries.get(e.path) is not e:
                continue  # unlinked while the commit ran: its row and objects are gone already
            if self.write_seq.get(ino, 0) != seq:
                late.append(e)  # written while the commit ran: the objects hold the old content
                continue
            self.tiered[ino] = e
            self._sealed_at_seq.pop(e.path, None)  # a later seal (after a rewrite) records its own
            self.cache_bytes += e.resident_bytes()
            self.stats.uploads += 1
            self.stats.upload_bytes += e.size
            self.observe("upload", time.monotonic() - t0, e.size)
            log.log(logging.INFO if len(batch) == 1 else logging.DEBUG, "tiered %s: %d bytes in %d objects, "
                    "crc32c %08x, %.2f s", e.path, e.size, len(e.objects), e.crc32c, time.monotonic() - t0)
        self.store_down_since = None
        if len(batch) > 1 and done:
            log.info("tiered %d small segments (%d bytes), %s .. %s, in %.2f s", len(done),
                     sum(e.size for e, _, _ in done), done[0][0].path, done[-1][0].path, time.monotonic() - t0)
        if late:
            await self._void_late(late)
        return failed

    async def _void_late(self, late: list[Entry]) -> None:
        """Segments written while their TIERED commit ran: not in `tiered` yet, so nothing was evicted and the
        hot file is whole. They turn HOT at gen+1 (to be sealed again) and their just-uploaded objects go."""
        keys: list[str] = []
        for e in late:
            log.info("%s written while its upload was committed; discarding gen %d objects", e.path, e.generation)
            keys += e.objects
            e.state = State.HOT
            e.generation += 1
            e.objects, e.block_crcs, e.crc32c, e.resident = [], [], None, bytearray()
        await self._db(self.catalog.put_many, late, keys, time.time())

    def _upload_blocking(self, e: Entry) -> tuple[int, list[int], list[str]]:
        """Read the hot file chunk by chunk, PUT each chunk, verify, and return (crc, block crcs, keys)."""
        keys = layout.chunk_keys(self.store_id, e.path, e.generation, "raw", e.size, e.chunk_bytes)
        crc = 0
        block_crcs: list[int] = []
        verify_full = self.config["upload.verify"] == "full"
        fd = os.open(self.hot / e.path, os.O_RDONLY)
        try:
            for i, key in enumerate(keys):
                off = i * e.chunk_bytes
                data = os.pread(fd, min(e.chunk_bytes, e.size - off), off)
                if len(data) != min(e.chunk_bytes, e.size - off):
                    raise OSError(errno.EIO, f"short read of {e.path} at {off}")
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

    def _fd(self, e: Entry) -> int:
        fd = self._fds.get(e.path)
        if fd is None:
            fd = self._fds[e.path] = os.open(self.hot / e.path, os.O_RDWR)
        return fd

    def _forget_fd(self, rel: str) -> None:
        fd = self._fds.pop(rel, None)
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
            if e.state is not State.TIERED:
                return os.pread(self._fd(e), end - off, off)  # rewritten meanwhile: now fully local
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
        """Make `blocks` resident (fetching what no one is fetching yet), bounded by the read deadline."""
        events = []
        todo = []
        for b in blocks:
            ev = self._inflight.get((e.path, e.generation, b))
            if ev is not None:
                events.append((b, ev))
            else:
                todo.append(b)
        for first, n in self._runs(e, todo, 8):
            events += self._start_fetch(e, first, n, prefetch=False)
        if any(ev in self._gave_up for _, ev in events):
            # a read of these blocks already waited the whole bound and the fetch is still stuck: the kernel's
            # retry of a failed read-ahead lands here, and must not double the bound the caller sees
            raise ReadFailed(f"{e.path}: object store did not answer within "
                             f"{self.config['objectstore.read_timeout_seconds']} s (fetch still in flight)")
        with trio.move_on_at(deadline) as scope:
            for _, ev in events:
                await ev.wait()
        if scope.cancelled_caught:
            self._gave_up.update(ev for _, ev in events if not ev.is_set())
            raise ReadFailed(f"{e.path}: object store did not answer within "
                             f"{self.config['objectstore.read_timeout_seconds']} s")
        for b, _ in events:
            err = self._fetch_errors.pop((e.path, e.generation, b), None)
            if err:
                raise ReadFailed(err)

    def _start_fetch(self, e: Entry, first: int, n: int, prefetch: bool) -> list[tuple[int, trio.Event]]:
        ev = trio.Event()
        out = []
        for b in range(first, first + n):
            self._inflight[(e.path, e.generation, b)] = ev
            out.append((b, ev))
        assert self._nursery is not None
        self._nursery.start_soon(self._fetch, e, first, n, ev, prefetch)
        return out

    def _prefetch(self, e: Entry, stream: ReadAhead, start: int, window: int) -> None:
        budget = int(self.config["readahead.budget_bytes"])
        # The window slides by the one block each read uncovers; extend it to the end of its aligned group, so
        # each GET brings a whole group (PREFETCH_GROUP_BYTES) instead of one block per read.
        group = max(1, PREFETCH_GROUP_BYTES // e.block_bytes)
        hi = min(-(-min(start + window, e.nblocks) // group) * group, e.nblocks)
        want = [b for b in range(start, hi)
                if not e.is_resident(b) and (e.path, e.generation, b) not in self._inflight]
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

    async def _fetch(self, e: Entry, first: int, n: int, done: trio.Event, prefetch: bool) -> None:
        gen = e.generation
        key = self._object_of(e, first)
        error = None
        t0 = time.monotonic()
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
            if prefetch:
                self.prefetch_inflight -= n * e.block_bytes
            if error:
                self.stats.fetch_errors += 1
                self.stats.last_error = error
                log.error("read of %s failed: %s", e.path, error)
            for b in range(first, first + n):
                k = (e.path, gen, b)
                if self._inflight.get(k) is done:
                    del self._inflight[k]
                if error and not prefetch:
                    self._fetch_errors[k] = error
            done.set()
            self._gave_up.discard(done)

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
        if e.state is not State.TIERED or e.generation != gen or self.entries.get(e.path) is not e:
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
        self._dirty_residency.add(e.path)

    # ------------------------------------------------------------------ writes into tiered segments

    async def before_write(self, e: Entry, ino: int, off: int, data: bytes) -> bool:
        """Called before a write lands in a tiered segment. Returns False for an identical rewrite (a no-op:
        index header at shutdown, BLANK after a crash); otherwise re-materialises the file as HOT, gen+1."""
        end = min(off + len(data), e.size)
        deadline = trio.current_time() + float(self.config["objectstore.read_timeout_seconds"])
        if off < end and await self._make_resident(e, off, end, deadline):
            if e.state is State.TIERED and off + len(data) <= e.size:
                if os.pread(self._fd(e), len(data), off) == bytes(data):
                    self.stats.identical_rewrites += 1
                    return False
        if e.state is not State.TIERED:
            return True
        await self._rematerialise(e, ino, e.size, f"write at {off}+{len(data)}", deadline)
        return True

    async def before_truncate(self, e: Entry, ino: int, new_size: int) -> None:
        """Called before a tiered segment is truncated (setattr, or an open with O_TRUNC): the file becomes HOT,
        gen+1, with only the bytes the truncate keeps fetched first. Without this the hot file would shrink and
        regrow under a TIERED row, and the old generation's blocks would be fetched into the new content."""
        if e.state is not State.TIERED or new_size == e.size:
            return
        deadline = trio.current_time() + float(self.config["objectstore.read_timeout_seconds"])
        await self._rematerialise(e, ino, min(new_size, e.size), f"truncate to {new_size}", deadline)

    async def _rematerialise(self, e: Entry, ino: int, keep: int, why: str, deadline: float) -> None:
        """Make [0, keep) resident, then turn the tiered row HOT at gen+1 and queue the old objects' deletion."""
        log.info("%s of tiered %s: re-materialising (gen %d -> %d)", why, e.path, e.generation, e.generation + 1)
        if keep and not await self._make_resident(e, 0, keep, deadline + 600):
            raise ReadFailed(f"{e.path}: could not re-materialise for a {why}")
        fd = self._fd(e)
        await trio.to_thread.run_sync(os.fdatasync, fd)
        failpoints.hit("tier.rewrite")
        if e.state is not State.TIERED:
            return
        old_keys = e.objects
        self.tiered.pop(ino, None)
        self.cache_bytes -= e.resident_bytes()
        e.state = State.HOT
        e.generation += 1
        e.objects, e.block_crcs, e.crc32c, e.resident = [], [], None, bytearray()
        e.format, e.chunk_bytes = "raw", self.chunk
        await self._db(self.catalog.put, e)
        not_before = time.time() + float(self.config["delete.grace_seconds"])
        await self._db(self.catalog.queue_deletes, old_keys, not_before)
        await self._db(self.catalog.drop_artifacts, e.path, ("cidx",), not_before)
        for k in old_keys:
            self._footers.pop(k, None)
        self.stats.rewrites += 1

    async def _make_resident(self, e: Entry, off: int, end: int, deadline: float) -> bool:
        """Fetch until [off, end) is resident; evictions can race a fetch, so retry a few times. True once
        nothing is missing, or once a concurrent rewrite made the file HOT (then it is all local anyway)."""
        for _ in range(8):
            if e.state is not State.TIERED:
                return True
            missing = self._needs_fetch(e, off, end)
            if not missing:
                return True
            await self._ensure(e, missing, deadline)
        return e.state is not State.TIERED or not self._needs_fetch(e, off, end)

    # ------------------------------------------------------------------ eviction

    async def _evictor_loop(self) -> None:
        while True:
            await trio.sleep(0.5)
            try:
                await self._evict_once()
                await self._persist_residency()
            except (OSError, sqlite3.Error) as err:
                log.warning("eviction pass failed: %s", err)

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
                if e.state is not State.TIERED or self.entries.get(e.path) is not e:
                    continue  # rewritten or unlinked while an earlier batch committed
                blocks = [b for b in range(e.nblocks) if e.is_resident(b)]
                if not blocks:
                    continue
                for b in blocks:
                    e.set_resident(b, False)
                expect -= sum(e.block_len(b) for b in blocks)
                picked.append((e, e.generation, blocks))
            if not picked:
                break
            # durable before the punches: a crash now can only cost a re-fetch
            await self._db(self.catalog.save_residency, [e for e, _, _ in picked])
            failpoints.hit("tier.evict")
            for e, gen, blocks in picked:
                if e.state is State.TIERED and e.generation == gen:
                    self._punch(e, blocks)

    def _punch(self, e: Entry, blocks: list[int]) -> None:
        """Punch the given non-resident blocks out of the hot file, keeping pinned pages. No await in here."""
        fd = self._fd(e)
        pins = self._pinned(e) if not self.read_only else []
        freed = 0
        for first, n in self._runs(e, blocks, 1 << 30):
            for b in range(first, first + n):
                if e.is_resident(b) or (e.path, e.generation, b) in self._inflight:
                    continue  # fetched again (or being fetched) while we waited for the catalog
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
        self.cache_bytes -= freed
        self.stats.evicted_bytes += freed

    async def _persist_residency(self) -> None:
        if not self._dirty_residency:
            return
        dirty = [self.entries[p] for p in self._dirty_residency if p in self.entries]
        self._dirty_residency.clear()
        fds = [self._fds[e.path] for e in dirty if e.path in self._fds]
        await trio.to_thread.run_sync(lambda: [os.fdatasync(fd) for fd in fds])
        await self._db(self.catalog.save_residency, dirty)

    # ------------------------------------------------------------------ deferred deletes

    async def _janitor_loop(self) -> None:
        while True:
            await trio.sleep(2.0)
            if not self.store_writable():
                continue
            try:
                keys = await self._db(self.catalog.due_deletes, time.time())
                if not keys:
                    continue
                await self._io(self.store.delete_many, keys)
                await self._db(self.catalog.deleted, keys)
                log.info("deleted %d objects", len(keys))
            except (ObjectStoreError, sqlite3.Error) as err:
                log.warning("object deletes failed (%s); will retry", err)

    def release_stream(self, fh: int) -> None:
        self.streams.pop(fh, None)
