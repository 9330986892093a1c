"""Continuous tiering of active files: the bucket holds a consistent point no older than `tiering.rpo_seconds`.

Every round (each `tiering.rpo_seconds`, in the daemon of a writable mount with an object store):

1. dirty kernel pages of every file that is not tiered are written back by an fsync through the mount, from a
   child process (tierfs.tier.flusher: a daemon thread must never do I/O on its own mount);
2. each segment that is not tiered uploads what was written to it since its last upload as *append objects*
   named by start offset and length,
   `<store-id>/tail/<incarnation>/<file no>/<start, 16 digits>-<length, 12 digits>.<upload no>`, crc32c in their
   metadata: for append-only kinds (CommitLog, ConsumeQueue, timer log) the bytes past the last committed offset
   (up to a hole amid them: a page not written back yet, see _append_end), for an IndexFile its header and new
   items (tierfs.tier.indextail: readers rebuild the hash slots), for every kind the ranges the daemon saw
   written (a recovery rewriting a tail), merged when closer than 64 KiB. Non-StopWrite: a failed or timed-out upload is simply forgotten; the next one
   starts again at the last committed offset with the failed ranges (no need to ask how much of the failed one
   landed: every upload has its own key, so a late one can never overwrite what a snapshot names). Objects are
   applied in upload order, so a later object wins where two overlap; one wholly rewritten is retired. A
   CommitLog's segments go in offset order, a later one only once the objects of the one before reach its
   terminal BLANK: a point holds a prefix of the log, never a gap before records (see _upload_tails);
3. the upload offsets and objects of every tail go into the catalog (table tail_offsets), so a restarted
   daemon, or the writer a takeover made, resumes from them (`_adopt`) instead of uploading every file again;
4. the catalog snapshot (tierfs.tier.snapshot) goes last, from the same walk of the hot dir: mutable files
   (checkpoint, config/*) as its content-addressed blobs, active segments as their append objects (table
   `snapshot_tails`), sealed ones as their segment objects; its pointer is the last write, so a reader only ever
   sees a complete point.

A segment that becomes TIERED no longer needs its append objects: sealing composes its chunks from them inside
the store where it can (tierfs.tier.sealcopy), then they are retired: queued for deletion in the catalog at the end
of the round (durable: a restart never forgets them), and deleted by the janitor once `delete.grace_seconds`
passed and the reference authority (tierfs.tier.references) says nothing names them (an active tail, a kept or
in-flight snapshot). Append objects of an earlier daemon that no resumed tail names (uploaded in the moments
before a crash, or by the writer a takeover replaced, after its last point) are found by one listing at the
first round and queued the same way.

The achieved RPO per kind is the age of the oldest write the bucket does not hold yet (0 when it holds all):
`tierfs status` and the metric `tierfs_rpo_lag_seconds{kind=...}` show it.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import crc32c
import trio

from tierfs import failpoints
from tierfs.objectstore import ObjectStore
from tierfs.objectstore.base import ObjectStoreError, validate_key
from tierfs.store import commitlog
from tierfs.store.indexfile import HEADER_SIZE, ITEM_SIZE
from tierfs.store.paths import Kind, classify
from tierfs.tier import indextail
from tierfs.tier.catalog import State

if TYPE_CHECKING:
    from tierfs.tier.engine import Engine

log = logging.getLogger("tierfs.appendlog")

APPEND_KINDS = frozenset((Kind.COMMITLOG, Kind.CONSUMEQUEUE, Kind.BATCHCONSUMEQUEUE, Kind.CONSUMEQUEUE_EXT,
                          Kind.TIMERLOG, Kind.DLEDGER_DATA, Kind.DLEDGER_INDEX))
MAX_OBJECT = 64 << 20  # one append object at most: a first upload of a long tail goes in pieces
GAP = 64 << 10  # written ranges closer than this go up as one object
_ZERO_SCAN = 1 << 20
_WALK_WINDOW = 8 << 20  # CommitLog bytes read per step of the complete-records walk
# Read before a round flushes, and named by the snapshot that names the round's append objects: what the
# broker's checkpoint claims durable (its flushed CommitLog and ConsumeQueue times, from which its recovery
# starts re-dispatching) must already be in the segment copies; read after them it could claim more.
CHECKPOINT_FILES = ("checkpoint",)
FINAL_TIMEOUT_S = 45.0  # `tierfs umount` waits 60 s for the daemon to exit
TAILS_SCHEMA = """
CREATE TABLE snapshot_tails (path TEXT PRIMARY KEY, size INTEGER NOT NULL, mtime_ns INTEGER NOT NULL,
                             mode INTEGER NOT NULL, uid INTEGER NOT NULL, gid INTEGER NOT NULL, objects TEXT NOT NULL);
