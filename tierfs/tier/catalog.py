"""The catalog: one SQLite row per segment that has entered the tiering lifecycle (DESIGN §5).

A row is keyed by its file id (never reused; it survives rename, hard links and directory renames, and travels
with the hot file: tierfs.tier.identity). The path is a derived attribute, for display, classification and object
key naming: only inserts and the namespace changes (`apply_namespace`) write it, so a row committed from a copy
made before a rename never puts the old name back. A segment with no row is plain HOT.

Rows are written in one transaction per state change with
synchronous=FULL, so after a crash the catalog says exactly what was durable: a TIERED row means the objects
were verified, and the local bytes may only be dropped after that commit. The resident bitmap follows one rule:
a block is marked non-resident *durably before* its bytes are punched out of the hot file, and marked resident
lazily after its bytes are written, so a crash can only make us fetch a block again, never serve a hole.

Blocking calls: the engine calls these methods through one worker thread (see Engine._db).
"""

from __future__ import annotations

import contextlib
import enum
import functools
import json
import re
import sqlite3
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from tierfs.tier import layout, units
from tierfs.tier.spacereserve import SpaceReserve


class State(str, enum.Enum):
    HOT = "hot"
    SEALED = "sealed"
    UPLOADING = "uploading"
    TIERED = "tiered"


