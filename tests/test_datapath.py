"""The data path on real mounts: cold reads served from fetched buffers without thrashing the local cache, and
holes of untiered files answered without reading the disk."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from mountutil import evict, helper_children, pid_alive, wait_for
from test_store_mount import PRODUCER
from test_tiering import copy_in

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from _common import resident_pages  # noqa: E402  (one page-cache residency helper for tests and benchmarks)

MiB = 1 << 20
CAP = 2 * MiB
OPTS = (f"tiering.enabled=true,cache.max_bytes={CAP},cache.block_bytes=64KiB,objectstore.chunk_bytes=256KiB,"
        "seal.quiet_seconds=0.5,seal.scan_interval_seconds=0.5,broker.max_hash_slot_num=500,"
        "broker.max_index_num=2000,delete.grace_seconds=0,readahead.max_blocks=16")
A, B = "commitlog/00000000000000000000", f"commitlog/{4 * MiB:020d}"


def status(m) -> dict:
    return json.loads((m.ctl / "status.json").read_text())


@pytest.fixture(scope="module")
def store_4mib(tmp_path_factory) -> Path:
    """A store with 4 MiB CommitLog segments (twice the cache budget), written natively by the example producer."""
    ref = tmp_path_factory.mktemp("ref4")
    r = subprocess.run([sys.executable, str(PRODUCER), str(ref), "--commitlog-size", str(4 * MiB), "--cq-size",
                        "60000", "--index-slots", "500", "--index-items", "2000", "--messages", "9000",
                        "--body-size", "1000", "--topics", "1", "--queues", "2"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return ref


def test_scan_larger_than_the_cache_is_served_from_memory_and_evicts_nothing(mount_store, store_4mib):
    m = mount_store(options=[OPTS])
    copy_in(store_4mib, m.mnt)

    def settled() -> bool:
        st = status(m)
        files = {f["path"]: f for f in st["files"]}
        return (all(files.get(p, {}).get("state") == "tiered" for p in (A, B))
                and st["totals"].get("upload_backlog_files", 0) == 0 and st["totals"]["cache_bytes"] <= 0.9 * CAP)
    wait_for(settled, timeout=90, what="both segments tiered, uploads done, cache under its high watermark")

    # a random reader of A: its block is fetched and kept locally (the evictor keeps the budget by LRU)
    ref_a = (store_4mib / A).read_bytes()
    fd = os.open(m.mnt / A, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        assert os.pread(fd, 4096, 2 * MiB + 8192) == ref_a[2 * MiB + 8192:2 * MiB + 12288]
    finally:
        os.close(fd)
    before = status(m)["totals"]["engine"]

    # a scan of B, twice the cache budget: every byte right, served from memory, nothing evicted for it
    evict(m.mnt / B)
    with open(m.mnt / B, "rb", buffering=0) as f:
        got = b"".join(iter(lambda: f.read(MiB), b""))
    assert got == (store_4mib / B).read_bytes()
    st = status(m)
    eng = st["totals"]["engine"]
    assert eng["reads_from_memory"] > before["reads_from_memory"]
    assert eng["memory_only_bytes"] - before["memory_only_bytes"] >= 2 * MiB  # most of the scan was not kept
    assert st["totals"]["cache_bytes"] <= 0.9 * CAP  # never above the evictor's high watermark...
    assert eng["evicted_bytes"] == before["evicted_bytes"]  # ...so nothing was evicted for the scan
    # the scan again: still right (from memory, the kept part, or fetched again)
    evict(m.mnt / B)
    assert (m.mnt / B).read_bytes() == (store_4mib / B).read_bytes()
    assert m.alive()


def test_read_ahead_gets_fit_a_budget_smaller_than_one_get(mount_store, store_4mib):
    """readahead.budget_bytes below the read-ahead GET size (16 MiB chunks: up to 16 MiB per GET): GETs are cut
    to a quarter of the budget. Before, a run longer than the budget never started as a prefetch, the reads
    waited on demand fetches and the pool thrashed (a 4 MiB scan fetched 9.8 MiB; now 4.0-4.7 MiB)."""
    from types import SimpleNamespace

    from tierfs.tier.blockcache import BlockCache

    plan = BlockCache(SimpleNamespace(config={"readahead.budget_bytes": 2 * MiB, "cache.unit_tables_bytes": MiB,
                                              "mount.max_store_waiters": 48}))
    assert plan._group_blocks(64 << 10) == 8  # 512 KiB GETs
    assert plan._group_blocks(MiB) == 1
    plan.eng.config["readahead.budget_bytes"] = 256 * MiB  # the default: 16 MiB GETs
    assert plan._group_blocks(MiB) == 16

    m = mount_store(options=[OPTS.replace("objectstore.chunk_bytes=256KiB", "objectstore.chunk_bytes=16MiB")
                             + f",readahead.budget_bytes={2 * MiB}"])
    copy_in(store_4mib, m.mnt)
    evicted: list[str] = []

    def one_evicted() -> bool:
        files = {f["path"]: f for f in status(m)["files"]}
        evicted[:] = [p for p in (A, B) if files.get(p, {}).get("state") == "tiered"
                      and files[p].get("resident_bytes") == 0]
        return bool(evicted)
    wait_for(one_evicted, timeout=90, what="a 4 MiB segment tiered with nothing resident")
    rel = evicted[0]
    before = status(m)["totals"]["engine"]
    evict(m.mnt / rel)
    with open(m.mnt / rel, "rb", buffering=0) as f:
        got = b"".join(iter(lambda: f.read(MiB), b""))
    assert got == (store_4mib / rel).read_bytes()
    assert status(m)["totals"]["engine"]["prefetch_bytes"] > before["prefetch_bytes"]


def test_holes_of_an_untiered_file_are_answered_without_reading_them(mounted, tmp_path):
    """A preallocated file (ftruncate) with data in the middle, as a fresh mmap'd CommitLog segment is: large reads
    of its holes are answered as zeros without the disk, and every byte still comes back right."""
    m = mounted
    data = os.urandom(3 * MiB + 12345)
    p = m.mnt / "prealloc.dat"
    with open(p, "wb") as f:
        f.truncate(32 * MiB)
        f.seek(8 * MiB + 4096)
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    evict(p)
    evict(m.hot / "prealloc.dat")
    with open(p, "rb", buffering=0) as f:
        got = b"".join(iter(lambda: f.read(MiB), b""))
    want = bytes(8 * MiB + 4096) + data + bytes(32 * MiB - 8 * MiB - 4096 - len(data))
    assert len(got) == len(want) and got == want
    assert status(m)["bytes_read_from_holes"] >= 20 * MiB


def test_consumequeue_page_prefetches_the_commitlog_records_it_names(mount_store, tmp_path):
    """Layout-aware prefetch: reading a tiered ConsumeQueue (beyond its pinned first and last pages, which the broker
    peeks at on start and when cleaning) fetches the evicted CommitLog blocks its units name, so the consumer's
    record reads that follow are answered from memory without waiting on the store."""
    ref = tmp_path / "ref"
    r = subprocess.run([sys.executable, str(PRODUCER), str(ref), "--commitlog-size", str(MiB), "--cq-size", "20000",
                        "--index-slots", "500", "--index-items", "2000", "--messages", "4000", "--body-size", "1000",
                        "--topics", "4", "--queues", "1"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    m = mount_store(options=[OPTS.replace(f"cache.max_bytes={CAP}", "cache.max_bytes=256KiB")])
    copy_in(ref, m.mnt)
    topic = sorted(p.name for p in (ref / "consumequeue").iterdir())[0]
    cq = f"consumequeue/{topic}/0/{sorted(os.listdir(ref / 'consumequeue' / topic / '0'))[0]}"
    cls = [f"commitlog/{n}" for n in sorted(os.listdir(ref / "commitlog"))[:-1]]

    def evicted() -> bool:
        files = {f["path"]: f for f in status(m)["files"]}
        return all(files.get(p, {}).get("state") == "tiered" and files[p]["resident_bytes"] <= 8192
                   for p in [cq, *cls])
    wait_for(evicted, timeout=90, what="the queue file and the sealed CommitLog segments tiered and evicted")
    for rel in [cq, *cls]:
        evict(m.mnt / rel)  # written through the mount: still in the page cache
    # the CommitLog open, as the broker keeps it mapped, and read from once (its first page is pinned: local)
    fds = {name: os.open(m.mnt / name, os.O_RDONLY) for name in cls}
    try:
        for fd in fds.values():
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            os.pread(fd, 64, 0)
        e0 = status(m)["totals"]["engine"]
        page = (m.mnt / cq).read_bytes()
        units = [u for u in struct.iter_unpack(">qiq", page) if u[0] >= 0 and u[1] > 0]
        assert len(units) == 1000
        e1 = status(m)["totals"]["engine"]
        named = e1["named_prefetch_bytes"] - e0["named_prefetch_bytes"]
        assert named > 0
        wait_for(lambda: status(m)["totals"]["engine"]["prefetch_bytes"] - e0["prefetch_bytes"] >= named,
                 timeout=30, what="the named CommitLog blocks fetched")
        e2 = status(m)["totals"]["engine"]
        for phys, size, _ in units:
            base = phys - phys % MiB
            name = f"commitlog/{base:020d}"
            if name not in cls:
                continue  # in the active segment: local
            got = os.pread(fds[name], size, phys - base)
            with open(ref / name, "rb") as f:
                f.seek(phys - base)
                assert got == f.read(size), f"record at {phys}"
        e3 = status(m)["totals"]["engine"]
    finally:
        for fd in fds.values():
            os.close(fd)
    assert e3["reads_waited"] == e2["reads_waited"]  # every record was in memory already
    assert e3["fetches"] == e2["fetches"]


def test_block_buffers_are_reused_held_and_given_back_when_idle():
    """Fetch buffers go back to their free list only when the last holder (fetch, pool, install) lets go, are
    reused from there, and leave once no fetch needed them for IDLE_SECONDS. Pure bookkeeping, no mount."""
    from tierfs.tier.bufferpool import IDLE_SECONDS, BufferPool

    pool = BufferPool(budget=2 * MiB)
    bufs = pool.buffers
    a = bufs.take(MiB)
    pool.put((1, 1, 0), a.view, unread=True, buf=a)  # the pool holds it too
    bufs.hold(a)  # and an install
    bufs.release(a)  # the fetch lets go
    assert bufs.free_bytes == 0
    pool.discard((1, 1, 0))
    assert bufs.free_bytes == 0  # the install still writes from it
    bufs.release(a)
    assert bufs.free_bytes == MiB
    assert bufs.take(MiB) is a and bufs.free_bytes == 0  # reused, not a fresh allocation
    b = bufs.take(MiB)
    assert b is not a
    pool.put((1, 1, 1), a.view, unread=False, buf=a)
    pool.put((1, 1, 2), b.view, unread=False, buf=b)
    bufs.release(a)
    bufs.release(b)
    pool.put((1, 1, 3), memoryview(bytearray(MiB)), unread=False)  # over budget: the oldest block goes
    assert (1, 1, 1) not in pool and bufs.free_bytes == MiB
    pool.discard_file(1)
    assert bufs.free_bytes == 2 * MiB
    bufs.trim(1000.0)  # first look: nothing was idle for a whole interval yet
    assert bufs.free_bytes == 2 * MiB
    bufs.release(bufs.take(MiB))  # one is cycled meanwhile: kept; the other stayed idle: goes
    bufs.trim(1000.0 + IDLE_SECONDS / 2)  # too soon
    assert bufs.free_bytes == 2 * MiB
    bufs.trim(1000.0 + IDLE_SECONDS)
    assert bufs.free_bytes == MiB
    bufs.trim(1000.0 + 2 * IDLE_SECONDS)
    assert bufs.free_bytes == 0


def _fuse_reads(m) -> int:
    for line in (m.ctl / "stats").read_text().splitlines():
        if line.split()[:1] == ["read"]:
            return int(line.split()[1])
    return 0


def test_a_writer_filling_a_preallocated_file_is_primed_ahead(mounted):
    """A broker's ConsumeQueue writer: 20-byte units into a file preallocated to its full size. With the writeback
    cache the kernel READs each new 4 KiB page from the daemon before the first write into it, and the writer
    waits for every one (0.44-0.54 of native in bench/hot_path.py b). Two such READs in a row make the primer read
    the next window into the page cache through the mount: the writer then fills it without a single READ, every
    byte lands, and a killed primer process is counted and replaced. Fails on a5e195a: no primer is ever asked
    (and with only the cue in place, no page ahead ever enters the page cache)."""
    m = mounted
    rel = "consumequeue/TopicP/0/00000000000000000000"
    p = m.mnt / rel
    p.parent.mkdir(parents=True)
    unit = struct.Struct(">qiq")
    per_page = 4096 // 20
    ahead = 64  # pages checked ahead of the writer (256 KiB: within any read_ahead_kb the kernel caps it to)
    fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
    written: list[range] = []

    def write_units(first: int, last: int) -> None:
        for i in range(first, last):
            os.write(fd, unit.pack(i * 100, 100, 7))
        written.append(range(first, last))

    def cue(first: int) -> int:
        """Write page after page from unit `first` until the daemon asked the primer (two page READs in a row,
        less than a second apart: a stalled test process only makes it take another page); the next unit."""
        asked = status(m).get("write_prime", {}).get("requests", 0)
        n = first + 2 * per_page
        write_units(first, n)
        for _ in range(200):
            if status(m).get("write_prime", {}).get("requests", 0) > asked:
                return n
            write_units(n, n + per_page)
            n += per_page
        raise AssertionError("the primer was never asked")

    try:
        os.ftruncate(fd, 4 * MiB)
        n = cue(0)
        page = n * 20 // 4096 + 1  # the first page after the one the last unit ended in: primed from here
        wait_for(lambda: resident_pages(p, page, ahead) == ahead, timeout=60, interval=0.05,
                 what="the pages ahead of the writer primed into the page cache")
        before = _fuse_reads(m)
        own = _fuse_reads(m) - before  # the READs of reading the stats file itself
        write_units(n, (page + ahead) * 4096 // 20 - 1)
        assert _fuse_reads(m) - before - 2 * own == 0, "a write into a primed page waited for a READ"

        (child,) = helper_children(m.pid, "tierfs.tier.primer")
        os.kill(child, signal.SIGKILL)
        wait_for(lambda: not pid_alive(child) or not helper_children(m.pid, "tierfs.tier.primer"), timeout=30)
        first = 2 * MiB // 20 + 1  # a new stretch: its first pages cue the primer again
        os.lseek(fd, first * 20, os.SEEK_SET)
        n = cue(first)
        page = n * 20 // 4096 + 1
        wait_for(lambda: resident_pages(p, page, ahead) == ahead, timeout=60, interval=0.05,
                 what="priming by a new primer process")
        assert status(m)["workers"]["restarts"].get("primer") == 1
        second = helper_children(m.pid, "tierfs.tier.primer")
        os.fsync(fd)
    finally:
        os.close(fd)
    got = m.hot_path(rel).read_bytes()
    want = bytearray(4 * MiB)
    for r in written:
        want[r.start * 20:r.stop * 20] = b"".join(unit.pack(i * 100, 100, 7) for i in r)
    assert got == want
    m.umount()
    assert not any(pid_alive(c) for c in second), "the primer outlived the unmount"
