"""The block cache: serves reads of tiered segments and makes them writable again (DESIGN §7, §10).

A tiered segment keeps its hot file at its true size, with holes where blocks were evicted; the entry's resident
bitmap says which blocks are real. A read of a non-resident block starts a ranged GET (one per run of blocks
inside one object, raw chunk or lz4c), checks each block's crc32c, writes it into the hole and serves the read
from the hot file. Sequential readers get read-ahead (tierfs.tier.readahead) within `readahead.budget_bytes`.
A write or truncate of a tiered segment first fetches what it keeps and turns the file HOT at a new generation.

Concurrency rule: everything that checks residency and then touches hot-file bytes (pread, pwrite of a fetched
block) does so with no `await` in between, so trio's cooperative scheduling makes it atomic.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING

import crc32c
import trio

from tierfs import failpoints
from tierfs.objectstore.base import ObjectNotFound, ObjectStoreError
from tierfs.store.paths import Kind
from tierfs.tier import layout, lz4c
from tierfs.tier.catalog import Entry, State
from tierfs.tier.readahead import ReadAhead
from tierfs.tier.state import ReadFailed

if TYPE_CHECKING:
    from tierfs.tier.engine import Engine

log = logging.getLogger("tierfs.tier")

PAGE = 4096
PREFETCH_GROUP_BYTES = 4 << 20  # one read-ahead GET: large enough that per-request costs stop mattering


def pinned_ranges(e: Entry) -> list[tuple[int, int]]:
    """Byte ranges that never leave the hot file: the first page of every segment (startup recovery),
    and the last page of every ConsumeQueue segment (cleaning reads its last unit)."""
    out = [(0, min(PAGE, e.size))]
    if e.kind in (Kind.CONSUMEQUEUE.value, Kind.BATCHCONSUMEQUEUE.value):
        out.append(((e.size - 1) // PAGE * PAGE, e.size))
    return out


def block_runs(e: Entry, blocks: list[int], max_blocks: int) -> list[tuple[int, int]]:
    """Group blocks into (first, count) runs that stay inside one chunk object."""
    per_chunk = e.chunk_bytes // e.block_bytes  # an lz4c entry's "chunk" is the whole segment
    runs: list[tuple[int, int]] = []
    for b in sorted(set(blocks)):
        if runs:
            first, n = runs[-1]
            if b == first + n and n < max_blocks and b // per_chunk == first // per_chunk:
                runs[-1] = (first, n + 1)
                continue
        runs.append((b, 1))
    return runs


class Fetch:
    """One ranged GET in flight for a run of blocks. Its outcome travels with it: a reader gets the error of the
    fetch it waited for, never one left over from an earlier fetch of the same blocks."""

    __slots__ = ("done", "error", "gave_up")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.error: str | None = None
        self.gave_up = False  # a reader already waited the whole bound on it


class BlockCache:
    def __init__(self, engine: Engine):
        self.eng = engine
        self.inflight: dict[tuple[int, int, int], Fetch] = {}  # (file id, generation, block) -> its fetch
        self.streams: dict[int, ReadAhead] = {}  # read-ahead state by FUSE file handle
        self.footers: dict[str, lz4c.Footer] = {}  # lz4c block tables by object key
        self.prefetch_inflight = 0

    def release_stream(self, fh: int) -> None:
        self.streams.pop(fh, None)

    def _needs_fetch(self, e: Entry, off: int, end: int) -> list[int]:
        # read-only: the sparse local files hold no pinned pages; never serve a hole as zeros
        if not self.eng.read_only and any(p0 <= off and end <= p1 for p0, p1 in pinned_ranges(e)):
            return []
        return [b for b in range(off // e.block_bytes, (end - 1) // e.block_bytes + 1) if not e.is_resident(b)]

    # ------------------------------------------------------------------ reads

    async def read(self, e: Entry, ino: int, fh: int, off: int, size: int) -> bytes:
        eng = self.eng
        end = min(off + size, e.size)
        if off >= end:
            return b""
        e.last_access = time.time()
        stream = self.streams.get(fh)
        if stream is None:
            c = eng.config
            stream = self.streams[fh] = ReadAhead(int(c["readahead.initial_blocks"]), int(c["readahead.batch_blocks"]),
                                                  int(c["readahead.max_blocks"]), tolerance=e.block_bytes)
        window = stream.on_read(off, end)
        waited = False
        deadline = trio.current_time() + float(eng.config["objectstore.read_timeout_seconds"])
        for _ in range(8):
            if eng.tiered.get(ino) is not e:
                return os.pread(fh, end - off, off)  # rewritten meanwhile: now fully local
            missing = self._needs_fetch(e, off, end)
            if not missing:
                for b in range(off // e.block_bytes, (end - 1) // e.block_bytes + 1):
                    stream.consumed(b)
                if window:
                    self._prefetch(e, stream, (end - 1) // e.block_bytes + 1, window)
                if waited:
                    eng.stats.reads_waited += 1
                else:
                    eng.stats.reads_local += 1
                return os.pread(eng.fd(e), end - off, off)  # no await since the residency check
            waited = True
            if window:
                self._prefetch(e, stream, missing[-1] + 1, window)
            await self._ensure(e, missing, deadline)
        raise ReadFailed(f"{e.path}: blocks kept being evicted while reading {off}+{size}")

    async def _ensure(self, e: Entry, blocks: list[int], deadline: float) -> None:
        """Make `blocks` resident (fetching what no one is fetching yet), bounded by the read deadline. The
        error a reader gets is the one of the fetch it waited for."""
        fetches: dict[int, Fetch] = {}
        todo = []
        for b in blocks:
            f = self.inflight.get((e.file_id, e.generation, b))
            if f is not None:
                fetches[id(f)] = f
            else:
                todo.append(b)
        for first, n in block_runs(e, todo, 8):
            f = self._start_fetch(e, first, n, prefetch=False)
            fetches[id(f)] = f
        timeout = self.eng.config["objectstore.read_timeout_seconds"]
        if any(f.gave_up for f in fetches.values()):
            # a read of these blocks already waited the whole bound and the fetch is still stuck: the kernel's
            # retry of a failed read-ahead lands here, and must not double the bound the caller sees
            raise ReadFailed(f"{e.path}: object store did not answer within {timeout} s (fetch still in flight)")
        with trio.move_on_at(deadline) as scope:
            for f in fetches.values():
                await f.done.wait()
        if scope.cancelled_caught:
            for f in fetches.values():
                f.gave_up = not f.done.is_set()
            raise ReadFailed(f"{e.path}: object store did not answer within {timeout} s")
        for f in fetches.values():
            if f.error:
                raise ReadFailed(f.error)

    def _start_fetch(self, e: Entry, first: int, n: int, prefetch: bool) -> Fetch:
        f = Fetch()
        for b in range(first, first + n):
            self.inflight[(e.file_id, e.generation, b)] = f
        self.eng.start_soon(self._fetch, e, first, n, f, prefetch)
        return f

    def _prefetch(self, e: Entry, stream: ReadAhead, start: int, window: int) -> None:
        budget = int(self.eng.config["readahead.budget_bytes"])
        # The window slides by the one block each read uncovers; extend it to the end of its aligned group, so
        # each GET brings a whole group (PREFETCH_GROUP_BYTES) instead of one block per read.
        group = max(1, PREFETCH_GROUP_BYTES // e.block_bytes)
        hi = min(-(-min(start + window, e.nblocks) // group) * group, e.nblocks)
        want = [b for b in range(start, hi)
                if not e.is_resident(b) and (e.file_id, e.generation, b) not in self.inflight]
        for first, n in block_runs(e, want, group):
            nbytes = n * e.block_bytes
            if self.prefetch_inflight + nbytes > budget:
                return
            self.prefetch_inflight += nbytes
            stream.prefetched.update(range(first, first + n))
            self._start_fetch(e, first, n, prefetch=True)

    @staticmethod
    def _object_of(e: Entry, first: int) -> str:
        return e.objects[0] if e.format == "lz4c" else e.objects[layout.raw_chunk_of(first, e.chunk_bytes,
                                                                                    e.block_bytes)[0]]

    async def _read_blocks(self, e: Entry, first: int, n: int) -> bytes:
        """The content of blocks [first, first+n) from the object store: one ranged GET of a raw chunk object,
        or of the covering lz4 blocks of an lz4c object (decompressed and checked off the trio loop)."""
        store = self.eng.store
        key = self._object_of(e, first)
        if e.format == "lz4c":
            footer = await self._footer(key)
            off, length = lz4c.block_span(footer, first, n)
            packed = await self.eng.io(store.get_range, key, off, length)
            return await trio.to_thread.run_sync(lz4c.decode_blocks, footer, first, n, packed)
        start = layout.raw_chunk_of(first, e.chunk_bytes, e.block_bytes)[1]
        length = sum(e.block_len(b) for b in range(first, first + n))
        return await self.eng.io(store.get_range, key, start, length)

    async def _footer(self, key: str) -> "lz4c.Footer":
        """An lz4c object's block table, fetched once (trailer, then footer) and kept in memory."""
        footer = self.footers.get(key)
        if footer is None:
            try:
                footer = await self.eng.io(lz4c.read_object_footer, self.eng.store, key)
            except lz4c.ObjectMissing:
                raise ObjectNotFound(key, "lz4c object is missing") from None
            self.footers[key] = footer
        return footer

    async def _fetch(self, e: Entry, first: int, n: int, fetch: Fetch, prefetch: bool) -> None:
        stats = self.eng.stats
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
                    stats.corrupt_objects += 1
                    error = f"object {key} of {e.path} is corrupt: {err}"
                    log.error("%s (attempt %d)", error, attempt)
                    self.footers.pop(key, None)
                    continue
                except ObjectNotFound:
                    error = f"object {key} of {e.path} is missing"
                    break
                except ObjectStoreError as err:
                    error = f"object {key} of {e.path}: {err}"
                    self.eng.store_down_since = self.eng.store_down_since or time.time()
                    break
                bad = self._verify_blocks(e, first, n, data)
                if bad is None:
                    self._install_blocks(e, gen, first, n, data)
                    stats.fetches += 1
                    stats.fetch_bytes += len(data)
                    self.eng.observe("download", time.monotonic() - t0, len(data))
                    if prefetch:
                        stats.prefetch_bytes += len(data)
                    error = None
                    break
                stats.corrupt_objects += 1
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
                stats.fetch_errors += 1
                stats.last_error = error
                log.error("read of %s failed: %s", e.path, error)
            for b in range(first, first + n):
                k = (e.file_id, gen, b)
                if self.inflight.get(k) is fetch:
                    del self.inflight[k]
            fetch.error = None if prefetch else error
            fetch.done.set()

    @staticmethod
    def _verify_blocks(e: Entry, first: int, n: int, data: bytes) -> int | None:
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
        eng = self.eng
        if e.state is not State.TIERED or e.generation != gen or not eng.is_live(e) or eng.tiered.get(e.ino) is not e:
            return
        fd = eng.fd(e)
        pos = 0
        mv = memoryview(data)
        for b in range(first, first + n):
            ln = e.block_len(b)
            if not e.is_resident(b):
                os.pwrite(fd, mv[pos:pos + ln], b * e.block_bytes)
                e.set_resident(b, True)
                eng.cache_bytes += ln
            pos += ln
        eng.evictor.residency_changed(e)

    # ------------------------------------------------------------------ writes into tiered segments

    async def before_write(self, e: Entry, ino: int, off: int, data: bytes) -> bool:
        """Called before a write lands in a tiered segment. Returns False for an identical rewrite (a no-op:
        index header at shutdown, BLANK after a crash); otherwise re-materialises the file as HOT."""
        eng = self.eng
        end = min(off + len(data), e.size)
        deadline = trio.current_time() + float(eng.config["objectstore.read_timeout_seconds"])
        e.pins += 1
        try:
            if off < end and await self._make_resident(e, off, end, deadline):
                if eng.tiered.get(ino) is e and off + len(data) <= e.size:
                    if os.pread(eng.fd(e), len(data), off) == bytes(data):
                        eng.stats.identical_rewrites += 1
                        return False
            if eng.tiered.get(ino) is not e:
                return True
            await self._rematerialise(e, ino, e.size, f"write at {off}+{len(data)}", deadline)
            return True
        finally:
            e.pins -= 1

    async def before_truncate(self, e: Entry, ino: int, new_size: int) -> None:
        """Called before a tiered segment is truncated (setattr, or an open with O_TRUNC): the file becomes HOT
        with only the bytes the truncate keeps fetched first. Without this the hot file would shrink and regrow
        under a TIERED row, and the old generation's blocks would be fetched into the new content."""
        if self.eng.tiered.get(ino) is not e or new_size == e.size:
            return
        deadline = trio.current_time() + float(self.eng.config["objectstore.read_timeout_seconds"])
        e.pins += 1
        try:
            await self._rematerialise(e, ino, min(new_size, e.size), f"truncate to {new_size}", deadline)
        finally:
            e.pins -= 1

    async def _rematerialise(self, e: Entry, ino: int, keep: int, why: str, deadline: float) -> None:
        """Make [0, keep) resident and durable, then turn the tiered row HOT at a new generation and queue the
        old objects' deletion, in one transaction. The caller pins `e`: the evictor cannot punch what was just
        fetched while this waits for the disk or the catalog."""
        eng = self.eng
        log.info("%s of tiered %s: re-materialising (gen %d -> new)", why, e.path, e.generation)
        if keep and not await self._make_resident(e, 0, keep, deadline + 600):
            raise ReadFailed(f"{e.path}: could not re-materialise for a {why}")
        if eng.tiered.get(ino) is not e:
            return  # another writer re-materialised it meanwhile
        fd = eng.fd(e)
        await trio.to_thread.run_sync(os.fdatasync, fd)
        failpoints.hit("tier.rewrite")
        await failpoints.pause("tier.rematerialise_synced")  # tests: the evictor runs while this waits
        grace = float(eng.config["delete.grace_seconds"])
        if eng.orphans.get(ino) is e:  # unlinked while open: no row to rewrite, the objects may simply go
            del eng.orphans[ino]
            eng.drop(e)
            await eng.db(eng.catalog.schedule_deletes, e.objects, time.time() + grace)
            return
        gen = await eng.db(eng.catalog.allocate, 1)
        if eng.tiered.get(ino) is not e:
            return
        row = eng.hot_copy(e, gen)
        old_keys = e.objects
        await eng.db(eng.catalog.replace, row, old_keys, time.time() + grace, ("cidx",))
        failpoints.hit("tier.rewritten")
        # committed: from here the hot file is the only copy, so the entry leaves `tiered` whatever else changed
        if eng.tiered.get(ino) is e:
            del eng.tiered[ino]
            eng.cache_bytes -= e.resident_bytes()
        eng.become(e, row)
        eng.evictor.forget(e.file_id)
        for k in old_keys:
            self.footers.pop(k, None)
        eng.stats.rewrites += 1

    async def _make_resident(self, e: Entry, off: int, end: int, deadline: float) -> bool:
        """Fetch until [off, end) is resident; evictions can race a fetch, so retry a few times. True once
        nothing is missing, or once a concurrent rewrite made the file HOT (then it is all local anyway)."""
        tiered = self.eng.tiered
        for _ in range(8):
            if tiered.get(e.ino) is not e:
                return True
            missing = self._needs_fetch(e, off, end)
            if not missing:
                return True
            await self._ensure(e, missing, deadline)
        return tiered.get(e.ino) is not e or not self._needs_fetch(e, off, end)