CREATE TABLE snapshot_index_slots (path TEXT PRIMARY KEY, slots INTEGER NOT NULL);
"""  # snapshot_index_slots: IndexFile tails uploaded without their hash-slot table (tierfs.tier.indextail)


def tail_prefix(store_id: str) -> str:
    return f"{store_id}/tail/"


@dataclass(frozen=True)
class TailObject:
    key: str
    start: int
    length: int
    crc: int

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass
class Tail:
    """One active segment: what of it the bucket holds, and what was written since."""

    rel: str
    ino: int
    fileno: int
    committed: int = 0  # append-only kinds: [0, committed) is in append objects (beyond: not uploaded yet)
    objects: list[TailObject] = field(default_factory=list)
    dirty: list[tuple[int, int]] = field(default_factory=list)  # ranges written since the last upload
    uploaded: bool = False  # False: the first upload takes every data extent of the file
    trusted: int = 0  # CommitLog: its last written byte before this round's flush (every record to there is whole)
    slots: int = 0  # an IndexFile uploaded as header + items: its maxHashSlotNum (the reader rebuilds the slots)
    slots_checked: bool = False  # `slots` was checked against items (not only the file size)
    hole: int = -1  # append-only kinds: the hole the last upload stopped at (a page not written back yet)
    ended: bool = False  # CommitLog: the objects reach its terminal BLANK (the log goes on in the next segment)


def coalesce(ranges: list[tuple[int, int]], size: int, gap: int = GAP) -> list[tuple[int, int]]:
    """Sorted, merged [lo, hi) ranges clipped to `size`; ranges closer than `gap` become one (one PUT of a few
    extra bytes is cheaper than two)."""
    out: list[list[int]] = []
    for lo, hi in sorted((max(0, lo), min(hi, size)) for lo, hi in ranges):
        if hi <= lo:
            continue
        if out and lo <= out[-1][1] + gap:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(lo, hi) for lo, hi in out]


def pieces(ranges: list[tuple[int, int]], chunk: int) -> Iterator[tuple[int, int]]:
    """(offset, length) of the append objects for `ranges`: at most MAX_OBJECT each, and none crossing a multiple
    of `chunk`. A segment's chunk that one round wrote whole is then one whole append object, which the seal
    makes its chunk without copying it (a hard link in the posix store)."""
    for lo, hi in ranges:
        off = lo
        while off < hi:
            end = min(hi, off + MAX_OBJECT, (off // chunk + 1) * chunk if chunk > 0 else hi)
            yield off, end - off
            off = end


def covered_by(o: TailObject, newer: list[tuple[int, int]]) -> bool:
    """Is [o.start, o.end) inside the union of the (sorted, merged) ranges?"""
    return any(lo <= o.start and o.end <= hi for lo, hi in newer)


@dataclass(frozen=True)
class TailRow:
    """An active file in a snapshot: sparse at `size`, the append objects applied in order."""

    path: str
    size: int
    mtime_ns: int
    mode: int
    uid: int
    gid: int
    objects: tuple[TailObject, ...]
    slots: int = 0  # > 0: an IndexFile whose hash-slot table is not in the objects; rebuilt from its items

    def encode(self) -> tuple:
        return (self.path, self.size, self.mtime_ns, self.mode, self.uid, self.gid, encode_objects(self.objects))


def encode_objects(objects) -> str:
    return json.dumps([[o.key, o.start, o.length, f"{o.crc:08x}"] for o in objects])


def decode_objects(text: str, store_id: str, size: int) -> list[TailObject]:
    """Append objects as encode_objects wrote them, validated (untrusted: from a bucket or a catalog): keys under
    the store's tail prefix, ranges inside a file of `size` bytes. ValueError/TypeError say what is wrong."""
    parsed = []
    for key, start, length, crc in json.loads(text):
        validate_key(key)
        if not key.startswith(tail_prefix(store_id)):
            raise ValueError(f"append object {key!r} is outside {tail_prefix(store_id)}")
        if not (isinstance(start, int) and isinstance(length, int) and 0 <= start and 0 < length
                and start + length <= size):
            raise ValueError(f"append object {key!r} range {start!r}+{length!r} is outside the file")
        parsed.append(TailObject(key, start, length, int(crc, 16)))
    return parsed


# ------------------------------------------------------------------------------------------ reader side


def load_tails(db, store_id: str) -> list[TailRow]:
    """The snapshot_tails rows of a snapshot (an sqlite3 connection), validated: untrusted input from a bucket.
    A snapshot without the table (format 1) has none."""
    tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    if "snapshot_tails" not in tables:
        return []
    slots_of: dict[str, int] = {}
    if "snapshot_index_slots" in tables:
        for path, slots in db.execute("SELECT path, slots FROM snapshot_index_slots"):
            if not (isinstance(slots, int) and 0 < slots < 1 << 31 and classify(str(path)) is Kind.INDEX):
                raise ValueError(f"index slots row {path!r}: {slots!r} is not a hash-slot count of an IndexFile")
            slots_of[path] = slots
    out = []
    for path, size, mtime_ns, mode, uid, gid, objs in db.execute("SELECT * FROM snapshot_tails"):
        try:
            if not (isinstance(size, int) and size >= 0 and isinstance(mtime_ns, int)):
                raise ValueError(f"size {size!r} or mtime {mtime_ns!r} is not a valid integer")
            parsed = decode_objects(objs, store_id, size)
            slots = slots_of.get(path, 0)
            if slots and indextail.items_base(slots) > size:
                raise ValueError(f"{slots} hash slots do not fit in {size} bytes")
            out.append(TailRow(path, size, mtime_ns, int(mode), int(uid), int(gid), tuple(parsed), slots))
        except (ValueError, TypeError) as e:
            raise ValueError(f"tail row {path!r} is invalid: {e}") from None
    return out


