"""What an operator and the broker are told: the per-kind `tierfs status` table, and statfs (DESIGN §9).

The broker reads statfs as one ratio, used / (used + available) with used = blocks - free (format §11: above 75 %
it deletes, above 85 % regardless of age, above 90 % it rejects writes). The statfs tests run on a 64 MiB tmpfs
holding the hot dir, with the object store elsewhere, so local pressure is real and quick to create.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from mountutil import is_root, run, wait_for
from test_tiering import TIER_OPTS, copy_in, reference_store, status, wait_tiered_and_evicted  # noqa: F401

MiB = 1 << 20
GiB = 1 << 30
KIND_COUNTS = {"commitlog": 7, "consumequeue": 20, "index": 7}  # the reference store (test_tiering)


# ---------------------------------------------------------------------------------------------- status table

def table(text: str) -> dict[str, dict[str, float]]:
    """The per-kind rows of `tierfs status` (text), by kind, keyed by the header's column names."""
    lines = text.splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[:2] == ["kind", "files"])
    cols = ["files", "hot", "tiered", "mib_local", "mib_remote", "backlog", "backlog_mib", "oldest_s"]
    assert re.sub(r"\s+", " ", lines[head].strip()) == "kind files hot tiered MiB local MiB remote backlog MiB oldest s"
    out = {}
    for line in lines[head + 1:]:
        parts = line.split()
        if len(parts) != len(cols) + 1:
            break
        out[parts[0]] = dict(zip(cols, map(float, parts[1:])))
    return out


def test_status_table_per_kind_with_backlog_age(mount_store, reference_store):
    """Uploads capped at 512 KiB/s keep a backlog while the table is read: per kind it shows every file (the
    active, never sealed ones too), bytes local and remote, the backlog and the age of its oldest entry."""
    m = mount_store(options=[TIER_OPTS + ",upload.bandwidth_bytes_per_second=512KiB"])
    copy_in(reference_store, m.mnt)

    def ready() -> bool:
        pk = status(m)["totals"]["per_kind"]
        return (all(pk.get(k, {}).get("files") == n for k, n in KIND_COUNTS.items())
                and pk["commitlog"]["tiered"] >= 1 and pk["commitlog"]["backlog_files"] >= 2)
    wait_for(ready, timeout=60, what="a commitlog segment tiered while others wait")
    r = m.cli("status", m.mnt)
    assert r.returncode == 0, r.stderr
    rows = table(r.stdout)
    assert {k: int(v["files"]) for k, v in rows.items()} == KIND_COUNTS, r.stdout
    cl = rows["commitlog"]
    assert cl["hot"] >= 1  # the active segment: no terminal BLANK, never sealed
    assert cl["tiered"] >= 1 and cl["mib_remote"] == pytest.approx(cl["tiered"] * 1.0, abs=0.11)
    assert cl["backlog"] >= 1 and cl["backlog_mib"] >= 1.0 and cl["oldest_s"] > 0
    assert cl["tiered"] + cl["backlog"] + cl["hot"] == cl["files"]
    assert 0 < cl["mib_local"] <= 7.0
    # the age is the oldest waiting entry's time since it was sealed: it grows while that entry waits
    a1 = status(m)["totals"]["per_kind"]["commitlog"]["backlog_age_s"]
    time.sleep(1.2)
    a2 = status(m)["totals"]["per_kind"]["commitlog"]["backlog_age_s"]
    assert a2 >= a1 + 1.0, (a1, a2)
    assert "upload backlog:" in r.stdout and "oldest" in r.stdout
    # JSON agrees on the columns the table shows
    pk = status(m)["totals"]["per_kind"]
    assert {"files", "hot", "tiered", "bytes_local", "bytes_remote", "backlog_files", "backlog_bytes",
            "backlog_age_s"} <= set(pk["commitlog"])
    t0 = time.monotonic()
    m.umount()  # a throttled upload in flight does not hold the unmount
    assert time.monotonic() - t0 < 15


# ---------------------------------------------------------------------------------------------- statfs