@dataclass
class Entry:
    """What the catalog knows about one segment. `resident` is a bytearray bitmap of blocks present locally."""

    path: str
    kind: str
    size: int
    mtime_ns: int
    state: State
    generation: int = 0
    format: str = "raw"
    chunk_bytes: int = 0
    block_bytes: int = 0
    crc32c: int | None = None
    block_crcs: list[int] = field(default_factory=list)
    objects: list[str] = field(default_factory=list)
    resident: bytearray = field(default_factory=bytearray)
    last_access: float = 0.0
    state_since: float = 0.0
    file_id: int = 0  # from the catalog sequence: never reused, survives rename (0: not assigned yet)
    ino: int = 0  # the hot file's st_ino when the row was written: reconcile re-checks it
    # a raw segment's finer verification table: crc32c of every `unit_bytes` piece (packed little-endian uint32),
    # so a random read fetches and checks only the pieces it needs; 0/empty: none (whole blocks are fetched)
    unit_bytes: int = 0
    unit_crcs: bytes = b""
    # ... or, instead of the table inline, a reference to it as one object next to the segment's chunks
    # (tierfs.tier.units: "crc32c hex:size:key"), loaded lazily by readers; "": none
    unit_ref: str = ""
    pins: int = field(default=0, compare=False)  # in memory only: rematerialise/fetch in progress, never evict

    @property
    def nblocks(self) -> int:
        return -(-self.size // self.block_bytes) if self.block_bytes else 0

    def is_resident(self, block: int) -> bool:
        return bool(self.resident[block >> 3] & (1 << (block & 7)))

    def set_resident(self, block: int, yes: bool) -> None:
        if yes:
            self.resident[block >> 3] |= 1 << (block & 7)
        else:
            self.resident[block >> 3] &= ~(1 << (block & 7)) & 0xFF

    def block_len(self, block: int) -> int:
        return min(self.block_bytes, self.size - block * self.block_bytes)

    def copy(self, **changes) -> Entry:
        """A detached copy to commit (its own bitmap, no pins): memory changes only after the commit, so the
        row written is never the live entry, which readers, fetches and the evictor keep changing meanwhile."""
        changes.setdefault("resident", bytearray(self.resident))
        return replace(self, pins=0, **changes)

    def all_objects(self) -> list[str]:
        """Every object of this generation: its chunks (or lz4c object) and its verification table object, if
        any. What goes when the row goes (deletes, rewrites, compaction, fsck's orphan check)."""
        key = units.ref_key(self.unit_ref)
        return self.objects + [key] if key else self.objects

    def resident_bytes(self) -> int:
        """Bytes present locally: a popcount of the bitmap, not a per-block loop (status and metrics walk every
        row, and a 1 GiB CommitLog has 1024 blocks)."""
        if self.state is not State.TIERED:
            return self.size
        nb = self.nblocks
        if not nb:
            return 0
        bits = int.from_bytes(self.resident, "little") & ((1 << nb) - 1)  # bits past the last block are padding
        n = bits.bit_count() * self.block_bytes
        if bits >> (nb - 1) & 1:
            n -= nb * self.block_bytes - self.size  # the last block is short
        return n


_FILES_TABLE = """
CREATE TABLE IF NOT EXISTS files (
    file_id INTEGER PRIMARY KEY,
    path TEXT NOT NULL,
    kind TEXT NOT NULL,
    size INTEGER NOT NULL,
    mtime_ns INTEGER NOT NULL,
    state TEXT NOT NULL,
    generation INTEGER NOT NULL,
    format TEXT NOT NULL,
    chunk_bytes INTEGER NOT NULL,
    block_bytes INTEGER NOT NULL,
    crc32c INTEGER,
    block_crcs TEXT NOT NULL,
    objects TEXT NOT NULL,
    resident BLOB NOT NULL,
    last_access REAL NOT NULL,
    state_since REAL NOT NULL,
    ino INTEGER NOT NULL DEFAULT 0,
    unit_bytes INTEGER NOT NULL DEFAULT 0,
    unit_crcs BLOB NOT NULL DEFAULT x'',
    unit_ref TEXT NOT NULL DEFAULT ''
)"""
# by path (display, renames), and by generation: the reference authority finds a row naming a segment key by the
# generation every such key carries
_FILES_INDEX = ("CREATE INDEX IF NOT EXISTS files_path ON files (path);"
                "CREATE INDEX IF NOT EXISTS files_generation ON files (generation)")
_SCHEMA = _FILES_TABLE + """;
CREATE TABLE IF NOT EXISTS pending_deletes (
    key TEXT PRIMARY KEY,
    not_before REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS object_refs (
    key TEXT NOT NULL,
    holder TEXT NOT NULL,
    PRIMARY KEY (key, holder)
);
CREATE INDEX IF NOT EXISTS object_refs_holder ON object_refs (holder);
CREATE TABLE IF NOT EXISTS cas_refs (
    key TEXT NOT NULL,
    file_id INTEGER NOT NULL,
    PRIMARY KEY (key, file_id)
);
CREATE INDEX IF NOT EXISTS cas_refs_file ON cas_refs (file_id);
CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS artifacts (
    path TEXT NOT NULL,
    kind TEXT NOT NULL,
    generation INTEGER NOT NULL,
    keys TEXT NOT NULL,
    info TEXT NOT NULL,
    created REAL NOT NULL,
    PRIMARY KEY (path, kind)
);
CREATE TABLE IF NOT EXISTS tail_offsets (
    path TEXT PRIMARY KEY,
    ino INTEGER NOT NULL,
    committed INTEGER NOT NULL,
    slots INTEGER NOT NULL,
    objects TEXT NOT NULL
);
"""


@dataclass
class Artifact:
    """Something the pipeline derived from one generation of a segment: a .cidx sidecar or its archive files.
    `info` holds what readers need without a GET (e.g. a sidecar's time range)."""

    path: str
    kind: str  # cidx | archive
    generation: int
    keys: list[str]
    info: dict
    created: float = 0.0

_COLS = ("path", "kind", "size", "mtime_ns", "state", "generation", "format", "chunk_bytes", "block_bytes",
         "crc32c", "block_crcs", "objects", "resident", "last_access", "state_since", "file_id", "ino",
         "unit_bytes", "unit_crcs", "unit_ref")
# Insert a row, or update every column of an existing one but its path: a row's path has one writer (inserts and
# apply_namespace), so a copy made before a rename and committed after it never puts the old name back.
_UPSERT = (f"INSERT INTO files ({','.join(_COLS)}) VALUES ({','.join('?' * len(_COLS))}) ON CONFLICT(file_id) DO "
           f"UPDATE SET {', '.join(f'{c}=excluded.{c}' for c in _COLS if c not in ('path', 'file_id'))}")
_KEY_GENERATION = re.compile(r"/(\d+)\.(?:raw|lz4c|cidx)(?:/|$)")  # the generation in a segment/sidecar key
# The not-before a namespace change gives the objects of an unlinked file that a process still holds open: they
# are queued, and held by a `held:<file id>` reference until its last close (schedule_deletes) or the next mount.
NEVER = 1e18
HELD = "held:"  # object_refs holder of an unlinked file still open, followed by its file id

def _retry_when_full(method: Callable) -> Callable:
    """A write that finds the disk full (SQLITE_FULL; the transaction is rolled back) is run again after some of
    the catalog's space reserve is given back (tierfs.tier.spacereserve), while there is some to give: the
    methods are pure database work, so running one again is running it once."""

    @functools.wraps(method)
    def run(self: Catalog, *args, **kwargs):
        while True:
            try:
                out = method(self, *args, **kwargs)
                break
            except sqlite3.OperationalError as e:
                if getattr(e, "sqlite_errorname", "") != "SQLITE_FULL" or self.reserve is None \
                        or not self.reserve.release():
                    raise
        if self.reserve is not None:
            self.reserve.maybe_rearm()
        return out

    return run


class Catalog:
    def __init__(self, path: Path, reserve: SpaceReserve | None = None):
        """`reserve`: space a commit on a full disk may have (writable mounts); None for tools and views."""
        self.path = path
        self.reserve = reserve
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)
        self._migrate()
        self._db.executescript(_FILES_INDEX)

    def _migrate(self) -> None:
        """Bring a catalog of an earlier version up to this one, in one transaction: rows get file ids (a
        duplicate id, which a version keyed by path could hold, gets a new one), the table is keyed by file id,
        and the id/generation sequence starts above every generation any row, queued delete or artifact names,
        so no new object key can equal an old one (keys carry the generation)."""
        info = list(self._db.execute("PRAGMA table_info(files)"))
        have = {r[1] for r in info}
        keyed_by_path = not any(r[1] == "file_id" and r[5] for r in info)  # an earlier version's table
        with self._transaction() as db:
            for col in ("file_id", "ino", "unit_bytes"):
                if col not in have:
                    db.execute(f"ALTER TABLE files ADD COLUMN {col} INTEGER NOT NULL DEFAULT 0")
            if "unit_crcs" not in have:
                db.execute("ALTER TABLE files ADD COLUMN unit_crcs BLOB NOT NULL DEFAULT x''")
            if "unit_ref" not in have:
                db.execute("ALTER TABLE files ADD COLUMN unit_ref TEXT NOT NULL DEFAULT ''")
            top = max(db.execute("SELECT coalesce(max(generation), 0), coalesce(max(file_id), 0) FROM files")
                      .fetchone())
            top = max(top, db.execute("SELECT coalesce(max(generation), 0) FROM artifacts").fetchone()[0])
            r = db.execute("SELECT v FROM meta WHERE k='next_id'").fetchone()
            if r is None:  # first mount of this version: queued deletes may name generations of deleted rows
                for (key,) in db.execute("SELECT key FROM pending_deletes"):
                    m = _KEY_GENERATION.search(key)
                    if m:
                        top = max(top, int(m.group(1)))
            nxt = max(int(r[0]) if r else 1, top + 1)
            if keyed_by_path:
                seen: set[int] = set()
                renumber: list[str] = []
                for p, fid in db.execute("SELECT path, file_id FROM files ORDER BY file_id, path"):
                    if not fid or fid in seen:
                        renumber.append(p)
                    seen.add(fid)
                db.executemany("UPDATE files SET file_id=? WHERE path=?",
                               [(nxt + i, p) for i, p in enumerate(renumber)])
                nxt += len(renumber)
                cols = ",".join(_COLS)
                db.execute("ALTER TABLE files RENAME TO files_by_path")
                db.execute(_FILES_TABLE)
                db.execute(f"INSERT INTO files ({cols}) SELECT {cols} FROM files_by_path")
                db.execute("DROP TABLE files_by_path")
                for stmt in _FILES_INDEX.split(";"):
                    db.execute(stmt)
            db.execute("INSERT OR REPLACE INTO meta VALUES ('next_id', ?)", (str(nxt),))
            if db.execute("SELECT v FROM meta WHERE k='cas_refs'").fetchone() is None:  # a version before it
                for fid, objs, unit_ref in db.execute("SELECT file_id, objects, unit_ref FROM files "
                                                      "WHERE objects LIKE '%/cas/%'").fetchall():
                    self._name_cas_locked(db, fid, json.loads(objs) + [units.ref_key(unit_ref or "")])
                db.execute("INSERT INTO meta VALUES ('cas_refs', '1')")

    @_retry_when_full
    def allocate(self, n: int = 1) -> int:
        """The first of n new numbers from the store's one sequence (file ids and generations alike): durable
        before any is used, and never handed out again, so two files can never share an object key."""
        with self._transaction() as db:
            first = int(db.execute("SELECT v FROM meta WHERE k='next_id'").fetchone()[0])
            db.execute("UPDATE meta SET v=? WHERE k='next_id'", (str(first + n),))
        return first

    def get_meta(self, k: str) -> str | None:
        with self._lock:
            r = self._db.execute("SELECT v FROM meta WHERE k=?", (k,)).fetchone()
        return r[0] if r else None

    @_retry_when_full
    def set_meta(self, k: str, v: str) -> None:
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (k, v))

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- rows

    def load_all(self) -> list[Entry]:
        with self._lock:
            rows = self._db.execute(f"SELECT {','.join(_COLS)} FROM files").fetchall()
        return [self._entry(r) for r in rows]

    @staticmethod
    def _entry(r: tuple) -> Entry:
        d = dict(zip(_COLS, r))
        return Entry(path=d["path"], kind=d["kind"], size=d["size"], mtime_ns=d["mtime_ns"], state=State(d["state"]),
                     generation=d["generation"], format=d["format"], chunk_bytes=d["chunk_bytes"],
                     block_bytes=d["block_bytes"], crc32c=d["crc32c"], block_crcs=json.loads(d["block_crcs"]),
                     objects=json.loads(d["objects"]), resident=bytearray(d["resident"]),
                     last_access=d["last_access"], state_since=d["state_since"], file_id=d["file_id"],
                     ino=d["ino"], unit_bytes=d["unit_bytes"] or 0, unit_crcs=bytes(d["unit_crcs"] or b""),
                     unit_ref=d["unit_ref"] or "")

    @staticmethod
    def _row(e: Entry) -> tuple:
        return (e.path, e.kind, e.size, e.mtime_ns, e.state.value, e.generation, e.format, e.chunk_bytes,
                e.block_bytes, e.crc32c, json.dumps(e.block_crcs), json.dumps(e.objects), bytes(e.resident),
                e.last_access, e.state_since, e.file_id, e.ino, e.unit_bytes, e.unit_crcs, e.unit_ref)

    def put(self, e: Entry) -> None:
        """Insert or update a row, durably (one transaction)."""
        self.put_many([e], [], 0.0)

    @_retry_when_full
    def save_residency(self, entries: list[Entry]) -> None:
        """Persist resident bitmaps and access times of several entries in one transaction."""
        with self._transaction() as db:
            db.executemany("UPDATE files SET resident=?, last_access=? WHERE file_id=?",
                           [(bytes(e.resident), e.last_access, e.file_id) for e in entries])

    @contextlib.contextmanager
    def _transaction(self):
        """One durable transaction under the lock: all of it commits, or none of it."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
                self._db.execute("COMMIT")
            except BaseException:
                if self._db.in_transaction:  # SQLITE_FULL and others roll back by themselves
                    self._db.execute("ROLLBACK")
                raise

    @_retry_when_full
    def save_tails(self, rows: list[tuple[str, int, int, int, str]]) -> None:
        """The append objects of every active segment (tierfs.tier.appendlog), all in one transaction, once they
        are durable: (path, hot-dir inode, committed offset, IndexFile hash slots, objects as JSON). A restart
        resumes from them instead of uploading every active file again."""
        with self._transaction() as db:
            db.execute("DELETE FROM tail_offsets")
            db.executemany("INSERT INTO tail_offsets VALUES (?, ?, ?, ?, ?)", rows)

    def load_tails(self) -> list[tuple[str, int, int, int, str]]:
        with self._lock:
            return self._db.execute("SELECT path, ino, committed, slots, objects FROM tail_offsets").fetchall()

    def _queue_locked(self, keys: list[str], not_before: float) -> None:
        self._db.executemany("INSERT OR REPLACE INTO pending_deletes VALUES (?, ?)", [(k, not_before) for k in keys])

    @_retry_when_full
    def remove(self, e: Entry, delete_keys: list[str], not_before: float, artifacts: tuple[str, ...] = ()) -> None:
        """Drop `e`'s row (and its artifacts of these kinds) and queue their objects for deletion, atomically."""
        with self._transaction() as db:
            self._remove_locked(db, e.file_id, e.path, delete_keys, not_before, artifacts)

    # Every row write goes through these two, so the content-addressed keys a row names (cas_refs: key -> rows,
    # which claim_deletes consults) change in the same transaction as the row.

    def _put_row_locked(self, db: sqlite3.Connection, e: Entry) -> None:
        db.execute(_UPSERT, self._row(e))
        self._name_cas_locked(db, e.file_id, e.all_objects())

    @staticmethod
    def _name_cas_locked(db: sqlite3.Connection, file_id: int, keys: list[str]) -> None:
        db.execute("DELETE FROM cas_refs WHERE file_id=?", (file_id,))
        db.executemany("INSERT OR IGNORE INTO cas_refs VALUES (?, ?)",
                       [(k, file_id) for k in keys if layout.is_cas(k)])

    @staticmethod
    def _drop_rows_locked(db: sqlite3.Connection, file_ids: list[int]) -> None:
        db.executemany("DELETE FROM files WHERE file_id=?", [(i,) for i in file_ids])
        db.executemany("DELETE FROM cas_refs WHERE file_id=?", [(i,) for i in file_ids])

    def _remove_locked(self, db: sqlite3.Connection, file_id: int, path: str, delete_keys: list[str],
                       not_before: float, artifacts: tuple[str, ...]) -> None:
        self._drop_rows_locked(db, [file_id])
        keys = list(delete_keys) + self._drop_artifacts_locked(path, artifacts)
        if not_before >= NEVER:  # still open: queued, and held until its last close
            db.executemany("INSERT OR IGNORE INTO object_refs VALUES (?, ?)", [(k, f"{HELD}{file_id}") for k in keys])
            not_before = 0.0
        self._queue_locked(keys, not_before)

    @_retry_when_full
    def replace(self, e: Entry, delete_keys: list[str], not_before: float, artifacts: tuple[str, ...] = ()) -> None:
        """Rewrite a row (e.g. TIERED -> HOT at a new generation) and queue the objects it no longer uses and
        its artifacts of these kinds for deletion: one transaction, so a crash leaks nothing."""
        with self._transaction() as db:
            self._put_row_locked(db, e)
            self._queue_locked(list(delete_keys) + self._drop_artifacts_locked(e.path, artifacts), not_before)

    @_retry_when_full
    def apply_namespace(self, moves: list[tuple[int, str]], removes: list[tuple[int, str, list[str], float]],
                        renamed: list[tuple[str, str]]) -> None:
        """One namespace change (tierfs.tier.namespace) in one transaction: rows that go, with their objects
        queued (file id, path, keys, not before) and their sidecars too; rows that get a new path (file id,
        path); and pipeline artifacts that follow a rename (old, new: a file's path, or a directory's, which
        moves everything below it; every pair is applied at once, so an exchange swaps them)."""
        with self._transaction() as db:
            for file_id, path, keys, not_before in removes:
                self._remove_locked(db, file_id, path, keys, not_before, ("cidx",))
            db.executemany("UPDATE files SET path=? WHERE file_id=?", [(p, fid) for fid, p in moves])
            move = "UPDATE artifacts SET path=? || substr(path, ?) WHERE path=? OR substr(path, 1, ?)=?"
            for i, (old, _) in enumerate(renamed):  # every source aside first: an exchange's targets are sources
                db.execute(move, (f"\0rename{i}", len(old) + 1, old, len(old) + 1, old + "/"))
            for i, (_, new) in enumerate(renamed):
                tmp = f"\0rename{i}"  # no real path holds a NUL
                db.execute("DELETE FROM artifacts WHERE path=? OR substr(path, 1, ?)=?", (new, len(new) + 1, new + "/"))
                db.execute(move, (new, len(tmp) + 1, tmp, len(tmp) + 1, tmp + "/"))

    def _drop_artifacts_locked(self, path: str, kinds: tuple[str, ...]) -> list[str]:
        if not kinds:
            return []
        marks = ",".join("?" * len(kinds))
        rows = self._db.execute(f"SELECT keys FROM artifacts WHERE path=? AND kind IN ({marks})",
                                (path, *kinds)).fetchall()
        self._db.execute(f"DELETE FROM artifacts WHERE path=? AND kind IN ({marks})", (path, *kinds))
        return [k for r in rows for k in json.loads(r[0])]

    @_retry_when_full
    def schedule_deletes(self, keys: list[str], not_before: float) -> None:
        """An unlinked file's last holder closed: its objects are no longer held, and go after `not_before`."""
        with self._transaction() as db:
            db.executemany(f"DELETE FROM object_refs WHERE key=? AND holder LIKE '{HELD}%'", [(k,) for k in keys])
            db.executemany("UPDATE pending_deletes SET not_before=? WHERE key=?", [(not_before, k) for k in keys])

    @_retry_when_full
    def release_held_deletes(self, not_before: float) -> int:
        """At mount: objects held for open files of an earlier daemon go after `not_before` (no process holds
        those files now). Also the deletes an earlier version held with a NEVER not-before."""
        with self._transaction() as db:
            held = f"SELECT key FROM object_refs WHERE holder LIKE '{HELD}%'"
            n = db.execute(f"UPDATE pending_deletes SET not_before=? WHERE key IN ({held}) OR not_before>=?",
                           (not_before, NEVER)).rowcount
            db.execute(f"DELETE FROM object_refs WHERE holder LIKE '{HELD}%'")
            return n
    @_retry_when_full
    def swap(self, e: Entry, delete_keys: list[str], not_before: float) -> bool:
        """Give a TIERED raw row its compacted objects (raw -> lz4c) and queue the raw ones for deletion,
        atomically, only if the row is still that generation, TIERED and raw: a write that made the file HOT again
        (committed while the swap waited for this thread) must not be overwritten by the old content's objects.
        Otherwise the compacted objects, which nothing names, are queued instead; False."""
        with self._transaction() as db:
            cur = db.execute("SELECT generation, state, format, objects FROM files WHERE file_id=?",
                             (e.file_id,)).fetchone()
            if cur is None or tuple(cur[:3]) != (e.generation, State.TIERED.value, "raw"):
                named = set(json.loads(cur[3])) if cur is not None else set()
                self._queue_locked([k for k in e.objects if k not in named], not_before)
                return False
            self._put_row_locked(db, e)
            self._queue_locked(delete_keys, not_before)
            return True

    @_retry_when_full
    def put_many(self, entries: list[Entry], delete_keys: list[str], not_before: float,
                 artifacts: list[Artifact] = (), drop_ids: tuple[int, ...] = ()) -> None:
        """Rows (inserted, or updated but for their path), artifacts, rows dropped by file id (a following
        mount's file replaced by a newer one) and deferred deletes in one transaction: all or none of them."""
        now = time.time()
        with self._transaction() as db:
            self._drop_rows_locked(db, list(drop_ids))
            fresh = [e for e in entries if not e.file_id]  # rows from a snapshot's blobs: numbered here
            if fresh:  # above every id in use and in this batch (a snapshot's rows keep their writer's ids)
                first = max(int(db.execute("SELECT v FROM meta WHERE k='next_id'").fetchone()[0]),
                            db.execute("SELECT coalesce(max(file_id), 0) FROM files").fetchone()[0] + 1,
                            max(e.file_id for e in entries) + 1)
                db.execute("UPDATE meta SET v=? WHERE k='next_id'", (str(first + len(fresh)),))
                for i, e in enumerate(fresh):
                    e.file_id = first + i
            for e in entries:
                e.state_since = e.state_since or now
                self._put_row_locked(db, e)
            db.executemany("INSERT OR REPLACE INTO artifacts VALUES (?, ?, ?, ?, ?, ?)",
                           [(a.path, a.kind, a.generation, json.dumps(a.keys), json.dumps(a.info), a.created or now)
                            for a in artifacts])
            self._queue_locked(delete_keys, not_before)

    # -- pipeline artifacts

    def artifacts(self, kind: str | None = None) -> list[Artifact]:
        q = "SELECT path, kind, generation, keys, info, created FROM artifacts"
        with self._lock:
            rows = self._db.execute(q + (" WHERE kind=?" if kind else ""), (kind,) if kind else ()).fetchall()
        return [Artifact(r[0], r[1], r[2], json.loads(r[3]), json.loads(r[4]), r[5]) for r in rows]

    @_retry_when_full
    def drop_artifacts(self, path: str, kinds: tuple[str, ...], not_before: float) -> list[str]:
        """Forget `path`'s artifacts of these kinds (its content changed or it is gone) and queue their objects."""
        with self._transaction():
            keys = self._drop_artifacts_locked(path, kinds)
            self._queue_locked(keys, not_before)
        return keys

    # -- deferred deletes and the references that hold them (tierfs.tier.references asks here)

    @_retry_when_full
    def queue_deletes(self, keys: list[str], not_before: float) -> None:
        with self._transaction():
            self._queue_locked(keys, not_before)

    @_retry_when_full
    def hold_refs(self, holder: str, keys: list[str]) -> None:
        """`holder` refers to `keys` (durably, before it writes or uses them): no delete takes them meanwhile."""
        with self._transaction() as db:
            db.executemany("INSERT OR IGNORE INTO object_refs VALUES (?, ?)", [(k, holder) for k in keys])

    @_retry_when_full
    def release_refs(self, holder: str, not_before: float) -> int:
        """`holder` is done with its objects: each is queued for deletion after `not_before`, in the same
        transaction, and goes once nothing else refers to it (a row that took one over keeps it)."""
        with self._transaction() as db:
            keys = [r[0] for r in db.execute("SELECT key FROM object_refs WHERE holder=?", (holder,))]
            db.execute("DELETE FROM object_refs WHERE holder=?", (holder,))
            db.executemany("INSERT OR IGNORE INTO pending_deletes VALUES (?, ?)", [(k, not_before) for k in keys])
        return len(keys)

    @_retry_when_full
    def hold_refs_many(self, refs: list[tuple[str, str]]) -> None:
        """Several holders' (key, holder) references in one transaction (an upload batch registers its keys)."""
        with self._transaction() as db:
            db.executemany("INSERT OR IGNORE INTO object_refs VALUES (?, ?)", refs)

    @_retry_when_full
    def hold_content(self, holder: str, key: str) -> bool:
        """`holder` refers to content-addressed `key` from now on (as hold_refs); True when a TIERED row already
        names it, i.e. the object is stored and verified (an upload of the same bytes need not PUT it again).
        One transaction: from here on no delete can take it whatever happens to that row."""
        with self._transaction() as db:
            db.execute("INSERT OR IGNORE INTO object_refs VALUES (?, ?)", (key, holder))
            return db.execute("SELECT 1 FROM cas_refs JOIN files USING (file_id) WHERE key=? AND state=? LIMIT 1",
                              (key, State.TIERED.value)).fetchone() is not None

    @_retry_when_full
    def end_refs(self, settled: list[str], released: list[str], not_before: float) -> None:
        """In one transaction: `settled` holders go without a delete (a committed row names their keys, or the
        commit queued them), `released` ones like `release_refs` (their keys queued after `not_before`)."""
        with self._transaction() as db:
            keys = [r[0] for h in released for r in db.execute("SELECT key FROM object_refs WHERE holder=?", (h,))]
            db.executemany("DELETE FROM object_refs WHERE holder=?", [(h,) for h in settled + released])
            db.executemany("INSERT OR IGNORE INTO pending_deletes VALUES (?, ?)", [(k, not_before) for k in keys])

    def holders(self, prefix: str) -> list[str]:
        """Every holder whose name starts with `prefix` (e.g. the compaction jobs that registered outputs)."""
        with self._lock:
            return [r[0] for r in self._db.execute(
                "SELECT DISTINCT holder FROM object_refs WHERE substr(holder, 1, ?)=?", (len(prefix), prefix))]

    @_retry_when_full
    def claim_deletes(self, now: float, limit: int, skip: set[str], named: Callable[[list[str]], set[str]],
                      retry: float) -> list[str]:
        """The one question before any object delete, in one transaction: due queued deletes that nothing refers
        to. Not free: a key a reference holds (held file, running job), one named by a live row, an artifact or
        an active file's append objects (a stale queue entry: the row that names it queues it again when it goes,
        so the entry is dropped), one in `skip` (being deleted) and one `named` says a snapshot names (its entry
        is retried after `retry` seconds, so keys waiting on snapshots never starve the others)."""
        with self._transaction() as db:
            due = [r[0] for r in db.execute(
                "SELECT key FROM pending_deletes WHERE not_before <= ? AND key NOT IN (SELECT key FROM object_refs) "
                "ORDER BY not_before LIMIT ?", (now, limit))]
            due = [k for k in due if k not in skip]
            if not due:
                return []
            live = self._named_by_rows_locked(db, due)
            if live:
                db.executemany("DELETE FROM pending_deletes WHERE key=?", [(k,) for k in live])
            free = [k for k in due if k not in live]
            waiting = named(free) if free else set()
            if waiting:
                db.executemany("UPDATE pending_deletes SET not_before=? WHERE key=?",
                               [(now + retry, k) for k in waiting])
            return [k for k in free if k not in waiting]

    @staticmethod
    def _named_by_rows_locked(db: sqlite3.Connection, keys: list[str]) -> set[str]:
        """Those of `keys` a live row (by the generation in the key, or by cas_refs for a content-addressed key,
        which several rows may name), an artifact or a tail names."""
        want = set(keys)
        named: set[str] = set()
        cas = [k for k in keys if layout.is_cas(k)]
        for i in range(0, len(cas), 500):
            part = cas[i:i + 500]
            named.update(r[0] for r in db.execute(
                f"SELECT DISTINCT key FROM cas_refs WHERE key IN ({','.join('?' * len(part))})", part))
        gens = {int(m.group(1)) for k in keys if (m := _KEY_GENERATION.search(k))}
        for g in gens:
            for objs, unit_ref in db.execute("SELECT objects, unit_ref FROM files WHERE generation=?", (g,)):
                named.update(json.loads(objs))
                named.add(units.ref_key(unit_ref or ""))
        for (objs,) in db.execute("SELECT keys FROM artifacts"):
            named.update(json.loads(objs))
        for (objs,) in db.execute("SELECT objects FROM tail_offsets"):
            named.update(o[0] for o in json.loads(objs))
        return want & named

    @_retry_when_full
    def deleted(self, keys: list[str]) -> None:
        with self._lock:
            self._db.executemany("DELETE FROM pending_deletes WHERE key=?", [(k,) for k in keys])

    def pending_delete_count(self) -> int:
        with self._lock:
            return self._db.execute("SELECT count(*) FROM pending_deletes").fetchone()[0]


