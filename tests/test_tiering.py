"""Tiering on real mounts, with the posix object store and with Ceph RGW (S3): seal, upload, verify, evict, read
back, kill -9 at each step, corrupt, rewrite, delete, stale multipart uploads, the upload bandwidth cap. The
reference bytes come from a native copy of the same store written before mounting."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import crc32c
import pytest

from mountutil import evict, wait_for
from test_store_mount import PRODUCER, SMALL, consume

TIER_OPTS = ("tiering.enabled=true,cache.max_bytes=2MiB,cache.block_bytes=64KiB,objectstore.chunk_bytes=256KiB,"
             "seal.quiet_seconds=0.5,seal.scan_interval_seconds=0.5,broker.max_hash_slot_num=500,"
             "broker.max_index_num=2000,delete.grace_seconds=0")
SEGMENT_TOPS = ("commitlog", "consumequeue", "index")


@pytest.fixture(scope="module")
def reference_store(tmp_path_factory) -> Path:
    """A store written natively by the example producer: the bytes every read through the mount must equal."""
    ref = tmp_path_factory.mktemp("ref")
    r = subprocess.run([sys.executable, str(PRODUCER), str(ref), *SMALL, "--messages", "6000", "--topics", "2",
                        "--queues", "2"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return ref


def segments(root: Path) -> list[str]:
    out = []
    for top in SEGMENT_TOPS:
        for p in sorted((root / top).rglob("*")):
            if p.is_file():
                out.append(str(p.relative_to(root)))
    return out


def copy_in(ref: Path, mnt: Path, stop_on_disconnect: bool = False) -> list[str]:
    """Copy the store into the mount the way a writer that flushes does (write, fsync). Returns the files whose
    fsync returned: the acknowledged ones. With stop_on_disconnect, a daemon that dies mid-copy ends the copy."""
    done = []
    try:
        for p in sorted(ref.rglob("*")):
            rel = p.relative_to(ref)
            dst = mnt / rel
            if p.is_dir():
                dst.mkdir(parents=True, exist_ok=True)
                continue
            with open(p, "rb") as src, open(dst, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
                out.flush()
                os.fsync(out.fileno())
            done.append(str(rel))
    except OSError as e:
        if not (stop_on_disconnect and e.errno in (errno.ENOTCONN, errno.ECONNABORTED)):
            raise
    return done


def status(m) -> dict:
    return json.loads((m.ctl / "status.json").read_text())


def by_path(m) -> dict[str, dict]:
    return {f["path"]: f for f in status(m)["files"]}


def wait_tiered_and_evicted(m, paths: list[str], timeout: float = 60) -> None:
    """All `paths` tiered, some of them evicted, and the cache back under its budget (2 MiB * 0.9)."""
    def done() -> bool:
        st = status(m)
        files = {f["path"]: f for f in st["files"]}
        tiered = all(files.get(p, {}).get("state") == "tiered" for p in paths)
        evicted = any(files[p]["resident_bytes"] < files[p]["size"] for p in paths) if tiered else False
        return tiered and evicted and st["totals"]["cache_bytes"] <= 0.9 * (2 << 20)
    wait_for(done, timeout=timeout, what="segments tiered and evicted")


def assert_same_bytes(m, ref: Path, paths: list[str]) -> None:
    for rel in paths:
        p = m.mnt / rel
        evict(p)
        assert p.stat().st_size == (ref / rel).stat().st_size, rel
        got = subprocess.run(["cat", str(p)], capture_output=True, timeout=60).stdout
        assert got == (ref / rel).read_bytes(), f"{rel} differs from the original"


def test_tier_evict_and_read_back_everything(mount_store, reference_store):
    m = mount_store(options=[TIER_OPTS])
    copy_in(reference_store, m.mnt)
    segs = segments(reference_store)
    wait_for(lambda: len([f for f in status(m)["files"] if f["state"] == "tiered"]) >= len(segs) // 2,
             timeout=60, what="tiering")
    wait_tiered_and_evicted(m, [f["path"] for f in status(m)["files"]])
    st = status(m)
    assert st["totals"]["cache_bytes"] <= 2 << 20
    # st_size and st_mtime never change because of tiering
    for rel in segs:
        a, b = (m.mnt / rel).stat(), (reference_store / rel).stat()
        assert a.st_size == b.st_size
    assert_same_bytes(m, reference_store, segs)
    assert consume(m.mnt, "--expect-messages", "6000", "--check-keys", "-1")["ok"]
    # mmap reads of evicted bytes
    rel = next(f["path"] for f in status(m)["files"] if f["kind"] == "commitlog")
    code = ("import mmap,sys,zlib; f=open(sys.argv[1],'rb'); m=mmap.mmap(f.fileno(),0,prot=mmap.PROT_READ); "
            "print(zlib.crc32(m[:]))")
    out = subprocess.run([sys.executable, "-c", code, str(m.mnt / rel)], capture_output=True, text=True, timeout=60)
    import zlib
    assert int(out.stdout) == zlib.crc32((reference_store / rel).read_bytes())
    # remount: the catalog is reloaded and evicted files still read back identically
    m.umount()
    m.mount()
    assert_same_bytes(m, reference_store, segs[:6])
    assert (m.ctl / "segments").read_text().count("tiered") >= len(segs) // 2


def test_evict_command_drops_every_idle_tiered_copy_now(mount_store, reference_store):
    """`tierfs evict`: before maintenance of the hot disk an operator empties the local copies of tiered segments
    now, whatever the watermarks. The cache here is far under them, so no pass would ever evict by itself. Every
    byte still reads back (from the object store), and a mount without tiering says why there is nothing to do."""
    m = mount_store(options=[TIER_OPTS.replace("cache.max_bytes=2MiB", "cache.max_bytes=1GiB")])
    copy_in(reference_store, m.mnt)
    segs = segments(reference_store)

    def settled() -> bool:
        st = status(m)
        return (st["totals"]["upload_backlog_files"] == 0
                and len([f for f in st["files"] if f["state"] == "tiered"]) >= len(segs) // 2)
    wait_for(settled, timeout=60, what="tiering")
    tiered = [f for f in status(m)["files"] if f["state"] == "tiered"]
    assert sum(f["resident_bytes"] for f in tiered) > 0, "evicted already: the test would prove nothing"

    def evicted_on_request() -> bool:  # a segment read in the last second is left alone: then ask again
        r = m.cli("evict", m.mnt)
        assert r.returncode == 0 and "tierfs: evicted" in r.stdout, r.stderr
        return all(by_path(m)[f["path"]]["resident_bytes"] == 0 for f in tiered)
    wait_for(evicted_on_request, timeout=60, interval=0.5, what="every tiered segment evicted on request")
    st = status(m)
    assert st["evict_now"]["done"] == st["evict_now"]["requested"] >= 1
    assert_same_bytes(m, reference_store, segs)

    off = mount_store(options=["tiering.enabled=false"])
    r = off.cli("evict", off.mnt)
    assert r.returncode == 1 and "tiering off" in r.stderr, r.stderr


def test_write_into_tiered_segment_makes_new_generation(mount_store, reference_store):
    m = mount_store(options=[TIER_OPTS])
    copy_in(reference_store, m.mnt)
    rel = "commitlog/00000000000000000000"
    wait_for(lambda: by_path(m).get(rel, {}).get("state") == "tiered", timeout=60, what="tiered")
    wait_for(lambda: by_path(m)[rel]["resident_bytes"] < by_path(m)[rel]["size"], timeout=60, what="evicted")
    old_objects = by_path(m)[rel]["objects"]
    gen0 = by_path(m)[rel]["generation"]
    ref = bytearray((reference_store / rel).read_bytes())
    # an identical rewrite (like the index header at shutdown) is a no-op
    with open(m.mnt / rel, "r+b") as f:
        f.seek(100_000)
        f.write(ref[100_000:100_100])
        f.flush()
        os.fsync(f.fileno())
    assert by_path(m)[rel]["generation"] == gen0 and by_path(m)[rel]["state"] == "tiered"
    # a real change: the file becomes hot again at a new generation, then is sealed and tiered again
    with open(m.mnt / rel, "r+b") as f:
        f.seek(200_000)
        f.write(b"X" * 10)
        f.flush()
        os.fsync(f.fileno())
    ref[200_000:200_010] = b"X" * 10
    assert by_path(m)[rel]["generation"] > gen0
    wait_for(lambda: by_path(m)[rel]["state"] == "tiered", timeout=60, what="re-tiered")
    evict(m.mnt / rel)
    assert (m.mnt / rel).read_bytes() == bytes(ref)
    objects_root = m.state_dir / "objects"
    wait_for(lambda: not any((objects_root / k).exists() for k in old_objects), timeout=30,
             what="stale generation objects deleted")


def test_corrupt_object_gives_eio_and_names_it(mount_store, reference_store):
    m = mount_store(options=[TIER_OPTS])
    copy_in(reference_store, m.mnt)
    rel = "commitlog/00000000000001048576"
    wait_for(lambda: by_path(m).get(rel, {}).get("state") == "tiered", timeout=60, what="tiered")
    wait_for(lambda: by_path(m)[rel]["resident_bytes"] < 300_000, timeout=60, what="evicted")
    key = by_path(m)[rel]["objects"][1]
    obj = m.state_dir / "objects" / key
    data = bytearray(obj.read_bytes())
    data[5000] ^= 0xFF
    obj.write_bytes(bytes(data))
    evict(m.mnt / rel)
    with open(m.mnt / rel, "rb") as f:
        f.seek(256 * 1024 + 4096)
        with pytest.raises(OSError) as ei:
            f.read(4096)
    assert ei.value.errno == errno.EIO
    assert key in m.log_text()
    # other bytes of the same file still read fine, and the daemon lives
    with open(m.mnt / rel, "rb") as f:
        assert f.read(4096) == (reference_store / rel).read_bytes()[:4096]
    assert m.alive()


def test_delete_tiered_segments_removes_objects(mount_store, reference_store):
    m = mount_store(options=[TIER_OPTS])
    copy_in(reference_store, m.mnt)
    rel = "commitlog/00000000000000000000"
    wait_for(lambda: by_path(m).get(rel, {}).get("state") == "tiered", timeout=60, what="tiered")
    keys = by_path(m)[rel]["objects"]
    os.unlink(m.mnt / rel)
    assert rel not in by_path(m)
    wait_for(lambda: not any((m.state_dir / "objects" / k).exists() for k in keys), timeout=30,
             what="objects deleted")


KILL_POINTS = ["tier.chunk_put", "tier.after_put", "tier.after_commit", "tier.evict"]


def assert_every_file_intact(m, ref: Path) -> None:
    """Every file of the reference store (segments, tiered or not, and the mutable files) has its size and
    crc32c through the mount, read after dropping its cached pages; the consumer reads every message back."""
    for p in sorted(ref.rglob("*")):
        if not p.is_file():
            continue
        rel = p.relative_to(ref)
        evict(m.mnt / rel)
        got = (m.mnt / rel).read_bytes()
        assert (len(got), crc32c.crc32c(got)) == (p.stat().st_size, crc32c.crc32c(p.read_bytes())), rel
    got = consume(m.mnt, "--expect-messages", "6000", "--check-keys", "-1")
    assert got["ok"] and got["messages"] == 6000, got


@pytest.mark.parametrize("backend", ["posix", "s3"])
@pytest.mark.parametrize("point", KILL_POINTS)
def test_kill9_during_tiering_loses_nothing(request, mount_store, reference_store, point, backend):
    """SIGKILL of the daemon in the middle of an upload (after one chunk object), between the upload and its
    catalog commit, right after the commit, and during eviction (residency durable, hole not yet punched); then
    remount: every acknowledged byte is there, tiering resumes, and the whole store reads back exactly."""
    opts = TIER_OPTS
    if backend == "s3":
        opts = s3_opts(request.getfixturevalue("rgw"), "kill-" + point.replace(".", "-").replace("_", "-"))
    m = mount_store(options=[opts], env={"TIERFS_FAILPOINTS": f"{point}=kill"})
    acked = copy_in(reference_store, m.mnt, stop_on_disconnect=True)
    wait_for(lambda: not m.alive(), timeout=60, what=f"daemon killed at {point}")
    m.kill()  # clears the dead mount
    from mountutil import daemon_env
    m.env = daemon_env()
    m.mount()
    acked_segs = [p for p in acked if p.split("/")[0] in SEGMENT_TOPS]
    assert acked_segs, "the daemon died before any file was acknowledged"
    assert_same_bytes(m, reference_store, acked_segs)  # every acknowledged byte survived the crash
    copy_in(reference_store, m.mnt)  # finish the store, then let tiering resume
    wait_tiered_and_evicted(m, [f["path"] for f in status(m)["files"]], timeout=90)
    assert_every_file_intact(m, reference_store)


# ---------------------------------------------------------------------------------------------- S3 (Ceph RGW)

def s3_opts(rgw, bucket: str, extra: str = "") -> str:
    rgw.make_bucket(bucket)
    return (f"{TIER_OPTS},objectstore.url=s3://{bucket}/stores,objectstore.endpoint_url={rgw.endpoint_url},"
            f"objectstore.access_key_id={rgw.access_key},objectstore.secret_access_key={rgw.secret_key},"
            f"objectstore.addressing=path,objectstore.max_attempts=2{extra}")


def test_s3_tier_evict_read_back_and_remount(mount_store, reference_store, rgw):
    m = mount_store(options=[s3_opts(rgw, "tier-basic")])
    copy_in(reference_store, m.mnt)
    segs = segments(reference_store)
    wait_for(lambda: len([f for f in status(m)["files"] if f["state"] == "tiered"]) >= len(segs) // 2,
             timeout=90, what="tiering to S3")
    wait_tiered_and_evicted(m, [f["path"] for f in status(m)["files"]], timeout=90)
    assert_same_bytes(m, reference_store, segs)
    assert consume(m.mnt, "--expect-messages", "6000", "--check-keys", "-1")["ok"]
    assert rgw.secret_key not in (m.ctl / "config").read_text()
    m.umount()
    m.mount()
    assert_same_bytes(m, reference_store, segs)


def test_s3_store_down_then_back(mount_store, reference_store, rgw):
    m = mount_store(options=[s3_opts(rgw, "tier-down", ",objectstore.read_timeout_seconds=3")])
    copy_in(reference_store, m.mnt)
    paths = lambda: [f["path"] for f in status(m)["files"]]  # noqa: E731
    wait_for(lambda: len(paths()) >= 10, timeout=90, what="some segments sealed")
    wait_tiered_and_evicted(m, paths(), timeout=90)
    victim = next(f["path"] for f in status(m)["files"]
                  if f["state"] == "tiered" and f["resident_bytes"] < f["size"] and f["kind"] == "commitlog")
    rgw.stop_rgw()
    try:
        # hot writes are unaffected while the store is down
        t0 = time.monotonic()
        with open(m.mnt / "hot-while-down", "wb") as f:
            f.write(os.urandom(4 << 20))
            os.fsync(f.fileno())
        assert time.monotonic() - t0 < 5
        # a read of evicted bytes fails with EIO within the configured bound, never with wrong bytes
        evict(m.mnt / victim)
        t0 = time.monotonic()
        with open(m.mnt / victim, "rb") as f:
            f.seek(300_000)
            with pytest.raises(OSError) as ei:
                f.read(65536)
        assert ei.value.errno == errno.EIO
        assert time.monotonic() - t0 < 3 + 10
        assert m.alive()
    finally:
        rgw.start_rgw()
    evict(m.mnt / victim)
    assert (m.mnt / victim).read_bytes() == (reference_store / victim).read_bytes()


# ---------------------------------------------------------------------------------------------- stale multipart uploads

def test_s3_stale_multipart_uploads_are_aborted_at_mount(mount_store, rgw):
    """A crashed daemon's multipart upload under <store-id>/ is aborted when the next daemon starts; uploads of
    other stores in the same bucket are left alone."""
    bucket = rgw.make_bucket("tier-stale-mpu")
    c = rgw.client()
    mine = "stores/mpu-store/seg/commitlog/00000000000000000000/0.raw/0"
    other = "stores/other-store/seg/commitlog/00000000000000000000/0.raw/0"
    ups = {}
    for key in (mine, other):
        ups[key] = c.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
        c.upload_part(Bucket=bucket, Key=key, UploadId=ups[key], PartNumber=1, Body=b"x" * (5 << 20))

    def listed(prefix: str) -> set[str]:
        return {u["Key"] for u in c.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", [])}

    assert listed("stores/") == {mine, other}
    time.sleep(1.1)  # S3 'Initiated' has whole seconds: start the daemon in a later second
    m = mount_store(options=[s3_opts(rgw, bucket, ",store.id=mpu-store")])
    try:
        wait_for(lambda: "stale multipart uploads under mpu-store/" in m.log_text(), timeout=30,
                 what="the stale-upload sweep")
        assert "aborted 1 stale multipart uploads under mpu-store/" in m.log_text(), m.log_tail()
        assert listed("stores/mpu-store/") == set()
        assert listed("stores/") == {other}
    finally:
        c.abort_multipart_upload(Bucket=bucket, Key=other, UploadId=ups[other])


def test_posix_stale_partial_objects_are_removed_at_mount(mount_store, tmp_path):
    """The posix store's equivalent: a temporary object file left by a daemon killed mid-put is deleted."""
    objects = tmp_path / "objects"
    d = objects / "px-store" / "seg" / "commitlog" / "00000000000000000000" / "0.raw"
    d.mkdir(parents=True)
    stale = d / ".tierfs-tmp.0123456789abcdef.0"
    stale.write_bytes(b"partial")
    past = time.time() - 60
    os.utime(stale, (past, past))
    m = mount_store(options=[f"{TIER_OPTS},store.id=px-store,objectstore.url=file://{objects}"])
    wait_for(lambda: "stale multipart uploads under px-store/" in m.log_text(), timeout=30,
             what="the stale-upload sweep")
    assert "aborted 1 stale multipart uploads under px-store/" in m.log_text(), m.log_tail()
    assert not stale.exists()


