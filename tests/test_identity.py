"""A file is its identity, not its name (issue 27): tiered and evicted segments read back exactly after every
namespace operation a person or a backup tool makes through the mount (hard links, renames of files and
directories, RENAME_EXCHANGE, writes through any name or through /proc/PID/fd), across remounts and kill -9.

Each test tiers a ConsumeQueue segment, lets eviction empty its local copy (cache.max_bytes=0), does the operation,
and reads every name back with its pages dropped (posix_fadvise DONTNEED, never drop_caches), against the bytes a
plain directory would hold.
"""

from __future__ import annotations

import ctypes
import os
import sqlite3
import struct
import subprocess
from pathlib import Path

from mountutil import wait_for

OPTS = ("tiering.enabled=true,cache.max_bytes=0,cache.block_bytes=4KiB,objectstore.chunk_bytes=64KiB,"
        "seal.quiet_seconds=0.05,seal.scan_interval_seconds=0.1,delete.grace_seconds=0")
TOPIC = "consumequeue/TopicI"
SEG = f"{TOPIC}/0/00000000000000000000"
RENAME_EXCHANGE = 2


def units(n: int, tag: int) -> bytes:
    """n valid ConsumeQueue units (commitlog offset, size, tag hash): a segment the sealer accepts."""
    return b"".join(struct.pack(">qiq", i * 100, 100, tag + i) for i in range(n))


def files_by_path(m) -> dict[str, dict]:
    return {f["path"]: f for f in m.status()["files"]}


def write_segment(m, rel: str, data: bytes) -> None:
    p = m.mnt / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def wait_evicted(m, rel: str) -> None:
    def evicted() -> bool:
        f = files_by_path(m).get(rel, {})
        return f.get("state") == "tiered" and f.get("resident_bytes", 1) < f.get("size", 0)
    wait_for(evicted, timeout=60, what=f"{rel} tiered and evicted")


def read_cold(path) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return os.pread(fd, 1 << 24, 0)
    finally:
        os.close(fd)


def assert_reads(m, rel: str, want: bytes) -> None:
    got = read_cold(m.mnt / rel)
    assert got == want, f"{rel}: {len(got)} bytes read, {len(want)} expected, " \
                        f"{sum(a != b for a, b in zip(got, want))} differ; log: {m.log_tail(15)}"


def tiered_segment(mount_store, rel: str = SEG, n: int = 2000):
    m = mount_store(options=[OPTS])
    data = units(n, 7)
    write_segment(m, rel, data)
    wait_evicted(m, rel)
    return m, data


def test_hard_link_then_unlink_the_first_name_keeps_the_bytes(mount_store):
    """`cp -al` of the store, then the broker's retention deletes the original: the backup's link reads the
    segment. Failed before: the other name read zeros (the row and objects went with the first name)."""
    m, data = tiered_segment(mount_store)
    backup = "backup/0/00000000000000000000"
    (m.mnt / "backup/0").mkdir(parents=True)
    os.link(m.mnt / SEG, m.mnt / backup)
    os.unlink(m.mnt / SEG)
    assert_reads(m, backup, data)
    m.remount()
    assert_reads(m, backup, data)


def test_write_through_a_non_segment_name_reaches_the_tiered_file(mount_store):
    """A tiered file renamed to x.bin and written at an evicted offset: the write is the file's, whatever its
    name. Failed before: the write went to a hole and the old bytes came back from the object store."""
    m, data = tiered_segment(mount_store)
    other = f"{TOPIC}/0/x.bin"
    os.rename(m.mnt / SEG, m.mnt / other)
    patch = b"\xab" * 20
    fd = os.open(m.mnt / other, os.O_RDWR)
    try:
        os.pwrite(fd, patch, 20_000)
        os.fsync(fd)
    finally:
        os.close(fd)
    want = data[:20_000] + patch + data[20_020:]
    assert_reads(m, other, want)
    m.remount()
    assert_reads(m, other, want)


def test_write_through_proc_fd_of_an_unlinked_tiered_file(mount_store):
    """An fd open on a tiered file that is then unlinked, reopened read-write through /proc/self/fd: its writes
    are the file's and read back through the held fd."""
    m, data = tiered_segment(mount_store)
    held = os.open(m.mnt / SEG, os.O_RDONLY)
    try:
        os.unlink(m.mnt / SEG)
        fd = os.open(f"/proc/self/fd/{held}", os.O_RDWR)
        try:
            os.pwrite(fd, b"\xcd" * 40, 8_000)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.posix_fadvise(held, 0, 0, os.POSIX_FADV_DONTNEED)
        assert os.pread(held, 1 << 20, 0) == data[:8_000] + b"\xcd" * 40 + data[8_040:]
    finally:
        os.close(held)


