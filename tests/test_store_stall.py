"""Requests on hot files never wait behind the object store (issue 28, point 1), on real mounts:
tierfs -> faultproxy (own process, "stall": accepts, answers nothing) -> Ceph RGW.

* More O_DIRECT reads of evicted bytes than mount.max_tasks wait on the hung store while another process times
  4 KiB write+fsync and stat of hot files: each stays under 1 s (p50/p99 printed), and every reader still waits
  the whole objectstore.read_timeout_seconds, then gets EIO. On the old code pyfuse3's max_tasks workers all
  awaited the store and nobody read /dev/fuse: the hot requests waited up to read_timeout.
* mount.max_store_waiters bounds the requests that wait on the store: one more fails with EIO at once (a log line
  names the key), each waiter fails after read_timeout (a log line names the file and the object); a value the
  kernel's max_background cannot hold is refused at mount, naming the key.
* A truncate of an evicted tiered segment, which must fetch what it keeps, is a store waiter too: EIO after
  read_timeout (it waited read_timeout + 600 s before).

Latencies are printed (run with -s); no assertion leans on timing finer than a second against a 20 s stall.
"""

from __future__ import annotations

import errno
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mountutil import evict, read_line, run_python, spawn_python, stop_process, wait_for
from test_faults import (EIO_SLACK, EVICT_ALL, evicted, file_state, read_outcome, reference_store,  # noqa: F401
                         s3_opts, sealable)
from test_tiering import copy_in, segments

from tierfs.fs.mount import _mount_dev

pytestmark = pytest.mark.usefixtures("fuse_required")

HOT_BOUND_S = 1.0  # the bound on a hot request while the store hangs
STALL_READ_TIMEOUT = 20.0  # long enough that "waited it all" and "served in ms" are never confused
PROBES = 30

# N readers, each one O_DIRECT (one synchronous READ, no page-cache lock) or buffered (the kernel's read-ahead:
# background READs, which share max_background with hot files' writeback) 4 KiB read, all started at once; a
# line per reader as it ends: index, outcome (ok, eio or the errno name), seconds it took.
_READERS = r"""
import errno, json, mmap, os, sys, threading, time
jobs = json.loads(sys.argv[1])
gate = threading.Barrier(len(jobs) + 1)
out = threading.Lock()
def reader(i, path, off, direct):
    buf = mmap.mmap(-1, 4096)
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    gate.wait()
    t0 = time.monotonic()
    try:
        os.preadv(fd, [buf], off)
        what = "ok"
    except OSError as e:
        what = "eio" if e.errno == errno.EIO else errno.errorcode.get(e.errno, str(e.errno))
    took = time.monotonic() - t0
    os.close(fd)
    with out:
        print(json.dumps({"i": i, "outcome": what, "took": took, "ended": time.time()}), flush=True)
threads = [threading.Thread(target=reader, args=(i, *job)) for i, job in enumerate(jobs)]
for t in threads:
    t.start()
gate.wait()
print(json.dumps({"started": time.time()}), flush=True)
for t in threads:
    t.join()
"""

# Hot requests, timed one by one: open, 4 KiB pwrite, fsync and close of a hot file, then a stat (LOOKUPs and
# GETATTR: the mount runs with attr_timeout 0) of another hot file.
_HOT_PROBES = r"""
import json, os, sys, time
path, other, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
page = os.urandom(4096)
writes, stats = [], []
t_start = time.time()
for k in range(n):
    t0 = time.monotonic()
    fd = os.open(path, os.O_RDWR)
    os.pwrite(fd, page, (k % 16) * 4096)
    os.fsync(fd)
    os.close(fd)
    t1 = time.monotonic()
    os.stat(other)
    t2 = time.monotonic()
    writes.append(t1 - t0)
    stats.append(t2 - t1)
print(json.dumps({"write_fsync": writes, "stat": stats, "start": t_start, "end": time.time()}))
"""


def fuse_waiting(mnt: Path) -> int:
    """Requests the kernel has sent to this mount and not had answered (fusectl), read without a FUSE request."""
    dev = _mount_dev(mnt)
    assert dev is not None, f"{mnt} not in mountinfo"
    conn = Path("/sys/fs/fuse/connections") / str(os.makedev(*dev))
    if not conn.exists():
        conn = Path("/sys/fs/fuse/connections") / str(dev[1])
    return int((conn / "waiting").read_text())


