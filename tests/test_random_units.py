"""Random reads of evicted raw segments fetch only the verification units they touch (tierfs/tier/units.py), on a
real mount: bytes fetched per byte read stay small, every byte is still checked (a corrupt unit gives EIO and a
log line naming the object), and rows without a table (older catalogs) still read by whole blocks."""

from __future__ import annotations

import errno
import json
import os
import random
import sqlite3
from pathlib import Path

import pytest

from mountutil import evict, wait_for
from test_datapath import store_4mib  # noqa: F401 - the module fixture: 4 MiB CommitLog segments
from test_tiering import copy_in

MiB = 1 << 20
PAGE = 4096
# default cache.block_bytes (1 MiB), verification units of 4 KiB; nothing kept locally but the pinned pages
OPTS = ("tiering.enabled=true,cache.verify_bytes=4KiB,cache.max_bytes=64KiB,objectstore.chunk_bytes=4MiB,seal.quiet_seconds=0.5,"
        "seal.scan_interval_seconds=0.5,broker.max_hash_slot_num=500,broker.max_index_num=2000,"
        "delete.grace_seconds=0")
A = "commitlog/00000000000000000000"


def status(m) -> dict:
    return json.loads((m.ctl / "status.json").read_text())


def tiered_and_evicted(m, rel: str) -> dict:
    """Wait until `rel` is tiered with nothing resident but its pinned first page; its status row."""
    row: dict = {}

    def done() -> bool:
        files = {f["path"]: f for f in status(m)["files"]}
        row.update(files.get(rel, {}))
        return row.get("state") == "tiered" and row.get("resident_bytes", 1 << 40) <= PAGE
    wait_for(done, timeout=90, what=f"{rel} tiered and evicted")
    evict(m.mnt / rel)  # written through the mount: still in the page cache
    return row


