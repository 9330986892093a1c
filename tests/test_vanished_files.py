"""A file deleted while background work is on it is the normal case, not an error: a broker's retention deletes
segments all day long. The deletion ends that file's work and nothing else: the continuous-tiering round still
publishes its point, the eviction pass still evicts the others, no error is counted (an alert on
tierfs_errors_total must not fire on retention) and the log has no warning or traceback for it.

Each deletion is placed inside the work by a failpoint that holds it open (`sleep:N`), and each test checks that
the deletion really landed there, so it never passes by the luck of timing."""

from __future__ import annotations

import os
import re
import threading
import time

from mountutil import wait_for
from test_engine_core import CQ, EVICT_ALL, by_path, cq_bytes, put_cq, tiered_and_evicted, wait_log
from test_metrics import parse, value
from test_rpo import _cq_file, status, wait_round_after
from test_tiering import TIER_OPTS

from tierfs.metrics import CONTROL_TTL
from tierfs.objectstore import open_store
from tierfs.tier import appendlog
from tierfs.tier import snapshot as snap

BAD_LOG = re.compile(r"\b(ERROR|CRITICAL|WARNING)\b|Traceback")


def rounds_done(m) -> int:
    rpo = status(m)["rpo"]
    return rpo["rounds"] + rpo["failed_rounds"]


def errors_counted(m) -> float:
    time.sleep(CONTROL_TTL)  # the metrics file reuses one scrape for this long
    return value(parse((m.ctl / "metrics").read_text()), "tierfs_errors_total")


def test_files_deleted_during_continuous_upload_rounds_are_no_error(tmp_path, mount_store):
    """ConsumeQueue files made and deleted in a loop, as a broker's retention does, each deletion inside a round
    (between its walk and its uploads). Old code: the round failed (FileNotFoundError) with a warning, every
    time. Now every round publishes its point, nothing is counted as an error, and the point holds every
    surviving file byte for byte and no deleted one."""
    objects = tmp_path / "objects"
    objects.mkdir()
    m = mount_store(options=[TIER_OPTS, f"objectstore.url=file://{objects},store.id=van1,tiering.rpo_seconds=1,"
                                        "lease.ttl_seconds=60"],
                    env={"TIERFS_FAILPOINTS": "appendlog.upload=sleep:2"})
    pause = "failpoint appendlog.upload: pausing"
    queues = 6
    live: list[str] = []
    deleted: list[str] = []
    for batch in range(4):
        made = [f"{CQ}/TopicV/{q}/{batch * 6000 * 20:020d}" for q in range(queues)]
        for i, rel in enumerate(made):
            (m.mnt / rel).parent.mkdir(parents=True, exist_ok=True)
            _cq_file(m.mnt / rel, 500 + 100 * batch + i, batch)
        # the second round to pause from now walked the hot dir after these files were made
        wait_log(m, pause, m.log_text().count(pause) + 2)
        inside = rounds_done(m)
        gone, live = live, made  # retention: the previous batch goes while this round holds it
        for rel in gone:
            os.unlink(m.mnt / rel)
        deleted += gone
        assert rounds_done(m) == inside, "the deletions did not land inside a round: lengthen the failpoint's sleep"
    for rel in live:  # more writes for the last point
        with open(m.mnt / rel, "r+b") as f:
            f.seek(2000 * 20)
            f.write(cq_bytes(50, tag=9))
    wait_round_after(m, time.time())

    bad = [ln for ln in m.log_text().splitlines() if BAD_LOG.search(ln)]
    rpo = m.status()["rpo"]
    assert (rpo["failed_rounds"], rpo["append_put_failures"]) == (0, 0), bad[:3]
    assert rpo["rounds"] >= 8, rpo
    assert status(m)["workers"]["restarts"].get("appendlog", 0) == 0
    assert errors_counted(m) == 0
    assert not bad, bad[:5]

    store = open_store(f"file://{objects}")
    db = tmp_path / "point.db"
    db.write_bytes(store.get(snap.read_pointer(store, "van1").key))
    rows = {r.path: r for r in snap.load_tails(db, "van1", ".tierfs", set())}
    assert not set(deleted) & set(rows), sorted(set(deleted) & set(rows))
    out = tmp_path / "point"
    for rel in live:
        row = rows[rel]
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        with open(out / rel, "wb") as f:
            f.truncate(row.size)
        appendlog.materialise(store, out, row)
        assert (out / rel).read_bytes() == (m.mnt / rel).read_bytes(), rel


