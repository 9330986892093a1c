"""`tierfs fsck HOT_DIR_OR_MOUNTPOINT [--deep] [--repair] [--json]`: compare catalog, hot dir and object store.

What is checked (DESIGN §4-§6):
* every catalog row has its hot file, and a tiered row's hot file has the row's size;
* every block the catalog marks resident has data in the hot file (SEEK_DATA/SEEK_HOLE); a block with a hole is
  damage only when its bytes (holes read as zeros) fail the block's crc32c, since a segment may be sparse;
* every object of a tiered row exists with the right size (one LIST of <store-id>/seg/ and <store-id>/cas/, HEAD
  for the rest; an lz4c object's trailer is read to learn its content size); a content-addressed object several
  rows name (replicas' identical segments: tierfs.tier.layout) is checked for each of them;
* no object under <store-id>/seg/ or <store-id>/cas/ is orphaned: each is referenced by a row, a pending delete,
  a held reference, a pipeline artifact, an unapplied pipeline result, or is the current generation of a segment
  being uploaded;
* with upload.dedup_group, a group's shared objects (groups/<group>/cas/) some mount marks
  (groups/<group>/refs/<sha256>/<store-id>: tierfs.tier.sharedrefs) are no orphans, its objects this store's rows
  name are checked like the rest, and a marker of this store whose object no row, pending delete or held reference
  names is reported (repair: delete the marker; the object goes with its last marker's mount, or fsck then
  reports it as an orphan);
* no multipart upload under <store-id>/ is stale (offline: any; mounted: older than --stale-after);
* with --deep, the crc32c of every block of every object (and of the whole content), and of every resident block.

Mounted stores are checked read-only (the catalog is opened with mode=ro) and every finding is checked again
against a fresh read of the catalog, so a segment the daemon evicted, rewrote or deleted during the scan is not
reported. --repair needs the store unmounted; it holds the daemon lock for the whole run so no mount can start,
and it refuses to run while any daemon but this hot dir's last one (as its state dir recorded it) holds the store
id's writer lease (its objects would look orphaned from here).

--repair does only what is safe: it deletes orphans whose segment the catalog knows (or that has no hot file),
aborts stale uploads, restores falsely resident blocks from their verified objects (or marks them non-resident),
re-uploads a missing or corrupt chunk object when every block of it is resident and verified locally, and drops
rows whose hot file is gone (their objects are queued for deletion, as the daemon does at mount). It never deletes
an object a hot file might still depend on. Exit codes: 0 clean, 1 damage found (repaired or not), 2 usage
error, 3 the check could not complete (object store unreachable).
"""

from __future__ import annotations

import bisect
import errno
import fcntl
import json
import os
import re
import sqlite3
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import crc32c

from tierfs.objectstore import ObjectStore, ObjectStoreError, format_crc32c
from tierfs.tier import identity, layout, storeconfig
from tierfs.tier.sharedrefs import SharedRefs
from tierfs.tier.appendlog import data_extents
from tierfs.tier.catalog import _COLS, Catalog, Entry, State

EXIT_CLEAN, EXIT_DAMAGE, EXIT_USAGE, EXIT_INCOMPLETE = 0, 1, 2, 3
STATE_DIR = ".tierfs"
_READ_PIECE = 8 << 20  # largest single GET while verifying
_SEG_KEY = re.compile(r"^(?P<path>.+)/(?P<gen>\d+)\.(?P<fmt>raw|lz4c)(?:/(?P<chunk>\d{6}|units))?$")


class UsageError(Exception):
    """Bad arguments or a target fsck cannot work on: exit 2 with this message."""


# ------------------------------------------------------------------------------------------------ the target


@dataclass
class Target:
    hot: Path
    mounted: bool
    mountpoint: Path | None = None
    lock_fd: int | None = None  # held for --repair: no daemon can mount meanwhile

    @property
    def state(self) -> Path:
        return self.hot / STATE_DIR


def _mount_of(hot: Path) -> Path | None:
    from tierfs.fs.mount import mount_table

    for src, mnt, fstype in mount_table():
        if fstype == "fuse.tierfs" and Path(src) == hot:
            return Path(mnt)
    return None