def tiered_segments(m, ref: Path, top: str) -> list[str]:
    """The sealable segments of `ref` under `top`, copied in, tiered and evicted (only pinned pages local)."""
    rels = [r for r in sealable(ref, segments(ref)) if r.startswith(top)]
    assert rels, f"no sealable {top} segment in the reference store"
    wait_for(lambda: all(file_state(m, r).get("state") == "tiered" for r in rels), timeout=90, what="tiered")
    wait_for(lambda: evicted(m, rels), timeout=60, what="evicted")
    for r in rels:
        evict(m.mnt / r)  # and out of the kernel's page cache (copy_in left its pages there)
    return rels


def read_jobs(m, rels: list[str], n: int, direct: bool, first_page: int = 1) -> list[tuple[str, int, bool]]:
    """`n` 4 KiB reads at distinct pages from `first_page` (past the first one, pinned) of the CommitLog segments
    `rels`, round robin."""
    sizes = {r: os.stat(m.mnt / r).st_size for r in rels}
    jobs = []
    k = 0
    while len(jobs) < n:
        r = rels[k % len(rels)]
        page = first_page + (k // len(rels)) * 3  # spaced, so O_DIRECT reads of neighbours never share a unit
        assert page * 4096 < sizes[r], "not enough evicted pages for the readers"
        jobs.append((str(m.mnt / r), page * 4096, direct))
        k += 1
    return jobs


def pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]


def test_hot_requests_are_served_while_more_reads_than_max_tasks_wait_on_a_hung_store(
        mount_store, reference_store, rgw, fault_proxy):
    m = mount_store(options=[s3_opts(rgw, fault_proxy, "stall-hot", EVICT_ALL)
                             + f",objectstore.read_timeout_seconds={STALL_READ_TIMEOUT},mount.attr_timeout=0"])
    max_tasks = 32  # the default: nothing here sets it, so the test runs unchanged against older daemons
    copy_in(reference_store, m.mnt)
    logs = tiered_segments(m, reference_store, "commitlog/")
    hot, other = m.mnt / "config" / "hot.json", m.mnt / "config" / "other.json"
    hot.parent.mkdir(exist_ok=True)
    hot.write_bytes(os.urandom(64 << 10))  # mutable files: never tiered
    other.write_bytes(b"{}")
    baseline = json.loads(run_python(_HOT_PROBES, hot, other, PROBES, timeout=60).stdout)

    n_direct = max_tasks + 8
    # the buffered ones far from the O_DIRECT ones: their read-ahead never covers a page another reader waits on
    jobs = read_jobs(m, logs, n_direct, direct=True) + read_jobs(m, logs, 4, direct=False, first_page=192)
    fault_proxy.set("stall")
    readers = spawn_python(_READERS, json.dumps(jobs))
    try:
        started = json.loads(read_line(readers, timeout=60))["started"]
        wait_for(lambda: fuse_waiting(m.mnt) >= len(jobs), timeout=STALL_READ_TIMEOUT / 2,
                 what=f"{len(jobs)} reads of evicted bytes waiting on the hung store")
        try:
            res = run_python(_HOT_PROBES, hot, other, PROBES, timeout=STALL_READ_TIMEOUT * 3)
            during = json.loads(res.stdout)
        except subprocess.TimeoutExpired:
            during = None
        ends = [json.loads(read_line(readers, timeout=STALL_READ_TIMEOUT * 3)) for _ in jobs]
    finally:
        fault_proxy.passthrough()
        stop_process(readers)
    assert during is not None, f"hot write+fsync and stat did not finish within {STALL_READ_TIMEOUT * 3:.0f} s"

    def summary(name: str, xs: list[float]) -> str:
        return f"{name} p50 {1000 * statistics.median(xs):.1f} ms, p99 {1000 * pct(xs, 0.99):.1f} ms"

    print(f"\nhot requests, healthy store: {summary('write+fsync', baseline['write_fsync'])}; "
          f"{summary('stat', baseline['stat'])}")
    print(f"hot requests while {len(jobs)} reads ({n_direct} O_DIRECT) wait on a hung store (mount.max_tasks="
          f"{max_tasks}): {summary('write+fsync', during['write_fsync'])}; {summary('stat', during['stat'])}")
    outcomes = {e["outcome"] for e in ends}
    waited = [e for e in ends if e["took"] >= STALL_READ_TIMEOUT]
    print(f"readers: {len(waited)} waited the whole {STALL_READ_TIMEOUT:.0f} s, outcomes {sorted(outcomes)}")
    assert max(during["write_fsync"]) < HOT_BOUND_S, during["write_fsync"]
    assert max(during["stat"]) < HOT_BOUND_S, during["stat"]
    # the probes ran while the reads waited: every reader ended after the last probe, with EIO
    assert min(e["ended"] for e in ends) > during["end"], (during["end"], ends)
    assert outcomes == {"eio"}, ends
    assert sum(1 for e in waited if e["i"] < n_direct) > max_tasks, ends  # more than max_tasks waited it all
    assert m.alive()


