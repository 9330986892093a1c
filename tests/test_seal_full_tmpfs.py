"""The sealer faults in a segment's pages before it reads them, so a full tmpfs hot dir does not kill the daemon.

On tmpfs, a read fault of a hole of a mapped file must allocate a page: with the file system full that is a
SIGBUS, and the sealer's read-only mapping (tierfs/tier/sealer.py, `_check_content`) took the daemon down the
first time it checked a segment with holes. MADV_POPULATE_READ answers EFAULT instead: the check is retried, and
judged once space is freed.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from mountutil import tmpfs, wait_for

CQ_UNIT = 20
CQ_BYTES = 20 * 6000  # a ConsumeQueue segment of the tests' brokers (mappedFileSizeConsumeQueue)


@pytest.fixture
def small_tmpfs(tmp_path: Path):
    """An 8 MiB tmpfs (set up before the mount, so torn down after it)."""
    with tmpfs(tmp_path / "ram", "8m", "tierfs-seal-tmpfs") as mnt:
        yield mnt


def fill(path: Path) -> None:
    """Write `path` until its file system is full."""
    with open(path, "wb", buffering=0) as f:
        for chunk in (1 << 20, 4096):
            try:
                while True:
                    f.write(b"\x55" * chunk)
            except OSError as e:
                assert e.errno == errno.ENOSPC, e


def test_the_seal_check_of_a_segment_with_holes_on_a_full_tmpfs_keeps_the_daemon_up(small_tmpfs, mount_store):
    """A ConsumeQueue segment whose only written unit is its last (holes before it) is checked by the sealer
    after the tmpfs under the hot dir filled up: the daemon stays up, the check is retried, and once space is
    freed the verdict is the content's (zeros are not a valid unit). Old code: the daemon died of SIGBUS in
    `_check_content`."""
    m = mount_store(hot=small_tmpfs / "hot", options=["seal.quiet_seconds=0.5,seal.scan_interval_seconds=0.5"])
    rel = f"consumequeue/TS/0/{0:020d}"
    seg = m.mnt / rel
    seg.parent.mkdir(parents=True)
    fd = os.open(seg, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, bytes(CQ_UNIT), CQ_BYTES - CQ_UNIT)  # its last page allocated, the unit not written yet
        os.fsync(fd)
        assert os.stat(m.hot / rel).st_blocks * 512 < CQ_BYTES, "the hot file has no holes to read"
        fill(small_tmpfs / "filler")
        os.pwrite(fd, (4096).to_bytes(8, "big") + (100).to_bytes(4, "big") + bytes(8), CQ_BYTES - CQ_UNIT)
        os.fsync(fd)  # into the page it has: no new block needed
    finally:
        os.close(fd)

    def logged(text: str) -> bool:
        assert m.alive(), f"the daemon died (exit {m.daemon_exit_code()}):\n{m.log_tail(40)}"
        return text in m.log_text()

    wait_for(lambda: logged(f"sealing {rel} failed ("), 60, 0.2, what=f"the sealer's retry of {rel} on a full disk")
    assert "will retry" in m.log_text()
    (small_tmpfs / "filler").unlink()
    wait_for(lambda: logged(f"{rel} not sealed: corrupt: unit 0 (offset 0, size 0)"), 60, 0.2,
             what=f"the sealer's verdict on {rel} once space was freed")
    assert m.alive()
