"""Catalog snapshots in the object store, and the read-only mounts built from them (DESIGN §5, §6).

Writer side (`Snapshotter`, in the daemon of a writable mount): every `snapshot.interval_seconds` and at a clean
unmount, a consistent copy of catalog.db (sqlite3 backup API, in a worker thread) gets the tables a reader needs
and is uploaded:

    <store-id>/meta/catalog-<seq, 12 digits>.db      the snapshot (the last KEEP are kept)
    <store-id>/meta/catalog-latest.json              pointer {seq, key, time, crc32c, size, store_id, sizes}
    <store-id>/meta/blobs/<sha256 of the chunk>      content-addressed chunks of the files that are not tiered

`snapshot_files` lists every regular file of the store in the shape of a TIERED catalog row (plus mode and
owner): a tiered segment points at its segment objects; every other file (config/*.json, checkpoint, lock and
abort markers, segments not tiered yet) is cut into objectstore.chunk_bytes chunks stored under their sha256 (not
crc32c: 32 bits collide among a few ten thousand chunks), so an unchanged chunk, e.g. the zero-filled tail of the
active CommitLog, is uploaded once and never again. `snapshot_tree` lists directories and symlinks. The pointer
is written last (the failpoint `snapshot.upload` sits between the .db and the pointer), so a reader only ever
sees complete snapshots. Blobs no kept snapshot refers to are deleted after `delete.grace_seconds`, like
segment objects. A snapshot identical to the previous one (an idle store) is not uploaded again.

A periodic snapshot reads the hot dir while the broker writes: each file is as of the moment it was read, and
data still in the kernel's writeback cache is not in it yet. The snapshot at unmount is exact (nothing writes
any more). A file that is tiered and evicted while it is being read is taken from its objects instead: the
catalog generation tells (every TIERED -> HOT transition bumps it).

Reader side (`prepare_readonly`, in the daemon of a read-only mount, before it mounts): download the newest
snapshot, check its crc32c, validate every row (paths and keys come from the bucket: untrusted input), build a
sparse local tree (true sizes, modes and mtimes, nothing resident) and a local catalog in which every file is
TIERED, so the engine serves all of them through its ordinary read path: block cache, read-ahead, eviction and a
crc32c check of every block fetched.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import errno
import hashlib
import json
import logging
import os
import re
import shutil
import sqlite3
import stat
import threading
import time
import urllib.parse
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import crc32c
import trio

from tierfs import failpoints
from tierfs.objectstore import ObjectStore, crc32c_file
from tierfs.objectstore.base import ObjectNotFound, ObjectStoreError, validate_key
from tierfs.store.paths import classify
from tierfs.tier import appendlog, units
from tierfs.tier.catalog import (
    COLUMNS,
    Catalog,
    Entry,
    State,
    check_units,
    entry_to_row,
    row_to_entry,
)
from tierfs.tier.references import BeingDeleted, Flight, References

if TYPE_CHECKING:
    from tierfs.tier.engine import Engine

log = logging.getLogger("tierfs.snapshot")

FORMAT = 3  # 2: active files may be tails of append objects (table snapshot_tails, tierfs.tier.appendlog);
# 3: an IndexFile tail may lack its hash-slot table (table snapshot_index_slots: the reader rebuilds it)
READABLE_FORMATS = (1, 2, 3)
KEEP = 3
FINAL_TIMEOUT_S = 45.0  # `tierfs umount` waits 60 s for the daemon to exit
MARKER = "readonly.json"  # in the state dir of a read-only cache
_SEQ_RE = re.compile(r"/meta/catalog-(\d{12})\.db$")
_SHA_RE = re.compile(r"^[0-9a-f]{64}$")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")

_UPLOAD_MEMORY = 128 << 20  # chunks held at once by the parallel readers/uploaders of one snapshot
_EXTRA_COLS = ("mode", "uid", "gid")
_OBJECTS = COLUMNS.index("objects")
_UNIT_CRCS = COLUMNS.index("unit_crcs")
_UNIT_REF = COLUMNS.index("unit_ref")
SCHEMA = f"""
CREATE TABLE snapshot_files ({', '.join(c + (' TEXT PRIMARY KEY' if c == 'path' else '') for c in COLUMNS)},
                             mode INTEGER NOT NULL, uid INTEGER NOT NULL, gid INTEGER NOT NULL);
CREATE TABLE snapshot_tree (path TEXT PRIMARY KEY, type TEXT NOT NULL, mode INTEGER NOT NULL,
                            uid INTEGER NOT NULL, gid INTEGER NOT NULL, mtime_ns INTEGER NOT NULL, target TEXT);
