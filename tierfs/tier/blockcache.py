"""The block cache: serves reads of tiered segments and makes them writable again (DESIGN §7, §10).

A tiered segment keeps its hot file at its true size, with holes where blocks were evicted; the entry's resident
bitmap says which blocks are real. A read of a block that is neither resident nor in memory starts a ranged GET
(one per run of blocks inside one object, raw chunk or lz4c) and checks each block's crc32c. A raw chunk's GET
reads straight into one reused buffer per block, so what the pool counts is what memory holds, however a GET's
blocks are read or dropped. Verified blocks land in a bounded pool of buffers (tierfs.tier.bufferpool, within
`readahead.budget_bytes`) and the FUSE reply is cut from there: a cold read never waits for the disk. Writing blocks into the hot file (the local cache) happens after,
in a worker thread, and only where the cache budget wants them kept: blocks a reader asked for always (the evictor
keeps the budget by LRU), the blocks of a sequential stream (prefetched, or asked for by a scan) only while
the cache is below its low watermark, so a large scan never pushes other files out. Sequential readers get read-ahead (tierfs.tier.readahead).
A write or truncate of a tiered segment first fetches what it keeps and turns the file HOT at a new generation.

Pinned pages (the first page of every segment, the last of every ConsumeQueue: DESIGN §4) are kept in the hot file
when their blocks are evicted, but a hot file need not hold them: a takeover builds its tiered segments as sparse
files with nothing local. So the hot file decides, never the rule: a page is local once the file is seen to hold it
(SEEK_DATA/SEEK_HOLE, remembered: nothing punches a kept page, and a rewrite is a new generation); until then it is
fetched like any evicted byte, and the first whole read of it writes it into the hot file, where it stays.

A random read (no read-ahead window) of a raw segment that has a finer verification table (tierfs.tier.units)
fetches only the verification units it touches (4 KiB by default) in one ranged GET, checks each, and is answered
from the pool, where units live under the key (file id, generation, ~unit); they are not written into the hot
file (the residency bitmap is per block). A block already being fetched whole is waited for instead. A compacted
(lz4c) segment is compressed per block, so a random read of one still fetches and decodes the covering blocks.

Concurrency rules: everything that checks residency and then touches hot-file bytes on the trio thread (pread,
an inline install) does so with no `await` in between, so trio's cooperative scheduling makes it atomic. A block
being installed by a worker thread is in `installing` until its bit is set: the evictor never punches it, and a
rewrite waits for every install of its file (`_installs_done`) and allows no new one, so no late install can land
over new bytes.
"""

from __future__ import annotations

import logging
import os
import struct
import time
from typing import TYPE_CHECKING, Callable

import crc32c
import trio

from tierfs import failpoints
from tierfs.objectstore.base import ObjectNotFound, ObjectStoreError
from tierfs.store.consumequeue import UNIT_SIZE as CQ_UNIT
from tierfs.store.paths import MESSAGE_LOGS, Kind, split_root
from tierfs.tier import layout, lz4c, units
from tierfs.tier.bufferpool import Buffer, BufferPool
from tierfs.tier.catalog import Entry, State, unit_count
from tierfs.tier.readahead import ReadAhead
from tierfs.tier.state import ReadFailed
from tierfs.tier.storewait import StoreWaiters

if TYPE_CHECKING:
    from tierfs.objectstore.base import ObjectStore
    from tierfs.tier.engine import Engine

log = logging.getLogger("tierfs.tier")

PAGE = 4096
PREFETCH_GROUP_BYTES = 16 << 20  # one read-ahead GET (a default chunk object): per-request costs stop mattering
NAMED_HOLD_SECONDS = 10.0  # a CommitLog whose records a ConsumeQueue named gets no generic read-ahead this long
NAMED_UNITS_PER_READ = 4096  # ConsumeQueue units looked at per read for layout-aware prefetch (~1 ms of parsing)
_CQ_UNIT = struct.Struct(">qiq")  # ConsumeQueue unit: CommitLog offset, record size, tags code
_PRE_BLANK_SIZE = (1 << 31) - 1
INSTALL_THREADS = 2  # hot-file installs in flight at once: page-cache writes, a few are enough
NAMED_GET_BYTES = 1 << 20  # a named prefetch's coalesced GET at most (records of one ConsumeQueue page)
UNITS_PER_GET = 256  # verification units one GET fetches at most (1 MiB of 4 KiB units: a large random read, one GET)


def _pwrite_blocks(fd: int, todo: list[tuple[int, memoryview, Buffer | None]], block_bytes: int) -> None:
    """Blocking: write fetched blocks (block, its bytes, -) at their place in the file."""
    for b, view, _ in todo:
        os.pwrite(fd, view, b * block_bytes)


def first_bad_block(first: int, data: bytes, crcs: list[int], lens: list[int]) -> int | None:
    """The first block of `data` (blocks first, first+1, ... of lengths `lens`) that fails its crc32c, or None."""
    mv = memoryview(data)
    pos = 0
    for i, (crc, ln) in enumerate(zip(crcs, lens)):
        if len(data) < pos + ln or crc32c.crc32c(mv[pos:pos + ln]) != crc:
            return first + i
        pos += ln
    return None


def _get_checked(store: ObjectStore, key: str, start: int, views: list[memoryview], first: int,
                 crcs: list[int], early: Callable[[int], None] | None = None) -> int | None:
    """Blocking: one ranged GET of a raw chunk object straight into its blocks' buffers, and their crc32c check
    as each arrives: the first bad block, or None. `early(i)` is told of each good block i the store reports
    before the GET ends (all blocks before it good too), so a waiting reader need not wait for the whole GET."""
    checked = 0
    bad: int | None = None

    def progress(k: int) -> None:
        nonlocal checked, bad
        while checked < k:
            i = checked
            checked += 1
            if bad is None and crc32c.crc32c(views[i]) != crcs[i]:
                bad = first + i
            elif bad is None and early is not None:
                early(i)

    store.get_range_into(key, start, views, progress)
    early = None  # the GET is over: the fetch lands the rest itself
    progress(len(views))
    return bad


def _get_units_checked(store: ObjectStore, key: str, start: int, length: int, first: int, table: bytes,
                       unit: int, only: list[int] | None = None) -> tuple[list[memoryview | None], int | None]:
    """Blocking: one ranged GET of verification units first, first+1, ... of a raw chunk object, and their crc32c
    check: (a view per unit, the first bad unit or None). Each unit of a multi-unit GET is copied out, so a pooled
    unit holds its own 4 KiB, not the whole GET (the pool counts what it keeps); of a GET coalesced over gaps only
    the units in `only` (the others' views are None)."""
    data = store.get_range(key, start, length)
    return _split_units(data, first, unit, only), units.first_bad(data, first, table, unit)


def _split_units(data: bytes, first: int, unit: int, only: list[int] | None) -> list[memoryview | None]:
    """A view per unit of `data` (units first, first+1, ...), each copied out of a multi-unit GET; None for the
    units not in `only` (the gaps of a coalesced GET)."""
    mv = memoryview(data)
    if len(mv) <= unit:
        return [mv]
    keep = set(only) if only is not None else None
    return [memoryview(bytes(mv[p:p + unit])) if keep is None or first + i in keep else None
            for i, p in enumerate(range(0, len(mv), unit))]