def locate(arg: str, repair: bool) -> Target:
    """A mountpoint (its hot dir comes from MNT/.tierfs/status.json) or a hot dir. Refuses --repair while a daemon
    serves the store, and otherwise takes the daemon lock so none can start during the repair."""
    from tierfs.fs.mount import hot_dir_of

    p = Path(arg)
    if hot_dir_of(p) is not None:
        try:
            st = json.loads((p / STATE_DIR / "status.json").read_text())
            hot = Path(st["hot_dir"])
        except (OSError, ValueError, KeyError) as e:
            raise UsageError(f"{arg} is a tierfs mount that does not answer ({e}); unmount it (tierfs umount "
                             f"{arg}) and run fsck on its hot dir") from None
        if st.get("read_only"):
            raise UsageError(f"{arg} is a read-only mount from the bucket: its local dir is only a cache; run fsck "
                             f"on the hot dir of the store's writer")
        target = Target(hot, True, p.resolve())
    else:
        if not os.path.lexists(p):
            raise UsageError(f"{arg}: no such file or directory")
        hot = p.resolve()
        if not (hot / STATE_DIR / "catalog.db").is_file():
            raise UsageError(f"{arg} is neither a tierfs mountpoint nor a hot dir (no {hot / STATE_DIR / 'catalog.db'})")
        target = Target(hot, False)
        lock = hot / STATE_DIR / "daemon.lock"
        if lock.exists():
            fd = os.open(lock, os.O_RDWR)
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                target.mounted = True
                target.mountpoint = _mount_of(hot)
            else:
                if repair:
                    target.lock_fd = fd
                else:
                    os.close(fd)
    if repair and target.mounted:
        where = f" at {target.mountpoint}" if target.mountpoint else ""
        raise UsageError(f"--repair needs the store unmounted: a tierfs daemon serves {target.hot}{where}; "
                         f"unmount it first (tierfs umount {target.mountpoint or 'MOUNTPOINT'}), or run without "
                         f"--repair for a read-only check")
    return target


# ------------------------------------------------------------------------------------------------ catalog state


@dataclass
class Snapshot:
    """What the catalog (and the pipeline's job dirs) say, read once."""

    rows: dict[str, Entry]
    pending: set[str]
    artifact_keys: set[str]
    job_keys: set[str]
    jobs_running: bool


def _keys_in(obj: Any) -> Iterator[str]:
    """Every string under a "key" or in a "keys" list anywhere in a pipeline result."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k == "key" and isinstance(v, str):
                yield v
            elif k == "keys" and isinstance(v, list):
                yield from (x for x in v if isinstance(x, str))
            else:
                yield from _keys_in(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _keys_in(v)


def load_snapshot(state: Path) -> Snapshot:
    """Read-only (mode=ro: safe while the daemon writes; WAL readers never block it)."""
    db = sqlite3.connect(f"file:{state / 'catalog.db'}?mode=ro", uri=True, timeout=30)
    try:
        rows = {e.path: e for e in (Catalog._entry(r) for r in db.execute(f"SELECT {','.join(_COLS)} FROM files"))}
        pending = {r[0] for r in db.execute("SELECT key FROM pending_deletes")}
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if "object_refs" in tables:  # held by a referrer (tierfs.tier.references): never an orphan
            pending.update(r[0] for r in db.execute("SELECT key FROM object_refs"))
        artifact_keys: set[str] = set()
        if "artifacts" in tables:
            for (keys,) in db.execute("SELECT keys FROM artifacts"):
                artifact_keys.update(json.loads(keys))
    finally:
        db.close()
    job_keys: set[str] = set()
    running = False
    jobs = state / "jobs"
    if jobs.is_dir():
        for d in jobs.iterdir():
            if not d.is_dir() or (d / "applied.json").exists():
                continue
            try:
                job_keys.update(_keys_in(json.loads((d / "result.json").read_text())))
            except FileNotFoundError:
                running = True  # no result yet: running (or killed before it wrote one)
            except (OSError, ValueError):
                pass
    return Snapshot(rows, pending, artifact_keys, job_keys, running)


# ------------------------------------------------------------------------------------------------ findings


@dataclass
class Finding:
    kind: str
    detail: str
    path: str | None = None
    key: str | None = None
    block: int | None = None
    generation: int | None = None
    upload_id: str | None = None
    repairable: bool = True
    repaired: str | None = None  # what --repair did
    unrepaired: str | None = None  # why --repair left it


KINDS = {
    "row_without_hot_file": "catalog rows whose hot file is gone",
    "row_renamed": "catalog rows whose file was renamed behind the catalog's back (the next mount follows it)",
    "hot_size": "tiered hot files whose size differs from the catalog",
    "false_resident": "blocks marked resident that are holes in the hot file",
    "bad_resident_block": "resident blocks whose local bytes fail their crc32c (--deep)",
    "missing_object": "objects of tiered rows that are missing",
    "object_size": "objects of tiered rows with the wrong size",
    "corrupt_object": "objects whose content fails its crc32c",
    "orphan_object": "objects under <store-id>/seg/ or <store-id>/cas/ nothing references",
    "stale_upload": "stale multipart uploads",
    "stale_marker": "this store's markers on a group's shared objects no row names",
}


# ------------------------------------------------------------------------------------------------ file helpers


def covered(extents: list[tuple[int, int]], lo: int, hi: int) -> bool:
    i = bisect.bisect_right(extents, (lo, float("inf"))) - 1
    return i >= 0 and extents[i][0] <= lo and extents[i][1] >= hi


def _pread_exact(fd: int, n: int, off: int) -> bytes:
    data = os.pread(fd, n, off)
    return data if len(data) == n else data + bytes(n - len(data))


def _chunk_sizes(e: Entry) -> list[int]:
    if e.format == "lz4c":
        return []
    return [min(e.chunk_bytes, e.size - i * e.chunk_bytes) for i in range(len(e.objects))]


def _chunk_blocks(e: Entry, chunk_no: int) -> range:
    return layout.raw_chunk_blocks(chunk_no, e.chunk_bytes, e.block_bytes, e.nblocks)


def read_block_from_store(store: ObjectStore, e: Entry, b: int) -> bytes:
    """Block `b` of a tiered entry, from its object, checked against the catalog's crc32c (ValueError if not)."""
    if e.format == "lz4c":
        from tierfs.tier import lz4c

        key = e.objects[0]
        try:
            f = lz4c.read_object_footer(store, key)
        except lz4c.ObjectMissing:
            raise ValueError(f"object {key} is missing") from None
        off, ln = lz4c.block_span(f, b, 1)
        data = lz4c.decode_blocks(f, b, 1, store.get_range(key, off, ln))
    else:
        chunk_no, off = layout.raw_chunk_of(b, e.chunk_bytes, e.block_bytes)
        key = e.objects[chunk_no]
        data = store.get_range(key, off, e.block_len(b))
    if crc32c.crc32c(data) != e.block_crcs[b]:
        raise ValueError(f"block {b} of object {key} fails its crc32c")
    return data