CREATE TABLE snapshot_info (k TEXT PRIMARY KEY, v TEXT NOT NULL);
CREATE TABLE snapshot_links (path TEXT PRIMARY KEY, target TEXT NOT NULL);
"""
# snapshot_links: every further name of a file with several (hard links), and the name its content comes by. A
# file that is tiered says so by its file id too, one that is not (blobs, a tail) only here. Additive: a reader
# that predates the table builds such names as separate files, as it always did; a point without it links none.


class SnapshotError(ValueError):
    """A snapshot that cannot be read or used, with what is wrong and where."""


# ------------------------------------------------------------------------------------------ keys and pointer


def meta_prefix(store_id: str) -> str:
    return f"{store_id}/meta/"


def snapshot_key(store_id: str, seq: int) -> str:
    return f"{store_id}/meta/catalog-{seq:012d}.db"


def pointer_key(store_id: str) -> str:
    return f"{store_id}/meta/catalog-latest.json"


def blob_prefix(store_id: str) -> str:
    return f"{store_id}/meta/blobs/"


def blob_key(store_id: str, sha: str) -> str:
    return f"{store_id}/meta/blobs/{sha}"


@dataclass(frozen=True)
class Pointer:
    """The content of catalog-latest.json."""

    seq: int
    key: str
    time: float
    crc32c: int
    size: int
    store_id: str
    chunk_bytes: int
    block_bytes: int
    writer: str

    def encode(self) -> bytes:
        d = dataclasses.asdict(self)
        d["crc32c"] = f"{self.crc32c:08x}"
        d["format"] = FORMAT
        return (json.dumps(d, indent=1, sort_keys=True) + "\n").encode()

    @classmethod
    def decode(cls, key: str, data: bytes) -> Pointer:
        try:
            d = json.loads(data)
            if int(d.get("format", 0)) not in READABLE_FORMATS:
                raise ValueError(f"format {d.get('format')!r}, this tierfs reads formats {READABLE_FORMATS}")
            p = cls(seq=int(d["seq"]), key=str(d["key"]), time=float(d["time"]), crc32c=int(d["crc32c"], 16),
                    size=int(d["size"]), store_id=str(d["store_id"]), chunk_bytes=int(d["chunk_bytes"]),
                    block_bytes=int(d["block_bytes"]), writer=str(d.get("writer", "")))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise SnapshotError(f"snapshot pointer {key!r} is not valid ({type(e).__name__}: {e})") from None
        if p.key != snapshot_key(p.store_id, p.seq):
            raise SnapshotError(f"snapshot pointer {key!r} names {p.key!r}, expected "
                                f"{snapshot_key(p.store_id, p.seq)!r}")
        return p


def read_pointer(store: ObjectStore, store_id: str) -> Pointer:
    key = pointer_key(store_id)
    try:
        data = store.get(key)
    except ObjectNotFound:
        raise SnapshotError(f"no catalog snapshot at {store.url}/{key}: is {store_id!r} the right store id, and has "
                            f"a writable mount of it taken a snapshot (at unmount, or every "
                            f"snapshot.interval_seconds)?") from None
    except ObjectStoreError as e:
        raise SnapshotError(f"cannot read the snapshot pointer: {e}") from None
    p = Pointer.decode(key, data)
    if p.store_id != store_id:
        raise SnapshotError(f"snapshot pointer {key!r} is for store id {p.store_id!r}, not {store_id!r}")
    return p


def split_from_url(url: str) -> tuple[str, str]:
    """`--from` URL -> (object store URL, store id): 's3://B/P/SID' -> ('s3://B/P', 'SID'),
    'file:///srv/tier/SID' -> ('file:///srv/tier', 'SID'). ValueError says what a good URL looks like."""
    hint = "use file:///PATH/STORE_ID or s3://BUCKET[/PREFIX]/STORE_ID (the store id's prefix in the object store)"
    parsed = urllib.parse.urlsplit(url.strip())
    scheme = parsed.scheme.lower()
    if scheme not in ("file", "s3") or parsed.query or parsed.fragment:
        raise ValueError(f"--from {url!r}: {hint}")
    base, _, sid = parsed.path.rstrip("/").rpartition("/")
    sid = urllib.parse.unquote(sid)
    if not sid or (scheme == "s3" and not parsed.netloc) or (scheme == "file" and not base):
        raise ValueError(f"--from {url!r}: no store id at the end of the URL; {hint}")
    try:
        validate_key(sid)
    except ValueError as e:
        raise ValueError(f"--from {url!r}: bad store id: {e}") from None
    return urllib.parse.urlunsplit((scheme, parsed.netloc, base, "", "")), sid


def default_cache_dir(url: str) -> Path:
    """/var/cache/tierfs/<store id>-<hash of the URL>: one cache per store, two URLs never share one."""
    _, sid = split_from_url(url)
    return Path("/var/cache/tierfs") / f"{sid}-{hashlib.sha256(url.strip().encode()).hexdigest()[:10]}"


# ------------------------------------------------------------------------------------------ writer side


@dataclass
class _Cached:
    """A file's blob row from an earlier snapshot, reused while the file is provably unchanged."""

    ident: tuple[int, int, int, int]  # ino, size, mtime_ns, ctime_ns
    read_at: float
    row: tuple
    shas: list[str]


def _file_row(e: Entry, st: os.stat_result) -> tuple:
    return entry_to_row(e) + (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid)


def _copy(e: Entry, rel: str) -> Entry:
    """A TIERED entry as a reader gets it under the name `rel` (a hard-linked file is a row per name, with one
    file id): the objects say everything, nothing is resident."""
    return dataclasses.replace(e, path=rel, resident=bytearray(), last_access=0.0)


def _row_keys(objects: str, unit_ref: str) -> list[str]:
    """Every object a snapshot_files row names: a reader may fetch its chunks and its verification table."""
    table = units.ref_key(unit_ref)
    return json.loads(objects) + ([table] if table else [])


def link_names(names: list[str], stats: dict[str, os.stat_result], prefer: set[str]) -> dict[str, str]:
    """{further name: the name its content comes by} for every hot inode the walk found under several of `names`:
    one file, whatever its tier state, so a reader can build its names as one inode (link(2)). The first name in
    `prefer` (the tails: their objects are the freshest upload), else the first in order, carries the content."""
    by_ino: dict[int, list[str]] = {}
    for rel in sorted(names):
        by_ino.setdefault(stats[rel].st_ino, []).append(rel)
    out: dict[str, str] = {}
    for group in (g for g in by_ino.values() if len(g) > 1):
        first = next((rel for rel in group if rel in prefer), group[0])
        out.update((rel, first) for rel in group if rel != first)
    return out


