"""The broker's own workload through a real mount: the example producer writes a byte-accurate store with the
broker's syscall pattern (shared mmap + msync, 20-byte writes + fdatasync, fcntl lock, config renames), the
example consumer reads it back by queue offset and by key, in separate processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mountutil import evict

REPO = Path(__file__).resolve().parent.parent
PRODUCER = REPO / "examples" / "producer.py"
CONSUMER = REPO / "examples" / "consumer.py"
SMALL = ["--commitlog-size", str(1 << 20), "--cq-size", "6000", "--index-slots", "500", "--index-items", "2000"]


def produce(store: Path, *extra: str, timeout: float = 120) -> dict:
    r = subprocess.run([sys.executable, str(PRODUCER), str(store), *SMALL, *extra], capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def consume(store: Path, *extra: str, timeout: float = 120) -> dict:
    r = subprocess.run([sys.executable, str(CONSUMER), str(store), "--json", "--index-slots", "500",
                        "--index-items", "2000", *extra], capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def tree_digest(root: Path) -> dict[str, tuple[int, bytes]]:
    """path -> (size, content) of every file below root, skipping the control dir and the state dir."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d != ".tierfs"]
        for f in files:
            p = Path(dirpath) / f
            out[str(p.relative_to(root))] = (p.stat().st_size, p.read_bytes())
    return out


@pytest.mark.parametrize("version,cq_mode", [("5", "filechannel"), ("4", "mmap")])
def test_producer_then_consumer_through_mount(mount_store, version, cq_mode):
    m = mount_store()
    summary = produce(m.mnt, "--broker-version", version, "--cq-mode", cq_mode, "--messages", "6000",
                      "--topics", "2", "--queues", "2", "--body-min", "100", "--body-max", "900")
    assert summary["messages"] == 6000
    got = consume(m.mnt, "--expect-messages", "6000", "--check-keys", "-1")
    assert got["ok"] and got["messages"] == 6000 and got["keys_checked"] > 0
    # every segment has exactly its configured size, as the broker's startup check demands (format §2)
    for p in (m.mnt / "commitlog").iterdir():
        assert p.stat().st_size == 1 << 20, p
    for p in (q for q in (m.mnt / "consumequeue").glob("*/*/0*") if q.is_file()):
        assert p.stat().st_size == 6000, p
    # the mount shows exactly the hot dir's bytes, and nothing extra in segment dirs
    assert tree_digest(m.mnt) == tree_digest(m.hot)
    assert not [p for p in (m.mnt / "commitlog").iterdir() if not p.name.isdigit()]
    # clean shutdown semantics of the producer: lock file present, abort removed
    assert (m.mnt / "lock").exists() and not (m.mnt / "abort").exists()


def test_remount_and_read_again_uncached(mount_store):
    m = mount_store()
    produce(m.mnt, "--messages", "4000", "--topics", "1", "--queues", "2")
    before = tree_digest(m.mnt)
    m.umount()
    m.mount()
    for p in m.mnt.rglob("*"):
        if p.is_file() and ".tierfs" not in p.parts:
            evict(p)  # read through FUSE from the disk, not from the page cache of the first mount
    assert tree_digest(m.mnt) == before
    assert consume(m.mnt, "--expect-messages", "4000", "--check-keys", "500")["messages"] == 4000


def test_kill9_producer_mid_run_recovers_valid_prefix(mount_store):
    m = mount_store()
    proc = subprocess.Popen([sys.executable, str(PRODUCER), str(m.mnt), *SMALL, "--messages", "0", "--topics", "2",
                             "--queues", "2", "--flush-ms", "50"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # let it roll over a few segments first
            if len(list((m.mnt / "commitlog").glob("0*"))) >= 4:
                break
            time.sleep(0.1)
        time.sleep(0.3)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert (m.mnt / "abort").exists(), "a killed broker leaves its abort file"
    # the killed producer may have appended records it had not indexed yet (the broker re-dispatches those at
    # abnormal recovery, format §9), so the recovered prefix is checked by queue offset, CRC and phys offset
    got = consume(m.mnt, "--recover", "--check-keys", "0")
    assert got["ok"] and got["abort_present"] and got["messages"] > 1000
    # and the same prefix is there after a remount (nothing acknowledged lived only in the daemon)
    m.umount()
    m.mount()
    again = consume(m.mnt, "--recover", "--check-keys", "0")
    assert again["ok"] and again["messages"] >= got["messages"]
