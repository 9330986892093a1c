"""The uploader: puts sealed segments into the object store, verifies them, and commits them TIERED (DESIGN §5).

A segment is read from its hot file chunk by chunk (objectstore.chunk_bytes), each chunk is PUT with its crc32c
(or composed inside the store from the append objects continuous tiering put, when they hold its exact bytes:
tierfs.tier.sealcopy) and checked back (HEAD, or a full GET with upload.verify=full), and only then does one transaction say TIERED:
the local bytes may be dropped only after that commit. A write during the upload voids it (write_seq moves) and
the segment is sealed again at a new generation. Also here: the sweep of multipart uploads a crashed daemon left.

No upload leaves an object nothing names. Keys carry the path at upload time, so a crash between the PUTs and the
commit, after a rename, made the next daemon upload the segment again under other keys and forget the first ones.
Now a batch registers every key it may put (`upload:<file id>`, tierfs.tier.references) in one catalog transaction
before its first PUT, and ends that registration only after the commit that names or queues them (or queues them
itself when the upload failed); the next mount queues whatever an earlier daemon still held. So at any moment each
object an upload put is named by a row, held, or queued; a queued key that a row names is never deleted.

Content-addressed chunks (upload.dedup; tierfs.tier.layout): a segment's keys are known only as its chunks are
read, so each is hashed (sha256, in the upload's thread, in the pass that reads it for the PUT) and held right
then, in a transaction that also says whether a live row already names it: then the bytes are stored (the other
replica's identical segment) and the PUT is skipped; the check that follows is the same as for a PUT (a full GET
compares the stored bytes with ours). Two uploads of the same bytes both hold the key, so neither's failure can
delete what the other commits; identical PUTs are idempotent.
"""

from __future__ import annotations

import hashlib
import heapq
import logging
import os
import random
import sqlite3
import time
from typing import TYPE_CHECKING

import crc32c
import trio

from tierfs import failpoints
from tierfs.objectstore.base import Fenced, ObjectNotFound, ObjectStoreError
from tierfs.tier import layout, sealcopy, units
from tierfs.tier.catalog import Entry, State
from tierfs.tier.ratelimit import BandwidthLimiterClosed, TokenBucket
from tierfs.tier.references import UPLOAD, BeingDeleted
from tierfs.tier.state import ShortRead

if TYPE_CHECKING:
    from tierfs.tier.engine import Engine

log = logging.getLogger("tierfs.tier")

_UPLOAD_BATCH = 64  # small segments (one block or less) uploaded together and committed in one transaction


