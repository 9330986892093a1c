"""Minimal reproductions of what the model-based walk (tests/test_model.py) found, each through a real mount."""

from __future__ import annotations

import os

from mountutil import wait_for
from test_identity import OPTS, assert_reads, files_by_path, units, write_segment

TOPIC = "consumequeue/TopicF"


def test_two_names_of_one_new_segment_sealed_in_one_scan_keep_one_identity(mount_store):
    """A file the sealer has never seen, with two segment names (a hard link) when the scan first finds it
    complete: seed 27 of the walk, at a link of a fresh segment. Both names were sealed in one batch as two new
    files: two file ids, the inode stamped with the second, the catalog keeping the first (the second row was
    dropped as stale). At the next mount the row's file looked like another file ("changed behind the daemon's
    back ... file id N's is gone"), the row was dropped and its objects deleted: the evicted bytes of every name
    read as zeros. One inode is one file: one id, stamped and cataloged alike, and it survives a remount."""
    m = mount_store(options=[OPTS])
    data = units(2000, 5)
    staging = m.mnt / TOPIC / "q"  # "q" is no queue id: nothing below it is a segment, nothing is sealed
    staging.mkdir(parents=True)
    with open(staging / f"{0:020d}", "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.link(staging / f"{0:020d}", staging / f"{6000:020d}")
    os.rename(staging, m.mnt / TOPIC / "0")  # both names become segments at once
    names = [f"{TOPIC}/0/{0:020d}", f"{TOPIC}/0/{6000:020d}"]

    def evicted() -> bool:
        rows = [r for p, r in files_by_path(m).items() if p in names]
        return len(rows) == 1 and rows[0]["state"] == "tiered" and rows[0]["resident_bytes"] < rows[0]["size"]
    wait_for(evicted, timeout=60, what=f"one tiered, evicted row for {names}")
    stamp = int(os.getxattr(m.hot / names[0], "user.tierfs.fid"))
    rows = [r for p, r in files_by_path(m).items() if p in names]
    assert [r["file_id"] for r in rows] == [stamp], f"rows {rows}, the inode stamped {stamp}"
    m.remount()
    for rel in names:
        assert_reads(m, rel, data)
    assert "changed behind the daemon's back" not in m.log_text(), m.log_tail(20)


def orphans(m) -> list[str]:
    """Objects under the store's seg/ that no catalog row and no pending delete names (tierfs fsck)."""
    import json

    res = m.cli("fsck", m.mnt, "--json", timeout=120)
    assert res.returncode in (0, 1), res.stderr
    return [f["key"] for f in json.loads(res.stdout)["findings"] if f["kind"] == "orphan_object"]


def test_objects_put_before_a_crash_are_not_left_behind_by_a_rename(mount_store):
    """The walk's `tierfs fsck` at rest found objects no row or pending delete names (seeds 1, 27 and random
    ones, after kill -9 steps and after takeovers). One way: a segment's chunks are PUT under its name, the file
    is renamed before the TIERED commit, the daemon dies before that commit. The next daemon finds the row (its
    path moved by the rename's own commit) SEALED again and uploads it anew under the new name; the chunks under
    the old name are never deleted. No byte is lost, but the bucket keeps them for good."""
    m = mount_store(options=[OPTS], env={"TIERFS_FAILPOINTS": "tier.upload_commit=sleep:60"})
    old, new = f"{TOPIC}/0/{0:020d}", f"{TOPIC}/1/{0:020d}"
    (m.mnt / TOPIC / "1").mkdir(parents=True)
    write_segment(m, old, units(500, 1))
    wait_for(lambda: "failpoint tier.upload_commit: pausing" in m.log_text(), timeout=30, what="the chunks put")
    os.rename(m.mnt / old, m.mnt / new)
    m.kill()
    m.env.pop("TIERFS_FAILPOINTS")
    m.mount()

    def tiered() -> bool:
        row = files_by_path(m).get(new, {})
        return row.get("state") == "tiered"
    wait_for(tiered, timeout=60, what=f"{new} tiered again")
    # the new daemon's own deletes and sweeps run in the background: wait, by condition, for none to be left
    wait_for(lambda: not orphans(m), timeout=20, interval=1, what=f"no orphaned object (left: {orphans(m)})")


def test_a_takeover_keeps_a_hard_linked_active_file_one_file(tmp_path, mount_store):
    """The walk (seed 1, a takeover at step 170; caught by its identity check: two catalog rows for one file)
    after a hard link of a segment not tiered yet: the takeover built its names as two files (two inodes, each
    nlink 1, each sealed with its own id), so a write through one name no longer shows through the other. A
    hard link is one file on the writer, and must be one on the takeover too (as it is for tiered files:
    test_identity.test_a_hard_linked_tiered_file_survives_a_takeover_as_one_file)."""
    from test_rpo import RPO

    (tmp_path / "objects").mkdir()
    url = f"file://{tmp_path / 'objects'}"
    opts = [OPTS, f"objectstore.url={url},store.id=hotlinks,tiering.rpo_seconds={RPO},lease.ttl_seconds=60,"
                  "compaction.enabled=false,seal.quiet_seconds=3600"]  # nothing seals: the file stays active
    a = mount_store(options=opts)
    names = [f"{TOPIC}/0/{0:020d}", f"{TOPIC}/1/{0:020d}"]
    (a.mnt / TOPIC / "1").mkdir(parents=True)
    write_segment(a, names[0], units(300, 4))
    os.link(a.mnt / names[0], a.mnt / names[1])
    b = lose_the_writer_and_take_over(tmp_path, a, f"{url}/hotlinks", opts)
    try:
        assert len({os.stat(b.mnt / rel).st_ino for rel in names}) == 1, "two files where there was one"
    finally:
        b.cleanup()


def lose_the_writer_and_take_over(tmp_path, a, src: str, opts: list[str]):
    """Once a continuous-tiering round that started now has published its point, the writer `a` is killed with
    its hot dir; the takeover mount (the caller cleans it up) from `src` is returned."""
    import shutil
    import signal
    import time

    from test_rpo import takeover, wait_round_after

    wait_round_after(a, time.time())
    a.kill(signal.SIGKILL)
    shutil.rmtree(a.hot)
    return takeover(tmp_path, src, opts, "b")[0]
