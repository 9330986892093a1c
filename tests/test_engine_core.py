"""The engine core's findings (issue 10), each on a real mount driven by real processes. Every test here failed
on the engine before file ids, pins, supervised workers and daemon-side flushes; the docstring names the finding.
"""

from __future__ import annotations

import mmap
import os
import re
import shutil
import sqlite3
import struct
from pathlib import Path

import crc32c

from mountutil import evict, wait_for
from test_tiering import (TIER_OPTS, by_path, copy_in, reference_store, segments, status,  # noqa: F401
                          wait_tiered_and_evicted)

EVICT_ALL = TIER_OPTS.replace("cache.max_bytes=2MiB", "cache.max_bytes=0")
CQ = "consumequeue"


def tiered_and_evicted(m, rel: str) -> bool:
    f = by_path(m).get(rel)
    return f is not None and f["state"] == "tiered" and f["resident_bytes"] < f["size"]


def object_files(m, rel: str) -> list[Path]:
    return [m.state_dir / "objects" / k for k in by_path(m)[rel]["objects"]]


def cq_bytes(units: int, tag: int = 7) -> bytes:
    """A complete ConsumeQueue file: every unit valid, unit ends strictly increasing (the seal rule's test)."""
    return b"".join(struct.pack(">qiq", i * 100, 100, tag + i) for i in range(units))