def _rows_and_digest(tiered: dict[str, Entry], stats: dict[str, os.stat_result], blobs: dict[str, tuple],
                     tree: list[tuple], tails: dict[str, appendlog.TailRow] | None = None
                     ) -> tuple[dict[str, tuple], bytes, set[str], dict[str, str]]:
    """Every snapshot_files row, a digest of what a reader would see (an unchanged store is not uploaded again),
    every object the snapshot names, and its hard links (`link_names`)."""
    rows = {**blobs, **{rel: _file_row(e, stats[rel]) for rel, e in tiered.items()}}
    tails = tails or {}
    links = link_names([*rows, *tails], stats, set(tails))
    tail_rows = sorted(t.encode() + (t.slots,) for t in tails.values())
    # a verification table is fixed by its row's generation: its length stands for it (repr of megabytes is slow)
    brief = {k: r[:_UNIT_CRCS] + (len(r[_UNIT_CRCS]),) + r[_UNIT_CRCS + 1:] for k, r in rows.items()}
    digest = hashlib.sha256(repr((sorted(brief.items()), sorted(tree), tail_rows, sorted(links.items())))
                            .encode()).digest()
    keys = {k for r in rows.values() for k in _row_keys(r[_OBJECTS], r[_UNIT_REF])}
    return rows, digest, keys | {o.key for t in tails.values() for o in t.objects}, links