def random_reads(m, ref: bytes, rel: str, offsets: list[int]) -> int:
    """4 KiB preads at `offsets` (fadvise RANDOM: no kernel read-ahead), each checked; the bytes fetched meanwhile."""
    before = status(m)["totals"]["engine"]["fetch_bytes"]
    fd = os.open(m.mnt / rel, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        for off in offsets:
            assert os.pread(fd, PAGE, off) == ref[off:off + PAGE], f"bytes at {off}"
    finally:
        os.close(fd)
    return status(m)["totals"]["engine"]["fetch_bytes"] - before


def test_random_4k_reads_of_an_evicted_segment_fetch_at_most_16x(mount_store, store_4mib):  # noqa: F811
    """Before (one crc32c per 1 MiB block) each cold random 4 KiB read fetched its whole block: 256x."""
    m = mount_store(options=[OPTS])
    copy_in(store_4mib, m.mnt)
    tiered_and_evicted(m, A)
    ref = (store_4mib / A).read_bytes()
    rng = random.Random(13)
    offsets = [rng.randrange(1, len(ref) // PAGE) * PAGE for _ in range(40)]
    fetched = random_reads(m, ref, A, offsets)
    needed = len(set(offsets)) * PAGE
    assert 0 < fetched <= 16 * needed, f"fetched {fetched} bytes for {needed} bytes read"
    assert status(m)["totals"]["engine"]["unit_fetch_bytes"] >= needed
    # the same pages again: from memory, nothing fetched
    assert random_reads(m, ref, A, offsets[:8]) == 0
    # a scan still reads by whole blocks (with read-ahead) and gets every byte right
    with open(m.mnt / A, "rb", buffering=0) as f:
        assert b"".join(iter(lambda: f.read(MiB), b"")) == ref
    assert m.alive()


def test_a_corrupt_unit_gives_eio_on_a_random_read_and_names_the_object(mount_store, store_4mib):  # noqa: F811
    m = mount_store(options=[OPTS])
    copy_in(store_4mib, m.mnt)
    tiered_and_evicted(m, A)
    ref = (store_4mib / A).read_bytes()
    key = next(f for f in status(m)["files"] if f["path"] == A)["objects"][0]
    obj = m.hot / ".tierfs" / "objects" / key
    bad = 2 * MiB + 5 * PAGE + 100  # inside one 4 KiB unit of the third block
    data = bytearray(obj.read_bytes())
    data[bad] ^= 0xFF
    obj.write_bytes(bytes(data))
    fd = os.open(m.mnt / A, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        with pytest.raises(OSError) as err:
            os.pread(fd, PAGE, bad - bad % PAGE)
        assert err.value.errno == errno.EIO
        # the other units of that block are intact: they are served, checked one by one
        for off in (bad - bad % PAGE - PAGE, bad - bad % PAGE + PAGE):
            assert os.pread(fd, PAGE, off) == ref[off:off + PAGE]
    finally:
        os.close(fd)
    wait_for(lambda: f"object {key} of {A} is corrupt" in m.log_text(), timeout=10, what="a log line naming it")
    assert m.alive()


def test_a_row_without_a_unit_table_reads_whole_blocks(mount_store, store_4mib):  # noqa: F811
    """cache.verify_bytes=0 writes rows as an older catalog has them: a random read fetches its whole block."""
    m = mount_store(options=[OPTS.replace("cache.verify_bytes=4KiB", "cache.verify_bytes=0")])
    copy_in(store_4mib, m.mnt)
    tiered_and_evicted(m, A)
    ref = (store_4mib / A).read_bytes()
    assert random_reads(m, ref, A, [MiB + 3 * PAGE]) == MiB
    assert status(m)["totals"]["engine"]["unit_fetch_bytes"] == 0


def test_a_catalog_from_before_unit_tables_opens_with_none(tmp_path: Path):
    """Catalog migration: the two columns are added; the rows read as having no table (whole-block fetch)."""
    from tierfs.tier.catalog import Catalog, State

    db = sqlite3.connect(str(tmp_path / "catalog.db"))
    db.executescript("""
        CREATE TABLE files (path TEXT PRIMARY KEY, kind TEXT NOT NULL, size INTEGER NOT NULL,
            mtime_ns INTEGER NOT NULL, state TEXT NOT NULL, generation INTEGER NOT NULL, format TEXT NOT NULL,
            chunk_bytes INTEGER NOT NULL, block_bytes INTEGER NOT NULL, crc32c INTEGER, block_crcs TEXT NOT NULL,
            objects TEXT NOT NULL, resident BLOB NOT NULL, last_access REAL NOT NULL, state_since REAL NOT NULL,
            file_id INTEGER NOT NULL DEFAULT 0, ino INTEGER NOT NULL DEFAULT 0);
        INSERT INTO files VALUES ('commitlog/00000000000000000000', 'commitlog', 4096, 0, 'tiered', 3, 'raw',
            65536, 65536, 1, '[7]', '["s/seg/commitlog/00000000000000000000/3.raw/000000"]', x'00', 0, 0, 5, 0);
    """)
    db.commit()
    db.close()
    cat = Catalog(tmp_path / "catalog.db")
    try:
        (e,) = cat.load_all()
        assert e.state is State.TIERED and e.unit_bytes == 0 and e.unit_crcs == b""
        cat.put(e)  # and it writes back
    finally:
        cat.close()


def test_snapshot_rows_carry_the_table_and_a_bad_one_is_refused():
    """A read-only mount or a takeover gets the table from the snapshot row; rows are untrusted input."""
    import dataclasses

    import crc32c

    from tierfs.tier import snapshot as snap
    from tierfs.tier import units
    from tierfs.tier.catalog import Entry, State, entry_to_row, row_to_entry

    data = os.urandom(3 * 65536 + 1000)
    key = "sid/seg/commitlog/00000000000000000000/3.raw/000000"
    e = Entry(path="commitlog/00000000000000000000", kind="commitlog", size=len(data), mtime_ns=1,
              state=State.TIERED, generation=3, chunk_bytes=4 * 65536, block_bytes=65536,
              crc32c=crc32c.crc32c(data),
              block_crcs=[crc32c.crc32c(data[i:i + 65536]) for i in range(0, len(data), 65536)],
              objects=[key], unit_bytes=4096, unit_crcs=units.table(data, 4096))
    back = row_to_entry(entry_to_row(e))
    assert back.unit_bytes == 4096 and back.unit_crcs == e.unit_crcs and len(back.unit_crcs) == 4 * 49
    snap._check_entry(back, "sid")
    assert units.first_bad(data[8192:16384], 2, back.unit_crcs, 4096) is None
    flipped = bytes([data[12288] ^ 0xFF])  # a constant byte was the same one 1 time in 256 (CI, 2026-11-26)
    assert units.first_bad(data[8192:12288] + flipped + data[12289:16384], 2, back.unit_crcs, 4096) == 3
    for bad, msg in ((dict(unit_crcs=e.unit_crcs[:-4]), "table of 192 bytes for 49 units"),
                     (dict(unit_bytes=3000), "does not divide")):
        with pytest.raises(ValueError, match=msg):
            snap._check_entry(dataclasses.replace(back, **bad), "sid")
