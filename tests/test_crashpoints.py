"""SIGKILL of the daemon at the engine's named crash points, then remount: every file's crc32c must equal the
reference copy's. The failpoint kills the daemon from inside (`TIERFS_FAILPOINTS=<point>=kill`, tests only).

Where each crash point of issue 6 is exercised:
    tier.chunk_put        mid-upload, after the first chunk object     test_tiering.py::test_kill9_during_tiering
    tier.after_put        after the PUTs, before the catalog commit    test_tiering.py::test_kill9_during_tiering
    tier.after_commit     after the commit, before local bytes drop    test_tiering.py::test_kill9_during_tiering
    tier.evict            between the durable bitmap and the punch     test_tiering.py::test_kill9_during_tiering
    compaction.before_swap between the job's manifest and the swap     here
    tier.rewrite          a write re-materialising a tiered segment    here
    tier.rewritten        after that rewrite's one transaction         here
    tier.sealed           after a seal batch's commit, before memory   here
    tier.unlinked         after an unlink's transaction, before memory here
    snapshot.upload       between the snapshot .db and its pointer     here
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import crc32c
import pytest

from mountutil import daemon_env, evict, wait_for
from test_compaction import PIPE_OPTS
from test_fsck import fsck, kinds
from test_tiering import copy_in, reference_store, segments, status, wait_tiered_and_evicted  # noqa: F401


def file_crcs(root: Path) -> dict[str, int]:
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and ".tierfs" not in p.parts:
            evict(p)
            out[str(p.relative_to(root))] = crc32c.crc32c(p.read_bytes())
    return out


def settle(m, ref: Path) -> None:
    """Every sealable segment tiered, and eviction done."""
    sealable = len(segments(ref)) - 2  # the active CommitLog and IndexFile stay hot
    wait_for(lambda: len(status(m)["files"]) >= sealable, timeout=90, what="segments sealed")
    wait_tiered_and_evicted(m, [f["path"] for f in status(m)["files"]], timeout=90)


def die_rewriting(m, ref: Path) -> None:
    victim = next(f["path"] for f in status(m)["files"] if f["kind"] == "commitlog" and f["state"] == "tiered")
    try:
        fd = os.open(m.mnt / victim, os.O_WRONLY)
        try:
            os.pwrite(fd, b"\x01" * 4096, 8192)  # different bytes: not an identical rewrite
            os.fsync(fd)  # never acknowledged: the daemon dies in before_write
        finally:
            os.close(fd)
    except OSError:
        pass


def die_unlinking(m, ref: Path) -> set[str]:
    victim = next(f["path"] for f in status(m)["files"] if f["kind"] == "consumequeue" and f["state"] == "tiered")
    try:
        os.unlink(m.mnt / victim)
    except OSError:
        pass
    return {victim}


def die_swapping(m, ref: Path) -> None:
    subprocess.run([sys.executable, "-m", "tierfs", "compact", str(m.mnt), "--only", "segments"],
                   capture_output=True, timeout=600)


@pytest.mark.parametrize("point,extra,trigger", [
    ("tier.rewrite", "", die_rewriting),
    ("tier.rewritten", "", die_rewriting),
    ("tier.sealed", "", None),
    ("tier.unlinked", "", die_unlinking),
    ("compaction.before_swap", "", die_swapping),
    ("snapshot.upload", ",snapshot.interval_seconds=1", None),
])
def test_sigkill_at_crash_point_loses_nothing(mount_store, reference_store, tmp_path, point, extra, trigger):
    ref = reference_store
    opts = PIPE_OPTS + f",objectstore.url=file://{tmp_path / 'bucket'}" + extra
    (tmp_path / "bucket").mkdir()
    m = mount_store(options=[opts], env={"TIERFS_FAILPOINTS": f"{point}=kill"})
    acked = copy_in(ref, m.mnt, stop_on_disconnect=True)
    gone: set[str] = set()
    if trigger is not None:
        settle(m, ref)
        gone = trigger(m, ref) or set()
    wait_for(lambda: not m.alive(), timeout=90, what=f"daemon killed at {point}")
    m.kill()  # clears the dead mount
    m.env = daemon_env()
    m.mount()
    if point == "compaction.before_swap":  # the job's result is applied at start-up
        wait_for(lambda: all(f["format"] == "lz4c" for f in status(m)["files"] if f["state"] == "tiered"),
                 timeout=60, what="the compaction result applied after the crash")
    want = {p: crc32c.crc32c((ref / p).read_bytes()) for p in acked if p not in gone}
    got = file_crcs(m.mnt)
    assert {p: got.get(p) for p in want} == want, "an acknowledged file differs after the crash"
    # one transaction per state change: whatever the crash interrupted, no object is left that nothing references
    _, rep, _ = fsck(m.mnt)
    assert kinds(rep).get("orphan_object", 0) == 0, rep
    copy_in(ref, m.mnt)  # finish the store, let tiering resume, and check everything once more
    settle(m, ref)
    assert file_crcs(m.mnt) == file_crcs(ref)