def test_store_waiters_are_bounded_and_fail_with_eio_naming_what(mount_store, reference_store, rgw, fault_proxy):
    limit, timeout = 4, 5.0
    m = mount_store(options=[s3_opts(rgw, fault_proxy, "stall-bound", EVICT_ALL)
                             + f",objectstore.read_timeout_seconds={timeout},mount.max_store_waiters={limit}"])
    copy_in(reference_store, m.mnt)
    logs = tiered_segments(m, reference_store, "commitlog/")
    jobs = read_jobs(m, logs, 3 * limit, direct=True)
    fault_proxy.set("stall")
    readers = spawn_python(_READERS, json.dumps(jobs))
    try:
        read_line(readers, timeout=60)
        ends = [json.loads(read_line(readers, timeout=timeout * 6)) for _ in jobs]
    finally:
        fault_proxy.passthrough()
        stop_process(readers)
    waited = [e for e in ends if e["took"] >= timeout]
    refused = [e for e in ends if e["took"] < timeout]
    print(f"\n{len(jobs)} reads at once, mount.max_store_waiters={limit}: {len(refused)} refused at once (slowest "
          f"{max((e['took'] for e in refused), default=0):.3f} s), {len(waited)} waited {timeout:.0f} s")
    assert {e["outcome"] for e in ends} == {"eio"}, ends
    assert refused and waited, ends
    text = m.log_text()
    assert "wait on it (mount.max_store_waiters=4" in text, m.log_tail()
    assert "did not answer within 5.0 s (objectstore.read_timeout_seconds)" in text, m.log_tail()
    assert any(re.search(rf"a read of {r} gave up with EIO: object \S+/seg/{r}/", text) for r in logs), m.log_tail()

    # more store waiters than the kernel's background requests leave hot files' writeback: refused at mount
    bad = mount_store(options=["mount.max_background=64,mount.max_store_waiters=49"], mount=False)
    res = bad._cli_mount()
    assert res.returncode != 0
    assert "config key 'mount.max_store_waiters': 49 is too many for mount.max_background=64" in res.stderr, \
        res.stderr


def test_a_truncate_of_an_evicted_tiered_segment_fails_within_the_read_bound(
        mount_store, reference_store, rgw, fault_proxy):
    timeout = 5.0
    m = mount_store(options=[s3_opts(rgw, fault_proxy, "stall-trunc", EVICT_ALL)
                             + f",objectstore.read_timeout_seconds={timeout}"])
    copy_in(reference_store, m.mnt)
    rel = tiered_segments(m, reference_store, "commitlog/")[0]
    size = os.stat(m.mnt / rel).st_size
    fault_proxy.set("stall")
    try:  # a SETATTR waits killably: a child that outlives its timeout is killed, the test goes on
        t0 = time.monotonic()
        res = run_python("import os, sys\nfd = os.open(sys.argv[1], os.O_RDWR)\n"
                         "try:\n    os.ftruncate(fd, int(sys.argv[2]))\nexcept OSError as e:\n"
                         "    print(e.errno)\nelse:\n    print(0)\n",
                         m.mnt / rel, size - 65536, timeout=timeout * 6, check=False)
        took = time.monotonic() - t0
    except subprocess.TimeoutExpired:
        took = None
    finally:
        fault_proxy.passthrough()
    print(f"\ntruncate of an evicted tiered segment with the store hung: "
          f"{'no answer' if took is None else f'{took:.2f} s'} (read_timeout_seconds={timeout})")
    assert took is not None, f"the truncate did not end within {timeout * 6:.0f} s"
    assert res.stdout.strip() == str(errno.EIO), (res.stdout, res.stderr)
    assert took < timeout + EIO_SLACK + 1.0, took  # + the helper process's start
    assert os.stat(m.mnt / rel).st_size == size
    # the store is back: once the fetches the truncate gave up on end, the segment reads its own bytes again
    ref = (reference_store / rel).read_bytes()
    outcomes = []
    wait_for(lambda: outcomes.append(read_outcome(m.mnt / rel, ref)) or outcomes[-1] == "ok", timeout=60,
             what=f"{rel} readable again")
    assert set(outcomes) <= {"ok", "eio"}, outcomes  # never other bytes
    assert m.alive()
