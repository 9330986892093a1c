"""The catalog: one SQLite row per segment that has entered the tiering lifecycle (DESIGN §5).

A segment with no row is plain HOT. Rows are written in one transaction per state change with
synchronous=FULL, so after a crash the catalog says exactly what was durable: a TIERED row means the objects
were verified, and the local bytes may only be dropped after that commit. The resident bitmap follows one rule:
a block is marked non-resident *durably before* its bytes are punched out of the hot file, and marked resident
lazily after its bytes are written, so a crash can only make us fetch a block again, never serve a hole.

Blocking calls: the engine calls these methods through one worker thread (see Engine._db).
"""

from __future__ import annotations

import enum
import json
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path


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


_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    path TEXT PRIMARY KEY,
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
    state_since REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS pending_deletes (
    key TEXT PRIMARY KEY,
    not_before REAL NOT NULL
);
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
         "crc32c", "block_crcs", "objects", "resident", "last_access", "state_since")


class Catalog:
    def __init__(self, path: Path):
        self.path = path
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)

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
                     last_access=d["last_access"], state_since=d["state_since"])

    @staticmethod
    def _row(e: Entry) -> tuple:
        return (e.path, e.kind, e.size, e.mtime_ns, e.state.value, e.generation, e.format, e.chunk_bytes,
                e.block_bytes, e.crc32c, json.dumps(e.block_crcs), json.dumps(e.objects), bytes(e.resident),
                e.last_access, e.state_since)

    def put(self, e: Entry) -> None:
        """Insert or replace a row, durably (one transaction)."""
        e.state_since = e.state_since or time.time()
        with self._lock:
            self._db.execute(f"INSERT OR REPLACE INTO files ({','.join(_COLS)}) VALUES ({','.join('?' * len(_COLS))})",
                             self._row(e))

    def save_residency(self, entries: list[Entry]) -> None:
        """Persist resident bitmaps and access times of several entries in one transaction."""
        with self._lock:
            self._db.execute("BEGIN")
            self._db.executemany("UPDATE files SET resident=?, last_access=? WHERE path=?",
                                 [(bytes(e.resident), e.last_access, e.path) for e in entries])
            self._db.execute("COMMIT")

    def remove(self, path: str, delete_keys: list[str], not_before: float) -> None:
        """Drop a row and queue its objects for deletion after the grace period, atomically."""
        with self._lock:
            self._db.execute("BEGIN")
            self._db.execute("DELETE FROM files WHERE path=?", (path,))
            self._db.executemany("INSERT OR REPLACE INTO pending_deletes VALUES (?, ?)",
                                 [(k, not_before) for k in delete_keys])
            self._db.execute("COMMIT")

    def rename(self, old: str, new: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM files WHERE path=?", (new,))
            self._db.execute("UPDATE files SET path=? WHERE path=?", (new, old))
            self._db.execute("DELETE FROM artifacts WHERE path=?", (new,))
            self._db.execute("UPDATE artifacts SET path=? WHERE path=?", (new, old))

    def swap(self, e: Entry, delete_keys: list[str], not_before: float) -> None:
        """Replace a row (e.g. raw -> lz4c objects) and queue the replaced objects for deletion, atomically."""
        self.put_many([e], delete_keys, not_before)

    def put_many(self, entries: list[Entry], delete_keys: list[str], not_before: float,
                 artifacts: list[Artifact] = ()) -> None:
        """Rows, artifacts and deferred deletes in one transaction: a crash leaves all or none of them."""
        now = time.time()
        with self._lock:
            self._db.execute("BEGIN")
            try:
                for e in entries:
                    e.state_since = e.state_since or now
                    self._db.execute(
                        f"INSERT OR REPLACE INTO files ({','.join(_COLS)}) VALUES ({','.join('?' * len(_COLS))})",
                        self._row(e))
                self._db.executemany("INSERT OR REPLACE INTO artifacts VALUES (?, ?, ?, ?, ?, ?)",
                                     [(a.path, a.kind, a.generation, json.dumps(a.keys), json.dumps(a.info),
                                       a.created or now) for a in artifacts])
                self._db.executemany("INSERT OR REPLACE INTO pending_deletes VALUES (?, ?)",
                                     [(k, not_before) for k in delete_keys])
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    # -- pipeline artifacts

    def artifacts(self, kind: str | None = None) -> list[Artifact]:
        q = "SELECT path, kind, generation, keys, info, created FROM artifacts"
        with self._lock:
            rows = self._db.execute(q + (" WHERE kind=?" if kind else ""), (kind,) if kind else ()).fetchall()
        return [Artifact(r[0], r[1], r[2], json.loads(r[3]), json.loads(r[4]), r[5]) for r in rows]

    def drop_artifacts(self, path: str, kinds: tuple[str, ...], not_before: float) -> list[str]:
        """Forget `path`'s artifacts of these kinds (its content changed or it is gone) and queue their objects."""
        with self._lock:
            self._db.execute("BEGIN")
            rows = self._db.execute(
                f"SELECT keys FROM artifacts WHERE path=? AND kind IN ({','.join('?' * len(kinds))})",
                (path, *kinds)).fetchall()
            keys = [k for r in rows for k in json.loads(r[0])]
            self._db.execute(f"DELETE FROM artifacts WHERE path=? AND kind IN ({','.join('?' * len(kinds))})",
                             (path, *kinds))
            self._db.executemany("INSERT OR REPLACE INTO pending_deletes VALUES (?, ?)",
                                 [(k, not_before) for k in keys])
            self._db.execute("COMMIT")
        return keys

    # -- deferred deletes

    def queue_deletes(self, keys: list[str], not_before: float) -> None:
        with self._lock:
            self._db.executemany("INSERT OR REPLACE INTO pending_deletes VALUES (?, ?)",
                                 [(k, not_before) for k in keys])

    def due_deletes(self, now: float, limit: int = 1000) -> list[str]:
        with self._lock:
            return [r[0] for r in self._db.execute(
                "SELECT key FROM pending_deletes WHERE not_before <= ? LIMIT ?", (now, limit))]

    def deleted(self, keys: list[str]) -> None:
        with self._lock:
            self._db.executemany("DELETE FROM pending_deletes WHERE key=?", [(k,) for k in keys])

    def pending_delete_count(self) -> int:
        with self._lock:
            return self._db.execute("SELECT count(*) FROM pending_deletes").fetchone()[0]

    # -- meta

    def get_meta(self, k: str) -> str | None:
        with self._lock:
            r = self._db.execute("SELECT v FROM meta WHERE k=?", (k,)).fetchone()
        return r[0] if r else None

    def set_meta(self, k: str, v: str) -> None:
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (k, v))


# The row shape, public for tables that reuse it (catalog snapshots: tierfs.tier.snapshot).
COLUMNS = _COLS


def entry_to_row(e: Entry) -> tuple:
    return Catalog._row(e)


def row_to_entry(r: tuple) -> Entry:
    return Catalog._entry(r)