def put_cq(m, rel: str, data: bytes) -> None:
    (m.mnt / rel).parent.mkdir(parents=True, exist_ok=True)
    with open(m.mnt / rel, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def test_unlinked_evicted_segment_reads_its_bytes_through_an_open_fd(mount_store):
    """Finding 1: an evicted segment unlinked while a process holds it open read back as zeros through that fd
    (the unlink dropped the tiered entry, and reads fell through to the punched hot file)."""
    m = mount_store(options=[EVICT_ALL])
    rel = f"{CQ}/TopicA/0/00000000000000000000"
    want = cq_bytes(3000)  # 60,000 bytes: all but its first and last page are evicted
    put_cq(m, rel, want)
    wait_for(lambda: tiered_and_evicted(m, rel), timeout=90, what=f"{rel} tiered and evicted")
    objects = object_files(m, rel)
    with open(m.mnt / rel, "rb", buffering=0) as f:
        os.unlink(m.mnt / rel)
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        got = f.read()
        assert got == want, f"{sum(a != b for a, b in zip(got, want))} bytes differ through the open fd"
        assert all(p.exists() for p in objects), "objects of an open file deleted before its last close"
        mapped = mmap.mmap(f.fileno(), len(want), prot=mmap.PROT_READ)
    assert mapped[:] == want  # still mapped after close: the kernel holds the file open
    mapped.close()
    wait_for(lambda: not any(p.exists() for p in objects), timeout=60, what="objects deleted after the last close")
    assert m.alive()


def test_segment_recreated_under_the_same_name_within_the_grace_keeps_its_data(mount_store):
    """Finding 2: a segment deleted and re-created under the same name within delete.grace_seconds restarted at
    generation 0, reused the object keys, and the janitor then deleted the new file's objects."""
    m = mount_store(options=[EVICT_ALL.replace("delete.grace_seconds=0", "delete.grace_seconds=3")])
    rel = f"{CQ}/TopicB/0/00000000000000000000"
    put_cq(m, rel, cq_bytes(3000))
    wait_for(lambda: tiered_and_evicted(m, rel), timeout=90, what=f"{rel} tiered and evicted")
    old = object_files(m, rel)
    data = cq_bytes(3000, tag=99)  # the topic deleted and created again: same name, other content
    os.unlink(m.mnt / rel)
    put_cq(m, rel, data)
    wait_for(lambda: tiered_and_evicted(m, rel), timeout=90, what="the new file tiered and evicted")
    new = object_files(m, rel)
    assert not set(new) & set(old), "the new file reuses the deleted file's object keys"
    wait_for(lambda: not any(p.exists() for p in old), timeout=60, what="the deleted file's objects gone")
    assert all(p.exists() for p in new), "the janitor deleted the new file's objects"
    evict(m.mnt / rel)
    assert (m.mnt / rel).read_bytes() == data


def _mmap_writer(src: Path, dst: Path) -> None:
    """Write a file the way a broker under ASYNC_FLUSH does when its flush service falls behind: through a
    shared mapping, with no msync or fsync ever."""
    data = src.read_bytes()
    fd = os.open(dst, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.ftruncate(fd, len(data))
        with mmap.mmap(fd, len(data)) as mp:
            mp[:] = data
    finally:
        os.close(fd)


def test_segments_written_through_mmap_seal_without_any_fsync(mount_store, reference_store):
    """Finding 3: a segment whose last pages reached the daemon as kernel writeback with no fsync after them
    stayed hot forever ("flushed after the last write" never held). Every complete segment must still seal,
    tier and evict; the hot ones say why they are not sealed."""
    m = mount_store(options=[TIER_OPTS])
    segs = segments(reference_store)
    for p in sorted(reference_store.rglob("*")):
        rel = p.relative_to(reference_store)
        if p.is_dir():
            (m.mnt / rel).mkdir(parents=True, exist_ok=True)
        elif str(rel) in segs:
            _mmap_writer(p, m.mnt / rel)
        else:
            shutil.copyfile(p, m.mnt / rel)
    sealable = len(segs) - 2  # the active CommitLog and IndexFile are incomplete
    wait_for(lambda: len(status(m)["files"]) >= sealable, timeout=120, what="every complete segment sealed")
    wait_tiered_and_evicted(m, [f["path"] for f in status(m)["files"]], timeout=120)
    hot = {f["path"]: f["not_sealed"] for f in status(m)["hot_segments"]}
    assert set(hot) == set(segs) - {f["path"] for f in status(m)["files"]}
    assert all(hot.values()), hot
    segments_view = (m.ctl / "segments").read_text()
    assert all(f"not sealed: {why}" in segments_view for why in hot.values())
    for rel in segs:
        evict(m.mnt / rel)
        assert crc32c.crc32c((m.mnt / rel).read_bytes()) == crc32c.crc32c((reference_store / rel).read_bytes())


def test_a_failing_worker_is_restarted_and_the_mount_stays_up(mount_store, reference_store):
    """Finding 6: one unexpected exception in a background loop ended the whole mount (here: the evictor, at its
    failpoint). Supervised, it is logged, counted, shown in status and restarted; the mount keeps serving."""
    m = mount_store(options=[TIER_OPTS], env={"TIERFS_FAILPOINTS": "tier.evict=raise"})
    copy_in(reference_store, m.mnt)
    wait_for(lambda: status(m).get("workers", {}).get("restarts", {}).get("evictor", 0) >= 1, timeout=90,
             what="the evictor failing and restarted")
    assert m.alive()
    assert "worker evictor restarted" in (m.ctl / "status").read_text()
    metrics = (m.ctl / "metrics").read_text()
    assert re.search(r'tierfs_worker_restarts_total\{worker="evictor"\} [1-9]', metrics), metrics[-2000:]
    for rel in segments(reference_store):
        assert (m.mnt / rel).read_bytes() == (reference_store / rel).read_bytes()


def test_a_file_changed_behind_the_daemons_back_is_not_served_from_stale_objects(mount_store):
    """Finding 10: reconcile trusted catalog rows without re-checking the file. A tiered segment replaced in the
    hot dir while unmounted was served from its old objects (wrong bytes); now the row goes and it seals anew."""
    m = mount_store(options=[EVICT_ALL])
    rel = f"{CQ}/TopicC/0/00000000000000000000"
    put_cq(m, rel, cq_bytes(3000))
    wait_for(lambda: tiered_and_evicted(m, rel), timeout=90, what=f"{rel} tiered and evicted")
    m.umount()
    new = cq_bytes(2999, tag=5)  # one unit shorter, other content, still complete
    hot = m.hot_path(rel)
    os.unlink(hot)
    hot.write_bytes(new)
    m.mount()
    assert (m.mnt / rel).read_bytes() == new
    assert "changed behind the daemon's back" in m.log_text()
    wait_for(lambda: tiered_and_evicted(m, rel), timeout=90, what="the replaced file tiered again")
    evict(m.mnt / rel)
    assert (m.mnt / rel).read_bytes() == new


def test_a_segment_that_shrinks_during_its_upload_is_sealed_again(mount_store, reference_store):
    """Finding 10: a file that shrank after its seal retried "short read" forever; a truncate did not even count
    as a change. Now the upload's generation is voided and the file is judged again from its new content."""
    opts = TIER_OPTS + ",upload.bandwidth_bytes_per_second=64KiB"
    m = mount_store(options=[opts])
    rel = "commitlog/00000000000000000000"
    (m.mnt / "commitlog").mkdir()
    shutil.copyfile(reference_store / rel, m.mnt / rel)
    with open(m.mnt / rel, "rb+") as f:
        os.fsync(f.fileno())
    wait_for(lambda: by_path(m).get(rel, {}).get("state") in ("sealed", "uploading"), timeout=60, what="sealed")
    os.truncate(m.mnt / rel, 100_000)
    wait_for(lambda: by_path(m).get(rel, {}).get("state") == "hot", timeout=60, what="back to hot")
    assert (m.mnt / rel).read_bytes() == (reference_store / rel).read_bytes()[:100_000]
    assert m.log_text().count("short read") <= 1
    assert m.alive()


def test_a_catalog_of_the_previous_version_is_migrated_at_mount(mount_store):
    """Existing stores: a catalog without file ids (the previous version's schema, generations counted per file
    from 0) is migrated at mount: rows get ids, every byte reads back, and new generations start above every
    generation in use, so no new object key can equal an old one."""
    m = mount_store(options=[EVICT_ALL])
    rels = [f"{CQ}/TopicM/{q}/00000000000000000000" for q in range(3)]
    for rel in rels:
        put_cq(m, rel, cq_bytes(3000, tag=len(rel)))
    wait_for(lambda: all(tiered_and_evicted(m, r) for r in rels), timeout=90, what="tiered and evicted")
    m.umount()
    db = sqlite3.connect(m.hot_path(".tierfs", "catalog.db"))
    cols = [r[1] for r in db.execute("PRAGMA table_info(files)") if r[1] not in ("file_id", "ino")]
    db.executescript(f"""
        CREATE TABLE old AS SELECT {','.join(cols)} FROM files; DROP TABLE files; ALTER TABLE old RENAME TO files;
        DELETE FROM meta;""")
    db.commit()
    top = max(g for (g,) in db.execute("SELECT generation FROM files"))
    db.close()
    m.mount()
    assert "Traceback" not in m.log_text()
    for rel in rels:
        evict(m.mnt / rel)
        assert (m.mnt / rel).read_bytes() == cq_bytes(3000, tag=len(rel))
    files = by_path(m)
    assert len({files[r]["file_id"] for r in rels}) == len(rels)
    os.unlink(m.mnt / rels[0])
    put_cq(m, rels[0], cq_bytes(2000))
    wait_for(lambda: tiered_and_evicted(m, rels[0]), timeout=90, what="the re-created file tiered")
    assert by_path(m)[rels[0]]["generation"] > top


def wait_log(m, text: str, count: int = 1, timeout: float = 90) -> None:
    wait_for(lambda: m.log_text().count(text) >= count, timeout=timeout, what=f"log line {text!r}")


def test_the_evictor_never_punches_a_file_being_rematerialised(mount_store):
    """Finding 4: a write into a tiered segment fetched every block, then awaited fdatasync while the entry was
    still evictable: the evictor punched the blocks just fetched and the file turned HOT full of holes. Now the
    file is pinned from the first fetch to the commit (the failpoint holds the window open for 3 s)."""
    m = mount_store(options=[EVICT_ALL], env={"TIERFS_FAILPOINTS": "tier.rematerialise_synced=sleep:3"})
    rel = f"{CQ}/TopicD/0/00000000000000000000"
    want = bytearray(cq_bytes(3000))
    put_cq(m, rel, bytes(want))
    wait_for(lambda: tiered_and_evicted(m, rel), timeout=90, what=f"{rel} tiered and evicted")
    new_unit = struct.pack(">qiq", 1500 * 100, 100, 424242)
    with open(m.mnt / rel, "r+b") as f:
        f.seek(1500 * 20)
        f.write(new_unit)
        f.flush()
        os.fsync(f.fileno())
    want[1500 * 20:1501 * 20] = new_unit
    wait_log(m, "failpoint tier.rematerialise_synced: pausing")
    evict(m.mnt / rel)
    assert (m.mnt / rel).read_bytes() == bytes(want)
    wait_for(lambda: tiered_and_evicted(m, rel), timeout=90, what="the new generation tiered and evicted")
    evict(m.mnt / rel)
    assert (m.mnt / rel).read_bytes() == bytes(want)


def test_an_unlink_and_recreate_during_an_eviction_batch_punches_nothing_of_the_new_file(mount_store):
    """Finding 5: an eviction batch punched by reopening each file by path after its commit. A file unlinked and
    re-created meanwhile had the new file's blocks punched (zeros where data was written); an unlinked one aborted
    the batch with the others half-done. Punches now go through the file's own fd (by file id)."""
    m = mount_store(options=[EVICT_ALL], env={"TIERFS_FAILPOINTS": "tier.evict_saved=sleep:3"})
    rel = f"{CQ}/TopicE/0/00000000000000000000"
    other = f"{CQ}/TopicE/1/00000000000000000000"
    put_cq(m, other, cq_bytes(3000, tag=3))
    put_cq(m, rel, cq_bytes(3000, tag=1))
    wait_for(lambda: by_path(m).get(rel, {}).get("state") == "tiered", timeout=90, what="tiered")
    before = m.log_text().count("failpoint tier.evict_saved: pausing")
    wait_log(m, "failpoint tier.evict_saved: pausing", before + 1)
    os.unlink(m.mnt / rel)  # while the batch that holds it waits between its commit and its punches
    new = cq_bytes(3000, tag=2)
    put_cq(m, rel, new)
    wait_log(m, "failpoint tier.evict_saved: pausing", before + 2)  # the batch went on to its punches
    evict(m.mnt / rel)
    assert (m.mnt / rel).read_bytes() == new
    wait_for(lambda: tiered_and_evicted(m, other), timeout=90, what="the other file of the batch evicted")
    evict(m.mnt / other)
    assert (m.mnt / other).read_bytes() == cq_bytes(3000, tag=3)
    assert m.alive()



def test_residency_reaches_the_catalog_only_after_its_bytes_are_durable(mount_store, tmp_path):
    """Finding 7: the evictor fdatasynced the hot files, then saved the *live* resident bitmaps, which had gained
    the bits of blocks fetched during the fdatasync; after a power cut those blocks were zeros on disk and still
    served as resident, with no crc check. The power cut is modelled (tests/powerloss.py): the daemon journals
    its writes and syncs, every sync waits 3 s, and after the kill -9 every write no completed sync covers is
    zeroed."""
    import powerloss

    journal = tmp_path / "journal"
    hot = tmp_path / "hot"
    # whole blocks: a random read of a row with a verification-unit table keeps nothing locally
    opts = TIER_OPTS.replace("cache.max_bytes=2MiB", "cache.max_bytes=256KiB") + ",cache.verify_bytes=0"
    m = mount_store(hot=hot, options=[opts], env=powerloss.env(hot, journal, slow_sync=3))
    rel = f"{CQ}/TopicP/0/00000000000000000000"
    want = cq_bytes(100_000)  # 2,000,000 bytes: 31 blocks of 64 KiB
    put_cq(m, rel, want)
    wait_for(lambda: (f := by_path(m).get(rel)) is not None and f["state"] == "tiered" and f["resident_bytes"] == 0,
             timeout=120, what=f"{rel} tiered and wholly evicted")
    seg = str(m.hot_path(rel))
    first, second = 2 << 16, 28 << 16  # blocks 2 and 28: far apart, so read-ahead of one never brings the other

    def read_at(off: int) -> bytes:
        fd = os.open(m.mnt / rel, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the writer's pages: not this read's
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            return os.pread(fd, 4096, off)
        finally:
            os.close(fd)

    def sync_started_after_first_write() -> str | None:
        wrote = False
        for f in powerloss.lines(journal)[skip:]:
            if f[0] == "W" and f[4] == seg and int(f[2]) <= first < int(f[2]) + int(f[3]):
                wrote = True
            elif f[0] == "S" and f[2] == seg and wrote:
                return f[1]
        return None

    skip = len(powerloss.lines(journal))  # the writer's writes and syncs, and the upload's
    assert read_at(first) == want[first:first + 4096]
    wait_for(lambda: sync_started_after_first_write() is not None, timeout=60,
             what="the daemon syncing the hot file after the first fetched block was written")
    sync = sync_started_after_first_write()
    assert read_at(second) == want[second:second + 4096]  # fetched and written while that sync is in progress
    wait_for(lambda: any(f[0] == "D" and f[2] == sync for f in powerloss.lines(journal)), timeout=60,
             what="that sync finished")

    def persisted_first() -> bool:
        db = sqlite3.connect(f"file:{m.state_dir / 'catalog.db'}?mode=ro", uri=True, timeout=10)
        try:
            row = db.execute("SELECT resident FROM files WHERE path=?", (rel,)).fetchone()
        finally:
            db.close()
        return bool(row and row[0] and row[0][2 >> 3] & (1 << 2))

    wait_for(persisted_first, timeout=60, what="the first block's residency in the catalog")
    m.kill()
    assert powerloss.apply(journal) > 0, "the power cut lost nothing: the test did not open its window"
    m2 = mount_store(hot=hot, options=[opts], mnt=tmp_path / "mnt2")
    got = (m2.mnt / rel).read_bytes()
    assert got == want, f"{sum(a != b for a, b in zip(got, want))} bytes differ after the power cut"