class Snapshotter:
    def __init__(self, engine: Engine):
        self.eng = engine
        self.store = engine.store
        self.sid = engine.store_id
        self._lock = trio.Lock()
        self._seq: int | None = None
        self._known: set[str] | None = None  # sha256 of the blobs in the store
        self._unref_since: dict[str, float] = {}
        self._files: dict[str, _Cached] = {}
        # the reference authority: kept and in-flight snapshots name their objects there (every delete asks it)
        self.references: References = engine.references
        self._last_digest: bytes | None = None
        self._zero: dict[int, tuple[str, bytes]] = {}
        self._mutex = threading.Lock()  # _known, counters and _zero, shared by the uploading threads
        self.last: dict = {}
        self.last_error = ""
        self.taken = 0
        self.skipped = 0
        self.puts = 0  # cumulative PUTs (blobs, .db, pointer) and their bytes, for the cost of continuous tiering
        self.put_bytes = 0

    def status(self) -> dict:
        return {**self.last, "taken": self.taken, "skipped_unchanged": self.skipped, "last_error": self.last_error,
                "puts_total": self.puts, "put_bytes_total": self.put_bytes,
                "interval_s": float(self.eng.config["snapshot.interval_seconds"])}

    # ------------------------------------------------------------------ loops

    async def run(self) -> None:
        interval = float(self.eng.config["snapshot.interval_seconds"])
        if interval <= 0:
            return
        while True:
            await trio.sleep(interval)
            await self._take_logged("periodic", force=self.references.roll_requested)

    async def final(self) -> None:
        """The snapshot at a clean unmount, bounded so the daemon still exits when the store is down."""
        with trio.move_on_after(FINAL_TIMEOUT_S) as scope:
            await self._take_logged("unmount")
        if scope.cancelled_caught:
            log.error("the catalog snapshot at unmount did not finish within %.0f s; read-only mounts will see "
                      "the previous snapshot", FINAL_TIMEOUT_S)

    async def _take_logged(self, reason: str, force: bool = False) -> None:
        if not self.eng.store_writable():
            log.warning("%s catalog snapshot skipped: the writer lease is not held", reason)
            return
        try:
            await self.take(reason, force)
            self.last_error = ""
            if force:
                self.references.roll_requested = False
        except (ObjectStoreError, OSError, sqlite3.Error, SnapshotError, BeingDeleted) as e:
            self.last_error = f"{reason} snapshot: {e}"
            log.warning("catalog snapshot failed (%s); will try again", self.last_error)
        except Exception as e:  # never let a snapshot take the daemon down
            self.last_error = f"{reason} snapshot: {type(e).__name__}: {e}"
            log.exception("catalog snapshot failed")

    # ------------------------------------------------------------------ one snapshot

    @asynccontextmanager
    async def _flight(self) -> AsyncIterator[Flight]:
        """One snapshot at a time; what it names is held against deletes from the moment it reads a row."""
        async with self._lock:
            with self.references.in_flight() as flight:
                yield flight

    async def take(self, reason: str, force: bool = False,
                   walked: tuple[list[tuple], dict[str, os.stat_result]] | None = None,
                   started: float | None = None) -> dict | None:
        """Take, upload and publish one snapshot; None when it would equal the previous one (unless forced).
        `walked`: the hot dir as `walk` found it earlier in a continuous-tiering round that started at `started`
        (the tails are stat'ed again: their append objects were uploaded since), so a round walks it once."""
        async with self._flight() as flight:
            t0 = time.monotonic()
            started = time.time() if started is None or walked is None else started
            tmp = self.eng.state_dir / "snapshot.tmp.db"
            await trio.to_thread.run_sync(self._backup, tmp)
            alog = getattr(self.eng, "appendlog", None)
            if walked is None:
                tree, stats = await trio.to_thread.run_sync(self.walk)
            else:
                tree, stats = walked[0], dict(walked[1])
                if alog is not None:
                    for rel, st in (await trio.to_thread.run_sync(alog.restat)).items():
                        if st is None:
                            stats.pop(rel, None)
                        else:
                            stats[rel] = st
            # on the loop only what must be consistent with the engine: which files are tiered, as shallow
            # copies (object lists are replaced, never mutated); rows are serialised in a worker thread
            tiered: dict[str, Entry] = {}
            blobs: dict[str, tuple] = {}
            todo: dict[str, int] = {}
            tails = alog.snapshot_rows(stats) if alog is not None else {}  # active files as append objects
            # with append objects, the broker's checkpoint as read before they were (see appendlog.CHECKPOINT_FILES)
            frozen = dict(alog.checkpoints) if tails else {}
            for rel in stats:
                e = self._entry_at(rel, stats[rel])
                if e is not None and e.state is State.TIERED:
                    # its segment objects hold all of it; a tail may still name less (its last uploads failed,
                    # or the round read it punched by an eviction after the walk)
                    tiered[rel] = _copy(e, rel)
                    tails.pop(rel, None)
                elif rel not in tails:
                    todo[rel] = e.generation if e is not None else 0
            # held from this loop turn on: a delete decided later waits for this snapshot (issue 27)
            flight.name([k for e in tiered.values() for k in e.all_objects()]
                        + [o.key for t in tails.values() for o in t.objects])
            counters = [0, 0]  # blobs uploaded, bytes uploaded
            for _ in range(3):
                if not todo:
                    break
                got = await trio.to_thread.run_sync(self._blob_files, list(todo), counters, frozen)
                again: dict[str, int] = {}
                for rel, gen in todo.items():
                    e = self._entry_at(rel, stats[rel])
                    if e is not None and e.state is State.TIERED:
                        tiered[rel] = _copy(e, rel)  # tiered (maybe evicted) while we read it
                        flight.name(e.all_objects())
                    elif (e.generation if e is not None else 0) != gen:
                        again[rel] = e.generation if e is not None else 0  # re-tiered meanwhile: read it again
                    elif got.get(rel) is not None:
                        blobs[rel] = got[rel]
                todo = again
            if todo:
                raise SnapshotError(f"{len(todo)} files kept changing tier state while being read, e.g. "
                                    f"{min(todo)}")
            for rel in [r for r in self._files if r not in stats]:
                del self._files[rel]
            rows, digest, keys, links = await trio.to_thread.run_sync(_rows_and_digest, tiered, stats, blobs, tree,
                                                                      tails)
            if digest == self._last_digest and not force:
                tmp.unlink(missing_ok=True)
                self.skipped += 1
                log.debug("%s catalog snapshot skipped: nothing changed since seq %s", reason, self._seq)
                return None
            seq = await trio.to_thread.run_sync(self._next_seq)
            crc, size = await trio.to_thread.run_sync(self._finish_db, tmp, seq, rows, tree, started, reason, tails,
                                                      links)
            flight.name(keys)  # the blobs too (uploaded by this snapshot: no other delete can take them)
            flight.publish(seq)  # before its pointer can go up: a failed publish stays held until the next prune
            ptr = Pointer(seq=seq, key=snapshot_key(self.sid, seq), time=started, crc32c=crc, size=size,
                          store_id=self.sid, chunk_bytes=self.eng.chunk, block_bytes=self.eng.block,
                          writer=f"{os.uname().nodename}:{self.eng.hot}")
            await trio.to_thread.run_sync(self._publish, tmp, ptr, limiter=self.eng.limiter)
            self._seq = seq
            self._last_digest = digest
            self.puts += counters[0] + 2
            self.put_bytes += counters[1] + size + len(ptr.encode())
            self.taken += 1
            self.last = {"seq": seq, "time": started, "key": ptr.key, "reason": reason, "files": len(rows) + len(tails),
                         "tails": len(tails),
                         "bytes": size, "blobs_uploaded": counters[0], "blob_bytes_uploaded": counters[1],
                         "seconds": round(time.monotonic() - t0, 3)}
            log.info("catalog snapshot %d (%s): %d files, %d new blobs (%d bytes), %.2f s", seq, reason, len(rows),
                     counters[0], counters[1], time.monotonic() - t0)
            try:
                await trio.to_thread.run_sync(self._prune_and_gc, limiter=self.eng.limiter)
            except (ObjectStoreError, OSError, sqlite3.Error) as e:
                log.warning("pruning old catalog snapshots failed (%s); will try again next time", e)
            return self.last

    def _backup(self, tmp: Path) -> None:
        """A consistent copy of catalog.db (its own read connection; WAL lets the engine keep writing)."""
        tmp.unlink(missing_ok=True)
        src = sqlite3.connect(str(self.eng.state_dir / "catalog.db"))
        try:
            dst = sqlite3.connect(str(tmp))
            try:
                src.backup(dst)
            finally:
                dst.close()
        finally:
            src.close()

    def _entry_at(self, rel: str, st: os.stat_result) -> Entry | None:
        """The engine's entry of the file the walk found at `rel`, by its inode (a hard link's other name is the
        same file: its punched bytes must never be read as a blob of zeros)."""
        e = self.eng.by_ino.get(st.st_ino)
        return e if e is not None else self.eng.entries.get(rel)

    def walk(self) -> tuple[list[tuple], dict[str, os.stat_result]]:
        """(directories and symlinks as snapshot_tree rows, regular files with their lstat) of the hot dir."""
        tree: list[tuple] = []
        files: dict[str, os.stat_result] = {}
        stack = [""]
        while stack:
            d = stack.pop()
            try:
                it = os.scandir(self.eng.hot / d if d else self.eng.hot)
            except (FileNotFoundError, NotADirectoryError):
                continue
            with it:
                for ent in it:
                    rel = f"{d}/{ent.name}" if d else ent.name
                    if not d and Path(ent.path) == self.eng.state_dir:
                        continue
                    try:
                        rel.encode()
                        st = ent.stat(follow_symlinks=False)
                        if stat.S_ISDIR(st.st_mode):
                            tree.append((rel, "d", stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, st.st_mtime_ns,
                                         None))
                            stack.append(rel)
                        elif stat.S_ISLNK(st.st_mode):
                            tree.append((rel, "l", stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, st.st_mtime_ns,
                                         os.readlink(ent.path)))
                        elif stat.S_ISREG(st.st_mode):
                            files[rel] = st
                    except FileNotFoundError:
                        continue
                    except UnicodeEncodeError:
                        log.warning("snapshot: skipping %r (not UTF-8)", rel)
        return tree, files

    def _blob_files(self, rels: list[str], counters: list[int], frozen: dict[str, bytes]
                    ) -> dict[str, tuple | None]:
        if self._known is None:
            pre = blob_prefix(self.sid)
            self._known = {i.key[len(pre):] for i in self.store.list(pre)}
        workers = max(1, min(8, int(self.eng.config["objectstore.max_concurrency"]), _UPLOAD_MEMORY // self.eng.chunk))
        if workers == 1 or len(rels) < 2:
            return {rel: self._blob_file(rel, counters, frozen.get(rel)) for rel in rels}
        with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="snapshot") as pool:
            return dict(zip(rels, pool.map(lambda rel: self._blob_file(rel, counters, frozen.get(rel)), rels)))

    def _blob_file(self, rel: str, counters: list[int], content: bytes | None = None) -> tuple | None:
        """Cut one file into chunks, upload the new ones, and return its snapshot row (None: it is gone).
        With `content`, that is the file's content (read earlier), not what the hot dir holds now."""
        assert self._known is not None
        try:
            fd = os.open(self.eng.hot / rel, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            if e.errno in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):
                return None
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return None
            ident = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
            c = self._files.get(rel)
            # reuse only if unchanged *and* last changed well before we read it (timestamps are coarse; ctime,
            # unlike mtime, always moves to "now" on a write)
            if content is None and c is not None and c.ident == ident and st.st_ctime < c.read_at - 1.0 \
                    and all(s in self._known for s in c.shas):
                return c.row
            read_at = time.time()
            chunk, block = self.eng.chunk, self.eng.block
            crc, block_crcs, shas, size = 0, [], [], 0
            length = st.st_size if content is None else len(content)
            for off in range(0, length, chunk):
                n = min(chunk, length - off)
                if content is not None:
                    data = content[off:off + n]
                    sha = hashlib.sha256(data).hexdigest()
                elif _is_hole(fd, off, n):
                    sha, data = self._zeros(n)
                else:
                    data = os.pread(fd, n, off)
                    sha = hashlib.sha256(data).hexdigest()
                if not data:
                    break  # truncated while we read: the row says what we read
                with self._mutex:
                    new = sha not in self._known
                if new:  # two threads may put the same new chunk at once: same key, same bytes, harmless
                    self.store.put(blob_key(self.sid, sha), data, metadata={"crc32c": f"{crc32c.crc32c(data):08x}"})
                    with self._mutex:
                        self._known.add(sha)
                        counters[0] += 1
                        counters[1] += len(data)
                crc = crc32c.crc32c(data, crc)
                mv = memoryview(data)
                block_crcs += [crc32c.crc32c(mv[b:b + block]) for b in range(0, len(data), block)]
                shas.append(sha)
                size += len(data)
                if len(data) < n:
                    break
            e = Entry(path=rel, kind=classify(rel).value, size=size, mtime_ns=st.st_mtime_ns, state=State.TIERED,
                      generation=0, format="raw", chunk_bytes=chunk, block_bytes=block, crc32c=crc,
                      block_crcs=block_crcs, objects=[blob_key(self.sid, s) for s in shas], state_since=0.0)
            row = _file_row(e, st)
            if content is None:
                self._files[rel] = _Cached(ident, read_at, row, shas)
            return row
        finally:
            os.close(fd)

    def _zeros(self, n: int) -> tuple[str, bytes]:
        with self._mutex:
            z = self._zero.get(n)
        if z is None:
            data = bytes(n)
            z = (hashlib.sha256(data).hexdigest(), data)
            with self._mutex:
                self._zero[n] = z
        return z

    def _next_seq(self) -> int:
        if self._seq is None:
            seqs = [int(m.group(1)) for i in self.store.list(meta_prefix(self.sid) + "catalog-")
                    if (m := _SEQ_RE.search(i.key))]
            try:
                seqs.append(read_pointer(self.store, self.sid).seq)
            except SnapshotError:
                pass
            self._seq = max(seqs, default=0)
        return self._seq + 1

    def _finish_db(self, tmp: Path, seq: int, rows: dict[str, tuple], tree: list[tuple], started: float,
                   reason: str, tails: dict[str, appendlog.TailRow] | None = None,
                   links: dict[str, str] | None = None) -> tuple[int, int]:
        """Add the reader's tables to the catalog copy; return (crc32c, size) of the finished file."""
        db = sqlite3.connect(str(tmp), isolation_level=None)
        try:
            db.execute("PRAGMA journal_mode=DELETE")  # one self-contained file
            db.executescript(SCHEMA + appendlog.TAILS_SCHEMA)
            cols = COLUMNS + _EXTRA_COLS
            db.execute("BEGIN")
            db.executemany(f"INSERT INTO snapshot_files ({','.join(cols)}) VALUES ({','.join('?' * len(cols))})",
                           list(rows.values()))
            db.executemany("INSERT INTO snapshot_tree VALUES (?, ?, ?, ?, ?, ?, ?)", tree)
            db.executemany("INSERT INTO snapshot_tails VALUES (?, ?, ?, ?, ?, ?, ?)",
                           [t.encode() for t in (tails or {}).values()])
            db.executemany("INSERT INTO snapshot_index_slots VALUES (?, ?)",
                           [(t.path, t.slots) for t in (tails or {}).values() if t.slots])
            db.executemany("INSERT INTO snapshot_links VALUES (?, ?)", sorted((links or {}).items()))
            info = {"format": FORMAT, "seq": seq, "time": started, "reason": reason, "store_id": self.sid,
                    "host": os.uname().nodename, "hot_dir": str(self.eng.hot)}
            db.executemany("INSERT INTO snapshot_info VALUES (?, ?)", [(k, json.dumps(v)) for k, v in info.items()])
            db.execute("COMMIT")
        finally:
            db.close()
        return crc32c_file(tmp), tmp.stat().st_size

    def _verify_lease(self) -> None:
        if self.eng.lease is not None:
            self.eng.lease.verify()  # a writer taken over meanwhile must never move the pointer back

    def _publish(self, tmp: Path, ptr: Pointer) -> None:
        self.store.put_file(ptr.key, tmp, crc32c=ptr.crc32c)
        failpoints.hit("snapshot.upload")
        self._verify_lease()
        self.store.put(pointer_key(self.sid), ptr.encode())
        tmp.unlink(missing_ok=True)

    def _prune_and_gc(self) -> None:
        """Keep the newest KEEP snapshots; delete blobs none of them uses once unused for delete.grace_seconds."""
        seqs = sorted(int(m.group(1)) for i in self.store.list(meta_prefix(self.sid) + "catalog-")
                      if (m := _SEQ_RE.search(i.key)))
        keep = seqs[-KEEP:]
        self._verify_lease()
        self.store.delete_many([snapshot_key(self.sid, s) for s in seqs[:-KEEP]])
        self.references.keep(keep, self._keys_of)
        if self._known is None:
            return
        pre = blob_prefix(self.sid)
        referenced = {k[len(pre):] for k in self.references.named(pre)}
        now = time.time()
        grace = float(self.eng.config["delete.grace_seconds"])
        for sha in referenced:
            self._unref_since.pop(sha, None)
        due = [sha for sha in self._known - referenced if now - self._unref_since.setdefault(sha, now) >= grace]
        if due:
            self.store.delete_many([blob_key(self.sid, s) for s in due])
            self._known.difference_update(due)
            for s in due:
                self._unref_since.pop(s, None)
            log.info("deleted %d snapshot blobs no kept snapshot uses", len(due))

    def _keys_of(self, seq: int) -> set[str]:
        """Every object a kept snapshot names (segment objects, their tables, blobs, tails): read its .db."""
        tmp = self.eng.state_dir / "snapshot.gc.db"
        tmp.write_bytes(self.store.get(snapshot_key(self.sid, seq)))
        try:
            db = sqlite3.connect(str(tmp))
            try:
                have = {r[1] for r in db.execute("PRAGMA table_info(snapshot_files)")}
                ref = "unit_ref" if "unit_ref" in have else "''"  # older snapshots have no table objects
                keys = {k for objs, unit_ref in db.execute(f"SELECT objects, {ref} FROM snapshot_files")
                        for k in _row_keys(objs, unit_ref)}
                return keys | {o.key for t in appendlog.load_tails(db, self.sid) for o in t.objects}
            finally:
                db.close()
        finally:
            tmp.unlink(missing_ok=True)


def _is_hole(fd: int, off: int, n: int) -> bool:
    """True when [off, off+n) of the file is one hole (reads as zeros without reading the disk)."""
    try:
        return os.lseek(fd, off, os.SEEK_DATA) >= off + n
    except OSError as e:
        return e.errno == errno.ENXIO  # no data at or after off


# ------------------------------------------------------------------------------------------ reader side


def _check_rel(rel: object, reserved: str) -> str:
    """A path from a snapshot row: relative, normalised, printable, never the state dir. Untrusted input."""
    if not isinstance(rel, str) or not rel or len(rel) > 4096:
        raise ValueError(f"path {rel!r} is empty or not text")
    if rel.startswith("/") or _CONTROL.search(rel):
        raise ValueError(f"path {rel!r} is absolute or has a control character")
    parts = rel.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"path {rel!r} has an empty, '.' or '..' segment")
    if parts[0] == reserved:
        raise ValueError(f"path {rel!r} is inside the reserved {reserved!r} directory")
    return rel


