"""The evictor: keeps the local copies of tiered segments under `cache.max_bytes` (DESIGN §7).

Least recently used tiered segments lose their resident blocks, which are punched out of the hot file
(FALLOC_FL_PUNCH_HOLE | KEEP_SIZE: the file keeps its size, so `ls`, stat and mmap are unchanged). The resident
bitmap follows one rule: a block is marked non-resident durably before it is punched, and marked resident only
after its bytes are durable, so a crash can only make us fetch a block again, never serve a hole.

An operator can also ask for every tiered segment's local copy to go now, whatever the watermarks (`tierfs evict`,
which sends the daemon SIGUSR1): before maintenance of the hot disk, or to make the next reads come from the
object store. Requests and completed passes are counted (`status.json` `evict_now`), so the command can wait for
the pass that served its own request.
"""

from __future__ import annotations

import ctypes
import heapq
import logging
import os
import sqlite3
import time
from typing import TYPE_CHECKING

import trio

from tierfs import failpoints
from tierfs.tier.blockcache import block_runs
from tierfs.tier.catalog import Entry, State
from tierfs.tier.state import ReadFailed

if TYPE_CHECKING:
    from tierfs.tier.engine import Engine

log = logging.getLogger("tierfs.tier")

_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
_EVICT_BATCH = 256  # segments whose residency is made durable in one transaction before their punches


def punch_hole(fd: int, off: int, length: int) -> None:
    if length <= 0:
        return
    if _libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, off, length) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


