"""Minimal reproductions of what the model-based walk (tests/test_model.py) found, each through a real mount."""

from __future__ import annotations

import os

from mountutil import wait_for
from test_identity import OPTS, assert_reads, files_by_path, units

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
