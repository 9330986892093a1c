"""The sealer: finds segments the broker has finished writing and seals them (DESIGN §4).

A segment is sealed when it has been quiet for `seal.quiet_seconds`, every write the daemon saw has been flushed
(the sealer flushes it itself, through the mount, when the broker did not), and its content passes the seal rule
of its kind (tierfs.store.seal). Sealing is bookkeeping: a SEALED catalog row, committed in batches, after which
the uploader takes the segment.
"""

from __future__ import annotations

import logging
import mmap
import os
import sqlite3
import time
from typing import TYPE_CHECKING

import trio

from tierfs import failpoints
from tierfs.store.paths import Kind, classify
from tierfs.store.seal import SealParams, checked_ranges, is_sealed
from tierfs.tier import identity
from tierfs.tier.catalog import Entry, State
from tierfs.tier.storeroots import find_roots, segment_dirs

if TYPE_CHECKING:
    from tierfs.tier.engine import Engine

log = logging.getLogger("tierfs.tier")

_SEAL_BATCH = 512  # candidates probed per worker-thread hop, and sealed per catalog transaction
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14; Python 3.11 lacks the name


class Sealer:
    def __init__(self, engine: Engine):
        self.eng = engine
        config = engine.config
        self.params = SealParams(int(config["broker.max_index_num"]), int(config["broker.max_hash_slot_num"]))
        self.untierable: set[str] = set()  # segments whose object keys the store refuses: kept local
        self._refused: dict[str, str] = {}  # path -> the corrupt-content reason last logged for it
        self._candidates: dict[str, int] = {}  # path -> st_ino when it became a candidate (0: unknown)
        self._probing: dict[int, int] = {}  # st_ino -> probes reading it now: a truncate waits (no SIGBUS)
        self._probe_done = trio.Event()
        self._flushed: dict[int, tuple[int, int]] = {}  # st_ino -> (write seq, mtime) when the sealer flushed it
        # (size, mtime, ctime, write seq, why) of segments whose content was found incomplete: a scan skips them
        # until one of those changes, so a periodic scan re-reads only what may have changed
        self._unsealed: dict[str, tuple[int, int, int, int, str]] = {}
        self._ns_changes = 0  # unlinks and renames seen: a seal batch re-checks its paths when this moved
        self.hot_segments: dict[str, tuple[str, int, int, str]] = {}  # rel -> (kind, size, local, why): last scan

    # ------------------------------------------------------------------ events from the engine

    def fsynced(self, rel: str, ino: int) -> None:
        if classify(rel).is_segment:
            self._candidates[rel] = ino

    async def truncate_barrier(self, ino: int) -> None:
        """Wait while a seal probe reads the file, so the probe never maps pages that a truncate is removing (a
        SIGBUS in the daemon)."""
        while ino in self._probing:
            await self._probe_done.wait()

    def unlinked(self, rel: str, ino: int) -> None:
        self._ns_changes += 1
        self.untierable.discard(rel)
        self._refused.pop(rel, None)
        self._unsealed.pop(rel, None)
        self._candidates.pop(rel, None)
        self._flushed.pop(ino, None)

    def renamed(self, old: str, new: str, tree: bool) -> None:
        """Names changed (the engine's index already has the new ones). `tree`: a directory moved or two names
        were exchanged; what was known by a name below either side is looked at afresh under its new name."""
        self._ns_changes += 1
        if tree:
            sides = (old, new)
            under = [p for p in list(self._candidates) + list(self._unsealed)
                     if any(p == s or p.startswith(s + "/") for s in sides)]
            for p in under:
                self._unsealed.pop(p, None)
                self._candidates.pop(p, None)
            for p, e in list(self.eng.entries.items()):
                if e.state is State.HOT and any(p == s or p.startswith(s + "/") for s in sides):
                    self._candidates[p] = e.ino
            return
        self._unsealed.pop(old, None)
        self._unsealed.pop(new, None)
        ino = self._candidates.pop(old, None)
        e = self.eng.entries.get(new)
        if e is None:
            if ino is not None:
                self._candidates[new] = ino
        elif e.state is State.HOT:
            self._candidates[new] = e.ino

    def retry(self, rel: str) -> None:
        """Look at `rel` afresh (its seal or upload was voided)."""
        self._candidates[rel] = 0

    # ------------------------------------------------------------------ the loop

    async def run(self) -> None:
        interval = float(self.eng.config["seal.scan_interval_seconds"])
        next_scan = 0.0
        while True:
            if time.monotonic() >= next_scan:
                found, self.hot_segments = await trio.to_thread.run_sync(self._scan_segments)
                for rel, ino in found:
                    self._candidates.setdefault(rel, ino)
                next_scan = time.monotonic() + interval
            todo = list(self._candidates.items())
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
        by_ino, unsealed, write_seq = self.eng.by_ino, self._unsealed, self.eng.write_seq
        hot = str(self.eng.hot)
        roots = find_roots(hot, self.eng.config["store.roots"])
        self.eng.store_roots = roots  # the uploader's upload.dedup=auto asks how many there are
        stack = segment_dirs(hot, roots=roots)  # every store root below the mount's too
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
                        e = by_ino.get(de.inode())
                        if e is not None and (e.state is not State.HOT or e.path != rel):
                            continue  # past HOT, or another name of a file the catalog has by its own
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
        eng = self.eng
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
        if failpoints.enabled():  # tests: names change between a probe and its verdict
            log.info("probed %s", ", ".join(f"{rel}: {v[0]}" for rel, v in probes))
            await failpoints.pause("seal.probed")
        sealed: list[tuple[Entry, Entry | None, int, str]] = []  # entry, the one it replaces, seq, why
        batch: set[int] = set()  # the inodes in `sealed`
        flush: list[tuple[str, int, tuple[int, int]]] = []
        for rel, verdict in probes:
            what = verdict[0]
            if what == "wait":
                continue
            if what == "bind":  # a candidate without its inode (or another's): probed next time with the one it has
                if self._candidates.get(rel) == cands[rel]:
                    self._candidates[rel] = verdict[1]
                continue
            if what == "flush":
                flush.append((rel, verdict[1], verdict[2]))
                continue
            if self._candidates.get(rel) == cands[rel]:
                del self._candidates[rel]
            if what == "retry":  # e.g. the hot dir (and the catalog) full: try again
                self._candidates[rel] = cands[rel]
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
            e = eng.by_ino.get(st.st_ino)  # by identity: the name probed may be another link of a known file
            if eng.write_seq.get(st.st_ino, 0) != seq:
                self._candidates[rel] = st.st_ino
                continue
            if (e is not None and (e.state is not State.HOT or e.path != rel)) or rel in self.untierable:
                continue
            if st.st_ino in batch:  # another name (a hard link) of a file this batch seals: one file, one row
                continue
            if self._ns_changes != ns0:  # unlinks or renames since the probe: seal only what is still there
                try:
                    if os.lstat(eng.hot / rel).st_ino != st.st_ino:
                        self._candidates[rel] = 0
                        continue
                except FileNotFoundError:
                    continue
            entry = Entry(path=rel, kind=kind.value, size=st.st_size, mtime_ns=st.st_mtime_ns, state=State.SEALED,
                          generation=e.generation if e is not None else 0, chunk_bytes=eng.chunk,
                          block_bytes=eng.block, state_since=time.time(),
                          file_id=e.file_id if e is not None else 0, ino=st.st_ino)
            sealed.append((entry, e, seq, why))
            batch.add(st.st_ino)
        if flush:
            eng.start_soon(self._flush_through_mount, flush)
        if sealed:
            await self._commit_sealed(sealed)

    async def _flush_through_mount(self, todo: list[tuple[str, int, tuple[int, int]]]) -> None:
        """fsync quiet segments through the mount, so the kernel writes back every page still dirty for them (as
        WRITEs to this daemon) before they are judged complete; our own fsync handler then records the flush and
        makes them candidates again. From the flusher's child process (tierfs.tier.flusher): never a daemon
        thread blocked on its own mount."""
        if self.eng.mountpoint is None:
            return
        for rel, ino, mark in todo:
            self._flushed[ino] = mark
        try:
            failed = await self.eng.flusher.flush(self.eng.mountpoint, [rel for rel, _, _ in todo])
        except OSError as err:
            log.warning("flushing quiet segments through the mount failed (%s); will retry", err)
            for _, ino, _ in todo:
                self._flushed.pop(ino, None)
            return
        for line in failed:
            log.warning("flushing quiet segment %s through the mount failed; will retry", line.replace("\t", ": "))
        for rel, ino, _ in todo:
            self._candidates.setdefault(rel, ino)

    async def _commit_sealed(self, sealed: list[tuple[Entry, Entry | None, int, str]]) -> None:
        """One transaction for the batch, then memory. New files take a file id (and first generation) from the
        catalog sequence first, so no two files ever share an object key, and carry it on their hot inode
        (tierfs.tier.identity) durably before the commit that names them."""
        eng = self.eng
        fresh = [s[0] for s in sealed if not s[0].file_id]
        try:
            if fresh:
                first = await eng.db(eng.catalog.allocate, len(fresh))
                for i, entry in enumerate(fresh):
                    entry.file_id = entry.generation = first + i
                failed = await trio.to_thread.run_sync(
                    identity.stamp_all, [(str(eng.hot / e.path), e.ino, e.file_id) for e in fresh])
                if failed:  # gone or replaced since the probe: not sealed; the scan looks at the name again
                    ids = {fid for _, fid in failed}
                    for entry in [s[0] for s in sealed if s[0].file_id in ids]:
                        self._candidates[entry.path] = 0
                    sealed = [s for s in sealed if s[0].file_id not in ids]
                    if not sealed:
                        return
            await eng.db(eng.catalog.put_many, [s[0] for s in sealed], [], 0.0)
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
                self._candidates[entry.path] = entry.ino
            return
        failpoints.hit("tier.sealed")
        stale: list[Entry] = []
        for entry, prev, seq, why in sealed:
            # re-checked after the commit's await: unlinked, renamed, replaced or written meanwhile?
            if (eng.by_ino.get(entry.ino) is not prev or eng.write_seq.get(entry.ino, 0) != seq
                    or (prev is not None and prev.path != entry.path) or not self._same_inode(entry)):
                stale.append(entry)
                continue
            eng.add(entry)
            self._unsealed.pop(entry.path, None)
            eng.uploader.enqueue(entry, seq)
            log.log(logging.INFO if len(sealed) == 1 else logging.DEBUG, "sealed %s (%s, %d bytes, gen %d)",
                    entry.path, why, entry.size, entry.generation)
        if stale:
            await self._unseal_stale(stale)
        if len(sealed) > 1:
            log.info("sealed %d segments (%d bytes), %s .. %s", len(sealed), sum(s[0].size for s in sealed),
                     sealed[0][0].path, sealed[-1][0].path)
        eng.uploader.wake()

    def _same_inode(self, e: Entry) -> bool:
        try:
            return os.lstat(self.eng.hot / e.path).st_ino == e.ino
        except OSError:
            return False

    async def _unseal_stale(self, stale: list[Entry]) -> None:
        """Rows committed for files that changed while the commit ran: the row goes again (no objects exist
        yet), and the path is looked at afresh by the sealer."""
        eng = self.eng
        for e in stale:
            cur = eng.files.get(e.file_id)
            if cur is not None and cur is not e:
                await eng.db(eng.catalog.put, cur.copy())  # back to the row of the file's live (HOT) entry
            else:
                await eng.db(eng.catalog.remove, e, [], 0.0)
            self._candidates[e.path] = 0
            log.info("%s changed while its seal was committed; it stays hot", e.path)

    # ------------------------------------------------------------------ probes (worker thread)

    def _probe(self, cands: dict[str, int]) -> list[tuple[str, tuple]]:
        """Blocking: each candidate's verdict. ('wait',): not quiet yet; ('flush', ino, mark): quiet, but
        written since the last flush the daemon saw; ('drop',): gone, past HOT, or kept local;
        ('retry', err) / ('bad', err): unreadable now / for good; ('bind', ino): a candidate parked without its
        inode, to be probed with the one it has now; ('checked', lstat, write seq before the read, kind, sealed?,
        why)."""
        quiet = float(self.eng.config["seal.quiet_seconds"])
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
        eng = self.eng
        if rel in self.untierable:
            return ("drop",)
        rel.encode()  # a name SQLite cannot store (not UTF-8) fails here, on its own, not in a batch commit
        st = os.lstat(eng.hot / rel)
        if st.st_ino != ino:  # parked without one, or the name has another file now: probed next time with the
            return ("bind", st.st_ino)  # inode the truncate barrier then protects (waiting would wait forever)
        e = eng.by_ino.get(ino)
        if e is not None and (e.state is not State.HOT or e.path != rel):
            return ("drop",)
        lw = eng.last_write.get(ino)
        if time.time() - st.st_mtime < quiet or (lw is not None and time.monotonic() - lw < quiet):
            return ("wait",)
        seq = eng.write_seq.get(ino, 0)
        mark = (seq, st.st_mtime_ns)
        flushed = lw is None or eng.last_fsync.get(ino, 0.0) >= lw
        if not flushed and self._flushed.get(ino) != mark:
            return ("flush", ino, mark)  # pages of it may still be dirty in the kernel: flush, then judge
        kind = classify(rel)
        ok, why = self._check_content(rel, ino, kind, st.st_size)
        if not ok and not why.startswith("corrupt") and self._flushed.get(ino) != mark:
            return ("flush", ino, mark)  # incomplete here; maybe complete in the kernel's dirty pages
        return ("checked", st, seq, kind, ok, why)

    def _check_content(self, rel: str, ino: int, kind: Kind, size: int) -> tuple[bool, str]:
        """Map the file and apply the seal rule. Truncates of this inode wait for the probe (truncate_barrier),
        so the mapping cannot lose pages under us. The bytes the rule reads are faulted in first with
        MADV_POPULATE_READ, which answers an error where a touch would be a SIGBUS that kills the daemon (a
        hole of a mapped file on a full tmpfs needs a page it cannot get); no copy, the page cache serves."""
        if size == 0:
            return False, "empty"
        fd = os.open(self.eng.hot / rel, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            st = os.fstat(fd)
            if st.st_ino != ino:
                return False, "replaced while being checked"
            size = min(size, st.st_size)
            if size == 0:
                return False, "empty"
            with mmap.mmap(fd, size, prot=mmap.PROT_READ) as m:
                try:
                    for off, length in checked_ranges(kind, size, self.params):
                        start = off - off % mmap.PAGESIZE
                        m.madvise(_MADV_POPULATE_READ, start, min(off + length, size) - start)
                except OSError as e:  # a retry, not a verdict: once space is freed the pages read in
                    raise OSError(e.errno, f"its pages cannot be read in ({e.strerror}; is the hot disk full?)")
                return is_sealed(kind, m, size, self.params)
        finally:
            os.close(fd)