def materialise(store: ObjectStore, hot: Path, row: TailRow, into: Path | None = None) -> int:
    """Write a tail's append objects into its (sparse, full-size) local file, or the file `into` that will take
    its name, each verified by its crc32c (an IndexFile's hash slots rebuilt from its items); restore its mtime.
    Returns the bytes written. Blocking; ObjectStoreError or ValueError on a bad object."""
    fd = os.open(into or hot / row.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    n = 0
    try:
        # IndexFile: the items the local copy's slots were built from (a follower's refresh adds to them), unless
        # an object changes one of those
        since = indextail.local_count(fd) if row.slots else 1
        built = (indextail.items_base(row.slots), indextail.items_base(row.slots) + since * ITEM_SIZE)
        for o in row.objects:
            data = store.get(o.key)
            if len(data) != o.length or crc32c.crc32c(data) != o.crc:
                raise ValueError(f"append object {o.key} of {row.path} is corrupt: {len(data)} bytes with crc32c "
                                 f"{crc32c.crc32c(data):08x}, the snapshot says {o.length} with {o.crc:08x}")
            lo, hi = max(o.start, built[0]), min(o.end, built[1])
            if row.slots and lo < hi and os.pread(fd, hi - lo, lo) != data[lo - o.start:hi - o.start]:
                since = 1
            os.pwrite(fd, data, o.start)
            n += len(data)
        if row.slots:
            indextail.rebuild_slots(fd, row.slots, since)
        os.fsync(fd)
        os.utime(fd, ns=(row.mtime_ns, row.mtime_ns))
    finally:
        os.close(fd)
    return n


# ------------------------------------------------------------------------------------------ writer side


def data_extents(fd: int, size: int, start: int = 0) -> list[tuple[int, int]]:
    """Maximal [start, end) ranges holding data (SEEK_DATA/SEEK_HOLE), from `start` up to `size`."""
    out = []
    off = start
    while off < size:
        try:
            begin = os.lseek(fd, off, os.SEEK_DATA)
        except OSError as e:
            if e.errno == errno.ENXIO:
                break
            raise
        if begin >= size:
            break
        end = os.lseek(fd, begin, os.SEEK_HOLE)
        out.append((begin, min(end, size)))
        off = end
    return out


def ends_in_blank(fd: int, end: int, size: int) -> bool:
    """Blocking: are the 8 bytes before `end` of a CommitLog segment of `size` bytes its terminal BLANK?"""
    pos = end - commitlog.BLANK_SIZE
    head = os.pread(fd, commitlog.BLANK_SIZE, pos) if pos >= 0 else b""
    return len(head) == commitlog.BLANK_SIZE and int.from_bytes(head[4:], "big", signed=True) == \
        commitlog.BLANK_MAGIC and int.from_bytes(head[:4], "big", signed=True) == size - pos


def data_end(fd: int, start: int, size: int) -> int:
    """End of the last non-zero byte at or after `start` (holes skipped by SEEK_DATA/SEEK_HOLE; a zero-filled
    tail of the last data extent trimmed), or `start` when there is none."""
    ext = data_extents(fd, size, start)
    last = ext[-1][1] if ext else start
    end = last
    while end > start:
        lo = max(start, end - _ZERO_SCAN)
        chunk = os.pread(fd, end - lo, lo).rstrip(b"\0")
        if chunk:
            return lo + len(chunk)
        end = lo
    return start


class AppendLog:
    def __init__(self, engine: Engine):
        self.eng = engine
        self.store = engine.store
        self.sid = engine.store_id
        self.rpo = float(engine.config["tiering.rpo_seconds"])
        self.index_geometry = (int(engine.config["broker.max_hash_slot_num"]),
                               int(engine.config["broker.max_index_num"]))
        self.incarnation = f"{time.strftime('%Y%m%d%H%M%S', time.gmtime())}-{uuid.uuid4().hex[:8]}"
        self.tails: dict[int, Tail] = {}  # by hot-dir st_ino
        self.pending: dict[int, tuple[str, float]] = {}  # ino -> (kind, first write the bucket lacks)
        self.retired: dict[str, float] = {}  # append objects no longer needed -> since when, until queued
        self._fileno = 0
        self._upload_no = 0
        self._listed_old = False
        self._adopted = False  # the tails of the last daemon (or of the point a takeover was built from) taken
        self._saved: list[tuple] = []  # the tail_offsets rows last committed to the catalog
        self._defer_holes = True  # a round after a flush: bytes past a hole in new data wait (see _append_end)
        self.rounds = 0
        self.failed_rounds = 0
        self.puts = 0
        self.put_bytes = 0
        self.put_failures = 0
        self.deleted = 0
        self.last_round: dict = {}
        self.last_error = ""
        self.checkpoints: dict[str, bytes] = {}  # CHECKPOINT_FILES as read before the committed objects' round
        # set by the FUSE front (mount.py): the hot-dir inodes open through the mount now
        self.open_inodes: Callable[[], set[int]] | None = None

    # ------------------------------------------------------------------ events from the FUSE front

    def note_write(self, ino: int, rel: str | None, off: int, n: int) -> None:
        """A write reached the daemon (a write(2), or the kernel writing back pages, mmap'd ones included)."""
        if ino not in self.pending:
            self.pending[ino] = (classify(rel).value if rel else Kind.MUTABLE.value, time.time())
        t = self.tails.get(ino)
        if t is not None and n:
            t.dirty.append((off, off + n))

    def inode_freed(self, ino: int) -> None:
        """The file of `ino` is gone for good: its tail must not become the tail of a new file that gets the same
        st_ino (and maybe the same name: a ConsumeQueue of a topic deleted and made again) before the next round
        sees it gone. Its objects go as when a round finds the file gone."""
        t = self.tails.pop(ino, None)
        if t is not None:
            self._retire(t)
        self.pending.pop(ino, None)

    def note_truncate(self, ino: int, size: int) -> None:
        self.note_write(ino, None, size, 0)
        t = self.tails.get(ino)
        if t is not None and size < t.committed:
            t.committed = size
            t.ended = False

    # ------------------------------------------------------------------ status

    def lag(self, now: float | None = None) -> dict[str, float]:
        """Achieved RPO per kind: the age of the oldest write the bucket does not hold yet (0: holds all)."""
        now = time.time() if now is None else now
        out: dict[str, float] = {}
        for kind, since in self.pending.values():
            out[kind] = max(out.get(kind, 0.0), round(now - since, 3))
        return out

    def status(self) -> dict:
        lag = self.lag()
        return {"rpo_seconds": self.rpo, "lag_s": lag, "lag_max_s": max(lag.values(), default=0.0),
                "rounds": self.rounds, "failed_rounds": self.failed_rounds, "active_tails": len(self.tails),
                "append_puts": self.puts, "append_bytes": self.put_bytes, "append_put_failures": self.put_failures,
                "append_objects_deleted": self.deleted, "retired_pending": len(self.retired),
                "last_round": self.last_round, "last_error": self.last_error}

    # ------------------------------------------------------------------ the loop

    async def run(self) -> None:
        # the first round one period after the start: at mount nothing was written yet, and the FUSE session
        # the round flushes through may not be serving yet
        started = time.monotonic()
        while True:
            await trio.sleep(max(0.0, self.rpo - (time.monotonic() - started)))
            started = time.monotonic()
            await self.round(flush=True)

    async def final(self) -> None:
        """At a clean unmount (the mount is gone: no flush through it, and nothing writes any more)."""
        with trio.move_on_after(FINAL_TIMEOUT_S):
            await self.round(flush=False, reason="unmount")
            return
        log.error("the continuous upload at unmount did not finish; the bucket holds the previous point")

    async def round(self, flush: bool, reason: str = "rpo") -> bool:
        """One round: flush, append uploads, snapshot last. True when a new consistent point was published."""
        eng = self.eng
        if not eng.store_writable():
            return False
        t0 = time.time()
        m0 = time.monotonic()
        try:
            await trio.to_thread.run_sync(self._verify_lease, limiter=eng.limiter)
            if not self._adopted:
                await self._adopt()
            # one walk of the hot dir serves the round's uploads and its snapshot (the engine makes an AppendLog
            # only with a snapshotter)
            assert eng.snapshotter is not None
            walked = await trio.to_thread.run_sync(eng.snapshotter.walk)
            files = self._not_tiered(walked[1])
            checkpoints = await self._before_flush(files)
            if flush:
                await self._flush(self._to_flush(files))
            self._defer_holes = flush
            await failpoints.pause("appendlog.upload")  # tests: files go between the walk and their uploads
            n_obj, n_bytes, failed, upload_error = await self._upload_tails(files)
            self.checkpoints = checkpoints
            rows = self._offset_rows()
            if rows != self._saved:  # the objects are durable: a restart resumes from here
                await eng.db(eng.catalog.save_tails, rows)
                self._saved = rows
            # deletes waiting for kept snapshots to roll over (ours or the janitor's) force a new one
            refs = eng.snapshotter.references
            roll = refs.roll_requested
            snap = await eng.snapshotter.take(reason, force=roll, walked=walked, started=t0)
            if roll:
                refs.roll_requested = False
            # everything written before this round started is in the bucket now (a snapshot skipped as unchanged
            # means the previous one already holds it), except in files whose upload failed: the snapshot still
            # went up, naming their last committed objects, so one failing file never holds the others back (only
            # the later segments of its CommitLog, which wait for it: see _upload_tails)
            self.pending = {ino: v for ino, v in self.pending.items() if v[1] >= t0 or ino in failed}
            await self._queue_retired()
            if upload_error is not None:
                raise upload_error
        except Exception as e:  # noqa: BLE001 - never let a round take the daemon (or its unmount) down
            self.failed_rounds += 1
            self.last_error = f"{time.strftime('%H:%M:%S')}: {type(e).__name__}: {e}"
            log.warning("continuous upload round failed (%s); the next round starts from the last committed "
                        "offsets", self.last_error, exc_info=not isinstance(e, (ObjectStoreError, OSError,
                                                                                ValueError)))
            return False
        self.rounds += 1
        self.last_error = ""
        self.last_round = {"time": t0, "seconds": round(time.monotonic() - m0, 3), "append_objects": n_obj,
                           "append_bytes": n_bytes, "snapshot_seq": (snap or {}).get("seq"),
                           "files": len(files), "files_behind": len(failed)}
        return True

    # ------------------------------------------------------------------ resuming

    def _offset_rows(self) -> list[tuple]:
        """The catalog's tail_offsets rows for the tails now (on the trio thread: a consistent view)."""
        return sorted((t.rel, t.ino, t.committed, t.slots, encode_objects(t.objects))
                      for t in self.tails.values() if t.uploaded)

    async def _adopt(self) -> None:
        """Resume the tails the catalog names (the last daemon's, or those a takeover materialised): each is
        registered first, so writes from now on are noted against it, then its objects are checked against the
        local bytes; an object that no longer matches is dropped and its range uploaded again. Bytes past the
        committed offset go up as usual. The first round then uploads only what changed, not every active file."""
        eng = self.eng
        rows = await eng.db(eng.catalog.load_tails)
        adopted: list[Tail] = []
        for rel, ino, committed, slots, objs in rows:
            try:
                objects = decode_objects(objs, self.sid, 1 << 62)
            except (ValueError, TypeError) as e:
                log.warning("tail offsets of %s in the catalog are invalid (%s); uploading it again", rel, e)
                continue
            if ino in self.tails or not classify(rel).is_segment:
                continue
            self._fileno += 1
            t = Tail(rel, ino, self._fileno, committed, objects, uploaded=True, slots=slots)
            self.tails[ino] = t
            adopted.append(t)
        stale = await trio.to_thread.run_sync(self._stale_objects, adopted, limiter=eng.limiter)
        now = time.time()
        for t in adopted:
            gone = stale.get(t.ino)
            if gone is None:
                continue
            if gone == "file":  # replaced or removed: the next round starts it afresh
                self._retire(self.tails.pop(t.ino))
                continue
            for o in gone:
                self.retired.setdefault(o.key, now)
                t.dirty.append((o.start, o.end))
            t.objects = [o for o in t.objects if o not in gone]
        self._saved = self._offset_rows() if not stale else []
        self._adopted = True
        if adopted:
            log.info("resumed %d active files from the catalog's upload offsets (%d objects to upload again)",
                     len(adopted), sum(len(v) for v in stale.values() if v != "file"))

    def _stale_objects(self, tails: list[Tail]) -> dict[int, list[TailObject] | str]:
        """Blocking: per tail, its objects whose bytes differ from the local file ("file": the file is not it)."""
        out: dict[int, list[TailObject] | str] = {}
        for t in tails:
            fd = self._open_tail(t)
            if fd is None:
                out[t.ino] = "file"
                continue
            try:
                bad = [o for o in t.objects if crc32c.crc32c(os.pread(fd, o.length, o.start)) != o.crc]
                if bad:
                    out[t.ino] = bad
            finally:
                os.close(fd)
        return out

    def _verify_lease(self) -> None:
        if self.eng.lease is not None:
            self.eng.lease.verify()

    # ------------------------------------------------------------------ steps

    def _not_tiered(self, stats: dict[str, os.stat_result]) -> list[tuple[str, os.stat_result]]:
        """The walked regular files that are not tiered (those may hold unwritten pages), one name per file: a
        hard-linked file has one tail, under the name its tail has if that is still one of its names (its other
        names are links in the point). On the trio thread."""
        names: dict[int, list[str]] = {}
        for rel, st in stats.items():
            e = self.eng.by_ino.get(st.st_ino)
            if e is None or e.state is not State.TIERED:
                names.setdefault(st.st_ino, []).append(rel)
        out = []
        for ino, rels in names.items():
            t = self.tails.get(ino)
            rel = t.rel if t is not None and t.rel in rels else min(rels)
            out.append((rel, stats[rel]))
        return out

    def _tail_for(self, rel: str, ino: int) -> Tail:
        """The tail of the file at hot-dir inode `ino`, now named `rel`: a renamed file keeps its tail (what the
        bucket holds of it is still its bytes); a new file, or one renamed into another kind of log, gets a new
        one."""
        t = self.tails.get(ino)
        if t is None or classify(t.rel) is not classify(rel):
            t = self.tails[ino] = self._new_tail(rel, ino)
        t.rel = rel
        return t

    def restat(self) -> dict[str, os.stat_result | None]:
        """Blocking: the lstat of every tail's file now (None: gone), for a snapshot reusing the round's walk."""
        out: dict[str, os.stat_result | None] = {}
        for t in list(self.tails.values()):
            try:
                out[t.rel] = os.lstat(self.eng.hot / t.rel)
            except FileNotFoundError:
                out[t.rel] = None
        return out

    async def _before_flush(self, files: list[tuple[str, os.stat_result]]) -> dict[str, bytes]:
        """Before the flush, in one worker-thread hop: the last written byte of each CommitLog as the hot dir
        holds it now, and the broker's checkpoint (CHECKPOINT_FILES), which the round's snapshot names. The
        broker wrote that byte before the flush, and one appender writes records in order, so after the flush
        every record up to it is whole; past it a record may still lack pages (see `_complete_end`)."""
        tails = []
        for rel, st in files:
            if classify(rel) is Kind.COMMITLOG:
                t = self._tail_for(rel, st.st_ino)
                tails.append((t, min(t.committed, st.st_size), st.st_size))
        ends, checkpoints = await trio.to_thread.run_sync(self._read_before_flush, tails, limiter=self.eng.limiter)
        for (t, _, _), end in zip(tails, ends):
            t.trusted = end
        return checkpoints

    def _read_before_flush(self, tails: list[tuple[Tail, int, int]]) -> tuple[list[int], dict[str, bytes]]:
        ends = []
        for t, start, size in tails:
            fd = self._open_tail(t)
            if fd is None:
                ends.append(start)  # gone or replaced: nothing past the committed offset is trusted
                continue
            try:
                ends.append(data_end(fd, start, size))
            finally:
                os.close(fd)
        checkpoints = {}
        for rel in CHECKPOINT_FILES:
            try:
                checkpoints[rel] = (self.eng.hot / rel).read_bytes()
            except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
                pass
        return ends, checkpoints

    def _open_tail(self, t: Tail) -> int | None:
        """Blocking: a read-only fd of the tail's file, or None when it is gone or no longer that inode."""
        try:
            fd = os.open(self.eng.hot / t.rel, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        if os.fstat(fd).st_ino != t.ino:
            os.close(fd)
            return None
        return fd

    def _new_tail(self, rel: str, ino: int) -> Tail:
        old = self.tails.get(ino)
        if old is not None:
            self._retire(old)
        self._fileno += 1
        return Tail(rel, ino, self._fileno)

    async def _flush(self, rels: list[str]) -> None:
        """fsync the files through the mount from a child process, so every page the kernel still holds dirty
        reaches the daemon (and the hot dir) before the round reads them."""
        if self.eng.mountpoint is None or not rels:
            return
        with trio.move_on_after(max(30.0, 3 * self.rpo)) as scope:
            failed = await self.eng.flusher.flush(self.eng.mountpoint, rels)
        if scope.cancelled_caught:
            raise OSError(errno.ETIMEDOUT, "flushing dirty pages through the mount timed out")
        if failed:
            log.warning("flushing %d files through the mount failed, e.g. %s", len(failed), failed[0])

    def _to_flush(self, files: list[tuple[str, os.stat_result]]) -> list[str]:
        """The files that may hold pages dirty in the kernel: open through the mount (a close writes a file's
        pages back), or written since the last round. Every file when the FUSE front does not say."""
        if self.open_inodes is None:
            return [rel for rel, _ in files]
        live = self.open_inodes() | set(self.pending)
        return [rel for rel, st in files if st.st_ino in live]

    async def _upload_tails(self, files: list[tuple[str, os.stat_result]]
                            ) -> tuple[int, int, set[int], Exception | None]:
        """Append objects for every segment that is not tiered and has new bytes; retire the tails of files that
        are gone, tiered or replaced. A failed upload leaves its tail as it was (the next round retries).

        One CommitLog is one log across its segments: a point must hold a prefix of it, or the broker's recovery
        (and any reader) stops at the gap and drops what follows. So its segments go in offset order, and once
        one's objects stop short of its terminal BLANK (its upload failed, or the page holding the BLANK was not
        written back when the round read it, while the next segment's pages were) the later segments of that
        log wait for the next round. Returns (objects, bytes, inodes whose new bytes are not in the bucket: their
        upload failed or waits, the first error)."""
        live: set[int] = set()
        n_obj = n_bytes = 0
        error: Exception | None = None
        failed: set[int] = set()
        short: set[str] = set()  # CommitLog dirs with a segment whose objects stop before its BLANK
        for rel, st in sorted(files, key=lambda f: f[0]):  # CommitLog names: zero-padded offsets
            kind = classify(rel)
            if not kind.is_segment:
                continue  # mutable files go as the snapshot's blobs
            gen = self._generation(rel, st.st_ino)
            if gen is None:  # tiered since the walk: the point names its segment objects (its tail goes)
                continue
            live.add(st.st_ino)
            t = self._tail_for(rel, st.st_ino)
            log_dir = rel.rpartition("/")[0] if kind is Kind.COMMITLOG else None
            if log_dir in short:
                if await trio.to_thread.run_sync(self._has_new_bytes, t, limiter=self.eng.limiter):
                    failed.add(t.ino)  # still owed to the bucket (the RPO lag says so)
                continue
            dirty, t.dirty = t.dirty, []  # writes during the upload start the next list
            try:
                done = await trio.to_thread.run_sync(self._upload_one, t, dirty, limiter=self.eng.limiter)
            except (ObjectStoreError, OSError) as e:
                t.dirty = dirty + t.dirty  # Non-StopWrite: the next round uploads them (under new keys)
                self.put_failures += 1
                failed.add(t.ino)
                error = error or e
                if log_dir is not None and not t.ended:
                    short.add(log_dir)
                continue
            if done is None:  # deleted since the walk (a broker's retention, all day long): no error, no upload
                log.debug("%s went before its continuous upload; its tail is retired", rel)
                live.discard(st.st_ino)
                continue
            objs, end = done
            now = self._generation(rel, st.st_ino)
            if now is None or 0 <= gen != now:  # tiered (or re-materialised) while read: it may have read holes
                for o in objs:
                    self.retired[o.key] = time.time()
                live.discard(st.st_ino)  # its tail goes; a file still active starts a new one next round
                failed.add(t.ino)
                if log_dir is not None:
                    short.add(log_dir)
                continue
            if self.tails.get(t.ino) is not t:  # its file went for good meanwhile (inode_freed)
                for o in objs:
                    self.retired[o.key] = time.time()
                continue
            t.uploaded = True
            if objs:
                merged = coalesce([(o.start, o.end) for o in objs], 1 << 62, 0)
                keep = [o for o in t.objects if not covered_by(o, merged)]
                for o in t.objects:
                    if not covered_by(o, merged):
                        continue
                    self.retired[o.key] = time.time()  # wholly rewritten by the new objects
                t.objects = keep + objs
                n_obj += len(objs)
                n_bytes += sum(o.length for o in objs)
            t.committed = end
            if log_dir is not None and not t.ended:
                short.add(log_dir)
        for ino in [i for i in self.tails if i not in live]:
            self._retire(self.tails.pop(ino))
        return n_obj, n_bytes, failed, error

    def _generation(self, rel: str, ino: int) -> int | None:
        """The generation of the file at `rel` (-1: no catalog row yet), None when it is TIERED. On the trio
        thread. Its hot file is punched only once it is TIERED (an eviction), so an upload that read it while
        this stayed the same read its real bytes; one that saw it change may have read holes as zeros."""
        e = self.eng.by_ino.get(ino) or self.eng.entries.get(rel)
        if e is None:
            return -1
        return None if e.state is State.TIERED else e.generation

    def objects_of(self, ino: int, rel: str) -> tuple[TailObject, ...]:
        """The committed append objects of a file (by hot-dir inode and path), in upload order; () if none."""
        t = self.tails.get(ino)
        return tuple(t.objects) if t is not None and t.rel == rel else ()

    def _retire(self, t: Tail) -> None:
        now = time.time()
        for o in t.objects:
            self.retired.setdefault(o.key, now)

    def _upload_one(self, t: Tail, dirty: list[tuple[int, int]]) -> tuple[list[TailObject], int] | None:
        """Blocking: upload what changed in one file: at the first upload every byte up to its last data; later
        the ranges written since (and, for append-only kinds, anything past the committed offset, which holds
        even for a write this daemon did not see). Returns the new objects and the new committed offset, or None
        when the file is gone (once open, a deletion no longer matters: the fd reads the file's bytes)."""
        try:
            fd = os.open(self.eng.hot / t.rel, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            return None
        try:
            st = os.fstat(fd)
            if st.st_ino != t.ino:
                return [], t.committed
            size = st.st_size
            committed = min(t.committed, size)
            kind = classify(t.rel)
            slots = None
            if kind is Kind.INDEX:  # once checked against items, an IndexFile's geometry stays
                if t.slots_checked:
                    slots = t.slots
                else:
                    slots, t.slots_checked = indextail.slot_count(fd, size, self.index_geometry)
            blank_end = -1  # CommitLog: where its terminal BLANK ends, if the whole records reach it
            if kind is Kind.COMMITLOG:
                # only whole records: a copy must never hold a record whose last pages are still zeros
                committed, limit = self._complete_end(fd, t, committed, size)
                ranges = coalesce([(0, limit)] if not t.uploaded else list(dirty) + [(committed, limit)], limit)
                blank_end = limit if ends_in_blank(fd, limit, size) else -1
            else:
                if slots is not None:
                    ranges = self._index_ranges(fd, t, slots, committed, size, dirty)
                elif kind in APPEND_KINDS:
                    start = committed if t.uploaded else 0
                    cut = self._append_end(fd, t, start, size)
                    # dirty pages past a hole wait with it (the new bytes from `start` cover them next round)
                    ranges = [(lo, min(hi, cut)) for lo, hi in dirty if lo < cut] + [(start, cut)]
                elif not t.uploaded or t.slots:  # first upload, or an IndexFile whose geometry no longer checks out
                    ranges = [(0, data_end(fd, 0, size))]
                else:
                    ranges = list(dirty)
                ranges = coalesce(ranges, size)
            t.slots = slots or 0
            objs = []
            end = max([committed] + [hi for _, hi in ranges])
            for off, n in pieces(ranges, self.eng.chunk):
                failpoints.hit("appendlog.piece")  # tests: the file goes TIERED between two pieces
                if self._became_tiered(t):  # its hot file is losing blocks: the rest would be holes read as zeros
                    end = min(end, off)
                    break
                data = os.pread(fd, n, off)
                if len(data) < n:  # truncated meanwhile: what is left
                    end = min(end, off + len(data))
                    if not data:
                        break
                crc = crc32c.crc32c(data)
                self._upload_no += 1
                key = f"{tail_prefix(self.sid)}{self.incarnation}/{t.fileno:06d}/{off:016d}-{len(data):012d}." \
                      f"{self._upload_no}"
                self.eng.fence(key)
                self.store.put(key, data, metadata={"crc32c": f"{crc:08x}", "offset": str(off)})
                objs.append(TailObject(key, off, len(data), crc))
                self.puts += 1
                self.put_bytes += len(data)
            t.ended = 0 <= blank_end <= end
            return objs, end
        finally:
            os.close(fd)

    def _became_tiered(self, t: Tail) -> bool:
        """From the upload's worker thread, a hint only: has the file gone TIERED since the round read its state?
        Then eviction punches its hot file, and reading on would upload holes as zeros (a first upload of a
        1 GiB segment read and PUT ~1 GiB of them, while the round drops what it read anyway). The decision
        stays on the trio thread: _upload_tails compares the generation after the upload."""
        e = self.eng.by_ino.get(t.ino)
        return e is not None and e.state is State.TIERED

    def _has_new_bytes(self, t: Tail) -> bool:
        """Blocking: does the tail's file hold bytes past its committed offset (any, before its first upload)?
        False when it is gone or replaced (the next round sees that)."""
        fd = self._open_tail(t)
        if fd is None:
            return False
        try:
            size = os.fstat(fd).st_size
            start = min(t.committed, size) if t.uploaded else 0
            return data_end(fd, start, size) > start
        finally:
            os.close(fd)

    def _complete_end(self, fd: int, t: Tail, committed: int, size: int) -> tuple[int, int]:
        """Blocking: (committed, end of the whole records from it) of a CommitLog segment. The walk starts at
        the committed offset (always a record boundary), or at 0 for a first upload and when the bytes there
        are no longer a record (the broker rewrote the tail): then the committed offset falls back to 0."""
        try:
            file_start = int(Path(t.rel).name)
        except ValueError:
            file_start = -1  # not a CommitLog name: its PHYSICALOFFSETs cannot be checked, nothing is whole
        start = committed if t.uploaded else 0
        stop = data_end(fd, start, size)
        end = self._walk(fd, start, stop, size, file_start, t.trusted)
        if end == start and stop > start > 0:
            head = os.pread(fd, 8, start)
            magic = int.from_bytes(head[4:8], "big", signed=True) if len(head) == 8 else 0
            if any(head) and magic not in (commitlog.MAGIC_V1, commitlog.MAGIC_V2, commitlog.BLANK_MAGIC):
                start = 0
                end = self._walk(fd, 0, stop, size, file_start, t.trusted)
        return start, end

    @staticmethod
    def _walk(fd: int, pos: int, stop: int, size: int, file_start: int, trusted: int) -> int:
        want = _WALK_WINDOW
        while pos < stop:
            buf = os.pread(fd, min(want, size - pos), pos)
            end, more = commitlog.complete_records_end(buf, pos, buf_offset=pos, file_start=file_start,
                                                       file_size=size, trusted_end=trusted)
            if not more:
                return end
            # one record longer than the window: read it whole
            want = _WALK_WINDOW if end > pos else int.from_bytes(buf[:4], "big") + commitlog.BLANK_SIZE
            if end == pos and len(buf) >= want:
                return pos
            pos = end
        return pos

    def _append_end(self, fd: int, t: Tail, start: int, size: int) -> int:
        """Blocking: the end of the new bytes of an append-only file from `start`: its last data, or the first hole
        before that when the hole is new since the last round. After the round's flush every page written before
        the round is in the hot file, so a hole amid the new bytes is a page the kernel has not written back yet
        (written after the flush, while later pages were): the bytes past it wait for the next round instead of
        going up as torn records. A hole still there a round later was never written: the bytes past it go. At
        unmount (no flush: nothing can still be written back) every byte goes."""
        end = data_end(fd, start, size)
        hole = os.lseek(fd, start, os.SEEK_HOLE) if self._defer_holes and end > start else end
        if hole >= end or hole == t.hole:
            t.hole = -1
            return end
        t.hole = hole
        return hole

    @staticmethod
    def _index_ranges(fd: int, t: Tail, slots: int, committed: int, size: int, dirty: list[tuple[int, int]]
                      ) -> list[tuple[int, int]]:
        """An IndexFile as header + items (tierfs.tier.indextail): the items appended past the committed offset,
        items rewritten (dirty ranges in the items region), and the header when anything changed. The hash-slot
        table never goes up: the reader rebuilds it."""
        base = indextail.items_base(slots)
        lo = max(committed, base) if t.uploaded and t.slots == slots else base
        lo -= (lo - base) % ITEM_SIZE  # whole items: data_end trimmed the zero bytes an item may end with
        ranges = [(max(a, base), b) for a, b in dirty if b > base]
        end = data_end(fd, lo, size)
        if end > lo:
            ranges.append((lo, min(size, end + (base - end) % ITEM_SIZE)))
        if ranges or dirty or not t.uploaded:
            ranges.append((0, HEADER_SIZE))
        return ranges

    def snapshot_rows(self, stats: dict[str, os.stat_result]) -> dict[str, TailRow]:
        """The tails a snapshot taken now names (only files whose inode is still the tail's). On the trio
        thread: a consistent view of the committed objects."""
        out = {}
        for t in self.tails.values():
            st = stats.get(t.rel)
            if st is None or st.st_ino != t.ino:
                continue
            objs = tuple(o if o.end <= st.st_size else None for o in t.objects if o.start < st.st_size)
            if any(o is None for o in objs):
                continue  # shrunk below an object: a blob of it this time
            out[t.rel] = TailRow(t.rel, st.st_size, st.st_mtime_ns, stat.S_IMODE(st.st_mode), st.st_uid,
                                 st.st_gid, objs, t.slots)  # type: ignore[arg-type]
        return out

    async def _queue_retired(self) -> None:
        """Queue the retired append objects (and, at the first round, those of earlier daemons no resumed tail
        names) for deletion after their grace, in the catalog: the janitor deletes them once nothing refers to
        them."""
        eng = self.eng
        if not self._listed_old:
            mine = f"{tail_prefix(self.sid)}{self.incarnation}/"
            listed = await trio.to_thread.run_sync(self.store.list, tail_prefix(self.sid), limiter=eng.limiter)
            named = {o.key for t in self.tails.values() for o in t.objects}  # adopted ones stay
            now = time.time()
            for info in listed:
                if not info.key.startswith(mine) and info.key not in named:
                    self.retired.setdefault(info.key, now)
            self._listed_old = True
        if not self.retired:
            return
        grace = float(eng.config["delete.grace_seconds"])
        by_time: dict[float, list[str]] = {}
        retired, self.retired = self.retired, {}
        for k, since in retired.items():
            by_time.setdefault(since + grace, []).append(k)
        try:
            for not_before, keys in by_time.items():
                await eng.db(eng.catalog.queue_deletes, keys, not_before)
        except BaseException:
            for k, since in retired.items():  # not all queued: the next round tries again
                self.retired.setdefault(k, since)
            raise

    def note_deleted(self, keys: list[str]) -> None:
        """The janitor deleted `keys`: count ours (status and metrics)."""
        pre = tail_prefix(self.sid)
        self.deleted += sum(k.startswith(pre) for k in keys)