def test_directory_rename_and_remount_keep_every_file(mount_store):
    """A topic directory renamed, then a remount and a kill -9 + remount: the files below it are the same
    files. Failed before: reconcile matched rows by path, deleted their objects, and the renamed files read
    zeros."""
    m, data = tiered_segment(mount_store)
    second = f"{TOPIC}/1/00000000000000000000"
    data2 = units(1500, 99)
    write_segment(m, second, data2)
    wait_evicted(m, second)
    os.rename(m.mnt / TOPIC, m.mnt / "consumequeue/TopicJ")
    moved = {SEG.replace("TopicI", "TopicJ"): data, second.replace("TopicI", "TopicJ"): data2}
    m.remount()  # before any read: a read would fetch the bytes back into the hot file
    assert {f["path"]: f["state"] for f in m.status()["files"]} == dict.fromkeys(moved, "tiered")
    for rel, want in moved.items():
        assert_reads(m, rel, want)
    m.kill()
    m.mount()
    for rel, want in moved.items():
        assert_reads(m, rel, want)


def test_rename_exchange_swaps_identities(mount_store):
    """RENAME_EXCHANGE of two tiered segments: each name now reads the other's bytes, also after a remount.
    Failed before: the engine saw a plain rename and one entry overwrote the other."""
    m, data = tiered_segment(mount_store)
    other = f"{TOPIC}/0/00000000000000040000"
    data2 = units(1000, 55)
    write_segment(m, other, data2)
    wait_evicted(m, other)
    libc = ctypes.CDLL(None, use_errno=True)
    a, b = os.fsencode(m.mnt / SEG), os.fsencode(m.mnt / other)
    assert libc.renameat2(-100, a, -100, b, RENAME_EXCHANGE) == 0, os.strerror(ctypes.get_errno())
    rows = files_by_path(m)
    assert (rows[SEG]["size"], rows[other]["size"]) == (len(data2), len(data)), "rows did not follow the files"
    m.remount()  # before any read: a read would fetch the bytes back into the hot file
    assert_reads(m, SEG, data2)
    assert_reads(m, other, data)


def test_rename_of_the_hot_dir_while_unmounted_is_followed(mount_store):
    """A crash between the hot-dir rename and its catalog commit is the same as a rename the daemon never saw:
    `tierfs fsck --repair` says where the file is and keeps its row and objects, and the next mount finds the
    file by its identity and the row follows it."""
    from test_fsck import fsck

    m, data = tiered_segment(mount_store)
    m.umount()
    os.rename(m.hot / TOPIC, m.hot / "consumequeue/TopicK")
    code, rep, err = fsck(m.hot, "--repair")
    assert rep["summary"].get("row_renamed") == 1 and not rep["summary"].get("row_without_hot_file"), rep
    m.mount()
    rel = SEG.replace("TopicI", "TopicK")
    assert_reads(m, rel, data)
    assert files_by_path(m)[rel]["state"] == "tiered"


# The last main before file-id keyed catalogs and identity stamps: the upgrade test mounts a store it wrote.
PREVIOUS = "b66567a"


def test_a_store_of_the_previous_version_upgrades_with_nothing_lost_or_reuploaded(mount_store, tmp_path):
    """A store written by the previous version (its own code, from git history), with a tiered segment renamed
    and another hard-linked before the upgrade, mounts with this version: every byte reads back, nothing is
    uploaded again, the catalog is keyed by file id and every tiered file is stamped."""
    repo = Path(__file__).resolve().parent.parent
    old = tmp_path / "previous"
    old.mkdir()
    arch = subprocess.run(["git", "-C", str(repo), "archive", PREVIOUS, "tierfs"], capture_output=True, timeout=60)
    assert arch.returncode == 0, f"the previous version {PREVIOUS} is not in this checkout's history " \
                                 f"(a shallow clone?): {arch.stderr.decode()}"
    subprocess.run(["tar", "-x", "-C", str(old)], input=arch.stdout, check=True, timeout=60)
    env = {"PYTHONPATH": str(old)}
    m = mount_store(options=[OPTS], env=env)
    want = {SEG: units(2000, 7), f"{TOPIC}/1/00000000000000000000": units(1500, 8)}
    for rel, data in want.items():
        write_segment(m, rel, data)
    for rel in want:
        wait_evicted(m, rel)
    renamed = f"{TOPIC}/0/00000000000000040000"
    os.rename(m.mnt / SEG, m.mnt / renamed)
    want[renamed] = want.pop(SEG)
    (m.mnt / "backup").mkdir()
    os.link(m.mnt / f"{TOPIC}/1/00000000000000000000", m.mnt / "backup/q1")
    want["backup/q1"] = want[f"{TOPIC}/1/00000000000000000000"]
    m.umount()
    assert not Path(m.hot / ".tierfs" / "catalog.db").read_bytes().count(b"files_path"), "not the old schema"

    new = mount_store(hot=m.hot, options=[OPTS])
    for rel, data in want.items():
        assert_reads(new, rel, data)
    st = new.status()
    assert st["totals"]["engine"]["uploads"] == 0, f"uploaded again after the upgrade: {st['totals']['engine']}"
    db = sqlite3.connect(new.hot / ".tierfs" / "catalog.db")
    try:
        pk = [r[1] for r in db.execute("PRAGMA table_info(files)") if r[5]]
        rows = dict(db.execute("SELECT path, file_id FROM files"))
    finally:
        db.close()
    assert pk == ["file_id"]
    assert renamed in rows and f"{TOPIC}/1/00000000000000000000" in rows
    for rel, fid in rows.items():
        assert int(os.getxattr(new.hot / rel, "user.tierfs.fid")) == fid, rel