class UploadQueue:
    """Sealed segments waiting for upload, by file id (a rename while queued changes nothing), oldest (mtime, id)
    first. A heap: taking the next one costs O(log n), where a min() over the whole backlog per upload made
    tiering 100,000 small files quadratic."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int]] = []
        self._queued: set[int] = set()

    def __len__(self) -> int:
        return len(self._queued)

    def __contains__(self, file_id: int) -> bool:
        return file_id in self._queued

    def push(self, file_id: int, mtime_ns: int) -> None:
        if file_id not in self._queued:
            self._queued.add(file_id)
            heapq.heappush(self._heap, (mtime_ns, file_id))

    def pop(self) -> tuple[int, int] | None:
        if not self._heap:
            return None
        item = heapq.heappop(self._heap)
        self._queued.discard(item[1])
        return item


class Uploader:
    def __init__(self, engine: Engine):
        self.eng = engine
        config = engine.config
        self.queue = UploadQueue()
        self._wakeup = trio.Event()
        self._uploading: dict[int, str] = {}  # file id -> the path its object keys are named by
        self._sealed_at_seq: dict[int, int] = {}  # file id -> write_seq when sealed: a later write voids it
        self.started_at = time.time()  # multipart uploads initiated before this are a crashed daemon's
        self._sweep_done = trio.Event()  # uploaders start after the first stale-upload sweep
        bw = int(config["upload.bandwidth_bytes_per_second"])
        self.bandwidth: TokenBucket | None = TokenBucket(bw) if bw else None
        # threads of a batch of small uploads: half the store's request slots, the rest stay with readers
        self._small_limiter = trio.CapacityLimiter(max(1, int(config["objectstore.max_concurrency"]) // 2))

    def enqueue(self, e: Entry, seq: int | None = None) -> None:
        """Queue a SEALED (or UPLOADING, after a restart) segment; `seq` is its write count when it sealed."""
        if seq is not None:
            self._sealed_at_seq[e.file_id] = seq
        self.queue.push(e.file_id, e.mtime_ns)

    def wake(self) -> None:
        self._wakeup.set()

    def forget(self, file_id: int) -> None:
        self._sealed_at_seq.pop(file_id, None)

    def start(self, nursery: trio.Nursery) -> None:
        eng = self.eng
        nursery.start_soon(eng.supervise, "upload-sweep", self._sweep_stale_uploads)
        if self.bandwidth is not None:
            nursery.start_soon(self._close_bandwidth_on_cancel)
        for _ in range(int(eng.config["upload.concurrency"])):
            nursery.start_soon(eng.supervise, "uploader", self.run)

    # ------------------------------------------------------------------ the loop

    async def run(self) -> None:
        eng = self.eng
        backoff = 1.0
        await self._sweep_done.wait()
        while True:
            if not eng.store_writable():
                await trio.sleep(1.0)  # never two writers uploading: wait for the lease
                continue
            batch = self._next_uploads()
            if not batch:
                self._wakeup = trio.Event()
                with trio.move_on_after(1.0):
                    await self._wakeup.wait()
                continue
            self._uploading.update((e.file_id, e.path) for e in batch)
            try:
                try:
                    failed = await self._upload(batch)
                except (ObjectStoreError, OSError, sqlite3.Error) as err:  # the batch's commit failed
                    failed = [(e, err) for e in batch]
                retry = False
                for e, err in failed:
                    if isinstance(err, BandwidthLimiterClosed):
                        return  # shutting down; the catalog says SEALED, so the next mount resumes it
                    if not eng.is_live(e):
                        log.info("%s was deleted during its upload", e.path)  # a broker's retention: no error
                        continue
                    if isinstance(err, FileNotFoundError):  # renamed while its upload opened it: again, no error
                        log.debug("%s was renamed during its upload (%s); it goes again", e.path, err)
                        if e.state is not State.HOT:
                            self.queue.push(e.file_id, e.mtime_ns)
                        continue
                    eng.stats.upload_failures += 1
                    eng.stats.last_error = f"upload {e.path}: {err}"
                    if isinstance(err, ObjectStoreError) and not isinstance(err, Fenced):  # metrics: store failing
                        eng.store_down_since = eng.store_down_since or time.time()
                    if isinstance(err, ValueError):  # the store refuses this segment's object key: never tiered
                        log.error("%s cannot be tiered (%s); it stays local", e.path, err)
                        await self._keep_local(e)
                        continue
                    log.warning("upload of %s failed (%s); retrying in %.1f s", e.path, err, backoff)
                    if e.state is not State.HOT:
                        self.queue.push(e.file_id, e.mtime_ns)
                    retry = True
                if retry:
                    await trio.sleep(backoff * (0.5 + random.random()))
                    backoff = min(backoff * 2, float(eng.config["upload.retry_max_seconds"]))
                else:
                    backoff = 1.0
            finally:
                for e in batch:
                    self._uploading.pop(e.file_id, None)

    async def _keep_local(self, e: Entry) -> None:
        eng = self.eng
        eng.sealer.untierable.add(e.path)
        try:
            await eng.db(eng.catalog.remove, e, [], time.time())
        except sqlite3.Error as err:
            log.warning("could not drop the catalog row of %s (%s)", e.path, err)
            return
        if eng.is_live(e):
            eng.drop(e)

    def _next_uploads(self) -> list[Entry]:
        """Oldest first (lowest mtime): the next segment waiting for upload and, while the oldest ones are small
        (one block or less, where per-object requests and commits cost more than the bytes), up to
        _UPLOAD_BATCH of them, uploaded together and committed in one transaction."""
        out: list[Entry] = []
        busy: list[tuple[int, int]] = []  # a failed upload backing off is still in _uploading: it stays queued
        while len(out) < _UPLOAD_BATCH:
            item = self.queue.pop()
            if item is None:
                break
            mtime_ns, fid = item
            e = self.eng.files.get(fid)
            if e is None or e.state not in (State.SEALED, State.UPLOADING):
                continue
            if fid in self._uploading:
                busy.append(item)
                continue
            if e.mtime_ns != mtime_ns:  # sealed again since it was queued: its place follows its new mtime
                self.queue.push(fid, e.mtime_ns)
                continue
            small = e.size <= self.eng.block
            if out and not small:
                self.queue.push(fid, mtime_ns)  # a big one goes alone, next
                break
            out.append(e)
            if not small:
                break
        for mtime_ns, fid in busy:
            self.queue.push(fid, mtime_ns)
        return out

    async def _upload(self, entries: list[Entry]) -> list[tuple[Entry, Exception]]:
        """Upload one segment, or a batch of small ones with their requests overlapping, then commit every one
        still unchanged as TIERED in one transaction: durable before any local byte may be dropped. Returns the
        segments whose upload failed, with the error; raises if the commit fails (nothing is tiered then).

        SEALED -> UPLOADING is kept in memory only: a crash resumes both the same way (upload again, under the
        keys of its path then). What an upload may put is registered durably instead, once per batch (module
        docstring): the keys an earlier attempt put under another path are queued, not forgotten."""
        eng = self.eng
        t0 = time.monotonic()
        batch: list[tuple[Entry, int, int]] = []  # entry, ino, write seq when sealed
        holds: dict[str, list[str]] = {}  # every key each upload may put, by the path it has now
        for e in entries:
            batch.append((e, e.ino, self._sealed_at_seq.get(e.file_id, eng.write_seq.get(e.ino, 0))))
            holds[f"{UPLOAD}{e.file_id}"] = self._keys(e)
            if e.state is State.SEALED:
                e.state = State.UPLOADING
        try:  # durable before the first PUT: a crash from here on leaves them registered (module docstring)
            await eng.db(eng.references.hold_many, holds)
        except BeingDeleted as err:  # a delete of an earlier attempt's object is running: upload it later
            return [(e, ObjectStoreError(str(err))) for e in entries]
        settled: list[str] = []
        try:
            return await self._upload_held(batch, holds, settled, t0)
        finally:  # whatever no commit named or queued is queued now (a crash or a cancel: at the next mount)
            released = [h for h in holds if h not in settled]
            await eng.db(eng.references.settle, settled, released,
                         time.time() + float(eng.config["delete.grace_seconds"]))

    def _keys(self, e: Entry) -> list[str]:
        """The objects an upload of `e` may put now, held before the first PUT: its chunks, named by its path,
        and their crc32c table; none for a content-addressed upload (each key is held once its chunk is read)."""
        if self._content_addressed(e):
            return []
        keys = layout.chunk_keys(self.eng.store_id, e.path, e.generation, "raw", e.size, e.chunk_bytes)
        return keys + ([units.table_key(keys[0])] if self._unit(e) else [])

    def _content_addressed(self, e: Entry) -> bool:
        """upload.dedup: a segment gets content-addressed chunks when on, or when auto and the stores are below
        the mount root (a broker group's layout: its replicas write the same bytes; the first replica's segments
        may well be uploaded before the next replica's store root exists)."""
        mode = self.eng.config["upload.dedup"]
        return mode == "on" or mode == "auto" and (self.eng.store_roots != [""] or self.eng.shared is not None)

    def _unit(self, e: Entry) -> int:
        """The verification unit of `e`'s crc32c table (0: none, whole blocks are checked)."""
        unit = self.eng.unit
        return unit if 0 < unit < e.block_bytes and e.block_bytes % unit == 0 else 0

    async def _upload_held(self, batch: list[tuple[Entry, int, int]], holds: dict[str, list[str]],
                           settled: list[str], t0: float) -> list[tuple[Entry, Exception]]:
        """`_upload` once the keys are held; `settled` gets the holders a commit named or queued the keys of."""
        eng = self.eng
        results: list[tuple[int, list[int], list[str]] | ShortRead | None] = [None] * len(batch)
        failed: list[tuple[Entry, Exception]] = []

        async def put(i: int, e: Entry) -> None:
            # the append objects continuous tiering holds for it (taken here, on the loop: a consistent list)
            tail = eng.appendlog.objects_of(e.ino, e.path) if eng.appendlog is not None else ()
            copied = [0, 0]
            try:  # one big segment: its own thread, as ever; small ones: bounded, so readers keep store slots
                results[i] = await trio.to_thread.run_sync(
                    self.upload_blocking, e, tail, copied, holds[f"{UPLOAD}{e.file_id}"],
                    limiter=self._small_limiter if len(batch) > 1 else None)
                eng.stats.upload_copied_bytes += copied[0]
                eng.stats.upload_dedup_bytes += copied[1]
            except ShortRead as err:
                results[i] = err  # the file shrank since it was sealed: void this generation, seal it again
            except (ObjectStoreError, OSError, ValueError) as err:
                failed.append((e, err))

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
            crc, block_crcs, keys, table = (0, [], res.keys, (0, b"", "")) if isinstance(res, ShortRead) else res
            if shrank or eng.write_seq.get(ino, 0) != seq or not eng.is_live(e) or e.state is not State.UPLOADING:
                log.info("%s changed during upload%s; discarding gen %d objects", e.path,
                         f" ({res})" if shrank else "", e.generation)
                void_keys += keys + ([units.ref_key(table[2])] if table[2] else [])  # its table object too
                if eng.is_live(e):
                    voided.append(e)
                continue
            done.append(((e, ino, seq), (crc, block_crcs, keys, table, now)))
        if not done and not void_keys:
            return failed
        gen0 = await eng.db(eng.catalog.allocate, len(voided)) if voided else 0
        # rows to commit are copies, made with no await before the commit is queued (so they carry the current
        # paths; a rename queues its own transaction after ours): memory changes only once it is durable
        rows = [eng.tiered_copy(e, res) for (e, _, _), res in done]
        void_rows = [eng.hot_copy(e, gen0 + i) for i, e in enumerate(voided)]
        await failpoints.pause("tier.upload_commit")  # tests: an unlink while the TIERED commit is on its way
        await eng.db(eng.catalog.put_many, rows + void_rows, void_keys, now)
        settled += [f"{UPLOAD}{e.file_id}" for (e, _, _), res in zip(batch, results) if res is not None]
        failpoints.hit("tier.after_commit")
        for e, row in zip(voided, void_rows):
            if eng.is_live(e):
                eng.apply(e, row)
        late: list[Entry] = []
        gone: list[Entry] = []
        for ((e, ino, seq), _), row in zip(done, rows):
            if not eng.is_live(e):
                gone.append(row)  # unlinked while the commit ran: its row and the objects it names go
                continue
            written = eng.write_seq.get(ino, 0) != seq  # while the commit ran: the objects hold the old content
            eng.apply(e, row, serve=not written)
            if written:
                late.append(e)
                continue
            self._sealed_at_seq.pop(e.file_id, None)  # a later seal (after a rewrite) records its own
            eng.stats.uploads += 1
            eng.stats.upload_bytes += e.size
            eng.observe("upload", time.monotonic() - t0, e.size)
            log.log(logging.INFO if len(batch) == 1 else logging.DEBUG, "tiered %s: %d bytes in %d objects, "
                    "crc32c %08x, %.2f s", e.path, e.size, len(e.objects), e.crc32c, time.monotonic() - t0)
        eng.store_down_since = None
        if len(batch) > 1 and done:
            log.info("tiered %d small segments (%d bytes), %s .. %s, in %.2f s", len(done),
                     sum(d[0][0].size for d in done), done[0][0][0].path, done[-1][0][0].path, time.monotonic() - t0)
        if gone:  # whichever of the unlink's and our commit ran first, the row ends gone and its objects queued
            for row in gone:
                await eng.db(eng.catalog.remove, row, row.all_objects(),
                             time.time() + float(eng.config["delete.grace_seconds"]), ("cidx",))
        if late:
            await self._void_late(late)
        return failed

    async def _void_late(self, late: list[Entry]) -> None:
        """Segments written while their TIERED commit ran: not in `tiered` yet, so nothing was evicted and the
        hot file is whole. They turn HOT at a new generation (to be sealed again) and their objects go."""
        eng = self.eng
        keys = [k for e in late for k in e.all_objects()]
        for e in late:
            log.info("%s written while its upload was committed; discarding gen %d objects", e.path, e.generation)
        gen0 = await eng.db(eng.catalog.allocate, len(late))
        rows = [eng.hot_copy(e, gen0 + i) for i, e in enumerate(late)]
        await eng.db(eng.catalog.put_many, rows, keys, time.time())
        for e, row in zip(late, rows):
            if eng.is_live(e) and eng.tiered.get(e.ino) is not e:
                eng.apply(e, row)

    def upload_blocking(self, e: Entry, tail: tuple = (), copied: list[int] | None = None,
                        held: list[str] | None = None) -> tuple[int, list[int], list[str], tuple[int, bytes, str]]:
        """Read the hot file chunk by chunk, PUT each chunk as its key in `held` (`_keys` as registered before the
        upload: a rename since changes nothing here; by default, as of now), or compose it in the store from the
        append objects
        `tail` that hold its exact bytes: tierfs.tier.sealcopy; their bytes are added to `copied[0]`, and those a
        live row already stored content-addressed to `copied[1]`), verify, and
        return (crc, block crcs, keys, (verification unit, b"", the reference to its crc32c table object:
        tierfs.tier.units)). The table object is put last, after every chunk: no table without its chunks.
        No keys in `held`: content-addressed (module docstring), each key held as its chunk is read."""
        eng = self.eng
        copied = [0, 0] if copied is None else copied
        unit = self._unit(e)
        held = self._keys(e) if held is None else held
        content = not held  # a per-row upload holds at least its one chunk
        keys = [] if content else held[:-1] if unit else held
        crc = 0
        block_crcs: list[int] = []
        unit_crcs: list[bytes] = []
        verify_full = eng.config["upload.verify"] == "full"
        fd = os.open(eng.hot / e.path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            if e.ino and os.fstat(fd).st_ino != e.ino:
                raise ShortRead(keys, f"{e.path} was replaced since it was sealed")
            # TIERED says every block is resident: the bytes must be durable before that commit
            os.fdatasync(fd)
            same: dict[str, bool] = {}  # append object -> holds the local bytes
            for i in range(max(-(-e.size // e.chunk_bytes), 1)):
                off = i * e.chunk_bytes
                data = os.pread(fd, min(e.chunk_bytes, e.size - off), off)
                if len(data) != min(e.chunk_bytes, e.size - off):
                    raise ShortRead(keys, f"short read of {e.path} at {off}: it shrank since it was sealed")
                key, stored = self._content_key(e, data) if content else (keys[i], False)
                if content:
                    keys.append(key)
                eng.fence(key)
                chunk_crc = crc32c.crc32c(data)
                crc = crc32c.crc32c(data, crc)
                mv = memoryview(data)
                block_crcs += [crc32c.crc32c(mv[b:b + e.block_bytes]) for b in range(0, len(data), e.block_bytes)]
                if unit:
                    unit_crcs.append(units.table(mv, unit))
                if stored and self._verified(key, data, chunk_crc, verify_full):
                    copied[1] += len(data)  # another row's identical chunk, checked as our own PUT would be
                    failpoints.hit("tier.chunk_put")
                    continue
                if stored:  # named by a row, yet missing or damaged: put it again (for that row too)
                    log.warning("%s: content-addressed object %s, which a row names, is missing or differs; "
                                "putting it again", e.path, key)
                if not self._compose(fd, key, off, len(data), chunk_crc, tail, same, copied):
                    if self.bandwidth is not None:
                        self.bandwidth.acquire(len(data))  # shared by every uploader thread
                    eng.store.put(key, data, metadata={"crc32c": f"{chunk_crc:08x}"})
                failpoints.hit("tier.chunk_put")
                if not self._verified(key, data, chunk_crc, verify_full):
                    raise ObjectStoreError(key, "verification failed: the object differs from what was put "
                                                "(size, or crc32c with upload.verify=full)")
        finally:
            os.close(fd)
        if not unit:
            return crc, block_crcs, keys, (0, b"", "")
        packed = b"".join(unit_crcs)
        tkey, stored = self._content_key(e, packed) if content else (held[-1], False)
        eng.fence(tkey)
        tcrc = crc32c.crc32c(packed)
        if not (stored and self._verified(tkey, packed, tcrc, False)):
            eng.store.put(tkey, packed, metadata={"crc32c": f"{tcrc:08x}"})
            if not self._verified(tkey, packed, tcrc, False):
                raise ObjectStoreError(tkey, "verification failed: size mismatch")
        return crc, block_crcs, keys, (unit, b"", units.make_ref(tkey, packed))

    def _verified(self, key: str, data: bytes, crc: int, full: bool) -> bool:
        """Blocking: the stored object `key` holds `data` (crc32c `crc`): read back in full, or its size only."""
        try:
            if full:
                back = self.eng.store.get(key)
                return len(back) == len(data) and crc32c.crc32c(back) == crc
            info = self.eng.store.head(key)
        except ObjectNotFound:
            return False
        return info is not None and info.size == len(data)

    def _content_key(self, e: Entry, data: bytes) -> tuple[str, bool]:
        """Blocking: the content-addressed key of `data`, held for `e`'s upload from now on, and whether a live
        row names it already (stored and verified: no PUT needed). With upload.dedup_group the key is the group's,
        shared with other mounts: this mount's marker goes up first, and the bucket says whether it is stored
        (tierfs.tier.sharedrefs)."""
        sha, shared = hashlib.sha256(data).hexdigest(), self.eng.shared
        key = shared.key(sha) if shared is not None else layout.cas_key(self.eng.store_id, sha)
        try:
            stored = self.eng.references.hold_content(f"{UPLOAD}{e.file_id}", key)
        except BeingDeleted as err:  # the same bytes' delete is running: upload again later (not "untierable")
            raise ObjectStoreError(key, str(err)) from None
        if shared is not None:
            self.eng.fence(key)
            stored = shared.acquire(key)  # held first: a failure from here on releases (unmarks) it
        return key, stored

    def _compose(self, fd: int, key: str, off: int, n: int, crc: int, tail: tuple, same: dict[str, bool],
                 copied: list[int] | None) -> bool:
        """Blocking: make chunk `key` ([off, off+n) of the file) in the store from append objects that hold its
        bytes. False when they cannot (the caller puts it)."""
        if not tail:
            return False
        ranges = sealcopy.plan(tail, off, off + n, self.eng.store.compose_min_part)
        if ranges is None or not all(sealcopy.matches(fd, o, same) for o, _, _ in ranges):
            return False
        try:
            self.eng.store.compose(key, [(o.key, start, length) for o, start, length in ranges], crc32c=crc)
        except NotImplementedError:
            return False
        except ObjectStoreError as err:  # e.g. an append object deleted meanwhile: put it as ever
            log.info("composing %s from append objects failed (%s); uploading it", key, err)
            return False
        if copied is not None:
            copied[0] += n
        return True

    # ------------------------------------------------------------------ multipart uploads a crash left

    async def _sweep_stale_uploads(self) -> None:
        """Abort the multipart uploads a crashed daemon left under <store-id>/ (DESIGN §5), retrying until one
        pass succeeds. Uploaders wait for the first pass; anything this daemon (or a job it started) puts while
        a retry runs was initiated after it started, and is spared."""
        eng = self.eng
        backoff = 1.0
        try:
            while True:
                if not eng.store_writable():
                    await trio.sleep(1.0)  # only the lease holder may abort uploads: they may be the writer's
                    continue
                try:
                    busy = tuple(f"{eng.store_id}/seg/{p}/" for p in self._uploading.values())
                    aborted, spared = await eng.io(self._abort_stale_uploads, busy)
                except ObjectStoreError as err:
                    log.warning("listing stale multipart uploads under %s/ failed (%s); retrying in %.0f s",
                                eng.store_id, err, backoff)
                else:
                    log.info("aborted %d stale multipart uploads under %s/ (initiated before this daemon "
                             "started)%s", aborted, eng.store_id, f"; {spared} newer kept" if spared else "")
                    return
                self._sweep_done.set()
                await trio.sleep(backoff)
                backoff = min(backoff * 2, float(eng.config["upload.retry_max_seconds"]))
        finally:
            self._sweep_done.set()

    def _abort_stale_uploads(self, busy: tuple[str, ...]) -> tuple[int, int]:
        """Blocking: abort uploads under <store-id>/ initiated before this daemon started. Spared: newer ones
        (another process, e.g. a compaction job) and those under `busy` (segments being uploaded right now)."""
        store, sid = self.eng.store, self.eng.store_id
        aborted = spared = 0
        for up in list(store.list_multipart_uploads(f"{sid}/")):
            if up.initiated is None or up.initiated >= self.started_at or up.key.startswith(busy):
                spared += 1
                continue
            store.abort_multipart(up.key, up.upload_id)
            log.info("aborted stale multipart upload of %s (upload id %s, initiated %s)", up.key, up.upload_id,
                     time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(up.initiated)))
            aborted += 1
        return aborted, spared

    async def _close_bandwidth_on_cancel(self) -> None:
        """At shutdown, wake uploaders waiting for bandwidth so an unmount never waits out a reservation."""
        try:
            await trio.sleep_forever()
        finally:
            assert self.bandwidth is not None
            self.bandwidth.close()