# ------------------------------------------------------------------------------------------------ the checker


class Progress:
    """tqdm bars on stderr, only when both stdout and stderr are terminals and the output is not JSON."""

    def __init__(self, enabled: bool):
        self.enabled = enabled

    def bar(self, desc: str, total: int | None = None, unit: str = "it", scale: bool = False):
        from tqdm import tqdm

        return tqdm(total=total, desc=f"{desc:<22}", unit=unit, unit_scale=scale, disable=not self.enabled,
                    file=sys.stderr, leave=False, dynamic_ncols=True)


@dataclass
class Report:
    target: dict
    deep: bool
    repair: bool
    checked: dict = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)
    error: str | None = None

    @property
    def exit_code(self) -> int:
        if self.error:
            return EXIT_INCOMPLETE
        return EXIT_DAMAGE if self.findings else EXIT_CLEAN

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for f in self.findings:
            out[f.kind] = out.get(f.kind, 0) + 1
        return out

    def as_dict(self) -> dict:
        return {"target": self.target, "deep": self.deep, "repair": self.repair, "checked": self.checked,
                "summary": self.counts(), "findings": [asdict(f) for f in self.findings],
                "repaired": sum(1 for f in self.findings if f.repaired),
                "error": self.error, "clean": self.exit_code == EXIT_CLEAN, "exit_code": self.exit_code}