def test_engine_fds_stay_bounded_with_many_tiered_files(mount_store):
    """Finding 11: the engine kept one fd per tiered file until it was deleted (a broker has tens of thousands of
    ConsumeQueue files; the fd limit is 20,000 here). 1,300 tiered, evicted files all read back cold: the daemon
    holds at most ENGINE_FDS of them (plus its own few), and every byte is right."""
    from mountutil import fd_targets
    from tierfs.tier import engine

    ENGINE_FDS = getattr(engine, "ENGINE_FDS", 1024)  # (b66567a had no bound: it fails with 1,300)

    m = mount_store(options=[OPTS.replace("seal.scan_interval_seconds=0.1", "seal.scan_interval_seconds=0.5")])
    n = ENGINE_FDS + 276
    want = {f"{TOPIC}/{q}/{i * 600 * 20:020d}": units(600, q * 1000 + i) for q in range(4) for i in range(n // 4)}
    for rel, data in want.items():
        write_segment(m, rel, data)

    def all_evicted() -> bool:
        files = files_by_path(m)
        return all(files.get(r, {}).get("state") == "tiered" and files[r]["resident_bytes"] < files[r]["size"]
                   for r in want)
    wait_for(all_evicted, timeout=300, interval=1, what=f"{n} segments tiered and evicted")
    for rel, data in want.items():
        assert_reads(m, rel, data)
    hot = str(m.hot)

    def held() -> int:  # the engine's, and the FUSE handles of readers whose RELEASE is still on its way
        return sum(t.startswith(hot + "/consumequeue") for t in fd_targets(m.pid))
    wait_for(lambda: held() <= ENGINE_FDS, timeout=30, what=f"at most {ENGINE_FDS} fds of tiered files "
                                                             f"(the daemon holds {held()})")


def test_a_hard_linked_tiered_file_survives_a_takeover_as_one_file(tmp_path, mount_store):
    """A catalog snapshot names a hard link's second name as the tiered file it is (before: it read the evicted
    file's holes as a blob of zeros), and a takeover builds both names as one inode (one row, one set of objects):
    both names read the segment, and deleting one of them later leaves the other whole."""
    import shutil
    import signal
    import time

    from test_rpo import RPO, status, takeover, wait_round_after

    (tmp_path / "objects").mkdir()
    url = f"file://{tmp_path / 'objects'}"
    opts = [OPTS, f"objectstore.url={url},store.id=links,tiering.rpo_seconds={RPO},lease.ttl_seconds=60,"
                  f"compaction.enabled=false"]
    a = mount_store(options=opts)
    data = units(2000, 7)
    write_segment(a, SEG, data)
    wait_evicted(a, SEG)
    backup = "backup/q0"
    (a.mnt / "backup").mkdir()
    os.link(a.mnt / SEG, a.mnt / backup)
    wait_round_after(a, time.time())  # a point that has both names
    a.kill(signal.SIGKILL)
    shutil.rmtree(a.hot)

    b, _ = takeover(tmp_path, f"{url}/links", opts, "b")
    try:
        assert os.stat(b.mnt / SEG).st_ino == os.stat(b.mnt / backup).st_ino, "two files where there was one"
        rows = [f["path"] for f in status(b)["files"] if f["state"] == "tiered"]
        assert len(rows) == 1 and rows[0] in (SEG, backup), rows
        assert_reads(b, SEG, data)
        assert_reads(b, backup, data)
        os.unlink(b.mnt / SEG)
        b.remount()
        assert_reads(b, backup, data)
    finally:
        b.cleanup()


def test_a_file_renamed_over_a_segment_during_its_probe_is_sealed(mount_store):
    """Finding 7: a segment replaced by a rename while the sealer probed it was parked as a candidate without an
    inode, which no probe ever took up again: the new file stayed local for good (unless something fsync'd it
    through the mount once more). Now the next probe binds the candidate to the inode the name has."""
    m = mount_store(options=[OPTS], env={"TIERFS_FAILPOINTS": "seal.probed=sleep:2"})
    data = units(800, 2)
    write_segment(m, f"{TOPIC}/0/tmp", data)  # no segment name: never a candidate; fsync'd: never flushed again
    write_segment(m, SEG, units(500, 1))  # complete: its probe's verdict is "seal it"
    wait_for(lambda: f"probed {SEG}: checked" in m.log_text(), timeout=30, what="a probe that says: seal it")
    os.rename(m.mnt / TOPIC / "0" / "tmp", m.mnt / SEG)  # while that probe holds the old inode's verdict
    log = m.log_text()
    assert log.count("failpoint seal.probed: paused") < log.count("failpoint seal.probed: pausing"), \
        "the rename came after that probe's verdict was applied"
    wait_evicted(m, SEG)
    assert_reads(m, SEG, data)


def test_an_unlink_during_the_tiered_commit_leaks_no_object(mount_store):
    """Finding 9: a segment unlinked while its upload's TIERED commit was on its way: the unlink dropped the row
    with no objects to delete (the entry was still UPLOADING), and the upload's commit either wrote the row back
    or left its chunks in the store for good. Now whichever commit runs first, the row ends gone and the chunks
    are deleted."""
    m = mount_store(options=[OPTS], env={"TIERFS_FAILPOINTS": "tier.upload_commit=sleep:2"})
    write_segment(m, SEG, units(2000, 3))
    wait_for(lambda: "failpoint tier.upload_commit: pausing" in m.log_text(), timeout=30, what="an upload commit")
    os.unlink(m.mnt / SEG)
    seg_objects = m.state_dir / "objects"

    def chunks() -> list[str]:  # os.walk: the janitor removes emptied directories while we list them
        return [f"{d}/{f}" for d, _, fs in os.walk(seg_objects) for f in fs if "/seg/" in f"{d}/"]
    wait_for(lambda: not chunks(), timeout=60, what="the deleted segment's chunks deleted")
    m.remount()
    assert SEG not in files_by_path(m), "a stale row came back"
    assert not chunks()


def test_a_compaction_swap_never_overwrites_a_write(mount_store):
    """Finding 8: a write into a tiered segment commits its row HOT (a new generation) a moment before memory
    follows; a compaction applied in that moment swapped in the lz4c objects of the old content over the HOT
    row (the swap was an INSERT OR REPLACE), and after a remount the old content was served: the write was lost.
    Now the swap is a compare-and-swap on (generation, tiered, raw) and the compacted object goes instead."""
    import sys
    import time

    from test_compaction import compact

    hold = 120  # seconds the write's memory update waits: far longer than the compaction job below
    # quiet for 5 s before a seal: the written file is not sealed (and its row rewritten) before the kill below
    # and the old generation's objects stay for the grace, as in production: the job can read them
    m = mount_store(options=[OPTS.replace("seal.quiet_seconds=0.05", "seal.quiet_seconds=5")
                             .replace("delete.grace_seconds=0", "delete.grace_seconds=600")
                             + ",compaction.enabled=false,spark.master=local[2]"],
                    env={"TIERFS_FAILPOINTS": f"tier.rewrite_committed=sleep:{hold}"})
    data = units(2000, 7)
    write_segment(m, SEG, data)
    wait_evicted(m, SEG)
    patch = struct.pack(">qiq", 1000 * 100, 100, 424242)  # unit 1000, rewritten (still a complete segment)
    code = ("import os,sys; fd=os.open(sys.argv[1], os.O_RDWR); os.pwrite(fd, bytes.fromhex(sys.argv[2]), 20000); "
            "os.fsync(fd); os.close(fd)")
    t0 = time.monotonic()
    writer = subprocess.Popen([sys.executable, "-c", code, str(m.mnt / SEG), patch.hex()])
    try:
        wait_for(lambda: "failpoint tier.rewrite_committed: pausing" in m.log_text(), timeout=60,
                 what="the write's HOT row committed")
        result = compact(m, "--only", "segments")
        assert writer.poll() is None and time.monotonic() - t0 < hold, "the compaction did not land in the window"
        assert not result["errors"], result  # the job compacted the old generation; its swap came in the window
        assert writer.wait(timeout=hold + 60) == 0
    finally:
        if writer.poll() is None:
            writer.kill()
    m.kill()  # the write is acknowledged (fsync'd); a crash now must not lose it
    m.mount()
    wait_evicted(m, SEG)  # whatever the catalog says the file is, its local copy goes: the store must hold it
    assert_reads(m, SEG, data[:20_000] + patch + data[20_020:])
