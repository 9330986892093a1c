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
import logging
import mmap
import os
import random
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
from tierfs.store.seal import SealParams, is_sealed
from tierfs.tier import layout
from tierfs.tier.catalog import Catalog, Entry, State
from tierfs.tier.readahead import ReadAhead

log = logging.getLogger("tierfs.tier")

PAGE = 4096
_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
SEGMENT_DIRS = ("commitlog", "consumequeue", "batchconsumequeue", "index", "timerlog")


def punch_hole(fd: int, off: int, length: int) -> None:
    if length <= 0:
        return
    if _libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, off, length) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


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
    reads_local: int = 0
    reads_waited: int = 0
    prefetch_bytes: int = 0
    rewrites: int = 0
    identical_rewrites: int = 0
    last_error: str = ""


class Engine:
    def __init__(self, hot_dir: Path, state_dir: Path, config: Config):
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
        self.catalog = Catalog(state_dir / "catalog.db")
        self.store: ObjectStore = open_store(self._store_url(), **self._store_options())
        self.store_id = config["store.id"] or self._persistent_store_id()
        self.entries: dict[str, Entry] = {}  # every catalog row, by path
        self.tiered: dict[int, Entry] = {}  # TIERED entries by hot-dir st_ino: the FUSE fast path
        self._ino_of: dict[str, int] = {}
        self._fds: dict[str, int] = {}  # engine-owned O_RDWR fds of tiered hot files
        self.last_write: dict[int, float] = {}
        self.last_fsync: dict[int, float] = {}
        self.write_seq: dict[int, int] = {}
        self._inflight: dict[tuple[str, int, int], trio.Event] = {}
        self._fetch_errors: dict[tuple[str, int, int], str] = {}
        self._dirty_residency: set[str] = set()
        self._seal_candidates: set[str] = set()
        self._sealed_at_seq: dict[str, int] = {}  # write_seq when sealed: a later write voids the upload
        self._upload_queue: list[str] = []
        self._upload_wakeup = trio.Event()
        self._uploading: set[str] = set()
        self.streams: dict[int, ReadAhead] = {}
        self.prefetch_inflight = 0
        self.cache_bytes = 0
        self.limiter = trio.CapacityLimiter(int(config["objectstore.max_concurrency"]))
        self.db_limiter = trio.CapacityLimiter(1)
        self.stats = EngineStats()
        self.store_down_since: float | None = None
        self._nursery: trio.Nursery | None = None

    # ------------------------------------------------------------------ set-up

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
                log.warning("catalog row %s has no hot file (deleted while unmounted); deleting its objects", e.path)
                self.catalog.remove(e.path, e.objects, now + grace)
                continue
            self.entries[e.path] = e
            self._ino_of[e.path] = st.st_ino
            if e.state in (State.SEALED, State.UPLOADING):
                self._upload_queue.append(e.path)
            elif e.state is State.TIERED:
                if len(e.resident) != (e.nblocks + 7) // 8:
                    e.resident = bytearray((e.nblocks + 7) // 8)
                self.tiered[st.st_ino] = e
                self.cache_bytes += e.resident_bytes()
        log.info("catalog: %d rows, %d tiered, %d to upload, %d deletes pending", len(self.entries),
                 len(self.tiered), len(self._upload_queue), self.catalog.pending_delete_count())

    async def run(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        if not self.enabled:
            return
        nursery.start_soon(self._sealer_loop)
        for _ in range(int(self.config["upload.concurrency"])):
            nursery.start_soon(self._uploader_loop)
        nursery.start_soon(self._evictor_loop)
        nursery.start_soon(self._janitor_loop)

    async def shutdown(self) -> None:
        await self._persist_residency()
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
        e = self.entries.pop(rel, None)
        ino = self._ino_of.pop(rel, None)
        if e is None:
            return
        if ino is not None:
            self.tiered.pop(ino, None)
        self._forget_fd(rel)
        if e.state is State.TIERED:
            self.cache_bytes -= e.resident_bytes()
        grace = float(self.config["delete.grace_seconds"])
        await self._db(self.catalog.remove, rel, e.objects, time.time() + grace)
        log.info("%s deleted: %d objects deleted after %.0f s", rel, len(e.objects), grace)

    async def on_rename(self, old: str, new: str) -> None:
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
                found = await trio.to_thread.run_sync(self._scan_segments)
                self._seal_candidates.update(p for p in found if p not in self.entries
                                             or self.entries[p].state is State.HOT)
                next_scan = time.monotonic() + interval
            for rel in sorted(self._seal_candidates):
                await self._try_seal(rel)
            await trio.sleep(min(1.0, interval))

    def _scan_segments(self) -> list[str]:
        out = []
        for top in SEGMENT_DIRS:
            root = self.hot / top
            if not root.is_dir():
                continue
            for dirpath, _, files in os.walk(root):
                for f in files:
                    rel = os.path.relpath(os.path.join(dirpath, f), self.hot)
                    if classify(rel).is_segment:
                        out.append(rel)
        return out

    async def _try_seal(self, rel: str) -> None:
        """Seal `rel` if its content is complete, flushed after the last write, and quiet long enough."""
        e = self.entries.get(rel)
        if e is not None and e.state is not State.HOT:
            self._seal_candidates.discard(rel)
            return
        try:
            st = os.lstat(self.hot / rel)
        except FileNotFoundError:
            self._seal_candidates.discard(rel)
            return
        ino = st.st_ino
        quiet = float(self.config["seal.quiet_seconds"])
        lw = self.last_write.get(ino)
        now = time.monotonic()
        if lw is not None:
            if self.last_fsync.get(ino, 0.0) < lw or now - lw < quiet:
                return  # not flushed since the last write, or not quiet yet: keep it as a candidate
        elif time.time() - st.st_mtime < quiet:
            return
        seq = self.write_seq.get(ino, 0)
        kind = classify(rel)
        ok, why = await trio.to_thread.run_sync(self._check_content, rel, kind, st.st_size)
        self._seal_candidates.discard(rel)
        if not ok:
            log.debug("%s not sealed: %s", rel, why)
            return
        if self.write_seq.get(ino, 0) != seq:
            self._seal_candidates.add(rel)
            return
        gen = e.generation if e is not None else 0
        entry = Entry(path=rel, kind=kind.value, size=st.st_size, mtime_ns=st.st_mtime_ns, state=State.SEALED,
                      generation=gen, chunk_bytes=self.chunk, block_bytes=self.block, state_since=time.time())
        await self._db(self.catalog.put, entry)
        self.entries[rel] = entry
        self._ino_of[rel] = ino
        self._sealed_at_seq[rel] = seq
        self._upload_queue.append(rel)
        self._upload_wakeup.set()
        log.info("sealed %s (%s, %d bytes, gen %d)", rel, why, st.st_size, gen)

    def _check_content(self, rel: str, kind: Kind, size: int) -> tuple[bool, str]:
        if size == 0:
            return False, "empty"
        with open(self.hot / rel, "rb") as f:
            with mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as m:
                return is_sealed(kind, m, size, self.seal_params)

    # ------------------------------------------------------------------ upload

    async def _uploader_loop(self) -> None:
        backoff = 1.0
        while True:
            rel = self._next_upload()
            if rel is None:
                self._upload_wakeup = trio.Event()
                with trio.move_on_after(1.0):
                    await self._upload_wakeup.wait()
                continue
            self._uploading.add(rel)
            try:
                await self._upload(rel)
                backoff = 1.0
            except (ObjectStoreError, OSError) as err:
                self.stats.upload_failures += 1
                self.stats.last_error = f"upload {rel}: {err}"
                log.warning("upload of %s failed (%s); retrying in %.1f s", rel, err, backoff)
                if rel in self.entries and self.entries[rel].state is not State.HOT:
                    self._upload_queue.append(rel)
                await trio.sleep(backoff * (0.5 + random.random()))
                backoff = min(backoff * 2, float(self.config["upload.retry_max_seconds"]))
            finally:
                self._uploading.discard(rel)

    def _next_upload(self) -> str | None:
        """Oldest first: the segment with the lowest mtime that is waiting for upload."""
        waiting = [p for p in dict.fromkeys(self._upload_queue)
                   if p in self.entries and self.entries[p].state in (State.SEALED, State.UPLOADING)
                   and p not in self._uploading]
        if not waiting:
            self._upload_queue.clear()
            return None
        rel = min(waiting, key=lambda p: (self.entries[p].mtime_ns, p))
        self._upload_queue = [p for p in waiting if p != rel]
        return rel

    def upload_backlog(self) -> tuple[int, int, float]:
        """(files, bytes, age in seconds of the oldest) waiting for or in upload."""
        waiting = [e for e in self.entries.values() if e.state in (State.SEALED, State.UPLOADING)]
        if not waiting:
            return 0, 0, 0.0
        return len(waiting), sum(e.size for e in waiting), time.time() - min(e.state_since for e in waiting)

    async def _upload(self, rel: str) -> None:
        e = self.entries[rel]
        ino = self._ino_of[rel]
        seq = self._sealed_at_seq.get(rel, self.write_seq.get(ino, 0))
        if e.state is State.SEALED:
            e.state = State.UPLOADING
            await self._db(self.catalog.put, e)
        t0 = time.monotonic()
        crc, block_crcs, keys = await trio.to_thread.run_sync(self._upload_blocking, e)
        failpoints.hit("tier.after_put")
        if self.write_seq.get(ino, 0) != seq or self.entries.get(rel) is not e or e.state is not State.UPLOADING:
            log.info("%s changed during upload; discarding gen %d objects", rel, e.generation)
            await self._db(self.catalog.queue_deletes, keys, time.time())
            if self.entries.get(rel) is e:
                e.state = State.HOT
                e.generation += 1
                await self._db(self.catalog.put, e)
            return
        e.crc32c, e.block_crcs, e.objects = crc, block_crcs, keys
        e.resident = bytearray(b"\xff" * ((e.nblocks + 7) // 8))
        e.state = State.TIERED
        e.last_access = time.time()
        e.state_since = time.time()
        await self._db(self.catalog.put, e)  # durable: from here the objects are authoritative
        failpoints.hit("tier.after_commit")
        self.tiered[ino] = e
        self.cache_bytes += e.resident_bytes()
        self.stats.uploads += 1
        self.stats.upload_bytes += e.size
        self.store_down_since = None
        log.info("tiered %s: %d bytes in %d objects, crc32c %08x, %.2f s", rel, e.size, len(keys), crc,
                 time.monotonic() - t0)

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
                self.store.put(key, data, metadata={"crc32c": f"{chunk_crc:08x}"})
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
        if any(p0 <= off and end <= p1 for p0, p1 in self._pinned(e)):
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
        with trio.move_on_at(deadline) as scope:
            for _, ev in events:
                await ev.wait()
        if scope.cancelled_caught:
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
        want = [b for b in range(start, min(start + window, e.nblocks))
                if not e.is_resident(b) and (e.path, e.generation, b) not in self._inflight]
        for first, n in self._runs(e, want, 4):
            nbytes = n * e.block_bytes
            if self.prefetch_inflight + nbytes > budget:
                return
            self.prefetch_inflight += nbytes
            stream.prefetched.update(range(first, first + n))
            self._start_fetch(e, first, n, prefetch=True)

    async def _fetch(self, e: Entry, first: int, n: int, done: trio.Event, prefetch: bool) -> None:
        gen = e.generation
        per_chunk = e.chunk_bytes // e.block_bytes
        chunk_no = first // per_chunk
        key = e.objects[chunk_no]
        start = (first - chunk_no * per_chunk) * e.block_bytes
        length = sum(e.block_len(b) for b in range(first, first + n))
        error = None
        try:
            for attempt in (1, 2):
                try:
                    data = await self._io(self.store.get_range, key, start, length)
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
        log.info("write into tiered %s at %d+%d: re-materialising (gen %d -> %d)", e.path, off, len(data),
                 e.generation, e.generation + 1)
        if not await self._make_resident(e, 0, e.size, deadline + 600):
            raise ReadFailed(f"{e.path}: could not re-materialise for a write")
        fd = self._fd(e)
        await trio.to_thread.run_sync(os.fdatasync, fd)
        failpoints.hit("tier.rewrite")
        if e.state is not State.TIERED:
            return True
        old_keys = e.objects
        self.tiered.pop(ino, None)
        self.cache_bytes -= e.resident_bytes()
        e.state = State.HOT
        e.generation += 1
        e.objects, e.block_crcs, e.crc32c, e.resident = [], [], None, bytearray()
        await self._db(self.catalog.put, e)
        await self._db(self.catalog.queue_deletes, old_keys, time.time() + float(self.config["delete.grace_seconds"]))
        self.stats.rewrites += 1
        return True

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
            except OSError as err:
                log.warning("eviction pass failed: %s", err)

    async def _evict_once(self) -> None:
        cap = int(self.config["cache.max_bytes"])
        if self.cache_bytes <= cap * float(self.config["cache.high_watermark"]):
            return
        target = cap * float(self.config["cache.low_watermark"])
        now = time.time()
        victims = sorted((e for e in self.tiered.values() if now - e.last_access > 1.0),
                         key=lambda e: e.last_access)
        for e in victims:
            if self.cache_bytes <= target:
                break
            blocks = [b for b in range(e.nblocks) if e.is_resident(b)]
            if not blocks:
                continue
            gen = e.generation
            for b in blocks:
                e.set_resident(b, False)
            # durable before the punch: a crash now can only cost a re-fetch
            await self._db(self.catalog.save_residency, [e])
            failpoints.hit("tier.evict")
            if e.state is not State.TIERED or e.generation != gen:
                continue
            self._punch(e, blocks)

    def _punch(self, e: Entry, blocks: list[int]) -> None:
        """Punch the given non-resident blocks out of the hot file, keeping pinned pages. No await in here."""
        fd = self._fd(e)
        pins = self._pinned(e)
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
            keys = await self._db(self.catalog.due_deletes, time.time())
            if not keys:
                continue
            try:
                await self._io(self.store.delete_many, keys)
                await self._db(self.catalog.deleted, keys)
                log.info("deleted %d objects", len(keys))
            except ObjectStoreError as err:
                log.warning("object deletes failed (%s); will retry", err)

    def release_stream(self, fh: int) -> None:
        self.streams.pop(fh, None)