class Checker:
    def __init__(self, target: Target, store: ObjectStore, store_id: str, *, deep: bool, progress: Progress,
                 stale_after: float | None, jobs: int = 4, group: str = ""):
        self.t = target
        self.shared = SharedRefs(store, store_id, group, 0.0) if group else None
        self.markers: dict[str, set[str]] = {}  # a group's sha256 -> the store ids marking it
        self.store = store
        self.sid = store_id
        self.deep = deep
        self.progress = progress
        self.stale_after = (0.0 if not target.mounted else 3600.0) if stale_after is None else stale_after
        self.jobs = jobs
        self._moved: dict[int, list[str]] = {}  # inode -> paths, of rows whose file is not at their path
        self.snap = load_snapshot(target.state)
        self.findings: list[Finding] = []
        self.checked: dict[str, int] = {"rows": len(self.snap.rows), "objects": 0, "uploads": 0,
                                        "resident_blocks": 0, "bytes_verified": 0, "local_bytes_verified": 0}
        self.listing: dict[str, int] = {}

    def add(self, f: Finding) -> None:
        self.findings.append(f)

    # -- catalog vs hot dir

    def check_hot(self) -> None:
        rows = sorted(self.snap.rows.values(), key=lambda e: e.path)
        missing = [e for e in rows if e.ino and not os.path.lexists(self.t.hot / e.path)]
        # a file is its identity (tierfs.tier.identity), not its name: a row whose file was renamed behind the
        # catalog's back (a crash between the two steps of a rename) is found, never dropped with its objects
        self._moved = identity.paths_of(self.t.hot, self.t.state, {e.ino for e in missing}) if missing else {}
        with self.progress.bar("catalog vs hot dir", len(rows), "row") as bar:
            for e in rows:
                self._check_row_hot(e)
                bar.update(1)

    def _renamed_to(self, e: Entry) -> str | None:
        for p in self._moved.get(e.ino, ()):
            try:
                if identity.read(str(self.t.hot / p)) in (e.file_id, None):
                    return p
            except OSError:
                continue
        return None

    def _check_row_hot(self, e: Entry) -> None:
        path = self.t.hot / e.path
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            moved = self._renamed_to(e)
            if moved is not None:
                self.add(Finding("row_renamed", f"{e.path}: the file (id {e.file_id}) is now {moved}; the next "
                                 f"mount moves its row there", e.path, generation=e.generation, repairable=False))
                return
            self.add(Finding("row_without_hot_file", f"{e.path}: cataloged ({e.state.value}, gen {e.generation}, "
                             f"{len(e.objects)} objects) but the hot file is gone", e.path,
                             generation=e.generation))
            return
        if e.state is not State.TIERED:
            return
        if st.st_size != e.size:
            self.add(Finding("hot_size", f"{e.path}: hot file is {st.st_size} bytes, the catalog says {e.size}",
                             e.path, generation=e.generation, repairable=False))
            return
        for b, why in self._bad_resident_blocks(e):
            kind = "false_resident" if why == "hole" else "bad_resident_block"
            text = ("is a hole in the hot file and its bytes fail the block crc32c" if why == "hole"
                    else "has local bytes that fail the block crc32c")
            self.add(Finding(kind, f"{e.path}: block {b} (bytes {b * e.block_bytes}+{e.block_len(b)}) is marked "
                             f"resident but {text}", e.path, block=b, generation=e.generation))

    def _bad_resident_blocks(self, e: Entry, only: Iterable[int] | None = None) -> list[tuple[int, str]]:
        """(block, 'hole' | 'crc') for resident blocks whose local bytes are wrong."""
        blocks = [b for b in (range(e.nblocks) if only is None else only) if e.is_resident(b)]
        if not blocks:
            return []
        out = []
        fd = os.open(self.t.hot / e.path, os.O_RDONLY)
        try:
            extents = data_extents(fd, e.size)
            for b in blocks:
                lo, ln = b * e.block_bytes, e.block_len(b)
                self.checked["resident_blocks"] += 1
                hole = not covered(extents, lo, lo + ln)
                if not hole and not self.deep:
                    continue
                ok = crc32c.crc32c(_pread_exact(fd, ln, lo)) == e.block_crcs[b]
                if not hole:
                    self.checked["local_bytes_verified"] += ln
                if not ok:
                    out.append((b, "hole" if hole else "crc"))
        finally:
            os.close(fd)
        return out

    # -- catalog vs object store

    def check_objects(self) -> None:
        with self.progress.bar("listing objects", None, "obj") as bar:
            for prefix in layout.object_prefixes(self.sid):
                for info in self.store.list(prefix):
                    self.listing[info.key] = info.size
                    bar.update(1)
            if self.shared is not None:  # a group's shared objects: this store's if it marks them
                self.markers = self.shared.marked()
                for info in self.store.list(layout.group_cas_prefix(self.shared.group)):
                    if self.sid in self.markers.get(layout.cas_sha(info.key), ()) or \
                            not self.markers.get(layout.cas_sha(info.key)):
                        self.listing[info.key] = info.size
                    bar.update(1)
        self.checked["objects"] = len(self.listing)
        tiered = [e for e in self.snap.rows.values() if e.state is State.TIERED]
        with self.progress.bar("objects of rows", sum(len(e.objects) for e in tiered), "obj") as bar:
            for e in sorted(tiered, key=lambda e: e.path):
                self._check_row_objects(e)
                bar.update(len(e.objects))
        self._check_orphans()
        self._check_markers()

    def _check_row_objects(self, e: Entry) -> None:
        sizes = _chunk_sizes(e)
        for i, key in enumerate(e.objects):
            size = self.listing.get(key)
            if size is None:
                try:
                    info = self.store.head(key)
                except ObjectStoreError as err:
                    if not self._unreadable(err):
                        raise
                    self.add(Finding("corrupt_object", f"{e.path}: object {key} is unreadable: {err}", e.path, key,
                                     generation=e.generation))
                    continue
                if info is None:
                    self.add(Finding("missing_object", f"{e.path}: object {key} is missing", e.path, key,
                                     generation=e.generation))
                    continue
                size = info.size
            if e.format == "lz4c":
                self._check_lz4c_trailer(e, key, size)
            elif size != sizes[i]:
                self.add(Finding("object_size", f"{e.path}: object {key} is {size} bytes, expected {sizes[i]}",
                                 e.path, key, generation=e.generation))

    @staticmethod
    def _unreadable(err: ObjectStoreError) -> bool:
        """A store error that is about this object's bytes (posix: a torn or foreign file), not the network."""
        from tierfs.objectstore import ObjectStoreUnavailable

        return not isinstance(err, ObjectStoreUnavailable)

    def _check_lz4c_trailer(self, e: Entry, key: str, size: int) -> None:
        from tierfs.tier import lz4c

        try:
            f = lz4c.read_footer(lambda o, n: self.store.get_range(key, o, n), size)
        except lz4c.Lz4cError as err:
            self.add(Finding("corrupt_object", f"{e.path}: lz4c object {key}: {err}", e.path, key,
                             generation=e.generation))
            return
        if f.trailer.size != e.size or list(f.crcs) != list(e.block_crcs):
            self.add(Finding("corrupt_object", f"{e.path}: lz4c object {key} holds {f.trailer.size} bytes in "
                             f"{f.nblocks} blocks that do not match the catalog ({e.size} bytes, "
                             f"{e.nblocks} blocks)", e.path, key, generation=e.generation))

    def _in_flight(self, key: str, snap: Snapshot) -> bool:
        """The current generation of a segment being uploaded (the daemon resumes it), or the lz4c output of a
        pipeline job still running while mounted."""
        m = _SEG_KEY.match(key[len(layout.segment_prefix(self.sid)):])
        if not m:
            return False
        e = snap.rows.get(m["path"])
        if e is None:
            return False
        gen = int(m["gen"])
        if e.state in (State.SEALED, State.UPLOADING) and gen == e.generation and m["fmt"] == "raw":
            return True
        return self.t.mounted and snap.jobs_running and m["fmt"] == "lz4c" and gen == e.generation

    def _orphan_keys(self, snap: Snapshot) -> set[str]:
        referenced = {k for e in snap.rows.values() for k in e.all_objects()}
        return {k for k in self.listing if k not in referenced and k not in snap.pending
                and k not in snap.artifact_keys and k not in snap.job_keys and not self._in_flight(k, snap)
                and not (layout.is_group_cas(k) and self.markers.get(layout.cas_sha(k)))}  # another mount's

    def _stale_markers(self, snap: Snapshot) -> dict[str, str]:
        """This store's markers (marker key -> object key) on group objects nothing of this store names."""
        if self.shared is None:
            return {}
        named = {layout.cas_sha(k) for k in (*(k for e in snap.rows.values() for k in e.all_objects()),
                                             *snap.pending, *snap.artifact_keys, *snap.job_keys)
                 if layout.is_group_cas(k)}
        return {self.shared.marker(key): key for sha, sids in self.markers.items()
                if self.sid in sids and sha not in named for key in [self.shared.key(sha)]}

    def _check_markers(self) -> None:
        for marker, key in sorted(self._stale_markers(self.snap).items()):
            self.add(Finding("stale_marker", f"marker {marker}: this store marks group object {key}, which no "
                             f"catalog row, pending delete or held reference names", key=marker))

    def _check_orphans(self) -> None:
        prefix = layout.segment_prefix(self.sid)
        for key in sorted(self._orphan_keys(self.snap)):
            m = _SEG_KEY.match(key[len(prefix):])
            path = m["path"] if m else None
            f = Finding("orphan_object", f"object {key} ({self.listing[key]} bytes) is referenced by no catalog row "
                        f"and no pending delete", path, key)
            if layout.is_cas(key):  # no path in its key: any hot file without a row might depend on it
                f.repairable, f.unrepaired = False, ("content-addressed: its key names no segment, so no hot file "
                                                     "can be ruled out as depending on it; left for a human")
            elif m is None:
                f.repairable, f.unrepaired = False, "its key is not a segment object key; left for a human"
            elif path not in self.snap.rows and (self.t.hot / path).exists():
                f.repairable = False
                f.unrepaired = (f"kept: hot file {path} exists without a catalog row, so it may depend on this "
                                f"object")
            self.add(f)

    # -- multipart uploads

    def check_uploads(self) -> None:
        now = time.time()
        with self.progress.bar("multipart uploads", None, "upl") as bar:
            for up in self.store.list_multipart_uploads(f"{self.sid}/"):
                self.checked["uploads"] += 1
                bar.update(1)
                age = now - up.initiated if up.initiated else None
                if age is not None and age < self.stale_after:
                    continue
                started = f"started {age:.0f} s ago" if age is not None else "start time unknown"
                self.add(Finding("stale_upload", f"multipart upload {up.upload_id} of {up.key} ({started}) was "
                                 f"never completed", key=up.key, upload_id=up.upload_id))

    # -- deep: object content

    def check_deep(self) -> None:
        tiered = [e for e in self.snap.rows.values() if e.state is State.TIERED and e.objects]
        bad_keys = {f.key for f in self.findings if f.kind in ("missing_object", "object_size", "corrupt_object")}
        with self.progress.bar("verifying objects", sum(e.size for e in tiered), "B", scale=True) as bar:
            with ThreadPoolExecutor(self.jobs) as pool:
                results = pool.map(lambda e: self._verify_row(e, bad_keys, bar.update),
                                   sorted(tiered, key=lambda e: e.path))
                for found, nbytes in results:
                    self.findings.extend(found)
                    self.checked["bytes_verified"] += nbytes

    def _verify_row(self, e: Entry, skip: set[str], tick: Callable[[int], Any]) -> tuple[list[Finding], int]:
        """(findings, bytes read) for one row; runs in a worker thread."""
        if any(k in skip for k in e.objects):
            tick(e.size)
            return [], 0  # already reported
        done = [0]

        def count(n: int) -> None:
            done[0] += n
            tick(n)

        try:
            found = self._verify_lz4c(e, count) if e.format == "lz4c" else self._verify_raw(e, count)
        except ObjectStoreError as err:
            if not self._unreadable(err):
                raise
            found = [Finding("corrupt_object", f"{e.path}: {err}", e.path, generation=e.generation)]
        return found, done[0]

    def _verify_raw(self, e: Entry, tick: Callable[[int], Any]) -> list[Finding]:
        out = []
        crc = 0
        for i, key in enumerate(e.objects):
            blocks = list(_chunk_blocks(e, i))
            base = blocks[0] * e.block_bytes
            per_get = max(1, _READ_PIECE // e.block_bytes)
            bad = None
            for j in range(0, len(blocks), per_get):
                group = blocks[j:j + per_get]
                lo = group[0] * e.block_bytes
                data = self.store.get_range(key, lo - base, sum(e.block_len(b) for b in group))
                mv = memoryview(data)
                pos = 0
                for b in group:
                    ln = e.block_len(b)
                    if bad is None and crc32c.crc32c(mv[pos:pos + ln]) != e.block_crcs[b]:
                        bad = b
                    pos += ln
                crc = crc32c.crc32c(data, crc)
                tick(len(data))
            if bad is not None:
                out.append(Finding("corrupt_object", f"{e.path}: object {key}: block {bad} fails its crc32c",
                                   e.path, key, block=bad, generation=e.generation))
        if not out and e.crc32c is not None and crc != e.crc32c:
            out.append(Finding("corrupt_object", f"{e.path}: content crc32c {crc:08x} differs from the catalog's "
                               f"{e.crc32c:08x}", e.path, generation=e.generation, repairable=False))
        return out

    def _verify_lz4c(self, e: Entry, tick: Callable[[int], Any]) -> list[Finding]:
        from tierfs.tier import lz4c

        key = e.objects[0]
        size = self.listing.get(key)
        if size is None:
            info = self.store.head(key)
            size = info.size if info else 0
        try:
            f = lz4c.read_footer(lambda o, n: self.store.get_range(key, o, n), size)
            per_get = max(1, _READ_PIECE // max(f.trailer.block_bytes, 1))
            crc = 0
            for first in range(0, f.nblocks, per_get):
                n = min(per_get, f.nblocks - first)
                off, ln = lz4c.block_span(f, first, n)
                content = lz4c.decode_blocks(f, first, n, self.store.get_range(key, off, ln))
                crc = crc32c.crc32c(content, crc)
                tick(len(content))
        except lz4c.Lz4cError as err:
            return [Finding("corrupt_object", f"{e.path}: lz4c object {key}: {err}", e.path, key,
                            generation=e.generation)]
        if e.crc32c is not None and crc != e.crc32c:
            return [Finding("corrupt_object", f"{e.path}: lz4c object {key}: content crc32c {crc:08x} differs from "
                            f"the catalog's {e.crc32c:08x}", e.path, key, generation=e.generation)]
        return []

    # -- mounted: drop what the daemon changed during the scan

    def recheck(self) -> None:
        snap = load_snapshot(self.t.state)
        orphans = self._orphan_keys(snap)
        keep = []
        for f in self.findings:
            e = snap.rows.get(f.path) if f.path else None
            same = e is not None and e.generation == f.generation
            if f.kind == "row_without_hot_file":
                ok = same and not (self.t.hot / f.path).exists()
            elif f.kind in ("missing_object", "object_size", "corrupt_object"):
                ok = same and e.state is State.TIERED and (f.key is None or f.key in e.objects)
                if ok and f.kind == "missing_object":
                    ok = self.store.head(f.key) is None
            elif f.kind in ("false_resident", "bad_resident_block"):
                ok = same and e.state is State.TIERED and bool(self._bad_resident_blocks(e, [f.block]))
            elif f.kind == "hot_size":
                ok = same and e.state is State.TIERED and (self.t.hot / f.path).exists() \
                    and (self.t.hot / f.path).stat().st_size != e.size
            elif f.kind == "orphan_object":
                ok = f.key in orphans and self.store.head(f.key) is not None
            elif f.kind == "stale_marker":
                ok = f.key in self._stale_markers(snap)
            else:
                ok = True
            if ok:
                keep.append(f)
        self.findings = keep
        self.snap = snap

    # -- repair (offline only)

    def repair(self) -> None:
        cat = Catalog(self.t.state / "catalog.db")
        try:
            with self.progress.bar("repairing", len(self.findings), "fix") as bar:
                order = ["missing_object", "object_size", "corrupt_object", "false_resident", "bad_resident_block",
                         "row_without_hot_file", "row_renamed", "orphan_object", "stale_upload", "hot_size",
                         "stale_marker"]
                for f in sorted(self.findings, key=lambda f: order.index(f.kind)):
                    try:
                        self._repair_one(cat, f)
                    except (OSError, ObjectStoreError, ValueError) as err:
                        f.unrepaired = f"repair failed: {err}"
                    bar.update(1)
        finally:
            cat.close()

    def _repair_one(self, cat: Catalog, f: Finding) -> None:
        if not f.repairable:
            f.unrepaired = f.unrepaired or "no safe automatic repair"
            return
        e = self.snap.rows.get(f.path) if f.path else None
        if f.kind == "orphan_object":
            self.store.delete(f.key)
            f.repaired = f"deleted orphaned object {f.key}"
        elif f.kind == "stale_marker":
            self.store.delete(f.key)
            f.repaired = f"deleted this store's marker {f.key}"
        elif f.kind == "stale_upload":
            self.store.abort_multipart(f.key, f.upload_id)
            f.repaired = f"aborted multipart upload {f.upload_id} of {f.key}"
        elif f.kind == "row_without_hot_file":
            cat.remove(e, e.all_objects(), time.time(), artifacts=("cidx",))
            f.repaired = (f"dropped the catalog row of {e.path}; its {len(e.objects)} objects are queued for "
                          f"deletion at the next mount")
        elif f.kind in ("false_resident", "bad_resident_block"):
            self._repair_block(cat, e, f)
        elif f.kind in ("missing_object", "object_size", "corrupt_object"):
            self._reupload(e, f)

    def _repair_block(self, cat: Catalog, e: Entry, f: Finding) -> None:
        """Restore the block from its verified object; failing that, mark it non-resident (a read then fetches
        it, or fails with EIO, instead of serving wrong bytes)."""
        b = f.block
        path = self.t.hot / e.path
        try:
            data = read_block_from_store(self.store, e, b)
        except (ObjectStoreError, ValueError) as err:
            e.set_resident(b, False)
            cat.save_residency([e])
            f.repaired = (f"marked block {b} of {e.path} non-resident (its object could not restore it: {err}); "
                          f"reads of it fetch again")
            return
        st = os.stat(path)
        fd = os.open(path, os.O_WRONLY)
        try:
            os.pwrite(fd, data, b * e.block_bytes)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        f.repaired = f"restored block {b} of {e.path} from its object (crc32c verified)"

    def _reupload(self, e: Entry, f: Finding) -> None:
        """PUT a chunk object again from the hot file, only when every block of it is resident and verified."""
        if e.format != "raw" or f.key not in e.objects:
            f.unrepaired = "no local copy to rebuild this object from"
            return
        i = e.objects.index(f.key)
        blocks = _chunk_blocks(e, i)
        missing = [b for b in blocks if not e.is_resident(b)]
        if missing:
            f.unrepaired = (f"blocks {missing[0]}..{missing[-1]} of {e.path} are not resident: this object was "
                            f"their only copy and reads of them fail with EIO")
            return
        fd = os.open(self.t.hot / e.path, os.O_RDONLY)
        try:
            parts = []
            for b in blocks:
                d = _pread_exact(fd, e.block_len(b), b * e.block_bytes)
                if crc32c.crc32c(d) != e.block_crcs[b]:
                    f.unrepaired = f"the local copy of block {b} of {e.path} fails its crc32c too"
                    return
                parts.append(d)
        finally:
            os.close(fd)
        data = b"".join(parts)
        self.store.put(f.key, data, metadata={"crc32c": format_crc32c(crc32c.crc32c(data))})
        info = self.store.head(f.key)
        if info is None or info.size != len(data):
            f.unrepaired = f"re-uploaded {f.key} but it does not read back with {len(data)} bytes"
            return
        f.repaired = f"re-uploaded {f.key} ({len(data)} bytes) from the verified local copy of {e.path}"


# ------------------------------------------------------------------------------------------------ entry point


def other_writer(store: ObjectStore, store_id: str, hot: Path) -> str | None:
    """Who else holds a live writer lease on this store id (any daemon but this hot dir's own), or None."""
    from tierfs.tier.lease import is_this_hot_dirs, read_current  # noqa: PLC0415

    got = read_current(store, store_id)
    now = time.time()
    if got is None or not got[0].live(now) or got[0].superseded_by or is_this_hot_dirs(got[0], store_id, hot):
        return None
    return got[0].describe(now)


def run(arg: str, *, deep: bool = False, repair: bool = False, as_json: bool = False,
        stale_after: float | None = None, jobs: int = 4, out=None) -> int:
    out = out or sys.stdout
    try:
        target = locate(arg, repair)
    except UsageError as e:
        print(f"tierfs fsck: {e}", file=sys.stderr)
        return EXIT_USAGE
    try:
        try:
            sc = storeconfig.load(target.state)
        except (OSError, ValueError) as e:
            print(f"tierfs fsck: {e}", file=sys.stderr)
            return EXIT_USAGE
        report = Report({"hot_dir": str(target.hot), "mounted": target.mounted,
                         "mountpoint": str(target.mountpoint) if target.mountpoint else None,
                         "store": sc.url, "store_id": sc.store_id}, deep, repair)
        progress = Progress(not as_json and sys.stdout.isatty() and sys.stderr.isatty())
        try:
            store = sc.open()
        except ValueError as e:
            print(f"tierfs fsck: {target.state / storeconfig.FILE_NAME}: {e}", file=sys.stderr)
            return EXIT_USAGE
        try:
            if repair:
                try:
                    other = other_writer(store, sc.store_id, target.hot)
                except ObjectStoreError as e:
                    print(f"tierfs fsck: cannot read the writer lease: {e}", file=sys.stderr)
                    return EXIT_INCOMPLETE
                if other:
                    print(f"tierfs fsck: --repair refused: store id {sc.store_id!r} is held by another writable "
                          f"mount ({other}); repairing from here would race it", file=sys.stderr)
                    return EXIT_USAGE
            try:
                checker = Checker(target, store, sc.store_id, deep=deep, progress=progress,
                                  stale_after=stale_after, jobs=jobs, group=sc.group)
            except sqlite3.Error as e:
                print(f"tierfs fsck: cannot read the catalog {target.state / 'catalog.db'}: {e}", file=sys.stderr)
                return EXIT_INCOMPLETE
            try:
                checker.check_hot()
                checker.check_objects()
                checker.check_uploads()
                if deep:
                    checker.check_deep()
                if target.mounted:
                    checker.recheck()
                if repair and checker.findings:
                    checker.repair()
            except ObjectStoreError as e:
                report.error = f"the object store failed, the check is incomplete: {e}"
            report.findings = checker.findings
            report.checked = checker.checked
        finally:
            store.close()
    finally:
        if target.lock_fd is not None:
            os.close(target.lock_fd)
    if as_json:
        print(json.dumps(report.as_dict(), indent=1), file=out)
    else:
        print(render(report), end="", file=out)
    return report.exit_code


def render(r: Report) -> str:
    t = r.target
    where = f"mounted at {t['mountpoint']}, read-only check" if t["mounted"] else "not mounted"
    lines = [f"tierfs fsck {t['hot_dir']} ({where}; store {t['store']}, id {t['store_id']})"]
    for f in r.findings:
        lines.append(f"  {f.kind}: {f.detail}")
        if f.repaired:
            lines.append(f"    repaired: {f.repaired}")
        elif r.repair and f.unrepaired:
            lines.append(f"    not repaired: {f.unrepaired}")
        elif f.unrepaired:
            lines.append(f"    note: {f.unrepaired}")
    c = r.checked
    lines.append(f"checked {c.get('rows', 0)} catalog rows, {c.get('resident_blocks', 0)} resident blocks, "
                 f"{c.get('objects', 0)} objects, {c.get('uploads', 0)} multipart uploads"
                 + (f"; verified {c.get('bytes_verified', 0)} object bytes and {c.get('local_bytes_verified', 0)} "
                    f"local bytes" if r.deep else ""))
    if r.error:
        lines.append(f"INCOMPLETE: {r.error}")
    counts = r.counts()
    if not counts:
        lines.append("clean: no damage found" if not r.error else "no damage found in what was checked")
    else:
        for kind, n in counts.items():
            lines.append(f"  {n:>6}  {KINDS[kind]}")
        fixed = sum(1 for f in r.findings if f.repaired)
        if r.repair:
            lines.append(f"damage found: {len(r.findings)} problem{'s' if len(r.findings) > 1 else ''}, {fixed} repaired, "
                         f"{len(r.findings) - fixed} left")
        else:
            hint = "" if t["mounted"] or not any(f.repairable for f in r.findings) else \
                "; run with --repair to fix what is safe"
            lines.append(f"damage found: {len(r.findings)} problem{'s' if len(r.findings) > 1 else ''}{hint}")
    return "\n".join(lines) + "\n"
