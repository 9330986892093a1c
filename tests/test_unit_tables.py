"""Verification tables as one object per segment (tierfs/tier/units.py), on a real mount: the row holds only a
reference (crc32c:size:key); the table object is untrusted (a corrupt one is refused, a wrong one that matches its
reference costs a re-fetch of the whole block, checked against the block's own crc32c: never wrong bytes, never a
false EIO); it goes with its segment; fsck does not call it an orphan; snapshot rows carry the reference."""

from __future__ import annotations

import dataclasses
import os
import sqlite3
from pathlib import Path

import crc32c
import pytest

from mountutil import wait_for
from test_datapath import store_4mib  # noqa: F401 - the module fixture: 4 MiB CommitLog segments
from test_fsck import fsck
from test_random_units import OPTS, PAGE, random_reads, tiered_and_evicted
from tierfs.objectstore.posix import PosixObjectStore
from tierfs.tier import snapshot as snap
from tierfs.tier import units
from tierfs.tier.catalog import Entry, State, entry_to_row, row_to_entry

MiB = 1 << 20
A = "commitlog/00000000000000000000"
B = "commitlog/00000000000004194304"


def table_object(m, rel: str) -> tuple[str, Path, str]:
    """(key, file in the posix store, reference) of the table object of `rel`, from the catalog."""
    db = sqlite3.connect(f"file:{m.hot / '.tierfs' / 'catalog.db'}?mode=ro", uri=True)
    try:
        (ref,) = db.execute("SELECT unit_ref FROM files WHERE path=?", (rel,)).fetchone()
    finally:
        db.close()
    key = units.ref_key(ref)
    assert key.endswith(".raw/units"), ref
    return key, m.hot / ".tierfs" / "objects" / key, ref


def test_a_wrong_or_corrupt_table_object_gives_the_right_bytes_by_whole_blocks(mount_store, store_4mib):  # noqa: F811
    m = mount_store(options=[OPTS])
    from test_tiering import copy_in
    copy_in(store_4mib, m.mnt)
    for rel in (A, B):
        tiered_and_evicted(m, rel)
    m.umount()
    # A: a wrong table that matches its reference (as a bad writer or a tampered bucket and row would make it)
    key_a, obj_a, _ = table_object(m, A)
    unit = MiB // 4096 + 5  # a unit of block 1
    store = PosixObjectStore(m.hot / ".tierfs" / "objects")
    table = bytearray(store.get(key_a))
    table[4 * unit] ^= 0x01
    store.put(key_a, bytes(table))
    db = sqlite3.connect(str(m.hot / ".tierfs" / "catalog.db"))
    with db:
        db.execute("UPDATE files SET unit_ref=? WHERE path=?", (units.make_ref(key_a, bytes(table)), A))
    db.close()
    # B: a corrupt table object (its reference no longer matches)
    key_b, obj_b, _ = table_object(m, B)
    table = bytearray(obj_b.read_bytes())
    table[100] ^= 0xFF  # in the content (the posix store's trailer follows it)
    obj_b.write_bytes(bytes(table))
    m.mount()

    ref_a, ref_b = (store_4mib / A).read_bytes(), (store_4mib / B).read_bytes()
    fetched = random_reads(m, ref_a, A, [unit * 4096])  # right bytes, no EIO: the block's own crc32c decides
    assert MiB <= fetched <= MiB + PAGE, fetched
    wait_for(lambda: f"verification table (object {key_a}) of {A} is wrong" in m.log_text(), timeout=10,
             what="a log line naming the wrong table object")
    assert random_reads(m, ref_a, A, [3 * MiB + 2 * PAGE]) == MiB  # from now on by whole blocks
    assert random_reads(m, ref_b, B, [MiB + 7 * PAGE, 2 * MiB + 9 * PAGE]) == 2 * MiB
    wait_for(lambda: f"verification table object {key_b} of {B} is refused" in m.log_text(), timeout=10,
             what="a log line naming the refused table object")
    eng = m.status()["totals"]["engine"]
    assert eng["unit_tables_refused"] == 2 and eng["fetch_errors"] == 0, eng
    assert m.alive()