def holds(m, point: str) -> tuple[int, int]:
    """(holds started, holds ended) of a `sleep:` failpoint hit() so far."""
    text = m.log_text()
    return text.count(f"failpoint {point}: holding"), text.count(f"failpoint {point}: held")


def unlink_inside_hold(m, point: str, rel: str) -> None:
    """Unlink `rel` through the mount (from a thread: the unlink may wait for the held work) once a hold of
    `point` is in progress; check that its name was gone before that hold ended."""
    wait_for(lambda: holds(m, point)[0] > holds(m, point)[1], timeout=90, what=f"a hold of {point}")
    during = holds(m, point)
    t = threading.Thread(target=os.unlink, args=(m.mnt / rel,))
    t.start()
    wait_for(lambda: not os.path.lexists(m.hot_path(rel)), timeout=10, what=f"{rel} gone from the hot dir")
    assert holds(m, point) == during, "the unlink did not land inside the hold: lengthen the failpoint's sleep"
    t.join(60)
    assert not t.is_alive()


def assert_no_error(m) -> None:
    bad = [ln for ln in m.log_text().splitlines() if BAD_LOG.search(ln)]
    assert not bad, bad[:5]
    assert m.status()["workers"]["restarts"] == {}
    assert errors_counted(m) == 0


def test_a_file_deleted_while_its_eviction_commits_is_no_error(mount_store):
    """A tiered segment deleted while the eviction batch that holds it commits (the failpoint holds the catalog
    thread after that commit, so the unlink's own commit waits behind it: the entry is still live, its name is
    gone). Old code: opening it by name to punch failed, logged as a warning. Now the batch just skips it, and
    eviction goes on for the next files."""
    point = "tier.evict_commit"
    m = mount_store(options=[EVICT_ALL], env={"TIERFS_FAILPOINTS": f"{point}=sleep:3"})
    rel, other = f"{CQ}/TopicW/0/00000000000000000000", f"{CQ}/TopicW/1/00000000000000000000"
    put_cq(m, rel, cq_bytes(3000))
    wait_for(lambda: by_path(m).get(rel, {}).get("state") == "tiered", timeout=90, what=f"{rel} tiered")
    unlink_inside_hold(m, point, rel)  # the first batch is the only tiered file's
    put_cq(m, other, cq_bytes(3000, tag=2))
    wait_for(lambda: tiered_and_evicted(m, other), timeout=90, what=f"{other} tiered and evicted")
    assert (m.mnt / other).read_bytes() == cq_bytes(3000, tag=2)
    assert rel not in by_path(m)
    assert_no_error(m)


def test_a_file_deleted_while_its_residency_is_synced_is_no_error(mount_store):
    """A tiered segment read back (its fetched blocks' residency to persist, after an fdatasync of its hot file
    through the engine's fd) and deleted while that fdatasync runs in a worker thread (held by the failpoint):
    the deletion closes the engine's fd. Old code: the thread's fdatasync hit the closed fd (EBADF, the whole
    pass failed with a warning) or whatever file had its number since. Now the thread syncs copies of the fds."""
    point = "tier.residency_sync"
    # whole blocks fetched into the hot file (no verification units served from memory), a cache they fit in
    opts = TIER_OPTS.replace("cache.max_bytes=2MiB", "cache.max_bytes=256KiB") + ",cache.verify_bytes=0"
    m = mount_store(options=[opts], env={"TIERFS_FAILPOINTS": f"{point}=sleep:3"})
    rel = f"{CQ}/TopicX/0/00000000000000000000"
    want = cq_bytes(100_000)  # 31 blocks of 64 KiB
    put_cq(m, rel, want)
    wait_for(lambda: (f := by_path(m).get(rel)) is not None and f["state"] == "tiered" and f["resident_bytes"] == 0,
             timeout=120, what=f"{rel} tiered and wholly evicted")
    fd = os.open(m.mnt / rel, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the writer's pages: not this read's
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        assert os.pread(fd, 4096, 2 << 16) == want[2 << 16:(2 << 16) + 4096]  # installs a block in the hot file
    finally:
        os.close(fd)
    wait_for(lambda: m.status()["open_files"] == 0, timeout=30, what="the read's file handle released")
    unlink_inside_hold(m, point, rel)  # the only file whose residency changed
    wait_for(lambda: holds(m, point)[1] >= 1, timeout=30, what="the hold's end")
    wait_for(lambda: rel not in by_path(m), timeout=30, what=f"{rel} forgotten")
    assert_no_error(m)