# ---------------------------------------------------------------------------------------------- upload bandwidth

def _engine(tmp_path: Path, name: str, options: str):
    from tierfs.config import Config
    from tierfs.tier.engine import Engine

    hot, state = tmp_path / f"{name}-hot", tmp_path / f"{name}-hot" / ".tierfs"
    state.mkdir(parents=True)
    return Engine(hot, state, Config.load(None, [options]))


def _timed_uploads(eng, nfiles: int, size: int) -> float:
    """Upload `nfiles` files of `size` bytes through the engine's upload path from as many threads at once (as
    the uploader tasks do); returns the wall time."""
    import concurrent.futures

    from tierfs.tier.catalog import Entry, State

    entries = []
    for i in range(nfiles):
        rel = f"commitlog/{i:020d}"
        (eng.hot / rel).parent.mkdir(parents=True, exist_ok=True)
        (eng.hot / rel).write_bytes(os.urandom(size))
        entries.append(Entry(path=rel, kind="commitlog", size=size, mtime_ns=0, state=State.UPLOADING,
                             chunk_bytes=eng.chunk, block_bytes=eng.block))
    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(nfiles) as pool:
        results = list(pool.map(eng.uploader.upload_blocking, entries))
    elapsed = time.monotonic() - t0
    for e, (crc, _, keys, _) in zip(entries, results):
        assert crc == crc32c.crc32c((eng.hot / e.path).read_bytes())
        assert b"".join(eng.store.get(k) for k in keys) == (eng.hot / e.path).read_bytes()
    return elapsed


