"""One reference authority over objects (issue 27): an object goes only when nothing refers to it, and every
object a referrer stops needing does go. Through a real mount, a real Spark job and the embedded object store."""

from __future__ import annotations

import os
import subprocess
import sys

from mountutil import files_under, wait_for
from test_identity import OPTS, SEG, units, wait_evicted, write_segment

HOLD = 45  # seconds the compaction's apply waits (a failpoint): far longer than the write below


def test_a_compaction_output_whose_swap_was_skipped_is_deleted(mount_store):
    """A compaction job compacts a tiered segment; before its result is applied, a write makes the segment HOT
    again, so the swap is skipped. The job's lz4c object is then referred to by nothing: it must be deleted
    (on 998c1ad nothing ever queued it, and it stayed in the store for good). It is also held while the job
    runs, so nothing deletes it before the apply."""
    m = mount_store(options=[OPTS + ",compaction.enabled=false,spark.master=local[1]"],
                    env={"TIERFS_FAILPOINTS": f"compaction.before_swap=sleep:{HOLD}"})
    data = units(2000, 7)
    write_segment(m, SEG, data)
    wait_evicted(m, SEG)
    objects = m.state_dir / "objects"

    def lz4c() -> list[str]:
        return sorted(str(p) for p in files_under(objects) if p.suffix == ".lz4c")
    job = subprocess.Popen([sys.executable, "-m", "tierfs", "compact", str(m.mnt), "--json", "--only", "segments"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: "failpoint compaction.before_swap: pausing" in m.log_text(), timeout=300,
                 what="the job's result waiting to be applied")
        assert lz4c(), "the job wrote no compacted object"
        with open(m.mnt / SEG, "r+b") as f:  # the segment is HOT again, at a new generation
            f.seek(20_000)
            f.write(b"\x01" * 20)
            f.flush()
            os.fsync(f.fileno())
        wait_for(lambda: {x["path"]: x for x in m.status()["files"]}.get(SEG, {}).get("state") == "hot",
                 timeout=60, what="the written segment HOT again")
        assert "failpoint compaction.before_swap: paused" not in m.log_text(), "the write missed the window"
        out, err = job.communicate(timeout=HOLD + 120)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    assert job.returncode == 0, err
    assert '"skipped"' in out and SEG in out, out
    wait_for(lambda: not lz4c(), timeout=60, what="the compacted object nothing refers to deleted")