def broker_ratio(sv: os.statvfs_result) -> float:
    """RocketMQ's UtilAll.getDiskPartitionSpaceUsedPercent (without its rounding up to 1 %)."""
    used = sv.f_blocks - sv.f_bfree
    return used / (used + sv.f_bavail)


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 64 MiB tmpfs, unmounted at teardown (request it before mount_store so the mount goes first)."""
    if not is_root():
        pytest.skip("mounting a tmpfs needs root")
    d = tmp_path / "disk"
    d.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,mode=0755", "tierfs-test", str(d)], check=True)
    yield d
    if subprocess.run(["umount", str(d)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(d)], check=True)


def fill(path: Path, nbytes: int) -> None:
    """Unsealed local data: a plain file written and fsynced through the mount."""
    with open(path, "wb") as f:
        for _ in range(nbytes // MiB):
            f.write(os.urandom(MiB))
        f.flush()
        os.fsync(f.fileno())


def remote_only(m) -> int:
    return sum(f["size"] - f["resident_bytes"] for f in status(m)["files"] if f["state"] == "tiered")


def tier_store_on_small_disk(small_disk: Path, mount_store, tmp_path: Path, ref: Path, extra: str = ""):
    objects = tmp_path / "objects"  # the object store lives off the small disk
    m = mount_store(hot=small_disk / "hot", options=[f"{TIER_OPTS},objectstore.url=file://{objects}{extra}"])
    copy_in(ref, m.mnt)
    sealable = sum(KIND_COUNTS.values()) - 2  # all but the active commitlog and index files
    wait_for(lambda: len(status(m)["files"]) >= sealable, timeout=60, what="segments sealed")
    wait_tiered_and_evicted(m, [f["path"] for f in status(m)["files"]])
    assert remote_only(m) > 3 * MiB
    return m


def test_statfs_default_is_the_hot_disk_and_tiering_frees_it(small_disk, mount_store, tmp_path, reference_store):
    """statfs.capacity_bytes = 0: the hot dir's own numbers. Remote-only bytes take nothing from capacity or
    available space (the broker's ratio follows the local disk, retention follows time); unsealed data does."""
    m = tier_store_on_small_disk(small_disk, mount_store, tmp_path, reference_store)
    store_bytes = sum(p.stat().st_size for p in reference_store.rglob("*") if p.is_file())
    sm, sh = os.statvfs(m.mnt), os.statvfs(m.hot)
    assert (sm.f_frsize, sm.f_blocks) == (sh.f_frsize, sh.f_blocks) and sm.f_blocks * sm.f_frsize == 64 * MiB
    assert abs(sm.f_bavail - sh.f_bavail) * sm.f_frsize <= 256 * 1024
    # the evicted bytes are not on the small disk, and nothing reports them as taken
    assert (64 * MiB - sm.f_bavail * sm.f_frsize) < store_bytes - remote_only(m) + 2 * MiB
    before = sm.f_bavail * sm.f_frsize
    fill(m.mnt / "ballast", 40 * MiB)
    sm, sh = os.statvfs(m.mnt), os.statvfs(m.hot)
    assert before - sm.f_bavail * sm.f_frsize >= 40 * MiB - 256 * 1024  # real local pressure shows through
    assert broker_ratio(sm) == pytest.approx(broker_ratio(sh), abs=0.01)
    r = run(["df", "-B1", "--output=size,avail", str(m.mnt)], timeout=30, check=True)
    size, avail = map(int, r.stdout.split()[-2:])
    assert size == 64 * MiB and abs(avail - sm.f_bavail * sm.f_frsize) <= 256 * 1024


def test_statfs_capacity_is_reported_and_local_pressure_shows(small_disk, mount_store, tmp_path, reference_store):
    """statfs.capacity_bytes = 1 GiB on a 64 MiB disk: df shows 1 GiB; tiered remote-only bytes do not take
    the available space (it stays what the disk really has); filling the disk with unsealed data drives the
    broker's ratio to the disk's own, past its 75 % deletion threshold, as it would without tiering."""
    m = tier_store_on_small_disk(small_disk, mount_store, tmp_path, reference_store, ",statfs.capacity_bytes=1GiB")
    sm, sh = os.statvfs(m.mnt), os.statvfs(m.hot)
    assert sm.f_blocks * sm.f_frsize == GiB
    r = run(["df", "-B1", "--output=size", str(m.mnt)], timeout=30, check=True)
    assert int(r.stdout.split()[-1]) == GiB
    assert abs(sm.f_bavail - sh.f_bavail) * sm.f_frsize <= 256 * 1024  # remote-only bytes take none of it
    assert sm.f_bavail <= sm.f_bfree <= sm.f_blocks
    logical = ((sh.f_blocks - sh.f_bfree) * sh.f_frsize + remote_only(m)) / GiB
    assert broker_ratio(sm) == pytest.approx(max(broker_ratio(sh), logical), abs=0.01)
    fill(m.mnt / "ballast", 48 * MiB)
    sm, sh = os.statvfs(m.mnt), os.statvfs(m.hot)
    assert broker_ratio(sh) > 0.75
    assert broker_ratio(sm) == pytest.approx(broker_ratio(sh), abs=0.01)  # the broker sees the local pressure
    assert sm.f_bavail <= sh.f_bavail + 64  # never more available than the disk has
    assert m.status()["statfs_capacity_bytes"] == GiB


class _Ops:
    """Just enough of TierOperations for capacity_blocks (a pure function of config and statvfs numbers)."""

    def __init__(self, cap: int):
        self.config = {"statfs.capacity_bytes": cap}


def _sv(blocks: int, bfree: int, bavail: int, frsize: int = 4096) -> os.statvfs_result:
    return os.statvfs_result((frsize, frsize, blocks, bfree, bavail, 1000, 900, 900, 0, 255))


@pytest.mark.parametrize("cap,disk,remote,want", [
    # capacity 0: the disk's own ratio whatever lives remotely
    (0, (1000, 600, 550), 10 ** 12, 400 / 950),
    # capacity >> disk: local ratio (25 %) beats the logical one (150 GiB / 2 TiB)
    (2048 * GiB, (200 * GiB // 4096, 150 * GiB // 4096, 150 * GiB // 4096), 100 * GiB, 0.25),
    # the store's logical size near the capacity: retention follows it (1750 / 2048)
    (2048 * GiB, (200 * GiB // 4096, 150 * GiB // 4096, 150 * GiB // 4096), 1700 * GiB, 1750 / 2048),
    # a full disk: ratio 1, nothing available
    (GiB, (1000, 0, 0), 0, 1.0),
    # beyond the capacity: ratio 1
    (GiB, (1000, 900, 900), 2 * GiB, 1.0),
])
def test_capacity_blocks_sets_the_brokers_ratio(cap, disk, remote, want):
    from tierfs.fs.operations import TierOperations

    sv = _sv(*disk)
    blocks, free, avail = TierOperations.capacity_blocks(_Ops(cap), sv, remote)  # type: ignore[arg-type]
    assert blocks == (cap // 4096 if cap else sv.f_blocks)
    assert 0 <= avail <= free <= blocks and avail <= sv.f_bavail
    used = blocks - free
    assert used / (used + avail) == pytest.approx(want, abs=1e-6)