@pytest.mark.parametrize("backend", ["posix", "s3"])
def test_upload_bandwidth_limit_is_shared_by_all_uploaders(request, tmp_path, backend):
    """upload.bandwidth_bytes_per_second caps the sum of concurrent uploads: 3 uploaders x 1 MiB at 1 MiB/s take
    about 3 s (the bucket keeps at most 0.1 s of credit), and the same uploads without a cap are quick."""
    base = "cache.block_bytes=64KiB,objectstore.chunk_bytes=256KiB"
    if backend == "s3":
        rgw = request.getfixturevalue("rgw")
        bucket = rgw.make_bucket("tier-bandwidth")
        base += (f",objectstore.url=s3://{bucket}/bw,objectstore.endpoint_url={rgw.endpoint_url},"
                 f"objectstore.access_key_id={rgw.access_key},objectstore.secret_access_key={rgw.secret_key},"
                 "objectstore.addressing=path")
    n, size, limit = 3, 1 << 20, 1 << 20
    fast = _timed_uploads(_engine(tmp_path, "free", base), n, size)
    slow = _timed_uploads(_engine(tmp_path, "capped", f"{base},upload.bandwidth_bytes_per_second={limit}"), n, size)
    least = (n * size - 0.1 * limit) / limit  # all bytes at the rate, less the burst credit
    assert slow >= least * 0.97, f"{n * size} bytes at {limit} B/s took {slow:.2f} s, expected >= {least:.2f} s"
    assert slow <= least + 2.5, f"the cap slowed uploads more than it should: {slow:.2f} s"
    assert fast < slow * 0.6, f"uncapped uploads took {fast:.2f} s, capped {slow:.2f} s"