def _check_entry(e: Entry, store_id: str) -> None:
    if e.state is not State.TIERED or e.format not in ("raw", "lz4c"):
        raise ValueError(f"state {e.state.value!r} / format {e.format!r}; expected tiered, raw or lz4c")
    if not (isinstance(e.size, int) and e.size >= 0 and isinstance(e.mtime_ns, int)):
        raise ValueError(f"size {e.size!r} or mtime {e.mtime_ns!r} is not a valid integer")
    if not (isinstance(e.block_bytes, int) and isinstance(e.chunk_bytes, int) and e.block_bytes >= 512
            and e.chunk_bytes >= e.block_bytes and e.chunk_bytes % e.block_bytes == 0):
        raise ValueError(f"chunk/block sizes {e.chunk_bytes!r}/{e.block_bytes!r} are not valid")
    if len(e.block_crcs) != e.nblocks or not all(isinstance(c, int) and 0 <= c < 1 << 32 for c in e.block_crcs):
        raise ValueError(f"{len(e.block_crcs)} block crc32c values for {e.nblocks} blocks")
    check_units(e)
    want = 1 if e.format == "lz4c" else -(-e.size // e.chunk_bytes)
    if (len(e.objects) > 1) if e.size == 0 else (len(e.objects) != want):
        raise ValueError(f"{len(e.objects)} objects, expected {want}")
    for k in e.objects:
        validate_key(k)
        if not k.startswith(f"{store_id}/"):
            raise ValueError(f"object key {k!r} is outside store id {store_id!r}")


def load_snapshot(db_path: Path, store_id: str, reserved: str
                  ) -> tuple[list[tuple[Entry, int, int, int]], list[tuple]]:
    """(files, tree) of a downloaded snapshot, every row validated; SnapshotError names the bad row."""
    db = sqlite3.connect(f"file:{urllib.parse.quote(str(db_path))}?mode=ro", uri=True)
    try:
        try:
            have = {r[1] for r in db.execute("PRAGMA table_info(snapshot_files)")}
            # snapshots written before file ids existed lack the identity columns: 0 (unassigned) for those
            # ... and those written before finer verification tables lack those: none (whole blocks are fetched)
            # ... and those written before table objects lack the reference: the table inline, or none
            absent = {"file_id": "0", "ino": "0", "unit_bytes": "0", "unit_crcs": "x''", "unit_ref": "''"}
            cols = [c if c in have or c not in absent else absent[c] for c in COLUMNS + _EXTRA_COLS]
            frows = db.execute(f"SELECT {','.join(cols)} FROM snapshot_files").fetchall()
            trows = db.execute("SELECT path, type, mode, uid, gid, mtime_ns, target FROM snapshot_tree").fetchall()
        except sqlite3.Error as e:
            raise SnapshotError(f"snapshot {db_path.name} has no readable snapshot tables ({e})") from None
    finally:
        db.close()
    files = []
    seen: set[str] = set()
    for r in frows:
        try:
            _check_rel(r[0], reserved)
            e = row_to_entry(r[:len(COLUMNS)])
            _check_entry(e, store_id)
            mode, uid, gid = (int(x) for x in r[len(COLUMNS):])
        except (ValueError, TypeError, KeyError) as err:
            raise SnapshotError(f"snapshot {db_path.name}: file row {r[0]!r} is invalid: {err}") from None
        seen.add(e.path)
        files.append((e, mode, uid, gid))
    tree = []
    for path, typ, mode, uid, gid, mtime_ns, target in trows:
        try:
            _check_rel(path, reserved)
            if path in seen or typ not in ("d", "l") or (typ == "l" and (not isinstance(target, str) or not target
                                                                           or "\0" in target)):
                raise ValueError("duplicate path, unknown type or bad symlink target")
            tree.append((path, typ, int(mode), int(uid), int(gid), int(mtime_ns), target))
        except (ValueError, TypeError) as err:
            raise SnapshotError(f"snapshot {db_path.name}: tree row {path!r} is invalid: {err}") from None
        seen.add(path)
    return files, tree


def load_tails(db_path: Path, store_id: str, reserved: str, seen: set[str]) -> list[appendlog.TailRow]:
    """The active files of a snapshot (append objects), validated like every other row."""
    db = sqlite3.connect(f"file:{urllib.parse.quote(str(db_path))}?mode=ro", uri=True)
    try:
        tails = appendlog.load_tails(db, store_id)
        for t in tails:
            _check_rel(t.path, reserved)
            if t.path in seen:
                raise ValueError(f"path {t.path!r} is both a tail and another row")
            seen.add(t.path)
    except (ValueError, sqlite3.Error) as e:
        raise SnapshotError(f"snapshot {db_path.name}: {e}") from None
    finally:
        db.close()
    return tails


def tail_stub(t: appendlog.TailRow) -> tuple[Entry, int, int, int]:
    """A tail as build_tree takes files: a sparse file of its size, mode and owner."""
    e = Entry(path=t.path, kind=classify(t.path).value, size=t.size, mtime_ns=t.mtime_ns, state=State.HOT)
    return e, t.mode, t.uid, t.gid


def wipe_local(hot: Path, state: Path) -> None:
    """Empty a read-only cache of an older snapshot (never follows symlinks; keeps lock, pid, log, marker)."""
    for ent in os.scandir(hot):
        p = Path(ent.path)
        if p == state:
            continue
        if ent.is_dir(follow_symlinks=False):
            shutil.rmtree(p)
        else:
            p.unlink()
    for name in ("catalog.db", "catalog.db-wal", "catalog.db-shm", "snapshot.db"):
        (state / name).unlink(missing_ok=True)


def load_links(db_path: Path, names: set[str]) -> dict[str, str]:
    """The hard links of a snapshot ({further name: the name its content comes by}), validated: both names are
    files of the snapshot, and a content name is never itself a further name. {} for a point that predates them."""
    db = sqlite3.connect(f"file:{urllib.parse.quote(str(db_path))}?mode=ro", uri=True)
    try:
        if not db.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='snapshot_links'").fetchone():
            return {}
        rows = db.execute("SELECT path, target FROM snapshot_links").fetchall()
    except sqlite3.Error as e:
        raise SnapshotError(f"snapshot {db_path.name} has no readable snapshot_links table ({e})") from None
    finally:
        db.close()
    links = dict(rows)
    for path, target in rows:
        if path not in names or target not in names or target in links:
            raise SnapshotError(f"snapshot {db_path.name}: link row {path!r} -> {target!r} is invalid: not two "
                                f"files of the snapshot, or the target is itself a link")
    return links


def build_tree(hot: Path, files: list[tuple[Entry, int, int, int]], tree: list[tuple],
               hard_links: dict[str, str] | None = None) -> None:
    """Directories, then sparse files (true size, mode, owner, mtime; no data), then the further names of files
    with several (`load_links`: link(2), one inode as on the writer), then symlinks, then directory attributes.
    Parents must be directories of the snapshot (implied ones are made): no path ever passes through a symlink,
    whatever the snapshot says."""
    root = os.geteuid() == 0
    dirs = {p: (mode, uid, gid, mt) for p, typ, mode, uid, gid, mt, _ in tree if typ == "d"}
    symlinks = {p: (target, uid, gid, mt) for p, typ, _, uid, gid, mt, target in tree if typ == "l"}
    leaves = {e.path for e, *_ in files} | set(symlinks)
    for p in [*leaves, *list(dirs)]:
        parent = p.rpartition("/")[0]
        while parent:
            if parent in leaves:
                raise SnapshotError(f"snapshot path {p!r} lies below {parent!r}, which is not a directory")
            dirs.setdefault(parent, (0o755, os.geteuid(), os.getegid(), time.time_ns()))
            parent = parent.rpartition("/")[0]
    for p in sorted(dirs, key=lambda p: p.count("/")):
        os.mkdir(hot / p, 0o700)
    hard_links = hard_links or {}
    for e, mode, uid, gid in files:
        if e.path in hard_links:
            continue
        fd = os.open(hot / e.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, e.size)
            # no setuid/setgid bits from a bucket; a non-root daemon needs to write fetched blocks into its cache
            os.fchmod(fd, (mode & 0o777) | (0 if root else 0o600))
            if root:
                os.fchown(fd, uid, gid)
            os.utime(fd, ns=(e.mtime_ns, e.mtime_ns))
        finally:
            os.close(fd)
    for p, target in hard_links.items():
        os.link(hot / target, hot / p, follow_symlinks=False)
    for p, (target, uid, gid, mt) in symlinks.items():
        os.symlink(target, hot / p)
        if root:
            os.lchown(hot / p, uid, gid)
        os.utime(hot / p, ns=(mt, mt), follow_symlinks=False)
    for p in sorted(dirs, key=lambda p: -p.count("/")):
        mode, uid, gid, mt = dirs[p]
        os.chmod(hot / p, (mode & 0o1777) | (0 if root else 0o700))
        if root:
            os.lchown(hot / p, uid, gid)
        os.utime(hot / p, ns=(mt, mt), follow_symlinks=False)


def prepare_readonly(store: ObjectStore, store_id: str, hot: Path, state: Path) -> dict:
    """Make HOT (a read-only cache dir) and STATE/catalog.db present the newest snapshot of `store_id`.

    Reuses the cache (and what it has fetched) when it already holds that snapshot; rebuilds it for a newer one.
    Blocking. SnapshotError says what is missing or wrong."""
    ptr = read_pointer(store, store_id)
    marker = state / MARKER
    try:
        old = json.loads(marker.read_text())
    except (FileNotFoundError, ValueError):
        old = None
    if old is not None and old.get("store") == store.url and old.get("store_id") == store_id \
            and old.get("seq") == ptr.seq and (state / "catalog.db").exists():
        log.info("read-only cache %s already holds snapshot %d; reusing it", hot, ptr.seq)
        return {"seq": ptr.seq, "time": ptr.time, "key": ptr.key, "writer": ptr.writer, "store": store.url,
                "files": old.get("files"), "reused": True}
    if old is None and any(Path(p.path) != state for p in os.scandir(hot)):
        raise SnapshotError(f"cache dir {hot.parent} is not empty and is not a tierfs read-only cache; "
                            f"use an empty directory (--cache-dir)")
    # ours from here on, so a build that stops halfway (crash, bad snapshot) is wiped next time, not refused
    marker.write_text(json.dumps({"store": store.url, "store_id": store_id, "seq": None}) + "\n")
    wipe_local(hot, state)
    for attempt in range(3):
        try:
            data = store.get(ptr.key)
            break
        except ObjectNotFound:  # pruned by the writer since we read the pointer: read the pointer again
            if attempt == 2:
                raise SnapshotError(f"catalog snapshot {ptr.key} kept disappearing after its pointer was read")
            ptr = read_pointer(store, store_id)
        except ObjectStoreError as e:
            raise SnapshotError(f"cannot download catalog snapshot {ptr.seq}: {e}") from None
    info = {"seq": ptr.seq, "time": ptr.time, "key": ptr.key, "writer": ptr.writer, "store": store.url}
    if len(data) != ptr.size or crc32c.crc32c(data) != ptr.crc32c:
        raise SnapshotError(f"catalog snapshot {store.url}/{ptr.key} is corrupt: {len(data)} bytes with crc32c "
                            f"{crc32c.crc32c(data):08x}, the pointer says {ptr.size} bytes with {ptr.crc32c:08x}")
    snap = state / "snapshot.db"
    snap.write_bytes(data)
    files, tree = load_snapshot(snap, store_id, state.name)
    tails = load_tails(snap, store_id, state.name, {e.path for e, *_ in files} | {t[0] for t in tree})
    build_tree(hot, files + [tail_stub(t) for t in tails], tree)
    try:  # active files are local in a read-only cache: the engine serves them as plain hot files
        for t in tails:
            appendlog.materialise(store, hot, t)
    except (ObjectStoreError, ValueError) as e:
        raise SnapshotError(f"snapshot {ptr.seq}: {e}") from None
    cat = Catalog(state / "catalog.db")
    try:
        now = time.time()
        # a reader's own ids (file_id 0: numbered by the catalog): the snapshot's are untrusted input, and a
        # snapshot of an earlier version may repeat one
        cat.put_many([dataclasses.replace(e, resident=bytearray((e.nblocks + 7) // 8), last_access=0.0,
                                          state_since=now, file_id=0) for e, *_ in files], [], 0.0)
    finally:
        cat.close()
    body = {"store": store.url, "store_id": store_id, "seq": ptr.seq, "time": ptr.time,
            "files": len(files) + len(tails)}
    marker.write_text(json.dumps(body) + "\n")
    log.info("read-only cache %s built from snapshot %d of %s/%s (%d files, taken %s by %s)", hot, ptr.seq, store.url,
             store_id, len(files), time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ptr.time)), ptr.writer)
    return {**info, "files": len(files) + len(tails), "reused": False}