# The row shape, public for tables that reuse it (catalog snapshots: tierfs.tier.snapshot).
COLUMNS = _COLS


def entry_to_row(e: Entry) -> tuple:
    return Catalog._row(e)


def row_to_entry(r: tuple) -> Entry:
    return Catalog._entry(r)


def unit_count(e: Entry) -> int:
    """How many pieces the finer verification table of `e` covers (0: it has none)."""
    return -(-e.size // e.unit_bytes) if e.unit_bytes else 0


def check_units(e: Entry) -> None:
    """A finer verification table, inline or by reference, must fit its row (snapshot rows are untrusted
    input): ValueError if not."""
    if not e.unit_bytes and not e.unit_crcs and not e.unit_ref:
        return
    if not (isinstance(e.unit_bytes, int) and e.unit_bytes >= 512 and e.block_bytes % e.unit_bytes == 0):
        raise ValueError(f"verification unit {e.unit_bytes!r} does not divide block size {e.block_bytes!r}")
    if e.unit_ref:
        if e.unit_crcs:
            raise ValueError("a row has both an inline verification table and a reference to one")
        if e.format != "raw" or not e.objects:
            raise ValueError(f"a verification table reference on a {e.format} row with {len(e.objects)} objects")
        units.parse_ref(e.unit_ref, 4 * unit_count(e), units.row_table_key(e.objects[0], e.unit_ref))
        return
    if not isinstance(e.unit_crcs, bytes) or len(e.unit_crcs) != 4 * unit_count(e):
        raise ValueError(f"verification table of {len(e.unit_crcs)} bytes for {unit_count(e)} units")