def test_token_bucket_close_wakes_waiters():
    import threading

    from tierfs.tier.ratelimit import BandwidthLimiterClosed, TokenBucket

    b = TokenBucket(1000)
    b.acquire(100)  # burst credit: immediate
    errors = []

    def wait_long() -> None:
        try:
            b.acquire(1_000_000)  # ~1000 s at this rate
        except BandwidthLimiterClosed as e:
            errors.append(e)

    t = threading.Thread(target=wait_long)
    t0 = time.monotonic()
    t.start()
    time.sleep(0.2)
    b.close()
    t.join(5)
    assert not t.is_alive() and len(errors) == 1 and time.monotonic() - t0 < 2
    with pytest.raises(BandwidthLimiterClosed):
        b.acquire(1)
    with pytest.raises(ValueError, match="rate must be > 0"):
        TokenBucket(0)


def test_truncating_a_tiered_segment_never_resurrects_old_bytes(mount_store, reference_store):
    """open(O_TRUNC) and truncate(2) of an evicted segment: the file leaves the tiered state first, so blocks
    of the old generation are never fetched into the new content."""
    m = mount_store(options=[TIER_OPTS])
    copy_in(reference_store, m.mnt)
    wait_for(lambda: len(status(m)["files"]) >= len(segments(reference_store)) - 2, timeout=60, what="sealing")
    wait_tiered_and_evicted(m, [f["path"] for f in status(m)["files"]])
    evicted = [f["path"] for f in status(m)["files"]
               if f["kind"] == "commitlog" and f["state"] == "tiered" and f["resident_bytes"] < f["size"]]
    assert len(evicted) >= 2
    replaced, shortened = evicted[:2]
    gens = {rel: by_path(m)[rel]["generation"] for rel in (replaced, shortened)}
    new = os.urandom(300_000)
    with open(m.mnt / replaced, "wb") as f:  # O_TRUNC, then a shorter, different content
        f.write(new)
        f.flush()
        os.fsync(f.fileno())
    os.truncate(m.mnt / shortened, 200_000)
    for rel in (replaced, shortened):
        evict(m.mnt / rel)
    assert (m.mnt / replaced).read_bytes() == new
    assert (m.mnt / shortened).read_bytes() == (reference_store / shortened).read_bytes()[:200_000]
    files = by_path(m)
    assert files[replaced]["generation"] > gens[replaced] and files[replaced]["state"] == "hot", files[replaced]
    assert files[shortened]["generation"] > gens[shortened] and files[shortened]["state"] == "hot"
    m.umount()
    m.mount()
    assert (m.mnt / replaced).read_bytes() == new