def test_the_table_object_is_read_lazily_and_goes_with_its_segment(mount_store, store_4mib):  # noqa: F811
    m = mount_store(options=[OPTS])
    from test_tiering import copy_in
    copy_in(store_4mib, m.mnt)
    for rel in (A, B):
        tiered_and_evicted(m, rel)
    key_a, obj_a, ref = table_object(m, A)
    key_b, obj_b, _ = table_object(m, B)
    assert len(PosixObjectStore(m.hot / ".tierfs" / "objects").get(key_a)) == 4 * (4 * MiB // 4096)
    assert m.status()["totals"]["engine"]["unit_table_loads"] == 0  # nothing read yet: nothing loaded
    ref_a = (store_4mib / A).read_bytes()
    assert random_reads(m, ref_a, A, [MiB + 3 * PAGE, 2 * MiB + 5 * PAGE]) <= 2 * PAGE  # units, not blocks
    assert m.status()["totals"]["engine"]["unit_table_loads"] == 1
    code, rep, _ = fsck(m.mnt)  # the table objects are referenced: no orphan
    assert code == 0 and rep["clean"], rep
    os.unlink(m.mnt / A)
    wait_for(lambda: not obj_a.exists(), timeout=20, what=f"{key_a} deleted with its segment")
    fd = os.open(m.mnt / B, os.O_WRONLY)  # a changed tiered segment: a new generation, the old objects go
    try:
        os.pwrite(fd, b"x" * 16, MiB + 100)
    finally:
        os.close(fd)
    wait_for(lambda: not obj_b.exists(), timeout=20, what=f"{key_b} deleted with its generation")
    assert m.alive()


def test_snapshot_rows_carry_the_table_reference_and_a_bad_one_is_refused():
    """The row carries 'crc32c:size:key', not the table: a snapshot stays small; rows are untrusted input."""
    data = os.urandom(3 * 65536 + 1000)
    key = "sid/seg/commitlog/00000000000000000000/3.raw/000000"
    table = units.table(data, 512)
    tkey = units.table_key(key)
    e = Entry(path="commitlog/00000000000000000000", kind="commitlog", size=len(data), mtime_ns=1,
              state=State.TIERED, generation=3, chunk_bytes=4 * 65536, block_bytes=65536,
              crc32c=crc32c.crc32c(data),
              block_crcs=[crc32c.crc32c(data[i:i + 65536]) for i in range(0, len(data), 65536)],
              objects=[key], unit_bytes=512, unit_ref=units.make_ref(tkey, table))
    back = row_to_entry(entry_to_row(e))
    assert back.unit_ref == e.unit_ref and back.unit_crcs == b"" and len(e.unit_ref) < 80
    assert back.all_objects() == [key, "sid/seg/commitlog/00000000000000000000/3.raw/units"]
    snap._check_entry(back, "sid")
    k, size, crc = units.parse_ref(back.unit_ref, len(table), tkey)
    assert units.check_table(table, size, crc) is None
    assert "crc32c" in units.check_table(table[:-4] + b"\0\0\0\0", size, crc)
    other = "sid/seg/commitlog/00000000000000000000/2.raw/units"
    for bad, msg in ((dict(unit_ref=units.make_ref(tkey, table[:-4])), "names 1540 bytes; the row needs 1544"),
                     (dict(unit_ref=units.make_ref(other, table)), "names object"),
                     (dict(unit_ref="zz:1544:" + tkey), "not 'crc32c:size:key'"),
                     (dict(unit_ref="nonsense"), "not 'crc32c:size:key'"),
                     (dict(unit_crcs=table), "both an inline"),
                     (dict(unit_bytes=3000), "does not divide")):
        with pytest.raises(ValueError, match=msg):
            snap._check_entry(dataclasses.replace(back, **bad), "sid")


@pytest.fixture(scope="module")
def store_8_topics(tmp_path_factory) -> Path:
    """8 topics of equal traffic, one queue each: a topic's records lie about 9 KiB apart in the CommitLog. Small
    ConsumeQueue files (600 units, three pages) so the first of each seals and tiers."""
    import subprocess
    import sys

    from test_store_mount import PRODUCER
    ref = tmp_path_factory.mktemp("ref8")
    r = subprocess.run([sys.executable, str(PRODUCER), str(ref), "--commitlog-size", str(4 * MiB), "--cq-size",
                        "12000", "--index-slots", "500", "--index-items", "2000", "--messages", "8000",
                        "--body-size", "1000", "--topics", "8", "--queues", "1", "--topic-prefix", "T"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return ref


def consume_page(m, ref_dir: Path, page_off: int) -> tuple[int, int, int]:
    """A lagging consumer's step through the mount: one 4 KiB page of topic T0's first ConsumeQueue file, then
    every CommitLog record of segment A it names, each checked. (GETs, bytes fetched, span of those records)."""
    import struct

    from mountutil import evict
    cq = "consumequeue/T0/0/00000000000000000000"
    for rel in (A, cq):
        tiered_and_evicted(m, rel)
    evict(m.mnt / cq)
    ref = (ref_dir / A).read_bytes()
    page = (ref_dir / cq).read_bytes()[page_off:page_off + PAGE]
    records = [(phys, n) for phys, n, _ in struct.iter_unpack(">qiq", page[-page_off % 20:][:(PAGE - 20) // 20 * 20])
               if phys + n <= 4 * MiB]
    assert len(records) > 150, len(records)
    fd = os.open(m.mnt / A, os.O_RDONLY)  # the consumer's CommitLog open (the broker keeps it mapped)
    qfd = os.open(m.mnt / cq, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        os.posix_fadvise(qfd, 0, 0, os.POSIX_FADV_RANDOM)
        before = m.status()["totals"]["engine"]
        assert os.pread(qfd, PAGE, page_off) == page
        for phys, n in records:
            assert os.pread(fd, n, phys) == ref[phys:phys + n], phys
        after = m.status()["totals"]["engine"]
    finally:
        os.close(qfd)
        os.close(fd)
    assert after["fetch_errors"] == 0 and m.alive()
    span = records[-1][0] + records[-1][1] - records[0][0]
    return after["fetches"] - before["fetches"], after["fetch_bytes"] - before["fetch_bytes"], span


def test_named_prefetch_coalesces_nearby_records_into_few_gets(mount_store, store_8_topics):
    """A ConsumeQueue page names ~200 records ~9 KiB apart: with readahead.named_gap_bytes they come in a few
    ranged GETs of up to 1 MiB (before: one GET per record), and the consumer's reads of them wait for nothing
    more. Fails on main: one GET per record (and no such key)."""
    m = mount_store(options=[OPTS + ",readahead.named_units=true,readahead.named_gap_bytes=64KiB"])
    from test_tiering import copy_in
    copy_in(store_8_topics, m.mnt)
    gets, fetched, span = consume_page(m, store_8_topics, PAGE)
    assert gets <= 4 + span // MiB, f"{gets} GETs for records over {span} bytes"
    assert fetched <= span + 2 * MiB


def test_a_consumers_records_come_by_whole_blocks_when_named_units_is_off(mount_store, store_8_topics):
    """Units on, readahead.named_units off (the default): the records a ConsumeQueue page names are a consumer's,
    and the next ones are in the same blocks. Even from the page no prefetch starts from (the first, pinned), they
    come by whole blocks: a few GETs, not one per record. Fails on main (one unit GET per record: ~200)."""
    m = mount_store(options=[OPTS])
    from test_tiering import copy_in
    copy_in(store_8_topics, m.mnt)
    gets, _, span = consume_page(m, store_8_topics, 0)
    assert gets <= 4 + span // MiB, f"{gets} GETs for records over {span} bytes"