def _get_decoded_checked(store: ObjectStore, key: str, footer: "lz4c.Footer", first: int, n: int, crcs: list[int],
                         lens: list[int]) -> tuple[bytes, int | None]:
    """Blocking: one ranged GET of the lz4 blocks covering blocks [first, first+n) of an lz4c object, their
    decompression and crc32c check, all in the one worker thread (one hop to the loop and back per GET)."""
    off, length = lz4c.block_span(footer, first, n)
    data = lz4c.decode_blocks(footer, first, n, store.get_range(key, off, length))
    return data, first_bad_block(first, data, crcs, lens)


def unit_runs(e: Entry, wanted: list[int]) -> list[tuple[int, int]]:
    """Group verification units into (first, count) runs that stay inside one chunk object, UNITS_PER_GET at most
    (a random read's GET stays small)."""
    return _runs(wanted, e.chunk_bytes // e.unit_bytes, UNITS_PER_GET)


def coalesce(runs: list[tuple[int, int]], gap: int, most: int, per_chunk: int) -> list[tuple]:
    """Merge (first, count) runs of units whose gaps are at most `gap` units into one GET each (`most` units
    long at most, none crossing a multiple of per_chunk): (first, count) for a run alone, (first, count, the units
    asked for) for a merged one, whose gap units are fetched and dropped."""
    out: list[tuple] = []
    for first, n in runs:
        if out:
            f0, n0, *only = out[-1]
            if (first - (f0 + n0) <= gap and first + n - f0 <= most
                    and f0 // per_chunk == (first + n - 1) // per_chunk):
                asked = only[0] if only else list(range(f0, f0 + n0))
                out[-1] = (f0, first + n - f0, asked + list(range(first, first + n)))
                continue
        out.append((first, n))
    return out


def pinned_ranges(e: Entry) -> list[tuple[int, int]]:
    """Byte ranges that never leave the hot file: the first page of every segment (startup recovery),
    and the last page of every ConsumeQueue segment (cleaning reads its last unit)."""
    out = [(0, min(PAGE, e.size))]
    if e.kind in (Kind.CONSUMEQUEUE.value, Kind.BATCHCONSUMEQUEUE.value):
        out.append(((e.size - 1) // PAGE * PAGE, e.size))
    return out


def in_pinned(e: Entry, off: int, end: int) -> bool:
    """Does [off, end) lie inside one pinned range (a page a broker reads at start or when cleaning)?"""
    return any(p0 <= off and end <= p1 for p0, p1 in pinned_ranges(e))


def holds_data(fd: int, lo: int, hi: int) -> bool:
    """Does the file hold [lo, hi) with no hole in it? False too when the file system cannot tell (EINVAL): the
    bytes are then fetched, never served as zeros."""
    try:
        return os.lseek(fd, lo, os.SEEK_DATA) == lo and os.lseek(fd, lo, os.SEEK_HOLE) >= hi
    except OSError:  # ENXIO: no data at or after lo
        return False


def block_runs(e: Entry, blocks: list[int], max_blocks: int) -> list[tuple[int, int]]:
    """Group blocks into (first, count) runs that stay inside one chunk object."""
    return _runs(blocks, e.chunk_bytes // e.block_bytes, max_blocks)  # an lz4c entry's "chunk": the whole segment


def _runs(pieces: list[int], per_chunk: int, most: int) -> list[tuple[int, int]]:
    """(first, count) runs of consecutive pieces, `most` long at most, none crossing a multiple of per_chunk."""
    runs: list[tuple[int, int]] = []
    for b in sorted(set(pieces)):
        if runs:
            first, n = runs[-1]
            if b == first + n and n < most and b // per_chunk == first // per_chunk:
                runs[-1] = (first, n + 1)
                continue
        runs.append((b, 1))
    return runs


class Fetch:
    """One ranged GET in flight for a run of blocks. Its outcome travels with it: a reader gets the error of the
    fetch it waited for, never one left over from an earlier fetch of the same blocks."""

    __slots__ = ("done", "error", "gave_up", "waiting", "arrived", "parts", "ready", "landed")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.error: str | None = None
        self.gave_up = False  # a reader already waited the whole bound on it
        # Blocks landing one by one while the GET runs (raw chunks), for the readers waiting on it:
        self.waiting = 0  # readers waiting on it (only then does the worker thread hop to the loop per block)
        self.arrived = trio.Event()  # set (and replaced) when blocks landed that way, and at the end
        self.parts: tuple | None = None  # (entry, generation, first block, views, buffers, prefetch) of the GET
        self.ready = 0  # blocks [first, first+ready) are in and verified (written by the worker thread)
        self.landed = 0  # blocks [first, first+landed) went into the pool ahead of the GET's end


class BlockCache:
    def __init__(self, engine: Engine):
        self.eng = engine
        self.inflight: dict[tuple[int, int, int], Fetch] = {}  # (file id, generation, block) -> its fetch
        self.streams: dict[int, ReadAhead] = {}  # read-ahead state by FUSE file handle
        self.footers: dict[str, lz4c.Footer] = {}  # lz4c block tables by object key
        self.prefetch_inflight = 0
        self.pool = BufferPool(int(engine.config["readahead.budget_bytes"]))  # verified blocks, replies cut here
        self.installing: set[tuple[int, int, int]] = set()  # blocks a worker thread is writing into the hot file
        self.installing_bytes = 0
        self._installs: dict[int, int] = {}  # file id -> installs in flight
        self._install_done = trio.Event()
        self._frozen: set[int] = set()  # file ids being rewritten: no install may start
        self._pins_local: set[tuple[int, int, int]] = set()  # (file id, generation, offset): pinned pages held
        self._pin_installs: set[tuple[int, int, int]] = set()  # ... being written into the hot file
        self._install_limiter = trio.CapacityLimiter(INSTALL_THREADS)
        # store root -> (its message log's file size, the log's dir with a trailing '/', when found)
        self._message_log_of: dict[str, tuple[int, str, float]] = {}
        self._named: dict[int, float] = {}  # CommitLog file id -> when a ConsumeQueue page last named its records
        self._peeked: dict[int, float] = {}  # ... named by a pinned page (no prefetch): random reads by blocks
        self._stream_file: dict[int, int] = {}  # FUSE file handle -> file id it opened (or read)
        self.tables = units.TableLRU(int(engine.config["cache.unit_tables_bytes"]))  # loaded table objects
        self._table_loads: dict[tuple[int, int], trio.Event] = {}  # (file id, generation) -> its load in flight
        self._bad_tables: set[tuple[int, int]] = set()  # tables refused or found wrong: whole blocks for those
        self.waiters = StoreWaiters(int(engine.config["mount.max_store_waiters"]))  # requests waiting on the store

    def opened(self, fh: int, e: Entry) -> None:
        """A handle of a tiered file opened: the file has a reader (its buffers live until the last one closes,
        and layout-aware prefetch may fill them)."""
        self._stream_file[fh] = e.file_id

    def release_stream(self, fh: int) -> None:
        """A handle closed: its read-ahead state goes, and once no handle of that file reads it any more, so do
        the file's buffers in the pool (what a reader left unread is not kept in memory for nobody)."""
        self.streams.pop(fh, None)
        fid = self._stream_file.pop(fh, None)
        if fid is not None and fid not in self._stream_file.values():
            self.pool.discard_file(fid)

    # ------------------------------------------------------------------ reads

    async def read(self, e: Entry, ino: int, fh: int, off: int, size: int) -> bytes | memoryview:
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
            self._stream_file[fh] = e.file_id
        window = stream.on_read(off, end)
        if window and self._named and time.monotonic() - self._named.get(e.file_id, -60.0) < NAMED_HOLD_SECONDS:
            window = 0  # a consumer's records, named by its ConsumeQueue and prefetched: no blind read-ahead
        waited = False
        deadline = trio.current_time() + float(eng.config["objectstore.read_timeout_seconds"])
        bb = e.block_bytes
        for _ in range(8):
            if eng.tiered.get(ino) is not e:
                return os.pread(fh, end - off, off)  # rewritten meanwhile: now fully local
            missing = self._missing(e, off, end)
            unit_gaps = self._missing_units(e, missing, off, end) if missing and not window else None
            if not missing or unit_gaps == []:
                data = self._cut(e, off, end, sequential=window > 0)  # no await since the check
                self._keep_pin(e, off, end, data)
                for b in range(off // bb, (end - 1) // bb + 1):
                    stream.consumed(b)
                if window:
                    self._prefetch(e, stream, (end - 1) // bb + 1, window)
                if e.kind == Kind.CONSUMEQUEUE.value and end - off >= CQ_UNIT:
                    # a pinned page (a peek at broker start or by cleaning, or a consumer's first page) prefetches
                    # nothing, but the CommitLogs it names are still marked as a consumer's (whole blocks)
                    self._prefetch_named(e, data, off, fetch=not in_pinned(e, off, end))
                if waited:
                    eng.stats.reads_waited += 1
                else:
                    eng.stats.reads_local += 1
                return data
            waited = True
            stream.ahead = None  # a block the read-ahead asked for is missing (dropped, or a fetch failed): look again
            if window:
                self._prefetch(e, stream, missing[-1] + 1, window)
            if unit_gaps:
                await self._ensure_units(e, unit_gaps, deadline)
            else:
                await self._ensure(e, missing, deadline, scan=window > 0)
        raise ReadFailed(f"{e.path}: blocks kept being evicted while reading {off}+{size}")

    def _missing(self, e: Entry, off: int, end: int) -> list[int]:
        """Blocks of [off, end) that are neither in memory nor resident (none for a pinned page the hot file
        holds)."""
        pool, fid, gen = self.pool, e.file_id, e.generation
        out = [b for b in range(off // e.block_bytes, (end - 1) // e.block_bytes + 1)
               if not e.is_resident(b) and (fid, gen, b) not in pool]
        return [] if out and self._pin_local(e, off, end) else out

    def kept_pins(self, e: Entry) -> list[tuple[int, int]]:
        """The pinned ranges of `e` this mount keeps in the hot file when it evicts (the evictor's rule). None on a
        read-only mount: its cache is punched whole."""
        return [] if self.eng.read_only else pinned_ranges(e)

    def _pin_local(self, e: Entry, off: int, end: int) -> bool:
        """Does the hot file hold [off, end), a part of one kept pinned page? Asked of the file itself (a takeover's
        sparse file holds none), except while an install is writing that page; a page found held is remembered.
        No await."""
        fid, gen, bb = e.file_id, e.generation, e.block_bytes
        for p0, p1 in self.kept_pins(e):
            if not (p0 <= off and end <= p1):
                continue
            key = (fid, gen, p0)
            if key in self._pins_local:
                return True
            if key in self._pin_installs or any((fid, gen, b) in self.installing
                                                for b in range(p0 // bb, (p1 - 1) // bb + 1)):
                return False  # being written: not known whole yet (fetched meanwhile)
            if holds_data(self.eng.fd(e), p0, p1):
                if len(self._pins_local) >= 1 << 16:
                    self._pins_local.clear()  # only a memory of the probe: deleted files' entries go with it
                self._pins_local.add(key)
                return True
        return False

    def _keep_pin(self, e: Entry, off: int, end: int, data: bytes | memoryview) -> None:
        """A reply that is a whole kept pinned page the hot file does not hold yet (nor will once an install of its
        block lands): write it there in a worker thread, so the page stays local from now on as DESIGN §4 wants
        (the evictor never punches it). Not while the file is being rewritten. No await."""
        fid, gen, bb = e.file_id, e.generation, e.block_bytes
        if end - off > PAGE or (off, end) not in self.kept_pins(e) or fid in self._frozen:
            return  # (a pinned page is one page at most: a large read is never one)
        key = (fid, gen, off)
        blocks = range(off // bb, (end - 1) // bb + 1)
        if key in self._pin_installs or all(e.is_resident(b) or (fid, gen, b) in self.installing for b in blocks):
            return
        if self._pin_local(e, off, end):
            return
        self._pin_installs.add(key)
        self._install_begin(fid)
        self.eng.start_soon(self._install_pin, e, key, bytes(data))

    async def _install_pin(self, e: Entry, key: tuple[int, int, int], page: bytes) -> None:
        """Write a pinned page into the hot file through a dup of the engine's fd, then remember it as held if the
        file is still this tiered generation."""
        ok = False
        try:
            fd = os.dup(self.eng.fd(e))
            try:
                await trio.to_thread.run_sync(os.pwrite, fd, page, key[2], limiter=self._install_limiter)
                ok = True
            finally:
                os.close(fd)
        except (OSError, ReadFailed) as err:
            log.warning("keeping pinned page %d of %s locally failed (%s); it is fetched again when needed", key[2],
                        e.path, err)
        finally:
            self._pin_installs.discard(key)
            self._install_end(key[0])
        if ok and self._same(e, key[1]):
            self._pins_local.add(key)

    def _units(self, e: Entry) -> int:
        """The verification unit a random read of `e` may fetch by, 0 when it has no table at hand (lz4c, an older
        row, a table object not loaded, refused or found wrong)."""
        return e.unit_bytes if self._table(e) is not None else 0

    def _table(self, e: Entry) -> bytes | None:
        """The verification table of `e` if it is at hand: inline in an older row, or its object loaded."""
        if e.format != "raw" or not e.unit_bytes or (e.file_id, e.generation) in self._bad_tables:
            return None
        if e.unit_crcs:
            return e.unit_crcs if len(e.unit_crcs) == 4 * unit_count(e) else None
        return self.tables.get((e.file_id, e.generation)) if e.unit_ref else None

    def _needs_table(self, e: Entry) -> bool:
        """Has `e` a table object that is not loaded yet (nor refused)?"""
        k = (e.file_id, e.generation)
        return bool(e.unit_ref) and e.format == "raw" and k not in self.tables and k not in self._bad_tables

    def _begin_table_load(self, e: Entry) -> trio.Event:
        """The load of `e`'s table object in flight (started now if none is): set when it ended. No await."""
        k = (e.file_id, e.generation)
        ev = self._table_loads.get(k)
        if ev is None:
            ev = self._table_loads[k] = trio.Event()
            self.eng.start_soon(self._table_loader, e, ev)
        return ev

    async def _load_table(self, e: Entry, deadline: float) -> None:
        """Wait (within the read deadline) for `e`'s table object to be loaded, starting its load if needed."""
        with trio.move_on_at(deadline):
            await self._begin_table_load(e).wait()

    async def _table_loader(self, e: Entry, ev: trio.Event) -> None:
        """Fetch the verification table object of `e` into the LRU, checked against its reference (size and
        crc32c); one load per segment at a time. A refused table is logged with its object and the segment is
        read by whole blocks from then on; a store error leaves it to the next read."""
        k = (e.file_id, e.generation)
        key = units.ref_key(e.unit_ref)
        try:
            try:
                key, size, crc = units.parse_ref(e.unit_ref, 4 * unit_count(e),
                                                 units.row_table_key(e.objects[0], e.unit_ref))
                data = await self.eng.io(self.eng.store.get, key)
                why = units.check_table(data, size, crc)
            except ValueError as err:
                why = str(err)
            except ObjectNotFound:
                why = "it is missing"
            if why is None:
                self.eng.stats.unit_table_loads += 1
                if self._same(e, k[1]):
                    self.tables.put(k, bytes(data))
            else:
                self.eng.stats.unit_tables_refused += 1
                self._bad_tables.add(k)
                log.error("verification table object %s of %s is refused (%s): it is read by whole blocks", key,
                          e.path, why)
        except Exception as err:  # a store error (or any other): never let a load take the nursery down
            log.warning("verification table object %s of %s: %s: %s; whole blocks meanwhile", key, e.path,
                        type(err).__name__, err)
        finally:
            del self._table_loads[k]
            ev.set()

    def _missing_units(self, e: Entry, missing: list[int], off: int, end: int) -> list[int] | None:
        """The verification units of [off, end) in `missing` blocks not pooled, or None when the read must fetch
        whole blocks (no table; a block of it is being fetched whole: that fetch is waited for; or a ConsumeQueue
        named the file's records lately and readahead.named_units is off: a consumer's next records are in the
        same blocks, one GET per record would cost far more than the bytes saved)."""
        u = self._units(e) or (e.unit_bytes if self._needs_table(e) else 0)  # a table object loads with the units
        if not u or ((self._named or self._peeked) and not self.eng.config["readahead.named_units"] and
                     time.monotonic() - max(self._named.get(e.file_id, -60.0), self._peeked.get(e.file_id, -60.0))
                     < NAMED_HOLD_SECONDS):
            return None  # none, or a consumer's records (a ConsumeQueue named them): they cluster in blocks
        fid, gen, bb, pool, inflight = e.file_id, e.generation, e.block_bytes, self.pool, self.inflight
        out = []
        for b in missing:
            if (fid, gen, b) in inflight:
                return None
            lo, hi = max(off, b * bb), min(end, b * bb + e.block_len(b))
            out += [k for k in range(lo // u, (hi - 1) // u + 1) if (fid, gen, ~k) not in pool]
        return out

    def _unit_views(self, e: Entry, lo: int, hi: int) -> list[memoryview] | None:
        """[lo, hi) cut from pooled verification units, or None unless every one of them is pooled."""
        u = e.unit_bytes
        if not u:
            return None
        out = []
        for k in range(lo // u, (hi - 1) // u + 1):
            mv = self.pool.get((e.file_id, e.generation, ~k))
            if mv is None:
                return None
            out.append(mv[max(lo, k * u) - k * u:min(hi, k * u + len(mv)) - k * u])
        return out

    def _cut(self, e: Entry, off: int, end: int, sequential: bool) -> bytes | memoryview:
        """The reply for [off, end), nothing missing: slices of pooled buffers or verification units, preads of
        resident runs (one per run). A sequential reader is done with a block once it read to its end: the buffer
        goes. No await."""
        eng, pool, bb = self.eng, self.pool, e.block_bytes
        parts: list[bytes | memoryview] = []
        run_lo = run_hi = off  # a run of resident bytes not read yet
        for b in range(off // bb, (end - 1) // bb + 1):
            b0 = b * bb
            b1 = b0 + e.block_len(b)
            lo, hi = max(off, b0), min(end, b1)
            key = (e.file_id, e.generation, b)
            mv = pool.get(key)
            pieces = self._unit_views(e, lo, hi) if mv is None and not e.is_resident(b) else None
            if pieces is not None:  # a random read's verification units
                if run_hi > run_lo:
                    parts.append(os.pread(eng.fd(e), run_hi - run_lo, run_lo))
                run_lo = run_hi = hi
                parts += pieces
                continue
            if mv is None:  # resident (or a pinned page the hot file holds)
                if run_hi != lo:
                    run_lo = lo
                run_hi = hi
                continue
            if run_hi > run_lo:
                parts.append(os.pread(eng.fd(e), run_hi - run_lo, run_lo))
            run_lo = run_hi = hi
            parts.append(mv[lo - b0:hi - b0])
            if sequential and hi == b1:
                pool.discard(key)
        if run_hi > run_lo:
            parts.append(os.pread(eng.fd(e), run_hi - run_lo, run_lo))
        if len(parts) == 1:
            if isinstance(parts[0], memoryview):
                eng.stats.reads_from_memory += 1
            return parts[0]
        eng.stats.reads_from_memory += 1
        return b"".join(parts)

    def _needs_fetch(self, e: Entry, off: int, end: int) -> list[int]:
        """Blocks of [off, end) not resident in the hot file (what a rewrite needs there, pooled or not; none for a
        pinned page the hot file holds)."""
        out = [b for b in range(off // e.block_bytes, (end - 1) // e.block_bytes + 1) if not e.is_resident(b)]
        return [] if out and self._pin_local(e, off, end) else out

    async def _ensure(self, e: Entry, blocks: list[int], deadline: float, scan: bool = False) -> None:
        """Make `blocks` resident (fetching what no one is fetching yet), bounded by the read deadline. The
        error a reader gets is the one of the fetch it waited for."""
        with self.waiters.slot(e.path):  # EIO at once when too many requests wait on the store already
            fetches = self._join_or_start(e, blocks, lambda todo: block_runs(e, todo, 8), scan=scan, unit=False)
            fid, gen, pool = e.file_id, e.generation, self.pool
            await self._wait(e, fetches, deadline, lambda: all(e.is_resident(b) or (fid, gen, b) in pool
                                                               for b in blocks), blocks[0])

    async def _ensure_units(self, e: Entry, wanted: list[int], deadline: float) -> None:
        """Fetch verification units `wanted` into the pool (runs inside one chunk object, one GET each), bounded
        by the read deadline, like _ensure."""
        with self.waiters.slot(e.path):
            fetches = self._join_or_start(e, wanted, lambda todo: unit_runs(e, todo), scan=False, unit=True)
            fid, gen, pool = e.file_id, e.generation, self.pool
            await self._wait(e, fetches, deadline, lambda: all((fid, gen, ~k) in pool for k in wanted),
                             wanted[0] * e.unit_bytes // e.block_bytes)

    def _join_or_start(self, e: Entry, pieces: list[int], runs: Callable[[list[int]], list[tuple[int, int]]],
                       scan: bool, unit: bool) -> dict[int, Fetch]:
        """The fetches a reader of `pieces` (blocks, or with `unit` verification units) waits for: those already
        in flight for some of them, and new ones for the rest, grouped by `runs`."""
        fetches: dict[int, Fetch] = {}
        todo: list[int] = []
        for p in pieces:
            f = self.inflight.get((e.file_id, e.generation, ~p if unit else p))
            if f is not None:
                fetches[id(f)] = f
            else:
                todo.append(p)
        for first, n in runs(todo):
            f = self._start_fetch(e, first, n, prefetch=False, scan=scan, unit=unit)
            fetches[id(f)] = f
        return fetches

    async def _wait(self, e: Entry, fetches: dict[int, Fetch], deadline: float, have: Callable[[], bool],
                    block: int) -> None:
        """Wait for `fetches` until `have()` (what the reader asked for is in: a GET may land its blocks before it
        ends) or they all ended, bounded by the read deadline; raise the error of one that failed. The first reader
        to give up on a fetch logs it, naming the file and the object of `block` (the first one it waited for)."""
        timeout = self.eng.config["objectstore.read_timeout_seconds"]
        if any(f.gave_up for f in fetches.values()):
            # a read of these blocks already waited the whole bound and the fetch is still stuck: the kernel's
            # retry of a failed read-ahead lands here, and must not double the bound the caller sees
            raise ReadFailed(f"{e.path}: object store did not answer within {timeout} s (fetch still in flight)")
        with trio.move_on_at(deadline) as scope:
            for f in fetches.values():
                f.waiting += 1
            try:
                while True:
                    pending = [f for f in fetches.values() if not f.done.is_set()]
                    for f in pending:
                        self._land_ready(f)  # what came in before anyone waited
                    if have():
                        return
                    if not pending:
                        break
                    await pending[0].arrived.wait()
            finally:
                for f in fetches.values():
                    f.waiting -= 1
        if scope.cancelled_caught:
            first_to_give_up = False
            for f in fetches.values():
                first_to_give_up |= not f.done.is_set() and not f.gave_up
                f.gave_up = not f.done.is_set()
            if first_to_give_up:
                log.error("a read of %s gave up with EIO: object %s did not answer within %s s "
                          "(objectstore.read_timeout_seconds)", e.path, self._object_of(e, block), timeout)
            raise ReadFailed(f"{e.path}: object store did not answer within {timeout} s")
        for f in fetches.values():
            if f.error:
                raise ReadFailed(f.error)

    def _start_fetch(self, e: Entry, first: int, n: int, prefetch: bool, scan: bool, unit: bool = False,
                     only: list[int] | None = None) -> Fetch:
        """Start one ranged GET of blocks (or `unit`s) [first, first+n); with `only`, a GET coalesced over gaps:
        only those units are claimed and kept (the gap bytes are checked and dropped)."""
        f = Fetch()
        for b in only if only is not None else range(first, first + n):
            self.inflight[(e.file_id, e.generation, ~b if unit else b)] = f
        self.eng.start_soon(self._fetch, e, first, n, f, prefetch, scan, unit, only)
        return f

    def _prefetch(self, e: Entry, stream: ReadAhead, start: int, window: int) -> None:
        budget = int(self.eng.config["readahead.budget_bytes"])
        # The window slides by the one block each read uncovers; extend it to the end of its aligned group, so
        # each GET brings a whole group instead of one block per read.
        group = self._group_blocks(e.block_bytes)
        hi = min(-(-min(start + window, e.nblocks) // group) * group, e.nblocks)
        fid, gen, pool = e.file_id, e.generation, self.pool
        ahead = stream.ahead
        if ahead is not None and ahead[0] == gen:  # what an earlier read of this stream asked for is not looked at
            if ahead[1] >= hi:  # again (each read moves the window by a block: one look per block, not per read)
                return
            start = max(start, ahead[1])
        want = [b for b in range(start, hi)
                if not e.is_resident(b) and (fid, gen, b) not in self.inflight and (fid, gen, b) not in pool]
        for first, n in block_runs(e, want, group):
            nbytes = n * e.block_bytes
            # what is in flight plus what arrived and is not read yet: a reader slower than the store stops it
            if self.prefetch_inflight + pool.unread_bytes + nbytes > budget:
                stream.ahead = (gen, first)
                return
            self.prefetch_inflight += nbytes
            stream.prefetched.update(range(first, first + n))
            self._start_fetch(e, first, n, prefetch=True, scan=True)
        stream.ahead = (gen, hi)

    def _group_blocks(self, block_bytes: int) -> int:
        """Blocks per read-ahead GET: PREFETCH_GROUP_BYTES, or a quarter of readahead.budget_bytes when that is
        less (a GET larger than the budget would never start, and one as large as it would leave no room)."""
        budget = int(self.eng.config["readahead.budget_bytes"])
        return max(1, min(PREFETCH_GROUP_BYTES, budget // 4) // block_bytes)

    def _prefetch_named(self, cq: Entry, data: bytes | memoryview, off: int, load: bool = True,
                        fetch: bool = True) -> None:
        """Layout-aware prefetch: a page of a tiered ConsumeQueue names the CommitLog records its consumer reads
        next (20-byte units: offset, size, tags code). Fetch the blocks of those records that are evicted, in
        coalesced ranged GETs, within the read-ahead budget, so a consumer of a small topic pulls only the blocks
        holding its messages, not the whole CommitLog. Only CommitLog files a reader has open (the broker keeps
        its CommitLog mapped): their buffers live until the last handle closes. A CommitLog whose verification
        table object is not loaded yet is prefetched once a task has loaded it (`load`). Without `fetch`, the
        CommitLogs named are only marked (a consumer's: random reads of them fetch whole blocks, see
        _missing_units). No await in here."""
        eng = self.eng
        root = split_root(cq.path)[0]
        seg, prefix = self._message_log(root)
        if not seg:
            return
        mv = memoryview(data)
        start = -off % CQ_UNIT
        stop = start + min((len(mv) - start) // CQ_UNIT, NAMED_UNITS_PER_READ) * CQ_UNIT
        reading = set(self._stream_file.values())  # only files a reader has open: buffers go at the last close
        by_units = bool(eng.config["readahead.named_units"])
        want: dict[int, tuple[Entry, list[int]]] = {}
        tables: dict[int, Entry] = {}  # CommitLogs whose table object must be loaded first
        last: tuple[int, int] = (-1, -1)  # (file id, block) just added: consecutive units share blocks
        for phys, size, _ in _CQ_UNIT.iter_unpack(mv[start:stop]):
            if phys < 0 or size <= 0:
                break  # the end of the queue's data
            if size == _PRE_BLANK_SIZE:
                continue
            base = phys - phys % seg
            c = eng.entries.get(f"{prefix}{base:020d}")
            if c is None or eng.tiered.get(c.ino) is not c or c.file_id not in reading:
                continue  # local (or unknown, or no reader has it open): nothing to fetch
            if by_units and self._needs_table(c):
                tables[c.file_id] = c
                continue
            u = by_units and self._units(c)
            bb = u or c.block_bytes  # the record's verification units, or its blocks
            rel = phys - base
            slot = want.get(c.file_id)
            if slot is None:
                slot = want[c.file_id] = (c, [])
            lo, hi = rel, min(rel + size, c.size)
            if u and u < PAGE:  # the kernel reads whole pages: the units of the record's pages
                lo, hi = lo - lo % PAGE, min(-(-hi // PAGE) * PAGE, c.size)
            for b in range(lo // bb, (hi - 1) // bb + 1):
                if (c.file_id, b) != last:
                    slot[1].append(b)
                    last = (c.file_id, b)
        now = time.monotonic()
        if not fetch:  # only marked: their generic read-ahead stays (self._named would hold it off)
            if len(self._peeked) > 1024:
                self._peeked = {k: t for k, t in self._peeked.items() if now - t < NAMED_HOLD_SECONDS}
            for c in [c for c, _ in want.values()] + list(tables.values()):
                self._peeked[c.file_id] = now
            return
        if tables and load:
            eng.start_soon(self._prefetch_named_loaded, cq, bytes(mv), off, list(tables.values()))
        budget = int(eng.config["readahead.budget_bytes"])
        gap = int(eng.config["readahead.named_gap_bytes"])
        if len(self._named) > 1024:
            self._named = {k: t for k, t in self._named.items() if now - t < NAMED_HOLD_SECONDS}
        for c, pieces in want.values():
            self._named[c.file_id] = now
            fid, gen, pool, inflight = c.file_id, c.generation, self.pool, self.inflight
            u = self._units(c) if by_units else 0
            if u:  # verification units: those of a block that is local, pooled or being fetched are not needed
                per = c.block_bytes // u
                todo = [k for k in pieces if not c.is_resident(k // per) and (fid, gen, k // per) not in inflight
                        and (fid, gen, k // per) not in pool and (fid, gen, ~k) not in inflight
                        and (fid, gen, ~k) not in pool]
                runs = coalesce(unit_runs(c, todo), gap // u, max(1, NAMED_GET_BYTES // u), c.chunk_bytes // u)
            else:
                todo = [b for b in pieces if not c.is_resident(b) and (fid, gen, b) not in inflight
                        and (fid, gen, b) not in pool]
                runs = block_runs(c, todo, self._group_blocks(c.block_bytes))
            for first, n, *only in runs:
                nbytes = n * (u or c.block_bytes)
                if self.prefetch_inflight + pool.unread_bytes + nbytes > budget:
                    return
                self.prefetch_inflight += nbytes
                eng.stats.named_prefetch_bytes += min((first + n) * (u or c.block_bytes), c.size) - first * (
                    u or c.block_bytes)
                self._start_fetch(c, first, n, prefetch=True, scan=True, unit=bool(u), only=only[0] if only else None)

    async def _prefetch_named_loaded(self, cq: Entry, data: bytes, off: int, logs: list[Entry]) -> None:
        """Load the table objects of CommitLogs a ConsumeQueue page named, then prefetch that page's records."""
        deadline = trio.current_time() + float(self.eng.config["objectstore.read_timeout_seconds"])
        for c in logs:
            if self._needs_table(c):
                await self._load_table(c, deadline)
        self._prefetch_named(cq, data, off, load=False)

    def _message_log(self, root: str) -> tuple[int, str]:
        """(file size, dir + '/') of the log a store root's ConsumeQueues point into: its CommitLog, or the data
        files of its DLedger CommitLog (`dledger-<id>/data/`, named by offset and holding the same records at
        the offsets the units name). The size (mappedFileSizeCommitLog: every sealed file has it) comes from a
        tiered file of the log; looked up again at most every 10 s while none is known."""
        size, prefix, when = self._message_log_of.get(root, (0, "", 0.0))
        now = time.monotonic()
        if size or now - when < 10.0:
            return size, prefix
        for c in self.eng.tiered.values():
            if c.kind in MESSAGE_LOGS and split_root(c.path)[0] == root:
                size, prefix = c.size, c.path.rpartition("/")[0] + "/"
                break
        self._message_log_of[root] = (size, prefix, now)
        return size, prefix

    @staticmethod
    def _object_of(e: Entry, first: int) -> str:
        return e.objects[0] if e.format == "lz4c" else e.objects[layout.raw_chunk_of(first, e.chunk_bytes,
                                                                                    e.block_bytes)[0]]

    async def _read_blocks(self, e: Entry, first: int, n: int, fetch: Fetch | None = None,
                           prefetch: bool = False) -> tuple[list[memoryview], list[Buffer], int | None]:
        """The content of blocks [first, first+n) from the object store (a view per block, and the pool's buffers
        they live in, held once for the caller to release; none for lz4c), and the first block that fails its
        crc32c (None: all good): one ranged GET of a raw chunk object into reused buffers, or of the covering lz4
        blocks of an lz4c object. GET, decompression and the check all run in one worker thread, off the loop.
        A raw chunk's blocks can land one by one while the GET runs, for readers waiting on `fetch` (_land_ready)."""
        store = self.eng.store
        key = self._object_of(e, first)
        crcs = e.block_crcs[first:first + n]
        lens = [e.block_len(b) for b in range(first, first + n)]
        if e.format == "lz4c":
            footer = await self._footer(key)
            data, bad = await self.eng.io(_get_decoded_checked, store, key, footer, first, n, crcs, lens)
            mv, views, pos = memoryview(data), [], 0
            for ln in lens:
                views.append(mv[pos:pos + ln])
                pos += ln
            return views, [], bad
        start = layout.raw_chunk_of(first, e.chunk_bytes, e.block_bytes)[1]
        # taken in this task, never in the reader's: see Buffers (a reply may still read a buffer freed there)
        bufs = [self.pool.buffers.take(e.block_bytes) for _ in range(n)]
        early: Callable[[int], None] | None = None
        if fetch is not None:
            token = trio.lowlevel.current_trio_token()

            def arrived(i: int) -> None:  # worker thread: a hop to the loop per block only while a reader waits
                fetch.ready = i + 1
                if fetch.waiting:
                    token.run_sync_soon(self._land_ready, fetch)
            early = arrived
        try:
            views = [buf.view[:ln] for buf, ln in zip(bufs, lens)]
            if fetch is not None:
                fetch.parts, fetch.ready = (e, e.generation, first, views, bufs, prefetch), 0
            bad = await self.eng.io(_get_checked, store, key, start, views, first, crcs, early)
        except BaseException:
            for buf in bufs:
                self.pool.buffers.release(buf)
            raise
        finally:
            if fetch is not None:
                fetch.parts = None  # the fetch lands the rest (or releases the buffers) itself now
        return views, bufs, bad

    def _land_ready(self, fetch: Fetch) -> None:
        """Blocks of a GET still running that are in and verified: into the pool now, for the readers waiting
        on it (the fetch holds their buffers until it ends; _land then skips them). No await in here."""
        parts = fetch.parts
        if parts is None or fetch.landed >= fetch.ready:
            return
        e, gen, first, views, bufs, prefetch = parts
        if not self._same(e, gen):
            return
        while fetch.landed < fetch.ready:
            i = fetch.landed
            fetch.landed += 1
            key = (e.file_id, gen, first + i)
            if key not in self.pool:
                self.pool.put(key, views[i], unread=prefetch, reserve=self.prefetch_inflight, buf=bufs[i])
        ev, fetch.arrived = fetch.arrived, trio.Event()
        ev.set()

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

    async def _read_units(self, e: Entry, first: int, n: int, deadline: float, only: list[int] | None = None
                          ) -> tuple[list[memoryview | None], list[Buffer], int | None, int | None]:
        """Verification units [first, first+n) of a raw segment (inside one chunk object) from the object store:
        (a view per unit, -, None, None) when all pass the table: one ranged GET and the check in one worker thread.
        The table is untrusted (an object): when a unit fails it, or there is no table at hand any more, the
        covering blocks are fetched and checked against their own crc32c instead: (a view per block, their
        buffers, the first bad block or None, the first block). Blocks that pass while a unit failed prove the
        table wrong: it is logged with its object and the segment is read by whole blocks from then on."""
        u = e.unit_bytes
        table = self._table(e)
        chunk_no = first * u // e.chunk_bytes
        key = e.objects[chunk_no]
        start, length = first * u - chunk_no * e.chunk_bytes, min((first + n) * u, e.size) - first * u
        bad: int | None = None
        if table is None and self._needs_table(e):
            # not loaded yet (or dropped from the LRU): the table object and the units at once, one round trip
            loading = self._begin_table_load(e)
            data = await self.eng.io(self.eng.store.get_range, key, start, length)
            with trio.move_on_at(deadline):
                await loading.wait()
            table = self._table(e)
            if table is not None:
                bad = units.first_bad(data, first, table, u)
                if bad is None:
                    return _split_units(data, first, u, only), [], None, None
        elif table is not None:
            views, bad = await self.eng.io(_get_units_checked, self.eng.store, key, start, length, first, table,
                                           u, only)
            if bad is None:
                return views, [], None, None
        b0, b1 = first * u // e.block_bytes, (min((first + n) * u, e.size) - 1) // e.block_bytes
        views, bufs, bad_block = await self._read_blocks(e, b0, b1 - b0 + 1)
        if table is not None and bad_block is None:
            k = (e.file_id, e.generation)
            self._bad_tables.add(k)
            self.tables.discard(k)
            self.eng.stats.unit_tables_refused += 1
            where = f"object {units.ref_key(e.unit_ref)}" if e.unit_ref else "the catalog's inline table"
            log.error("verification table (%s) of %s is wrong: unit %d fails it but blocks %d-%d pass their own "
                      "crc32c; the segment is read by whole blocks from now on", where, e.path, bad, b0, b1)
        return views, bufs, bad_block, b0

    async def _fetch(self, e: Entry, first: int, n: int, fetch: Fetch, prefetch: bool, scan: bool,
                     unit: bool = False, only: list[int] | None = None) -> None:
        """Fetch blocks [first, first+n), or with `unit` verification units [first, first+n), into the pool."""
        stats = self.eng.stats
        gen = e.generation
        key = self._object_of(e, first * e.unit_bytes // e.block_bytes if unit else first)
        size = e.unit_bytes if unit else e.block_bytes  # of one of the n pieces
        error = None
        t0 = time.monotonic()
        deadline = trio.current_time() + float(self.eng.config["objectstore.read_timeout_seconds"])
        e.pins += 1  # the evictor leaves a file alone while a fetch for it is in flight
        prefetch_counted = prefetch
        try:
            for attempt in (1, 2):
                try:
                    as_blocks = None  # units fetched as their whole blocks from this one (see _read_units)
                    if unit:
                        views, bufs, bad, as_blocks = await self._read_units(e, first, n, deadline, only)
                    else:
                        views, bufs, bad = await self._read_blocks(e, first, n, fetch, prefetch)
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
                nbytes = sum(len(v) for v in views) if not unit or as_blocks is not None else (
                    min((first + n) * size, e.size) - first * size)  # the GET's bytes, gaps included
                try:
                    if bad is None:
                        if prefetch:  # landed: from here its bytes count as pooled (unread), not in flight
                            self.prefetch_inflight -= n * size
                            prefetch_counted = False
                        if unit and as_blocks is None:
                            self._land_units(e, gen, first, views, prefetch, only)
                        elif unit:
                            self._land(e, gen, as_blocks, views, bufs, prefetch, scan)
                        else:
                            self._land(e, gen, first, views, bufs, prefetch, scan, fetch.landed)
                finally:
                    for buf in bufs:  # the fetch's own hold: the pool and installs hold what they keep
                        self.pool.buffers.release(buf)
                if bad is None:
                    self.eng.store_down_since = None  # it answered: any outage is over
                    stats.fetches += 1
                    stats.fetch_bytes += nbytes
                    self.eng.observe("download", time.monotonic() - t0, nbytes)
                    if prefetch:
                        stats.prefetch_bytes += nbytes
                    if unit and as_blocks is None:
                        stats.unit_fetch_bytes += nbytes
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
            if prefetch_counted:
                self.prefetch_inflight -= n * size
            if error:
                stats.fetch_errors += 1
                stats.last_error = error
                log.error("read of %s failed: %s", e.path, error)
            for b in range(first, first + n):
                k = (e.file_id, gen, ~b if unit else b)
                if self.inflight.get(k) is fetch:
                    del self.inflight[k]
            fetch.error = None if prefetch else error
            fetch.done.set()
            fetch.arrived.set()

    def _same(self, e: Entry, gen: int) -> bool:
        """Is `e` still the live tiered entry of its inode, at generation `gen`?"""
        eng = self.eng
        return e.state is State.TIERED and e.generation == gen and eng.is_live(e) and eng.tiered.get(e.ino) is e

    def _land(self, e: Entry, gen: int, first: int, views: list[memoryview], bufs: list[Buffer], prefetch: bool,
              scan: bool, landed: int = 0) -> None:
        """Verified blocks arrive (a view per block, in `bufs` when they live in pool buffers): into the pool
        (readers are answered from there), and into the hot file in a worker thread when the cache budget wants
        them kept; the first `landed` views are in the pool already (_land_ready). No await in here."""
        if not self._same(e, gen):
            return
        fid = e.file_id
        todo: list[tuple[int, memoryview, Buffer | None]] = []
        for i, view in enumerate(views):
            b = first + i
            buf = bufs[i] if bufs else None
            if i >= landed:  # one landed early may have been read (and let go by the pool) already
                self.pool.put((fid, gen, b), view, unread=prefetch, reserve=self.prefetch_inflight, buf=buf)
            if not e.is_resident(b) and (fid, gen, b) not in self.installing:
                todo.append((b, view, buf))
        nbytes = sum(len(t[1]) for t in todo)
        if todo and fid in self._frozen:  # being rewritten: it needs every block in the hot file, now
            fd = self.eng.fd(e)
            for b, view, _ in todo:
                os.pwrite(fd, view, b * e.block_bytes)
                self.eng.set_resident(e, b, True)
            self.eng.evictor.residency_changed(e)
        elif todo and self._keep_locally(nbytes, scan):
            self.installing.update((fid, gen, b) for b, _, _ in todo)
            self.installing_bytes += nbytes
            self._install_begin(fid)
            for _, _, buf in todo:
                if buf is not None:  # the install's hold: the pool may let the block go before it is written
                    self.pool.buffers.hold(buf)
            self.eng.start_soon(self._install, e, gen, todo)
        elif todo:
            self.eng.stats.memory_only_bytes += nbytes

    def _land_units(self, e: Entry, gen: int, first: int, views: list[memoryview | None], prefetch: bool,
                    only: list[int] | None = None) -> None:
        """Verified units arrive: into the pool only (the hot file keeps whole blocks); of a coalesced GET only
        those asked for (`only`; the views of the others are None). No await in here."""
        if self._same(e, gen):
            for i, view in enumerate(views):
                if view is not None:
                    self.pool.put((e.file_id, gen, ~(first + i)), view, unread=prefetch,
                                  reserve=self.prefetch_inflight)
            self.eng.stats.memory_only_bytes += sum(len(v) for v in views if v is not None)

    def _keep_locally(self, nbytes: int, scan: bool) -> bool:
        """Should fetched blocks go into the local cache? A random reader's blocks always (the evictor keeps the
        budget, least recently used first); a sequential stream's (prefetched, or read by a scan) only while the
        cache stays below its low watermark, so a scan of more than the budget neither evicts other files' blocks
        nor its own just-kept ones."""
        if not scan:
            return True
        cfg = self.eng.config
        limit = int(cfg["cache.max_bytes"]) * float(cfg["cache.low_watermark"])
        return self.eng.cache_bytes + self.installing_bytes + nbytes <= limit

    async def _install(self, e: Entry, gen: int, todo: list[tuple[int, memoryview, Buffer | None]]) -> None:
        """Write fetched blocks (block, bytes, the buffer held for this) into the hot file's holes in a worker
        thread, through a dup of the engine's fd (the engine may close its own meanwhile). The bits are set after
        the pwrite returned, and only if the file is still this tiered generation."""
        eng = self.eng
        fid = e.file_id
        keys = [(fid, gen, b) for b, _, _ in todo]
        nbytes = sum(len(t[1]) for t in todo)
        ok = False
        try:
            fd = os.dup(eng.fd(e))
            try:
                await trio.to_thread.run_sync(_pwrite_blocks, fd, todo, e.block_bytes, limiter=self._install_limiter)
                ok = True
            finally:
                os.close(fd)
        except (OSError, ReadFailed) as err:
            log.warning("keeping fetched blocks of %s locally failed (%s); they are fetched again when needed",
                        e.path, err)
        finally:
            for _, _, buf in todo:
                if buf is not None:
                    self.pool.buffers.release(buf)
            self.installing.difference_update(keys)
            self.installing_bytes -= nbytes
            self._install_end(fid)
        if not ok or not self._same(e, gen):
            return
        for b, _, _ in todo:
            eng.set_resident(e, b, True)
        eng.stats.install_bytes += nbytes
        eng.evictor.residency_changed(e)

    def _install_begin(self, file_id: int) -> None:
        """An install into the file's hot file starts: a rewrite waits for it (_installs_done). No await."""
        self._installs[file_id] = self._installs.get(file_id, 0) + 1

    def _install_end(self, file_id: int) -> None:
        left = self._installs.pop(file_id) - 1
        if left:
            self._installs[file_id] = left
        self._install_done.set()
        self._install_done = trio.Event()

    async def _installs_done(self, file_id: int) -> None:
        while self._installs.get(file_id):
            await self._install_done.wait()

    def _install_inline(self, e: Entry, blocks: list[int]) -> None:
        """Write pooled blocks into the hot file now, on the trio thread (a rewrite needs them there). No await."""
        eng = self.eng
        fd = eng.fd(e)
        for b in blocks:
            mv = self.pool.get((e.file_id, e.generation, b))
            if mv is None or e.is_resident(b):
                continue
            os.pwrite(fd, mv, b * e.block_bytes)
            eng.set_resident(e, b, True)
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
        log.info("%s of tiered %s: re-materialising (gen %d -> new)", why, e.path, e.generation)
        self._frozen.add(e.file_id)  # no new install of old bytes may start; those in flight are waited for
        try:
            await self._rematerialise_frozen(e, ino, keep, why, deadline)
        finally:
            self._frozen.discard(e.file_id)

    async def _rematerialise_frozen(self, e: Entry, ino: int, keep: int, why: str, deadline: float) -> None:
        eng = self.eng
        if keep and not await self._make_resident(e, 0, keep, deadline):  # a store waiter: bounded like a read
            raise ReadFailed(f"{e.path}: could not re-materialise for a {why}")
        await self._installs_done(e.file_id)
        if eng.tiered.get(ino) is not e:
            return  # another writer re-materialised it meanwhile
        fd = os.dup(eng.fd(e))  # the engine's own may be closed by its LRU while the thread syncs
        try:
            await trio.to_thread.run_sync(os.fdatasync, fd)
        finally:
            os.close(fd)
        failpoints.hit("tier.rewrite")
        await failpoints.pause("tier.rematerialise_synced")  # tests: the evictor runs while this waits
        grace = float(eng.config["delete.grace_seconds"])
        if eng.orphans.get(ino) is e:  # unlinked while open: no row to rewrite, the objects may simply go
            eng.drop(e)
            await eng.db(eng.catalog.schedule_deletes, e.all_objects(), time.time() + grace)
            return
        gen = await eng.db(eng.catalog.allocate, 1)
        if eng.tiered.get(ino) is not e:
            return
        row = eng.hot_copy(e, gen)
        old_keys = e.all_objects()
        await eng.db(eng.catalog.replace, row, old_keys, time.time() + grace, ("cidx",))
        failpoints.hit("tier.rewritten")
        await failpoints.pause("tier.rewrite_committed")  # tests: the row is HOT, memory still says TIERED
        # committed: from here the hot file is the only copy, so the entry leaves `tiered` whatever else changed
        eng.apply(e, row)
        eng.evictor.forget(e.file_id)
        self.pool.discard_file(e.file_id)
        for k in old_keys:
            self.footers.pop(k, None)
        eng.stats.rewrites += 1

    def forget(self, e: Entry) -> None:
        """`e` is gone for good: what the cache keeps by its object keys goes with it."""
        for k in e.objects:
            self.footers.pop(k, None)

    async def _make_resident(self, e: Entry, off: int, end: int, deadline: float) -> bool:
        """Fetch until [off, end) is resident; evictions can race a fetch, so retry a few times. True once
        nothing is missing, or once a concurrent rewrite made the file HOT (then it is all local anyway)."""
        tiered = self.eng.tiered
        for _ in range(8):
            if tiered.get(e.ino) is not e:
                return True
            missing = self._needs_fetch(e, off, end)
            if missing:
                self._install_inline(e, missing)  # those already in memory, with no await since the check
                missing = self._needs_fetch(e, off, end)
            if not missing:
                return True
            await self._ensure(e, missing, deadline)
        return tiered.get(e.ino) is not e or not self._needs_fetch(e, off, end)
