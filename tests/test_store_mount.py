"""The broker's own workload through a real mount: the example producer writes a byte-accurate store with the
broker's syscall pattern (shared mmap + msync, 20-byte writes + fdatasync, fcntl lock, config renames), the
example consumer reads it back by queue offset and by key, in separate processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mountutil import evict, wait_for

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


def evict_tree(root: Path) -> None:
    """Drop the clean pages of every file below root, so reads go through FUSE to the daemon's hot dir."""
    for p in root.rglob("*"):
        if p.is_file() and ".tierfs" not in p.parts:
            evict(p)


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
    evict_tree(m.mnt)
    assert tree_digest(m.mnt) == before
    assert consume(m.mnt, "--expect-messages", "4000", "--check-keys", "500")["messages"] == 4000


def test_kill9_producer_mid_run_recovers_valid_prefix(mount_store):
    """A broker killed mid-write leaves a store whose valid prefix recovers, and the daemon keeps exactly the bytes
    the broker left: the hot dir after the unmount and the mount after a remount (read uncached) hold the same
    bytes, file for file, as the mount showed right after the kill (a count of messages would miss a lost page
    of an index or a ConsumeQueue)."""
    m = mount_store()
    proc = subprocess.Popen([sys.executable, str(PRODUCER), str(m.mnt), *SMALL, "--messages", "0", "--topics", "2",
                             "--queues", "2", "--flush-ms", "50"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def rolled_over() -> bool:
        assert proc.poll() is None, f"the producer exited {proc.returncode}: {proc.stderr.read()[-2000:]!r}"
        return len(list((m.mnt / "commitlog").glob("0*"))) >= 4
    try:
        wait_for(rolled_over, timeout=120, interval=0.1, what="the producer to roll over to a 4th CommitLog segment")
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert (m.mnt / "abort").exists(), "a killed broker leaves its abort file"
    # the killed producer may have appended records it had not indexed yet (the broker re-dispatches those at
    # abnormal recovery, format §9), so the recovered prefix is checked by queue offset, CRC and phys offset
    got = consume(m.mnt, "--recover", "--check-keys", "0")
    assert got["ok"] and got["abort_present"] and got["messages"] > 1000
    left = tree_digest(m.mnt)
    assert len(left) >= 4 + 4, sorted(left)  # the CommitLog segments and a ConsumeQueue per queue at least
    m.umount()
    assert changed_files(tree_digest(m.hot), left) == [], "the hot dir lacks bytes the killed broker wrote"
    m.mount()
    evict_tree(m.mnt)
    assert changed_files(tree_digest(m.mnt), left) == [], "a remount does not serve the bytes the broker left"
    assert consume(m.mnt, "--recover", "--check-keys", "0") == got


def changed_files(now: dict[str, tuple[int, bytes]], want: dict[str, tuple[int, bytes]]) -> list[str]:
    """Paths whose size or bytes differ between two tree_digest results (or that only one holds)."""
    return sorted(p for p in now.keys() | want.keys() if now.get(p) != want.get(p))