class Evictor:
    def __init__(self, engine: Engine):
        self.eng = engine
        self._dirty: set[int] = set()  # file ids whose resident bits changed since they were persisted
        self.now_requested = 0  # operator requests to evict everything (evict_now), and the last one served
        self.now_done = 0
        self._wake = trio.Event()

    def evict_now(self) -> None:
        """Every idle tiered segment loses its local copy at the next pass (which starts at once)."""
        self.now_requested += 1
        self._wake.set()

    def now_status(self) -> dict:
        return {"requested": self.now_requested, "done": self.now_done}

    def residency_changed(self, e: Entry) -> None:
        """Blocks were installed, or someone rewrote e's row without its live bits: persist them (after an
        fdatasync)."""
        self._dirty.add(e.file_id)

    def forget(self, file_id: int) -> None:
        self._dirty.discard(file_id)

    async def run(self) -> None:
        while True:
            with trio.move_on_after(0.5):
                await self._wake.wait()
            self.eng.cache.pool.buffers.trim(time.monotonic())  # fetch buffers no reader needed lately
            serving = self.now_requested
            if self._wake.is_set():
                self._wake = trio.Event()
            try:
                await self._evict_once(everything=serving != self.now_done)
                await self.persist_residency()
            except (OSError, sqlite3.Error) as err:
                log.warning("eviction pass failed: %s", err)
            finally:
                if serving != self.now_done:
                    log.info("evicted every idle tiered segment on request; %d bytes still local", self.eng.cache_bytes)
                    self.now_done = serving

    def _evictable(self, e: Entry) -> bool:
        eng = self.eng
        return (e.pins == 0 and e.state is State.TIERED and eng.is_live(e) and eng.tiered.get(e.ino) is e
                and e.ino not in eng.orphans)

    async def _evict_once(self, everything: bool = False) -> None:
        """One pass: above the high watermark, least recently used segments down to the low one; with
        `everything` (an operator's request), every tiered segment not pinned, read or written right now."""
        eng = self.eng
        cap = int(eng.config["cache.max_bytes"])
        if not everything and eng.cache_bytes <= cap * float(eng.config["cache.high_watermark"]):
            return
        target = 0 if everything else cap * float(eng.config["cache.low_watermark"])
        now = time.time()
        # least recently used first: a heap (O(n) to build, O(log n) per victim taken), not a sort of every entry
        victims = [(e.last_access, n, e) for n, e in enumerate(eng.tiered.values()) if now - e.last_access > 1.0]
        heapq.heapify(victims)
        while eng.cache_bytes > target and victims:
            # up to _EVICT_BATCH segments per transaction: many small segments must not cost a commit each
            picked: list[tuple[Entry, int, list[int]]] = []
            expect = eng.cache_bytes
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
                    eng.set_resident(e, b, False)
            rows = [e.copy() for e, _, _ in picked]
            await eng.db(self._save_victims, rows)
            failpoints.hit("tier.evict")
            await failpoints.pause("tier.evict_saved")  # tests: names change between the commit and the punches
            for e, gen, blocks in picked:
                if e.generation == gen and eng.is_live(e) and eng.tiered.get(e.ino) is e:
                    try:
                        self._punch(e, blocks)
                    except OSError as err:  # one file's failure must not leave the others half-done
                        log.warning("evicting %s failed (%s); its blocks are fetched again when read", e.path, err)

    def _save_victims(self, rows: list[Entry]) -> None:
        """Blocking, on the catalog thread: the victims' bitmaps without the blocks to punch."""
        self.eng.catalog.save_residency(rows)
        failpoints.hit("tier.evict_commit")  # tests: hold the catalog thread, so an unlink's commit waits behind

    def _punch(self, e: Entry, blocks: list[int]) -> None:
        """Punch the given non-resident blocks out of the hot file through the file's own fd, keeping pinned
        pages. A block fetched again (or being fetched, or being written in by an install) meanwhile is left
        alone. A file deleted meanwhile (its unlink still committing: the entry is live, its name is gone) has
        nothing left to evict: a broker's retention, not an error. No await in here."""
        eng = self.eng
        inflight, installing, streams = eng.cache.inflight, eng.cache.installing, eng.cache.streams
        try:
            fd = eng.fd(e)
        except (FileNotFoundError, NotADirectoryError, ReadFailed) as err:  # ReadFailed: another file has its name
            log.debug("%s went while being evicted (%s)", e.path, err)
            return
        pins = eng.cache.kept_pins(e)
        freed = 0
        for first, n in block_runs(e, blocks, 1 << 30):
            for b in range(first, first + n):
                key = (e.file_id, e.generation, b)
                if e.is_resident(b) or key in inflight or key in installing:
                    continue
                lo, hi = b * e.block_bytes, b * e.block_bytes + e.block_len(b)
                cuts = [(lo, hi)]
                for p0, p1 in pins:
                    cuts = [c for c0, c1 in cuts for c in ((c0, min(c1, p0)), (max(c0, p1), c1)) if c[1] > c[0]]
                for c0, c1 in cuts:
                    punch_hole(fd, c0, c1 - c0)
                freed += hi - lo
                eng.stats.evicted_blocks += 1
                for s in streams.values():
                    s.expired_unread(b)
        eng.stats.evicted_bytes += freed

    async def persist_residency(self) -> None:
        """Copy the bitmaps, make the hot files' data durable, then persist the copies: a bit can only reach the
        catalog after the bytes it stands for are on disk."""
        if not self._dirty:
            return
        eng = self.eng
        dirty = [eng.files[i] for i in self._dirty if i in eng.files]
        self._dirty.clear()
        dirty = [e for e in dirty if eng.tiered.get(e.ino) is e]
        # copies of the engine's fds: a file deleted meanwhile has its fd closed (and its number maybe reused)
        fds: list[int] = []
        kept: list[Entry] = []
        for e in dirty:
            try:
                fds.append(os.dup(eng.fd(e)))
                kept.append(e)
            except (OSError, ReadFailed) as err:  # gone or renamed meanwhile: its bits wait for the next change
                log.debug("residency of %s not persisted now (%s)", e.path, err)
        dirty = kept
        before = [bytes(e.resident) for e in dirty]
        try:
            await trio.to_thread.run_sync(self._sync, fds)
            # a bit goes to the catalog only if it was set before the fdatasync (its bytes are durable) and is
            # still set now (not given up by an eviction meanwhile); no await between this and queueing the save
            rows = []
            for e, old in zip(dirty, before):
                bits = bytearray(a & b for a, b in zip(old, e.resident))
                rows.append(e.copy(resident=bits))
                if bits != e.resident:
                    self._dirty.add(e.file_id)  # set since: persisted by a later pass
            await eng.db(eng.catalog.save_residency, rows)
        except BaseException:
            self._dirty.update(e.file_id for e in dirty)
            raise

    @staticmethod
    def _sync(fds: list[int]) -> None:
        """Blocking: fdatasync and close each fd."""
        failpoints.hit("tier.residency_sync")  # tests: files are deleted while this holds
        try:
            for fd in fds:
                os.fdatasync(fd)
        finally:
            for fd in fds:
                os.close(fd)
