"""The benchmarks' baselines and CPU figures (bench/_common.py, bench/fuse_floor.c), on real processes and a real
C floor mount: a daemon's CPU counts its helper processes, live and reaped, each once; the floor's write primer
primes a page-by-page writer ahead as tierfs's does, and its hole answer returns the file's true bytes."""

from __future__ import annotations

import math
import os
import struct
import subprocess
import sys
from pathlib import Path

from mountutil import wait_for

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import _common as C  # noqa: E402

MiB = 1 << 20

# burns `cpu` CPU-seconds, then (live=True) waits for its stdin to close
_BURN = ("import sys, time\nt = time.process_time()\nwhile time.process_time() - t < {cpu}: pass\n"
         "sys.stdin.read() if {live} else None\n")
_PARENT = """import subprocess, sys
live = subprocess.Popen([sys.executable, "-c", {live!r}], stdin=subprocess.PIPE)
subprocess.run([sys.executable, "-c", {gone!r}], stdin=subprocess.DEVNULL)  # reaped: only in our cutime
print("burning", flush=True)
sys.stdin.read()
live.stdin.close()
live.wait()
"""


def test_tree_cpu_counts_live_and_reaped_helpers_once():
    """A parent with one live child and one reaped child, each having burnt 0.3 CPU-seconds: both show in the tree's
    helpers, and the whole tree's figure is no more than what the tree really used (counted by the kernel when we
    reap the parent), so nothing is counted twice. The daemon pid's own figure (proc_cpu_seconds) has neither."""
    cpu = 0.3
    parent = _PARENT.format(live=_BURN.format(cpu=cpu, live=True), gone=_BURN.format(cpu=cpu, live=False))
    before = C.children_cpu_seconds()
    p = subprocess.Popen([sys.executable, "-c", parent], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "burning"
        # the live child has burnt its share once its CPU stops growing past `cpu` (it is then blocked on stdin)
        wait_for(lambda: C.tree_cpu(p.pid).helpers >= 2 * cpu - 0.02, timeout=60, interval=0.05,
                 what="both children's CPU in the tree")
        t = C.tree_cpu(p.pid)
        own = C.proc_cpu_seconds(p.pid)
        assert t.processes == 2
        assert abs(t.own - own) <= 0.02
        assert C.tree_cpu(p.pid, same_session=True).helpers < t.helpers - cpu / 2  # the reaped one left out
    finally:
        p.stdin.close()
        p.wait(timeout=60)
    used = C.children_cpu_seconds() - before  # the whole tree, reaped: the kernel's own sum
    assert t.total <= used + 0.02, (t, used)
    assert math.isnan(C.tree_cpu(p.pid).total)  # gone: nan, never a stale figure


def _cue(fd: int, p: Path, first: int, per_page: int, log: Path) -> int:
    """Write 20-byte units page after page from unit `first` until the floor's primer has read pages ahead of the
    writer into the page cache (two page READs in a row, < 1 s apart, ask it); the next unit."""
    unit = struct.Struct(">qiq")
    n = first
    for _ in range(400):
        for i in range(n, n + per_page):
            os.write(fd, unit.pack(i * 100, 100, 7))
        n += per_page
        page = n * 20 // 4096 + 1
        if C.resident_pages(p, page, 16) == 16:
            return n
    raise AssertionError(f"no page ahead of the writer was ever primed; floor log: {log.read_text()[-2000:]}")


def test_floor_write_primer_and_hole_reads(tmp_path: Path, fuse_required: None):
    """bench/fuse_floor.c --write-prime --hole-reads, as hot_path.py --floor mounts it: a writer of a preallocated
    file gets the pages ahead of it primed by the floor's helper process, every byte it wrote lands, the primer's
    requests are counted in the log at exit; large READs of a file with holes return its true bytes."""
    src, mnt = tmp_path / "src", tmp_path / "mnt"
    src.mkdir()
    sparse = src / "sparse"
    with open(sparse, "wb") as f:  # hole, data, hole: large READs answer the holes without reading them
        f.truncate(4 * MiB)
        f.seek(MiB + 12345)
        f.write(os.urandom(300_000))
    with C.FloorMount(src, mnt, tmp_path / "build", write_prime_kb=256, hole_reads=True) as floor:
        assert floor.pid is not None
        fd = os.open(mnt / "sparse", os.O_RDONLY)
        try:
            got = b"".join(iter(lambda: os.read(fd, MiB), b""))
        finally:
            os.close(fd)
        assert got == sparse.read_bytes()

        p = mnt / "cq" / "00000000000000000000"
        p.parent.mkdir()
        fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            os.ftruncate(fd, 4 * MiB)
            n = _cue(fd, p, 0, 4096 // 20, floor.log_path)
            os.fsync(fd)
        finally:
            os.close(fd)
        assert C.tree_cpu(floor.pid).processes == 2  # the floor and its primer process
    data = (src / "cq" / "00000000000000000000").read_bytes()
    unit = struct.Struct(">qiq")
    assert len(data) == 4 * MiB
    assert all(unit.unpack_from(data, i * 20) == (i * 100, 100, 7) for i in range(n))
    assert data[n * 20:] == bytes(4 * MiB - n * 20)
    log = floor.log_path.read_text()
    requests = int(log.split("write primer: ", 1)[1].split()[0])
    assert requests >= 1, log


def test_floor_without_primer_has_no_helper(tmp_path: Path, fuse_required: None):
    """The bare floor (--floor-primer off) stays a single process and logs no primer."""
    with C.FloorMount(tmp_path / "src", tmp_path / "mnt", tmp_path / "build", write_prime_kb=0) as floor:
        (floor.mnt / "f").write_bytes(b"x" * 5000)
        assert C.tree_cpu(floor.pid).processes == 1
    assert "write primer" not in floor.log_path.read_text()
    assert (tmp_path / "src" / "f").read_bytes() == b"x" * 5000
