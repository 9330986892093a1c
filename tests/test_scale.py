"""Scale (issue 6, point 4): many tiny sealed ConsumeQueue files, the many-topics case of RocketMQ RIP-66.

A store of N full ConsumeQueue files (`consumequeue/<topic>/<queue>/<offset>`, 100 bytes each) is in the hot dir
when tierfs mounts it, as after a broker restart. Through a real mount every file must be sealed and tiered, with
one catalog row each; `ls -R` and stat must see all of them with their true size and mtime, and their bytes must
read back. The same is done for 2,000 and for 20,000 files in one test, and the per-file costs (time to tier,
remount time) at 20,000 must stay within a generous factor of those at 2,000: a cost that grows with the store
(a scan of the whole backlog per upload, a transaction per state change, a walk per statfs) fails it.
bench/scale.py measures the same up to 100,000 files and prints the figures.
"""

from __future__ import annotations

import os
import random
import sqlite3
import struct
import time
from pathlib import Path

from mountutil import run, wait_for

UNITS = 5  # 20-byte units per file: full, every unit valid
CQ_UNIT = struct.Struct(">qiq")  # commitlog offset, size, tags code (format §5)
OPTS = ("tiering.enabled=true,seal.quiet_seconds=0.5,seal.scan_interval_seconds=2,compaction.enabled=false,"
        "delete.grace_seconds=0")
FACTOR = 4.0  # per-file cost at 20k over per-file cost at 2k (fixed costs make the 2k figure the larger one)


def tree_paths(n: int) -> list[str]:
    """Topics of 4 queues with 2 files each: consumequeue/topic-XXXXX/Q/<20-digit offset>."""
    return [f"consumequeue/topic-{i // 8:05d}/{i % 8 // 2}/{i % 2 * UNITS * 20:020d}" for i in range(n)]


def cq_file(seed: int) -> bytes:
    """A full ConsumeQueue file whose unit ends strictly increase (the broker's own invariant)."""
    return b"".join(CQ_UNIT.pack(seed * 10_000 + u * 1000, 100 + u, seed) for u in range(UNITS))


def write_tree(hot: Path, paths: list[str], mtime: float) -> None:
    for i, rel in enumerate(paths):
        p = hot / rel
        if i % 2 == 0:
            p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(cq_file(i))
        os.utime(p, (mtime, mtime))


def catalog_states(hot: Path) -> dict[str, int]:
    """Rows per state, read-only (the daemon's WAL writer is never blocked)."""
    con = sqlite3.connect(f"file:{hot / '.tierfs' / 'catalog.db'}?mode=ro", uri=True, timeout=10)
    try:
        return dict(con.execute("SELECT state, count(*) FROM files GROUP BY state").fetchall())
    except sqlite3.OperationalError:  # the schema is not there yet
        return {}
    finally:
        con.close()


def listed_files(root: Path) -> int:
    """Segment files `ls -R` prints under the mount (20-digit names)."""
    r = run(["ls", "-R", str(root)], timeout=120, check=True)
    return sum(1 for line in r.stdout.splitlines() if len(line) == 20 and line.isdigit())


def one_store(mount_store, tmp_path: Path, n: int) -> dict:
    """Mount a store of n files, wait until all are tiered, check what the mount shows, remount. Timings in s."""
    hot, mnt = tmp_path / f"hot{n}", tmp_path / f"mnt{n}"
    paths = tree_paths(n)
    mtime = time.time() - 3600
    write_tree(hot, paths, mtime)
    t = time.monotonic()
    m = mount_store(hot=hot, mnt=mnt, options=[OPTS])
    out = {"mount_s": time.monotonic() - t}
    wait_for(lambda: catalog_states(hot).get("tiered", 0) == n, timeout=120, interval=0.2,
             what=f"{n} files tiered (catalog: {catalog_states(hot)})")
    out["tier_s"] = time.monotonic() - t
    assert catalog_states(hot) == {"tiered": n}, "one catalog row per file, every one tiered"
    st = m.status()
    assert st["totals"]["per_kind"]["consumequeue"]["tiered"] == n
    assert sum(1 for _ in (hot / ".tierfs" / "objects").rglob("000000")) == n  # one chunk object per file

    m.umount()
    t = time.monotonic()
    m.mount()
    out["remount_s"] = time.monotonic() - t
    assert listed_files(m.mnt) == n
    rnd = random.Random(n)
    for i in rnd.sample(range(n), 200):
        s = os.stat(m.mnt / paths[i])
        assert (s.st_size, s.st_mtime) == (UNITS * 20, mtime), paths[i]
    for i in rnd.sample(range(n), 20):
        assert (m.mnt / paths[i]).read_bytes() == cq_file(i), paths[i]
    assert catalog_states(hot) == {"tiered": n}
    m.umount()
    return out


def test_many_tiny_consumequeue_files_tier_with_flat_per_file_costs(mount_store, tmp_path):
    small, large = 2_000, 20_000
    a = one_store(mount_store, tmp_path, small)
    b = one_store(mount_store, tmp_path, large)
    figures = f"{small} files: {a}; {large} files: {b}"
    print(figures)  # shown with -s, and on failure
    # time to tier everything, per file
    assert b["tier_s"] / large <= FACTOR * a["tier_s"] / small, figures
    # mounting (the first time: nothing cataloged; again: load the catalog, match it against the hot dir): the
    # cost beyond the 2k run, per extra file, against the 2k run's cost per file
    for key in ("mount_s", "remount_s"):
        assert (b[key] - a[key]) / (large - small) <= FACTOR * a[key] / small, figures
